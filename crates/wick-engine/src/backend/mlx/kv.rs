//! KV cache of one layer of one sequence on MLX: `[1, kv_heads, capacity, head_dim]`
//! buffers grown a block at a time and written with `slice_update` (in place when MLX
//! can donate the old buffer), with sliding-window eviction.
//!
//! Sequences decoded in lockstep may instead share one left-padded buffer
//! `[n, kv_heads, capacity, head_dim]` (row `i` holds sequence `i`, right-aligned), so a
//! decode step of all `n` is one write and one attention call ([`SharedKv`]). A shared
//! row is detached into its own buffer when cloned.
use std::sync::{Arc, Mutex};

use wick_mlx::{Array, Dtype, Stream};

use super::mlx_err;
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::{EngineError, Result};

/// Tokens a buffer grows by.
const BLOCK: usize = 256;

/// A buffer holding several sequences' keys and values, left-padded so that sequences
/// fed the same number of steps end in the same column.
#[derive(Debug)]
pub struct SharedKv {
    pub(crate) keys: Option<Array>,
    pub(crate) values: Option<Array>,
    /// Columns allocated.
    pub(crate) capacity: usize,
    /// Leading padding columns of each row.
    pub(crate) pads: Vec<usize>,
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
    /// Row `row` of a buffer shared with other sequences.
    Shared {
        batch: Arc<Mutex<SharedKv>>,
        row: usize,
    },
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
}

fn cache_err(message: &str) -> EngineError {
    EngineError::Cache(format!("mlx: {message}"))
}

