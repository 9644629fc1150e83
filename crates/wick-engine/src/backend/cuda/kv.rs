//! KV storage of the CUDA backend: one sequence's keys and values of one layer in two
//! device buffers `[capacity][kv_heads][head_dim]` (f32, or f16 with `--kv-type f16`:
//! half the bytes a decode step reads), grown in steps of
//! [`GROWTH_TOKENS`] and shared between clones until one of them appends (copy on write).
//! A sliding-window layer keeps every token (its attention skips the old ones).
use std::sync::Arc;

use wick_cuda::{Buffer, Device};

use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::kv_pool::{blocks_for_tokens, BlockLease};
use crate::{EngineError, Result};

use super::cuda_err;

/// Capacity is a multiple of this many tokens.
pub(super) const GROWTH_TOKENS: usize = 256;

fn capacity_for(tokens: usize) -> usize {
    tokens.max(1).div_ceil(GROWTH_TOKENS) * GROWTH_TOKENS
}

pub(super) struct KvStore {
    pub(super) k: Buffer,
    pub(super) v: Buffer,
    pub(super) cap: usize,
}

/// One layer's cache of one sequence on the GPU.
pub struct CudaKvLayer {
    dev: Device,
    store: Option<Arc<KvStore>>,
    /// First kept token (non-zero only for a snapshot that a window had cut).
    start: usize,
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Stored as f16 (else f32).
    half: bool,
    window: Option<usize>,
    lease: Option<BlockLease>,
}

impl Clone for CudaKvLayer {
    /// Shares the storage; the first of the two to append copies it. A clone is not
    /// charged to any pool until attached.
    fn clone(&self) -> Self {
        CudaKvLayer {
            dev: self.dev.clone(),
            store: self.store.clone(),
            start: self.start,
            len: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            half: self.half,
            window: self.window,
            lease: None,
        }
    }
}

