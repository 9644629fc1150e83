//! KV storage of the CUDA backend: one sequence's keys and values of one layer in two
//! device buffers `[capacity][kv_heads][head_dim]` f32, grown in steps of
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
        window: Option<usize>,
    ) -> Self {
        CudaKvLayer {
            dev,
            store: None,
            start: 0,
            len: 0,
            kv_heads,
            head_dim,
            window,
            lease: None,
        }
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
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
        let shared = self
            .store
            .as_ref()
            .is_some_and(|s| Arc::strong_count(s) > 1);
        if need > self.cap() || shared {
            let cap = capacity_for(need).max(self.cap());
            let bytes = cap * self.row() * 4;
            let k = self.dev.alloc(bytes).map_err(cuda_err)?;
            let v = self.dev.alloc(bytes).map_err(cuda_err)?;
            if let Some(old) = &self.store {
                let kept = self.len * self.row() * 4;
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
        let s = self
            .store
            .as_ref()
            .ok_or_else(|| EngineError::Cache("CUDA KV storage missing".into()))?;
        let at = self.len;
        self.len = need;
        Ok((s.k.ptr(), s.v.ptr(), at))
    }

    pub(super) fn from_snapshot(dev: Device, s: &KvLayerSnapshot) -> Result<Self> {
        let row = s.kv_heads * s.head_dim;
        let stored = s.len.checked_sub(s.start).ok_or_else(|| {
            EngineError::Cache(format!("snapshot start {} > len {}", s.start, s.len))
        })?;
        if s.keys.len() != stored * row || s.values.len() != stored * row {
            return Err(EngineError::Cache(format!(
                "snapshot holds {} key and {} value floats, expected {} for {stored} tokens",
                s.keys.len(),
                s.values.len(),
                stored * row
            )));
        }
        let mut layer = CudaKvLayer::new(dev, s.kv_heads, s.head_dim, s.window);
        if s.len == 0 {
            return Ok(layer);
        }
        layer.len = s.start;
        let (k, v, at) = layer.reserve_append(stored)?;
        let offset = (at * row * 4) as u64;
        let kb = layer
            .dev
            .upload(bytemuck::cast_slice(&s.keys))
            .map_err(cuda_err)?;
        let vb = layer
            .dev
            .upload(bytemuck::cast_slice(&s.values))
            .map_err(cuda_err)?;
        layer
            .dev
            .copy(k + offset, kb.ptr(), stored * row * 4)
            .map_err(cuda_err)?;
        layer
            .dev
            .copy(v + offset, vb.ptr(), stored * row * 4)
            .map_err(cuda_err)?;
        layer.start = s.start;
        Ok(layer)
    }

    fn read(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(s) = &self.store else {
            return Ok((Vec::new(), Vec::new()));
        };
        let row = self.row();
        let offset = (self.start * row * 4) as u64;
        let bytes = (self.len - self.start) * row * 4;
        let k = self
            .dev
            .download(s.k.ptr() + offset, bytes)
            .map_err(cuda_err)?;
        let v = self
            .dev
            .download(s.v.ptr() + offset, bytes)
            .map_err(cuda_err)?;
        Ok((super::words(&k), super::words(&v)))
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
        if !self.can_trim_to(len) {
            return Err(crate::backend::untrimmable(self.len, self.start, len));
        }
        // Tokens past `len` are overwritten by later appends (after a copy if shared).
        self.len = len.max(self.start);
        if len < self.start {
            self.start = len;
            self.len = len;
        }
        Ok(())
    }

    fn byte_size(&self) -> usize {
        self.cap() * 2 * self.row() * 4
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