fn poisoned() -> EngineError {
    cache_err("a shared KV buffer's lock was poisoned")
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
            storage: Storage::Own {
                keys: None,
                values: None,
                capacity: 0,
            },
        }
    }

    /// Layers for `lens.len()` sequences about to be fed prompts of `lens` tokens in
    /// lockstep, sharing one buffer (left-padded to the longest prompt).
    pub(crate) fn new_shared(
        stream: Stream,
        dtype: Dtype,
        kv_heads: usize,
        head_dim: usize,
        lens: &[usize],
    ) -> Vec<Self> {
        let longest = lens.iter().copied().max().unwrap_or(0);
        let batch = Arc::new(Mutex::new(SharedKv {
            keys: None,
            values: None,
            capacity: 0,
            pads: lens.iter().map(|&l| longest - l).collect(),
        }));
        (0..lens.len())
            .map(|row| MlxKvLayer {
                storage: Storage::Shared {
                    batch: batch.clone(),
                    row,
                },
                ..MlxKvLayer::new(stream, dtype, kv_heads, head_dim, None)
            })
            .collect()
    }

    /// Tokens stored (`len - start`).
    pub(crate) fn stored(&self) -> usize {
        self.len - self.start
    }

    fn shape(&self, rows: usize, tokens: usize) -> [i32; 4] {
        [
            rows as i32,
            self.kv_heads as i32,
            tokens as i32,
            self.head_dim as i32,
        ]
    }

    /// `a[rows, :, from..to, :]`.
    fn view(&self, a: &Array, rows: (usize, usize), from: usize, to: usize) -> Result<Array> {
        let start = [rows.0 as i32, 0, from as i32, 0];
        let mut stop = self.shape(rows.1, to);
        stop[0] = rows.1 as i32;
        self.stream.slice(a, &start, &stop).map_err(mlx_err)
    }

    /// A zero buffer of `capacity` columns and `rows` rows holding `keep` (`rows` rows,
    /// `n` columns) in front.
    fn buffer(
        &self,
        rows: usize,
        capacity: usize,
        keep: Option<&Array>,
        n: usize,
    ) -> Result<Array> {
        let s = &self.stream;
        let fresh = s
            .zeros(&self.shape(rows, capacity), self.dtype)
            .map_err(mlx_err)?;
        match keep {
            Some(k) if n > 0 => s
                .slice_update(&fresh, k, &[0; 4], &self.shape(rows, n))
                .map_err(mlx_err),
            _ => Ok(fresh),
        }
    }

    /// `buf[rows, :, at..at + m, :] = update`, growing `buf` (all rows) to hold `need`
    /// columns; returns the new buffer and capacity.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        buf: Option<Array>,
        capacity: usize,
        rows: usize,
        target: (usize, usize),
        at: usize,
        m: usize,
        update: &Array,
    ) -> Result<(Array, usize)> {
        let need = at + m;
        let (buf, capacity) = match buf {
            Some(b) if need <= capacity => (b, capacity),
            old => {
                // Every row keeps all it holds (rows of a shared buffer end in
                // different columns while their prompts are being fed).
                let grown = need.div_ceil(BLOCK) * BLOCK;
                let kept = if old.is_some() { capacity } else { 0 };
                let fresh = self.buffer(rows, grown, old.as_ref(), kept)?;
                (fresh, grown)
            }
        };
        let start = [target.0 as i32, 0, at as i32, 0];
        let mut stop = self.shape(target.1, need);
        stop[0] = target.1 as i32;
        let out = self
            .stream
            .slice_update(&buf, update, &start, &stop)
            .map_err(mlx_err)?;
        Ok((out, capacity))
    }

    /// Appends `m` tokens of keys and values, each `[1, kv_heads, m, head_dim]`.
    pub(crate) fn append(&mut self, k: &Array, v: &Array, m: usize) -> Result<()> {
        let stored = self.stored();
        // Take the buffers out so nothing else holds them during the update: MLX then
        // writes in place instead of copying.
        let storage = std::mem::replace(
            &mut self.storage,
            Storage::Own {
                keys: None,
                values: None,
                capacity: 0,
            },
        );
        match storage {
            Storage::Own {
                keys,
                values,
                capacity,
            } => {
                let (nk, c) = self.write(keys, capacity, 1, (0, 1), stored, m, k)?;
                let (nv, _) = self.write(values, capacity, 1, (0, 1), stored, m, v)?;
                self.storage = Storage::Own {
                    keys: Some(nk),
                    values: Some(nv),
                    capacity: c,
                };
            }
            Storage::Shared { batch, row } => {
                self.storage = Storage::Shared {
                    batch: batch.clone(),
                    row,
                };
                let mut b = batch.lock().map_err(|_| poisoned())?;
                let rows = b.pads.len();
                let at = b.pads[row] + stored;
                let (kb, vb, cap) = (b.keys.take(), b.values.take(), b.capacity);
                let (nk, c) = self.write(kb, cap, rows, (row, row + 1), at, m, k)?;
                let (nv, _) = self.write(vb, cap, rows, (row, row + 1), at, m, v)?;
                b.keys = Some(nk);
                b.values = Some(nv);
                b.capacity = c;
            }
        }
        self.len += m;
        Ok(())
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
            storage: Storage::Own {
                keys: None,
                values: None,
                capacity: 0,
            },
        }
    }

    /// Keys and values `[1, kvh, to - from, hd]` of logical positions `from..to`.
    pub(crate) fn range(&self, from: usize, to: usize) -> Result<(Array, Array)> {
        match &self.storage {
            Storage::Own { keys, values, .. } => {
                let (Some(k), Some(v)) = (keys, values) else {
                    return Err(cache_err("the cache is empty"));
                };
                let (a, b) = (from - self.start, to - self.start);
                Ok((self.view(k, (0, 1), a, b)?, self.view(v, (0, 1), a, b)?))
            }
            Storage::Shared { batch, row } => {
                let b = batch.lock().map_err(|_| poisoned())?;
                let (Some(k), Some(v)) = (&b.keys, &b.values) else {
                    return Err(cache_err("the cache is empty"));
                };
                let pad = b.pads[*row];
                let r = (*row, row + 1);
                Ok((
                    self.view(k, r, pad + from, pad + to)?,
                    self.view(v, r, pad + from, pad + to)?,
                ))
            }
        }
    }

    /// Drops tokens no future query of a sliding-window layer can see (a window's worth
    /// at a time, so the copy is amortized). Shared buffers never hold windowed layers.
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
        let capacity = n.div_ceil(BLOCK).max(1) * BLOCK;
        self.storage = Storage::Own {
            keys: Some(self.buffer(1, capacity, Some(&k), n)?),
            values: Some(self.buffer(1, capacity, Some(&v), n)?),
            capacity,
        };
        self.start = keep_from;
        Ok(())
    }

    /// This layer with its tokens in a buffer of its own.
    fn detached(&self) -> Result<MlxKvLayer> {
        let mut out = self.shallow();
        let stored = self.stored();
        if stored > 0 {
            let (k, v) = self.range(self.start, self.len)?;
            let capacity = stored.div_ceil(BLOCK) * BLOCK;
            out.storage = Storage::Own {
                keys: Some(self.buffer(1, capacity, Some(&k), stored)?),
                values: Some(self.buffer(1, capacity, Some(&v), stored)?),
                capacity,
            };
        }
        Ok(out)
    }

    pub(crate) fn from_snapshot(stream: Stream, dtype: Dtype, s: &KvLayerSnapshot) -> Result<Self> {
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
        let mut layer = MlxKvLayer::new(stream, dtype, s.kv_heads, s.head_dim, s.window);
        layer.start = s.start;
        layer.len = s.start;
        if stored > 0 {
            let shape = [stored as i32, s.kv_heads as i32, s.head_dim as i32];
            let up = |data: &[f32]| -> Result<Array> {
                let a = Array::from_slice(data, &shape).map_err(mlx_err)?;
                let a = stream.transpose(&a, &[1, 0, 2]).map_err(mlx_err)?;
                let a = stream
                    .reshape(&a, &layer.shape(1, stored))
                    .map_err(mlx_err)?;
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
    /// A copy that can grow on its own: a shared row is copied into a buffer of its own
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
            Storage::Shared { .. } => self.detached().unwrap_or_else(|e| {
                tracing::error!("mlx: copying a shared KV row failed: {e}");
                let mut empty = self.shallow();
                empty.start = 0;
                empty.len = 0;
                empty
            }),
        }
    }
}

