//! KV cache of one layer of one sequence on MLX: `[1, kv_heads, capacity, head_dim]`
//! buffers grown a block at a time and written with `slice_update` (in place when MLX
//! can donate the old buffer), with sliding-window eviction.
//!
//! A sequence decoded together with others lives instead in a row of a batch buffer
//! (`arena.rs`); it moves back into buffers of its own when it is cloned or appended to
//! outside a batched decode step.
//!
//! An attached layer is charged to the KV pool for the columns its buffers allocated (a
//! batch row: the columns of its batch buffer), in the pool's blocks of
//! [`BLOCK_TOKENS`] tokens; the charge follows every change of storage.
use wick_mlx::{Array, Dtype, Stream};

use super::arena::{poisoned, ArenaRow};
use super::mlx_err;
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::kv_pool::{blocks_for_tokens, BlockLease, BLOCK_TOKENS};
use crate::{EngineError, Result};

/// Tokens a buffer grows by (a whole number of the pool's blocks).
pub(crate) const BLOCK: usize = 256;
const _: () = assert!(BLOCK.is_multiple_of(BLOCK_TOKENS));

/// Columns of a buffer that holds `tokens` tokens.
fn columns_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK) * BLOCK
}

/// Where a layer's keys and values live.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Buffers of this sequence alone, `[1, kvh, capacity, hd]`.
    Own {
        keys: Option<Array>,
        values: Option<Array>,
        capacity: usize,
    },
    /// A row of a batch buffer.
    Row(ArenaRow),
}

impl Storage {
    /// Own storage holding nothing.
    pub(crate) fn empty() -> Self {
        Storage::Own {
            keys: None,
            values: None,
            capacity: 0,
        }
    }
}

/// Keys and values of one layer.
#[derive(Debug)]
pub struct MlxKvLayer {
    pub(crate) stream: Stream,
    pub(crate) dtype: Dtype,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: Option<usize>,
    /// Logical position of the first stored token.
    pub(crate) start: usize,
    /// Logical length.
    pub(crate) len: usize,
    pub(crate) storage: Storage,
    /// The pool charge, when the cache belongs to a running sequence.
    pub(crate) lease: Option<BlockLease>,
}

fn cache_err(message: &str) -> EngineError {
    EngineError::Cache(format!("mlx: {message}"))
}

impl MlxKvLayer {
    pub(crate) fn new(
        stream: Stream,
        dtype: Dtype,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
    ) -> Self {
        MlxKvLayer {
            stream,
            dtype,
            kv_heads,
            head_dim,
            window,
            start: 0,
            len: 0,
            storage: Storage::empty(),
            lease: None,
        }
    }

    /// Tokens stored (`len - start`).
    pub(crate) fn stored(&self) -> usize {
        self.len - self.start
    }

    /// Shape of `tokens` tokens of one sequence.
    fn shape(&self, tokens: usize) -> [i32; 4] {
        [1, self.kv_heads as i32, tokens as i32, self.head_dim as i32]
    }

    /// A zero buffer of `capacity` tokens holding `keep` (`n` tokens) in front.
    fn buffer(&self, capacity: usize, keep: Option<&Array>, n: usize) -> Result<Array> {
        let s = &self.stream;
        let fresh = s
            .zeros(&self.shape(capacity), self.dtype)
            .map_err(mlx_err)?;
        match keep {
            Some(k) if n > 0 => s
                .slice_update(&fresh, k, &[0; 4], &self.shape(n))
                .map_err(mlx_err),
            _ => Ok(fresh),
        }
    }

    /// `buf[:, :, at..at + m, :] = update`, growing `buf` to hold `at + m` tokens;
    /// returns the new buffer and capacity.
    fn write(
        &self,
        buf: Option<Array>,
        capacity: usize,
        at: usize,
        m: usize,
        update: &Array,
    ) -> Result<(Array, usize)> {
        let need = at + m;
        let (buf, capacity) = match buf {
            Some(b) if need <= capacity => (b, capacity),
            old => {
                let grown = columns_for(need);
                // The old buffer's first `at` columns (its capacity may be larger: a
                // prompt chunk that overflows a partly filled buffer).
                let kept = match old {
                    Some(b) if at > 0 => Some(
                        self.stream
                            .slice(&b, &[0; 4], &self.shape(at))
                            .map_err(mlx_err)?,
                    ),
                    _ => None,
                };
                let fresh = self.buffer(grown, kept.as_ref(), at)?;
                (fresh, grown)
            }
        };
        let out = self
            .stream
            .slice_update(&buf, update, &[0, 0, at as i32, 0], &self.shape(need))
            .map_err(mlx_err)?;
        Ok((out, capacity))
    }

