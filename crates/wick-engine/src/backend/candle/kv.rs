//! Paged host-memory KV cache of one layer of one sequence: a block table of
//! [`KvBlock`]s, sliding-window eviction by whole blocks, copy-on-write clones, and an
//! optional [`BlockLease`] that charges the blocks to a shared [`BlockPool`].
use std::collections::VecDeque;
use std::sync::Arc;

use super::block_pool::{KvBlock, KvDtype};
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::kv_pool::{block_bytes, BlockLease, BLOCK_TOKENS};
use crate::Result;

/// Keys and values of one layer, in blocks of [`BLOCK_TOKENS`] tokens.
///
/// Block `i` of the table holds logical positions `base + i·B .. base + (i+1)·B`. A
/// sliding-window layer drops whole blocks from the front once no future query can see
/// them (keeping one block of slack, so the cache can still be cut back by up to a block,
/// which the prompt cache needs when a new prompt diverges just before the end of an
/// entry); once that has happened the cache can no longer be trimmed below the dropped
/// range.
///
/// `clone` shares every block with the original (an `Arc` each) and is not charged to any
/// pool; the first write to a shared block copies that block only.
#[derive(Debug)]
pub struct CpuKvLayer {
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: Option<usize>,
    /// How the blocks store numbers.
    pub(crate) dtype: KvDtype,
    /// Logical position of the first valid token.
    pub(crate) start: usize,
    /// Logical position of slot 0 of the first block (a multiple of [`BLOCK_TOKENS`]).
    pub(crate) base: usize,
    /// Logical length.
    pub(crate) len: usize,
    /// The block table.
    pub(crate) blocks: VecDeque<Arc<KvBlock>>,
    /// The pool charge, when the cache belongs to a running sequence.
    lease: Option<BlockLease>,
}

impl Clone for CpuKvLayer {
    fn clone(&self) -> Self {
        CpuKvLayer {
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            dtype: self.dtype,
            start: self.start,
            base: self.base,
            len: self.len,
            blocks: self.blocks.clone(),
            lease: None,
        }
    }
}

impl PartialEq for CpuKvLayer {
    /// Same layout and same stored keys and values (block boundaries and pool charges
    /// aside).
    fn eq(&self, other: &Self) -> bool {
        self.snapshot() == other.snapshot()
    }
}

/// Blocks needed to cover `first .. end` with blocks aligned at `base`.
#[inline]
fn blocks_spanning(base: usize, end: usize) -> usize {
    end.saturating_sub(base).div_ceil(BLOCK_TOKENS)
}

impl CpuKvLayer {
    pub(crate) fn new(
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        dtype: KvDtype,
    ) -> Self {
        CpuKvLayer {
            kv_heads,
            head_dim,
            window,
            dtype,
            start: 0,
            base: 0,
            len: 0,
            blocks: VecDeque::new(),
            lease: None,
        }
    }

    /// Floats per token.
    pub(crate) fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Blocks in the table.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the cache is charged to a pool.
    pub fn is_attached(&self) -> bool {
        self.lease.is_some()
    }