/// The shared buffer behind `layers` when every one is row `i` of the same buffer (and
/// there are no other rows) and all rows end in the same column: the lockstep decode
/// case. Returns the buffer and that column.
pub(crate) fn lockstep(layers: &[&MlxKvLayer]) -> Option<(Arc<Mutex<SharedKv>>, usize)> {
    let first = match &layers.first()?.storage {
        Storage::Shared { batch, .. } => batch.clone(),
        Storage::Own { .. } => return None,
    };
    let b = first.lock().ok()?;
    if b.pads.len() != layers.len() {
        return None;
    }
    let mut end = None;
    for (i, l) in layers.iter().enumerate() {
        match &l.storage {
            Storage::Shared { batch, row } if Arc::ptr_eq(batch, &first) && *row == i => {}
            _ => return None,
        }
        let e = b.pads[i] + l.stored();
        if *end.get_or_insert(e) != e {
            return None;
        }
    }
    drop(b);
    Some((first, end?))
}

impl MlxKvLayer {
    /// One decode step of all rows of a lockstep batch (see [`lockstep`]): writes
    /// `k`/`v` `[n, kvh, 1, hd]` at column `end` and returns all keys/values up to it
    /// with the rows' padding (`pads`).
    pub(crate) fn lockstep_step(
        layers: &mut [&mut MlxKvLayer],
        batch: &Arc<Mutex<SharedKv>>,
        end: usize,
        k: &Array,
        v: &Array,
    ) -> Result<(Array, Array, Vec<usize>)> {
        let proto = layers
            .first()
            .ok_or_else(|| cache_err("empty batch"))?
            .shallow();
        let mut b = batch.lock().map_err(|_| poisoned())?;
        let rows = b.pads.len();
        let (kb, vb) = (b.keys.take(), b.values.take());
        let (nk, c) = proto.write(kb, b.capacity, rows, (0, rows), end, 1, k)?;
        let (nv, _) = proto.write(vb, b.capacity, rows, (0, rows), end, 1, v)?;
        let keys = proto.view(&nk, (0, rows), 0, end + 1)?;
        let values = proto.view(&nv, (0, rows), 0, end + 1)?;
        b.keys = Some(nk);
        b.values = Some(nv);
        b.capacity = c;
        let pads = b.pads.clone();
        drop(b);
        for l in layers.iter_mut() {
            l.len += 1;
        }
        Ok((keys, values, pads))
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
        if !self.can_trim_to(len) {
            return Err(crate::backend::untrimmable(self.len, self.start, len));
        }
        // Stored tokens past `len` are simply overwritten by later appends.
        self.len = len.max(self.start);
        if len < self.start {
            self.start = len;
            self.len = len;
        }
        Ok(())
    }

    fn byte_size(&self) -> usize {
        let per_column = 2 * self.kv_heads * self.head_dim * self.dtype.size();
        match &self.storage {
            Storage::Own { capacity, .. } => capacity * per_column,
            Storage::Shared { batch, .. } => {
                batch.lock().map(|b| b.capacity * per_column).unwrap_or(0)
            }
        }
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