    /// Appends `m` tokens of keys and values, each `[1, kv_heads, m, head_dim]`. A row of
    /// a batch buffer first moves into buffers of its own.
    pub(crate) fn append(&mut self, k: &Array, v: &Array, m: usize) -> Result<()> {
        self.move_to_own()?;
        let stored = self.stored();
        // Take the buffers out so nothing else holds them during the update: MLX then
        // writes in place instead of copying.
        let Storage::Own {
            keys,
            values,
            capacity,
        } = std::mem::replace(&mut self.storage, Storage::empty())
        else {
            return Err(cache_err("a batch row was left in place"));
        };
        let (nk, c) = self.write(keys, capacity, stored, m, k)?;
        let (nv, _) = self.write(values, capacity, stored, m, v)?;
        self.storage = Storage::Own {
            keys: Some(nk),
            values: Some(nv),
            capacity: c,
        };
        self.len += m;
        self.settle();
        Ok(())
    }

    /// Moves a row of a batch buffer into buffers of its own.
    fn move_to_own(&mut self) -> Result<()> {
        if matches!(self.storage, Storage::Row(_)) {
            self.storage = self.detached()?.storage;
            self.settle();
        }
        Ok(())
    }

    /// [`Self::move_to_own`] for a cache about to be stored (the batch can then shrink);
    /// on failure, logged, the row stays where it is.
    pub(crate) fn leave_batch(&mut self) {
        if let Err(e) = self.move_to_own() {
            tracing::error!("mlx: moving a KV row out of its batch failed: {e}");
        }
    }

    /// A copy of the plain fields, with empty storage.
    fn shallow(&self) -> MlxKvLayer {
        MlxKvLayer {
            stream: self.stream,
            dtype: self.dtype,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            start: self.start,
            len: self.len,
            storage: Storage::empty(),
            lease: None,
        }
    }

    /// Columns its storage allocated (a batch row: its buffer's).
    pub(crate) fn columns(&self) -> usize {
        match &self.storage {
            Storage::Own { capacity, .. } => *capacity,
            Storage::Row(r) => r.arena.lock().map(|a| a.columns()).unwrap_or(0),
        }
    }

    /// Whether the layer is charged to a pool with a budget.
    pub(crate) fn in_bounded_pool(&self) -> bool {
        self.lease.as_ref().is_some_and(|l| l.pool().is_bounded())
    }

    /// Keys and values `[1, kvh, to - from, hd]` of logical positions `from..to`.
    pub(crate) fn range(&self, from: usize, to: usize) -> Result<(Array, Array)> {
        let (a, b) = (from - self.start, to - self.start);
        match &self.storage {
            Storage::Own { keys, values, .. } => {
                let (Some(k), Some(v)) = (keys, values) else {
                    return Err(cache_err("the cache is empty"));
                };
                let s = &self.stream;
                let (start, stop) = ([0, 0, a as i32, 0], self.shape(b));
                Ok((
                    s.slice(k, &start, &stop).map_err(mlx_err)?,
                    s.slice(v, &start, &stop).map_err(mlx_err)?,
                ))
            }
            Storage::Row(r) => r
                .arena
                .lock()
                .map_err(|_| poisoned())?
                .row_range(r.row, a, b),
        }
    }

    /// Drops tokens no future query of a sliding-window layer can see (a window's worth
    /// at a time, so the copy is amortized). Batch buffers never hold windowed layers.
    pub(crate) fn evict(&mut self) -> Result<()> {
        let Some(window) = self.window else {
            return Ok(());
        };
        let keep_from = (self.len + 1).saturating_sub(window);
        if keep_from < self.start + window || !matches!(self.storage, Storage::Own { .. }) {
            return Ok(());
        }
        let (k, v) = self.range(keep_from, self.len)?;
        let n = self.len - keep_from;
        let capacity = columns_for(n).max(BLOCK);
        self.storage = Storage::Own {
            keys: Some(self.buffer(capacity, Some(&k), n)?),
            values: Some(self.buffer(capacity, Some(&v), n)?),
            capacity,
        };
        self.start = keep_from;
        self.settle();
        Ok(())
    }

    /// This layer with its tokens in a buffer of its own.
    pub(crate) fn detached(&self) -> Result<MlxKvLayer> {
        let mut out = self.shallow();
        let stored = self.stored();
        if stored > 0 {
            let (k, v) = self.range(self.start, self.len)?;
            let capacity = columns_for(stored);
            out.storage = Storage::Own {
                keys: Some(self.buffer(capacity, Some(&k), stored)?),
                values: Some(self.buffer(capacity, Some(&v), stored)?),
                capacity,
            };
        }
        Ok(out)
    }