    /// Charges up to the blocks `tokens` more need, if the pool allows.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        let blocks = KvLayer::blocks_after(self, tokens);
        match &mut self.lease {
            Some(lease) => lease.try_grow(blocks),
            None => true,
        }
    }

    pub(crate) fn append(&mut self, keys: &[f32], values: &[f32]) {
        debug_assert_eq!(keys.len(), values.len());
        let row = self.row();
        let tokens = keys.len() / row;
        if self.blocks.is_empty() {
            // Realign an empty table at the next token.
            self.base = self.len - self.len % BLOCK_TOKENS;
            self.start = self.start.max(self.base);
        }
        for t in 0..tokens {
            let offset = self.len - self.base;
            let (index, slot) = (offset / BLOCK_TOKENS, offset % BLOCK_TOKENS);
            if index == self.blocks.len() {
                self.blocks
                    .push_back(Arc::new(KvBlock::with_row(row, self.dtype)));
            }
            // Copies the block first if a clone shares it.
            Arc::make_mut(&mut self.blocks[index]).write(
                slot,
                self.head_dim,
                &keys[t * row..(t + 1) * row],
                &values[t * row..(t + 1) * row],
            );
            self.len += 1;
        }
        if self.blocks.len() > self.charged_blocks() {
            KvLayer::settle(self);
        }
    }

    /// Drops blocks that fall out of the window of every future query.
    pub(crate) fn evict(&mut self) {
        let Some(window) = self.window else { return };
        // The next query (position `len`) needs keys from `len - window + 1` on; one
        // more block is kept as slack.
        let keep_from = (self.len + 1).saturating_sub(window);
        let mut dropped = false;
        while self.blocks.len() > 1 && self.base + 2 * BLOCK_TOKENS <= keep_from {
            self.blocks.pop_front();
            self.base += BLOCK_TOKENS;
            dropped = true;
        }
        if dropped {
            self.start = self.start.max(self.base);
        }
        KvLayer::settle(self);
    }

    /// The block holding logical position `pos`, and the slot in it.
    #[inline]
    pub(crate) fn locate(&self, pos: usize) -> (&KvBlock, usize) {
        let offset = pos - self.base;
        (&self.blocks[offset / BLOCK_TOKENS], offset % BLOCK_TOKENS)
    }

    /// Keys of stored token `pos` (logical), head `h`.
    #[cfg(test)]
    pub(crate) fn key(&self, pos: usize, h: usize) -> Vec<f32> {
        let (block, slot) = self.locate(pos);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        block.read(slot, self.row(), self.head_dim, &mut k, &mut v);
        k[h * self.head_dim..(h + 1) * self.head_dim].to_vec()
    }

    /// Values of stored token `pos` (logical), head `h`.
    #[cfg(test)]
    pub(crate) fn value(&self, pos: usize, h: usize) -> Vec<f32> {
        let (block, slot) = self.locate(pos);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        block.read(slot, self.row(), self.head_dim, &mut k, &mut v);
        v[h * self.head_dim..(h + 1) * self.head_dim].to_vec()
    }

    /// Rebuilds a layer from its host copy, storing numbers as `dtype`.
    pub(crate) fn from_snapshot(s: &KvLayerSnapshot, dtype: KvDtype) -> Result<Self> {
        s.stored()?;
        let mut layer = CpuKvLayer::new(s.kv_heads, s.head_dim, s.window, dtype);
        layer.base = s.start - s.start % BLOCK_TOKENS;
        layer.start = s.start;
        layer.len = s.start;
        layer.append(&s.keys, &s.values);
        Ok(layer)
    }
}