impl CudaKvLayer {
    pub(super) fn new(
        dev: Device,
        kv_heads: usize,
        head_dim: usize,
        half: bool,
        window: Option<usize>,
    ) -> Self {
        CudaKvLayer {
            dev,
            store: None,
            start: 0,
            len: 0,
            kv_heads,
            head_dim,
            half,
            window,
            lease: None,
        }
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one cached token's keys (or values).
    fn row_bytes(&self) -> usize {
        self.row() * if self.half { 2 } else { 4 }
    }

    fn cap(&self) -> usize {
        self.store.as_ref().map_or(0, |s| s.cap)
    }

    pub(super) fn shape(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    pub(super) fn window(&self) -> Option<usize> {
        self.window
    }

    /// Makes room for `tokens` more tokens in storage of this layer's own, copying what
    /// is kept (as recorded work) when the storage grows or is shared. Returns the key and
    /// value addresses and the position the new tokens go to.
    pub(super) fn reserve_append(&mut self, tokens: usize) -> Result<(u64, u64, usize)> {
        let need = self.len + tokens;
        self.own_room_for(need)?;
        let s = self
            .store
            .as_ref()
            .ok_or_else(|| EngineError::Cache("CUDA KV storage missing".into()))?;
        let at = self.len;
        self.len = need;
        Ok((s.k.ptr(), s.v.ptr(), at))
    }

    /// Storage of this layer's own with room for `need` tokens: a larger buffer (or, when
    /// the storage is shared, a copy of it) that what is kept is copied into, as recorded
    /// work.
    fn own_room_for(&mut self, need: usize) -> Result<()> {
        let shared = self
            .store
            .as_ref()
            .is_some_and(|s| Arc::strong_count(s) > 1);
        if need > self.cap() || shared {
            let cap = capacity_for(need).max(self.cap());
            let bytes = cap * self.row_bytes();
            let k = self.dev.alloc(bytes).map_err(cuda_err)?;
            let v = self.dev.alloc(bytes).map_err(cuda_err)?;
            if let Some(old) = &self.store {
                let kept = self.len * self.row_bytes();
                self.dev
                    .copy(k.ptr(), old.k.ptr(), kept)
                    .map_err(cuda_err)?;
                self.dev
                    .copy(v.ptr(), old.v.ptr(), kept)
                    .map_err(cuda_err)?;
            }
            self.store = Some(Arc::new(KvStore { k, v, cap }));
            self.settle();
        }
        Ok(())
    }

    /// The key and value addresses and the position of the last `tokens` tokens, which
    /// an earlier layer of the pass appended (a layer reading a cache it shares).
    pub(super) fn last_tokens(&self, tokens: usize) -> Result<(u64, u64, usize)> {
        let at = self
            .len
            .checked_sub(tokens)
            .filter(|&at| at >= self.start)
            .ok_or_else(|| {
                EngineError::Cache(format!(
                    "a shared KV cache of {} tokens (first kept {}) does not hold this pass's {tokens}",
                    self.len, self.start
                ))
            })?;
        match &self.store {
            Some(s) => Ok((s.k.ptr(), s.v.ptr(), at)),
            None if tokens == 0 => Ok((0, 0, at)),
            None => Err(EngineError::Cache("CUDA KV storage missing".into())),
        }
    }

    pub(super) fn from_snapshot(dev: Device, s: &KvLayerSnapshot, half: bool) -> Result<Self> {
        let stored = s.stored()?;
        let mut layer = CudaKvLayer::new(dev, s.kv_heads, s.head_dim, half, s.window);
        if s.len == 0 {
            return Ok(layer);
        }
        layer.len = s.start;
        let (k, v, at) = layer.reserve_append(stored)?;
        let offset = (at * layer.row_bytes()) as u64;
        let bytes = stored * layer.row_bytes();
        for (to, from) in [(k, &s.keys), (v, &s.values)] {
            let staged = if half {
                let h: Vec<half::f16> = from.iter().map(|&x| half::f16::from_f32(x)).collect();
                layer.dev.upload(bytemuck::cast_slice(&h))
            } else {
                layer.dev.upload(bytemuck::cast_slice(from))
            }
            .map_err(cuda_err)?;
            layer
                .dev
                .copy(to + offset, staged.ptr(), bytes)
                .map_err(cuda_err)?;
        }
        layer.start = s.start;
        Ok(layer)
    }

    fn read(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(s) = &self.store else {
            return Ok((Vec::new(), Vec::new()));
        };
        let offset = (self.start * self.row_bytes()) as u64;
        let bytes = (self.len - self.start) * self.row_bytes();
        let read = |buf: &Buffer| -> Result<Vec<f32>> {
            let raw = self
                .dev
                .download(buf.ptr() + offset, bytes)
                .map_err(cuda_err)?;
            Ok(if self.half {
                super::words::<half::f16>(&raw)
                    .into_iter()
                    .map(half::f16::to_f32)
                    .collect()
            } else {
                super::words(&raw)
            })
        };
        Ok((read(&s.k)?, read(&s.v)?))
    }
}

impl KvLayer for CudaKvLayer {
    fn len(&self) -> usize {
        self.len
    }

    fn can_trim_to(&self, len: usize) -> bool {
        crate::backend::can_trim(self.len, self.start, self.window, len)
    }

    fn trim(&mut self, len: usize) -> Result<()> {
        // Tokens past `len` are overwritten by later appends (after a copy if shared).
        crate::backend::trim_span(&mut self.len, &mut self.start, self.window, len)
    }

    fn byte_size(&self) -> usize {
        self.cap() * 2 * self.row_bytes()
    }

    fn snapshot(&self) -> KvLayerSnapshot {
        let (keys, values) = self.read().unwrap_or_else(|e| {
            tracing::error!("cuda: reading a KV layer to the host failed: {e}");
            (Vec::new(), Vec::new())
        });
        KvLayerSnapshot {
            start: self.start,
            len: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            keys,
            values,
        }
    }

    fn held_blocks(&self) -> usize {
        blocks_for_tokens(self.cap())
    }

    fn preallocate(&mut self, tokens: usize) -> Result<()> {
        if tokens == 0 || self.len + tokens <= self.cap() {
            return Ok(());
        }
        self.own_room_for(self.len + tokens)
    }

    fn blocks_after(&self, tokens: usize) -> usize {
        let need = self.len + tokens;
        if need <= self.cap() {
            self.held_blocks()
        } else {
            blocks_for_tokens(capacity_for(need))
        }
    }

    fn peak_blocks(tokens: usize, _window: Option<usize>, chunk: usize) -> usize {
        let _ = chunk;
        blocks_for_tokens(capacity_for(tokens))
    }

    fn lease(&self) -> Option<&BlockLease> {
        self.lease.as_ref()
    }

    fn lease_mut(&mut self) -> &mut Option<BlockLease> {
        &mut self.lease
    }
}
