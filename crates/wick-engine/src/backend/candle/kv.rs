//! Host-memory KV cache of one layer of one sequence, with sliding-window eviction.
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::{EngineError, Result};

/// Keys and values of one layer, token-major: `[token][kv_head][head_dim]`.
///
/// For a sliding-window layer, tokens that no future query can see are dropped from the
/// front (lazily, a slack at a time, so eviction is amortized O(1) per token). Once that
/// has happened the cache can no longer be trimmed below the dropped range.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuKvLayer {
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: Option<usize>,
    /// Logical position of the first stored token.
    pub(crate) start: usize,
    /// Logical length.
    pub(crate) len: usize,
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
}

impl CpuKvLayer {
    pub(crate) fn new(kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
        CpuKvLayer {
            kv_heads,
            head_dim,
            window,
            start: 0,
            len: 0,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Floats per token.
    pub(crate) fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub(crate) fn append(&mut self, keys: &[f32], values: &[f32]) {
        debug_assert_eq!(keys.len(), values.len());
        self.keys.extend_from_slice(keys);
        self.values.extend_from_slice(values);
        self.len += keys.len() / self.row();
    }

    /// Drops tokens that fall out of the window of every future query.
    pub(crate) fn evict(&mut self) {
        let Some(window) = self.window else { return };
        // The next query (position `len`) needs keys from `len - window + 1` on.
        let keep_from = (self.len + 1).saturating_sub(window);
        let slack = window;
        if keep_from >= self.start + slack {
            let drop = (keep_from - self.start) * self.row();
            self.keys.drain(..drop);
            self.values.drain(..drop);
            self.start = keep_from;
        }
    }

    /// Keys of stored token `pos` (logical), head `h`.
    #[inline]
    pub(crate) fn key(&self, pos: usize, h: usize) -> &[f32] {
        let at = (pos - self.start) * self.row() + h * self.head_dim;
        &self.keys[at..at + self.head_dim]
    }

    /// Values of stored token `pos` (logical), head `h`.
    #[inline]
    pub(crate) fn value(&self, pos: usize, h: usize) -> &[f32] {
        let at = (pos - self.start) * self.row() + h * self.head_dim;
        &self.values[at..at + self.head_dim]
    }

    pub(crate) fn from_snapshot(s: &KvLayerSnapshot) -> Result<Self> {
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
        Ok(CpuKvLayer {
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            window: s.window,
            start: s.start,
            len: s.len,
            keys: s.keys.clone(),
            values: s.values.clone(),
        })
    }
}

impl KvLayer for CpuKvLayer {
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
        let stored = len.saturating_sub(self.start) * self.row();
        self.keys.truncate(stored);
        self.values.truncate(stored);
        self.len = len;
        if len < self.start {
            // Only possible for len == 0 with start == 0, kept for clarity.
            self.start = len;
        }
        Ok(())
    }

    fn byte_size(&self) -> usize {
        (self.keys.capacity() + self.values.capacity()) * std::mem::size_of::<f32>()
    }

    fn snapshot(&self) -> KvLayerSnapshot {
        KvLayerSnapshot {
            start: self.start,
            len: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            keys: self.keys.clone(),
            values: self.values.clone(),
        }
    }
}