impl KvLayer for CpuKvLayer {
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
        if len <= self.start {
            // Only possible for len == start == 0 (or a window that dropped nothing).
            self.blocks.clear();
            self.base = len - len % BLOCK_TOKENS;
            self.start = len;
        } else {
            self.blocks.truncate(blocks_spanning(self.base, len));
        }
        self.len = len;
        KvLayer::settle(self);
        Ok(())
    }

    fn held_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn blocks_after(&self, tokens: usize) -> usize {
        blocks_spanning(self.base, self.len + tokens)
    }

    fn peak_blocks(tokens: usize, window: Option<usize>, chunk: usize) -> usize {
        let all = tokens.div_ceil(BLOCK_TOKENS);
        match window {
            None => all,
            // The window, the slack block, the chunk, and one block of misalignment
            // at each end.
            Some(w) => all.min((w + chunk.max(1)).div_ceil(BLOCK_TOKENS) + 3),
        }
    }

    fn lease(&self) -> Option<&BlockLease> {
        self.lease.as_ref()
    }

    fn lease_mut(&mut self) -> &mut Option<BlockLease> {
        &mut self.lease
    }

    fn byte_size(&self) -> usize {
        // Every block of a layer has the same size; counting them spares the engine loop,
        // which sums this over all running sequences each step, a walk over every block.
        self.blocks.len() * block_bytes(self.row(), self.dtype.bytes())
    }

    fn snapshot(&self) -> KvLayerSnapshot {
        let row = self.row();
        let stored = self.len - self.start;
        let mut keys = Vec::with_capacity(stored * row);
        let mut values = Vec::with_capacity(stored * row);
        let mut pos = self.start;
        while pos < self.len {
            let (block, slot) = self.locate(pos);
            block.read(slot, row, self.head_dim, &mut keys, &mut values);
            pos += 1;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_pool::BlockPool;

    fn tokens(from: usize, n: usize, row: usize) -> Vec<f32> {
        (from * row..(from + n) * row).map(|i| i as f32).collect()
    }

    fn filled(n: usize, window: Option<usize>) -> CpuKvLayer {
        let mut l = CpuKvLayer::new(2, 4, window, KvDtype::F32);
        let mut at = 0;
        for chunk in [1, 7, 16, 3, 40, 1, 1] {
            let take = chunk.min(n - at);
            if take == 0 {
                break;
            }
            let t = tokens(at, take, 8);
            l.append(&t, &t);
            l.evict();
            at += take;
        }
        if at < n {
            let t = tokens(at, n - at, 8);
            l.append(&t, &t);
            l.evict();
        }
        l
    }

    #[test]
    fn blocks_hold_tokens_in_order_across_boundaries() {
        let l = filled(69, None);
        assert_eq!(l.len, 69);
        assert_eq!(l.block_count(), 5);
        for pos in [0, 15, 16, 17, 47, 68] {
            assert_eq!(l.key(pos, 1)[0], (pos * 8 + 4) as f32);
            assert_eq!(l.value(pos, 0)[3], (pos * 8 + 3) as f32);
        }
        let s = l.snapshot();
        assert_eq!(s.keys, tokens(0, 69, 8));
    }

    #[test]
    fn window_frees_whole_blocks_and_limits_trimming() {
        let l = filled(200, Some(32));
        // The next query needs 169..; one slack block before that is kept.
        assert!(l.base <= 169 - BLOCK_TOKENS && l.base + 2 * BLOCK_TOKENS > 169);
        assert!(l.block_count() <= 32 / BLOCK_TOKENS + 3);
        assert!(l.can_trim_to(200 - 1));
        assert!(!l.can_trim_to(100));
        let s = l.snapshot();
        assert_eq!(s.start, l.base);
        assert_eq!(s.keys, tokens(l.base, 200 - l.base, 8));
        let back = CpuKvLayer::from_snapshot(&s, KvDtype::F32).unwrap();
        assert_eq!(back, l);
    }

    #[test]
    fn trim_then_append_overwrites_stale_slots() {
        let mut l = filled(40, None);
        l.trim(21).unwrap();
        assert_eq!(l.block_count(), 2);
        let t = vec![-1f32; 8 * 5];
        l.append(&t, &t);
        assert_eq!(l.len, 26);
        assert_eq!(l.key(20, 0)[0], 160.0);
        assert_eq!(l.key(21, 0)[0], -1.0);
        assert_eq!(l.snapshot().keys.len(), 26 * 8);
        assert_eq!(l.value(25, 1), vec![-1.0; 4]);
        l.trim(0).unwrap();
        assert_eq!((l.len, l.block_count()), (0, 0));
    }

    #[test]
    fn clones_share_full_blocks_and_copy_on_write() {
        let mut a = filled(40, None);
        let mut b = a.clone();
        assert!(Arc::ptr_eq(&a.blocks[0], &b.blocks[0]));
        b.trim(20).unwrap();
        let t = vec![7f32; 8 * 3];
        b.append(&t, &t);
        // The shared partial block was copied; the original keeps its tokens.
        assert!(Arc::ptr_eq(&a.blocks[0], &b.blocks[0]));
        assert!(!Arc::ptr_eq(&a.blocks[1], &b.blocks[1]));
        assert_eq!(a.key(21, 0)[0], 168.0);
        assert_eq!(b.key(21, 0)[0], 7.0);
        a.append(&t, &t);
        assert_eq!(a.key(40, 0)[0], 7.0);
        assert_eq!(b.len, 23);
    }

    #[test]
    fn leases_follow_the_block_table() {
        let pool = BlockPool::new(100);
        let mut l = CpuKvLayer::new(2, 4, Some(32), KvDtype::F32);
        l.attach(&pool);
        assert!(l.reserve(20));
        assert_eq!(pool.used(), 2);
        let t = tokens(0, 20, 8);
        l.append(&t, &t);
        l.evict();
        assert_eq!(pool.used(), 2);
        for i in 20..300 {
            assert!(l.reserve(1));
            let t = tokens(i, 1, 8);
            l.append(&t, &t);
            l.evict();
            assert_eq!(pool.used(), l.block_count());
        }
        assert!(l.block_count() <= <CpuKvLayer as KvLayer>::peak_blocks(300, Some(32), 1));
        let c = l.clone();
        assert_eq!(pool.used(), l.block_count(), "clones are not charged");
        drop(l);
        assert_eq!(pool.used(), 0);
        assert_eq!(c.len, 300);
    }
}