    pub(crate) fn from_snapshot(stream: Stream, dtype: Dtype, s: &KvLayerSnapshot) -> Result<Self> {
        let stored = s.stored()?;
        let mut layer = MlxKvLayer::new(stream, dtype, s.kv_heads, s.head_dim, s.window);
        layer.start = s.start;
        layer.len = s.start;
        if stored > 0 {
            let shape = [stored as i32, s.kv_heads as i32, s.head_dim as i32];
            let up = |data: &[f32]| -> Result<Array> {
                let a = Array::from_slice(data, &shape).map_err(mlx_err)?;
                let a = stream.transpose(&a, &[1, 0, 2]).map_err(mlx_err)?;
                let a = stream.reshape(&a, &layer.shape(stored)).map_err(mlx_err)?;
                stream.astype(&a, dtype).map_err(mlx_err)
            };
            let (k, v) = (up(&s.keys)?, up(&s.values)?);
            layer.append(&k, &v, stored)?;
        }
        Ok(layer)
    }

    fn host(&self, a: &Array) -> Result<Vec<f32>> {
        let s = &self.stream;
        let v = s.transpose(a, &[0, 2, 1, 3]).map_err(mlx_err)?;
        let v = s.astype(&v, Dtype::F32).map_err(mlx_err)?;
        v.to_vec::<f32>().map_err(mlx_err)
    }
}

impl Clone for MlxKvLayer {
    /// A copy that can grow on its own: a batch row is copied into a buffer of its own
    /// (lazily, by MLX; the copy cannot fail short of running out of memory, which MLX
    /// reports when the graph runs).
    fn clone(&self) -> Self {
        match &self.storage {
            Storage::Own {
                keys,
                values,
                capacity,
            } => MlxKvLayer {
                storage: Storage::Own {
                    keys: keys.clone(),
                    values: values.clone(),
                    capacity: *capacity,
                },
                ..self.shallow()
            },
            Storage::Row(_) => self.detached().unwrap_or_else(|e| {
                tracing::error!("mlx: copying a batch KV row failed: {e}");
                let mut empty = self.shallow();
                empty.start = 0;
                empty.len = 0;
                empty
            }),
        }
    }
}

impl KvLayer for MlxKvLayer {
    fn len(&self) -> usize {
        self.len
    }

    fn can_trim_to(&self, len: usize) -> bool {
        crate::backend::can_trim(self.len, self.start, self.window, len)
    }

    fn trim(&mut self, len: usize) -> Result<()> {
        // Stored tokens past `len` are simply overwritten by later appends.
        crate::backend::trim_span(&mut self.len, &mut self.start, self.window, len)
    }

    fn byte_size(&self) -> usize {
        self.columns() * 2 * self.kv_heads * self.head_dim * self.dtype.size()
    }

    fn held_blocks(&self) -> usize {
        blocks_for_tokens(self.columns())
    }

    fn blocks_after(&self, tokens: usize) -> usize {
        if tokens == 0 {
            return self.held_blocks();
        }
        let columns = match &self.storage {
            // One more token of a batch row is the next column of its buffer.
            Storage::Row(r) if tokens == 1 => match r.arena.lock() {
                Ok(a) => a.columns_after_step(),
                Err(_) => columns_for(self.stored() + 1),
            },
            // More moves the row into buffers of its own first.
            Storage::Row(_) => columns_for(self.stored() + tokens),
            Storage::Own { capacity, .. } => {
                let need = self.stored() + tokens;
                if need <= *capacity {
                    *capacity
                } else {
                    columns_for(need)
                }
            }
        };
        blocks_for_tokens(columns)
    }

    fn stored_after_step(&self) -> usize {
        self.stored() + 1
    }

    fn blocks_after_decode_step(&self, widest: usize) -> usize {
        // Every row of a batch buffer is as wide as the buffer, and the buffer is as wide
        // as its widest row: a sequence joining it, or a longer one moving every row right,
        // makes this row `widest` tokens wide (rounded up to the buffer's growth).
        self.blocks_after(1)
            .max(blocks_for_tokens(columns_for(widest)))
    }

    fn peak_blocks(tokens: usize, window: Option<usize>, chunk: usize) -> usize {
        // A window layer keeps up to two windows before it drops one (see `evict`), plus
        // the chunk just appended.
        let stored = match window {
            None => tokens,
            Some(w) => tokens.min(2 * w + chunk.max(1)),
        };
        blocks_for_tokens(columns_for(stored.max(1)))
    }

    fn lease(&self) -> Option<&BlockLease> {
        self.lease.as_ref()
    }

    fn lease_mut(&mut self) -> &mut Option<BlockLease> {
        &mut self.lease
    }

    fn snapshot(&self) -> KvLayerSnapshot {
        let read = || -> Result<(Vec<f32>, Vec<f32>)> {
            if self.stored() == 0 {
                return Ok((Vec::new(), Vec::new()));
            }
            let (k, v) = self.range(self.start, self.len)?;
            Ok((self.host(&k)?, self.host(&v)?))
        };
        let (keys, values) = read().unwrap_or_else(|e| {
            tracing::error!("mlx: reading a KV layer to the host failed: {e}");
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
}
