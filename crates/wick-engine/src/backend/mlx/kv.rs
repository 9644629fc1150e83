//! KV cache of one layer of one sequence on MLX: `[1, kv_heads, capacity, head_dim]`
//! buffers grown a block at a time and written with `slice_update` (in place when MLX
//! can donate the old buffer), with sliding-window eviction.
use wick_mlx::{Array, Dtype, Stream};

use super::mlx_err;
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::{EngineError, Result};

/// Tokens a buffer grows by.
const BLOCK: usize = 256;

/// Keys and values of one layer.
#[derive(Debug, Clone)]
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
    /// Stored tokens the buffers have room for.
    pub(crate) capacity: usize,
    pub(crate) keys: Option<Array>,
    pub(crate) values: Option<Array>,
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
            capacity: 0,
            keys: None,
            values: None,
        }
    }

    /// Tokens stored (`len - start`).
    pub(crate) fn stored(&self) -> usize {
        self.len - self.start
    }

    fn shape(&self, tokens: usize) -> [i32; 4] {
        [1, self.kv_heads as i32, tokens as i32, self.head_dim as i32]
    }

    /// A fresh buffer of `capacity` tokens holding `keep` (`[1, kvh, n, hd]`) in front.
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

    fn view(&self, a: &Array, from: usize, to: usize) -> Result<Array> {
        let start = [0, 0, from as i32, 0];
        let stop = self.shape(to);
        self.stream.slice(a, &start, &stop).map_err(mlx_err)
    }

    /// Appends `m` tokens of keys and values, each `[1, kv_heads, m, head_dim]`.
    pub(crate) fn append(&mut self, k: &Array, v: &Array, m: usize) -> Result<()> {
        let stored = self.stored();
        if stored + m > self.capacity || self.keys.is_none() {
            let capacity = (stored + m).div_ceil(BLOCK) * BLOCK;
            let keep_k = match &self.keys {
                Some(a) => Some(self.view(a, 0, stored)?),
                None => None,
            };
            let keep_v = match &self.values {
                Some(a) => Some(self.view(a, 0, stored)?),
                None => None,
            };
            self.keys = Some(self.buffer(capacity, keep_k.as_ref(), stored)?);
            self.values = Some(self.buffer(capacity, keep_v.as_ref(), stored)?);
            self.capacity = capacity;
        }
        let start = [0, 0, stored as i32, 0];
        let stop = self.shape(stored + m);
        let s = self.stream;
        // Take the buffers out so this layer drops its reference before the update: MLX
        // then writes in place instead of copying.
        let keys = self.keys.take().ok_or_else(|| cache_err("no key buffer"))?;
        let values = self
            .values
            .take()
            .ok_or_else(|| cache_err("no value buffer"))?;
        self.keys = Some(s.slice_update(&keys, k, &start, &stop).map_err(mlx_err)?);
        drop(keys);
        self.values = Some(s.slice_update(&values, v, &start, &stop).map_err(mlx_err)?);
        self.len += m;
        Ok(())
    }

    /// Keys and values of stored tokens `from..to` (logical positions).
    pub(crate) fn range(&self, from: usize, to: usize) -> Result<(Array, Array)> {
        let (k, v) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) => (k, v),
            _ => return Err(cache_err("the cache is empty")),
        };
        let (a, b) = (from - self.start, to - self.start);
        Ok((self.view(k, a, b)?, self.view(v, a, b)?))
    }

    /// Drops tokens no future query of a sliding-window layer can see (a window's worth
    /// at a time, so the copy is amortized).
    pub(crate) fn evict(&mut self) -> Result<()> {
        let Some(window) = self.window else {
            return Ok(());
        };
        let keep_from = (self.len + 1).saturating_sub(window);
        if keep_from < self.start + window {
            return Ok(());
        }
        let (k, v) = self.range(keep_from, self.len)?;
        let n = self.len - keep_from;
        let capacity = n.div_ceil(BLOCK).max(1) * BLOCK;
        self.keys = Some(self.buffer(capacity, Some(&k), n)?);
        self.values = Some(self.buffer(capacity, Some(&v), n)?);
        self.capacity = capacity;
        self.start = keep_from;
        Ok(())
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
                let a = stream.reshape(&a, &layer.shape(stored)).map_err(mlx_err)?;
                stream.astype(&a, dtype).map_err(mlx_err)
            };
            let (k, v) = (up(&s.keys)?, up(&s.values)?);
            layer.append(&k, &v, stored)?;
        }
        Ok(layer)
    }

    fn host(&self, a: &Array) -> Vec<f32> {
        let s = &self.stream;
        let stored = self.stored();
        let read = || -> Result<Vec<f32>> {
            let v = self.view(a, 0, stored)?;
            let v = s.transpose(&v, &[0, 2, 1, 3]).map_err(mlx_err)?;
            let v = s.astype(&v, Dtype::F32).map_err(mlx_err)?;
            v.to_vec::<f32>().map_err(mlx_err)
        };
        read().unwrap_or_default()
    }
}

fn cache_err(message: &str) -> EngineError {
    EngineError::Cache(format!("mlx: {message}"))
}

impl KvLayer for MlxKvLayer {
    fn len(&self) -> usize {
        self.len
    }

    fn can_trim_to(&self, len: usize) -> bool {
        if len > self.len {
            return false;
        }
        match self.window {
            None => true,
            Some(w) => self.start <= (len + 1).saturating_sub(w),
        }
    }

    fn trim(&mut self, len: usize) -> Result<()> {
        if !self.can_trim_to(len) {
            return Err(EngineError::Cache(format!(
                "cannot trim a sliding-window cache of {} tokens (first kept {}) to {len}",
                self.len, self.start
            )));
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
        2 * self.capacity * self.kv_heads * self.head_dim * self.dtype.size()
    }

    fn snapshot(&self) -> KvLayerSnapshot {
        let (keys, values) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) if self.stored() > 0 => (self.host(k), self.host(v)),
            _ => (Vec::new(), Vec::new()),
        };
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
