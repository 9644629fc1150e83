//! The KV block pool: every layer of every sequence stores its keys and values in blocks
//! of [`BLOCK_TOKENS`] tokens, and the blocks a running sequence holds are charged to one
//! shared budget, so memory — not the longest request — bounds how many sequences run.
//!
//! A block is an `Arc`: a cloned cache shares its full blocks with the original and copies
//! one only when it writes to it (copy-on-write, `Arc::make_mut`). That is the hook the
//! prefix cache uses to share a common prompt prefix between sequences.
//!
//! Charging is per holder: a cache attached to the pool holds a [`BlockLease`] for the
//! blocks it references (shared ones included, so the count is an upper bound of the
//! memory really used) and gives them back when it drops them or is dropped itself.
//! Caches not attached to any pool (the single-request path, prompt-cache entries) are
//! not charged.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Tokens per block. 16 keeps the waste of a sequence's last, partly filled block small
/// (≤ 15 tokens per layer) while a block of a small model (3 KV heads × 64 dims) is still
/// 12 KiB of keys, long enough for the attention loop to stream through.
pub const BLOCK_TOKENS: usize = 16;

/// Keys and values of [`BLOCK_TOKENS`] consecutive tokens of one layer.
///
/// Keys are stored transposed, `[kv_head][dim][slot]`, so attention computes the scores
/// of a whole block as sixteen-wide vector products with no horizontal sums; values are
/// token-major, `[slot][kv_head][dim]`, the rows attention adds up. Slots past the
/// layer's length hold stale or zero data and are never read.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBlock {
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
}

impl KvBlock {
    /// A zeroed block for tokens of `row` floats.
    pub(crate) fn with_row(row: usize) -> Self {
        KvBlock {
            keys: vec![0.0; BLOCK_TOKENS * row],
            values: vec![0.0; BLOCK_TOKENS * row],
        }
    }

    /// Stores one token's keys and values (`row` floats each, `[kv_head][dim]`) in `slot`.
    #[inline]
    pub(crate) fn write(&mut self, slot: usize, keys: &[f32], values: &[f32]) {
        let row = keys.len();
        for (i, &k) in keys.iter().enumerate() {
            self.keys[i * BLOCK_TOKENS + slot] = k;
        }
        self.values[slot * row..(slot + 1) * row].copy_from_slice(values);
    }

    /// Appends the keys and values of `slot` (`[kv_head][dim]`) to `keys` and `values`.
    pub(crate) fn read(&self, slot: usize, row: usize, keys: &mut Vec<f32>, values: &mut Vec<f32>) {
        keys.extend((0..row).map(|i| self.keys[i * BLOCK_TOKENS + slot]));
        values.extend_from_slice(&self.values[slot * row..(slot + 1) * row]);
    }

    /// Transposed keys of KV head `h`: `[dim][slot]`.
    #[inline]
    pub(crate) fn head_keys(&self, h: usize, head_dim: usize) -> &[f32] {
        &self.keys[h * head_dim * BLOCK_TOKENS..(h + 1) * head_dim * BLOCK_TOKENS]
    }

    /// Bytes the block's buffers occupy.
    pub(crate) fn byte_size(&self) -> usize {
        (self.keys.capacity() + self.values.capacity()) * std::mem::size_of::<f32>()
    }
}

/// A snapshot of the pool's occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolUsage {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Blocks the budget allows.
    pub total_blocks: usize,
    /// Blocks charged to running sequences.
    pub used_blocks: usize,
    /// Most blocks ever charged at once.
    pub peak_blocks: usize,
    /// Charges refused because the pool was full.
    pub refusals: u64,
}

impl PoolUsage {
    /// Blocks not charged to anyone.
    pub fn free_blocks(&self) -> usize {
        self.total_blocks.saturating_sub(self.used_blocks)
    }
}

/// The shared block budget (counts one layer's block as one block).
#[derive(Debug)]
pub struct BlockPool {
    capacity: AtomicUsize,
    used: AtomicUsize,
    peak: AtomicUsize,
    refusals: AtomicU64,
}

impl BlockPool {
    /// A pool of `capacity` blocks.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(BlockPool {
            capacity: AtomicUsize::new(capacity),
            used: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refusals: AtomicU64::new(0),
        })
    }

    /// Blocks the budget allows.
    pub fn capacity(&self) -> usize {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Blocks charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Blocks free now.
    pub fn free(&self) -> usize {
        self.capacity().saturating_sub(self.used())
    }

    /// Occupancy figures.
    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            block_tokens: BLOCK_TOKENS,
            total_blocks: self.capacity(),
            used_blocks: self.used(),
            peak_blocks: self.peak.load(Ordering::Relaxed),
            refusals: self.refusals.load(Ordering::Relaxed),
        }
    }

    /// Charges `n` blocks if they fit the budget; all or nothing.
    pub fn try_charge(&self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let cap = self.capacity();
        let result = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + n <= cap).then_some(used + n)
            });
        match result {
            Ok(before) => {
                self.peak.fetch_max(before + n, Ordering::Relaxed);
                true
            }
            Err(_) => {
                self.refusals.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Charges `n` blocks even past the budget (a write nobody reserved for; the
    /// scheduler reserves before every step, so this only happens outside it).
    pub fn charge(&self, n: usize) {
        if n > 0 {
            let before = self.used.fetch_add(n, Ordering::AcqRel);
            self.peak.fetch_max(before + n, Ordering::Relaxed);
        }
    }

    /// Gives `n` blocks back.
    pub fn release(&self, n: usize) {
        if n > 0 {
            let _ = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    Some(used.saturating_sub(n))
                });
        }
    }
}

/// The blocks one layer cache has charged to a pool; given back on drop.
#[derive(Debug)]
pub struct BlockLease {
    pool: Arc<BlockPool>,
    charged: usize,
}

impl BlockLease {
    /// A lease of `charged` blocks already charged to `pool`.
    pub(crate) fn new(pool: Arc<BlockPool>, charged: usize) -> Self {
        BlockLease { pool, charged }
    }

    /// The pool.
    pub(crate) fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// Blocks charged.
    pub(crate) fn charged(&self) -> usize {
        self.charged
    }

    /// Records `n` more blocks that were charged by the caller.
    pub(crate) fn add_charged(&mut self, n: usize) {
        self.charged += n;
    }

    /// Makes the charge exactly `blocks`: more is charged past the budget (an unreserved
    /// write), the excess is given back.
    pub(crate) fn settle(&mut self, blocks: usize) {
        if blocks > self.charged {
            self.pool.charge(blocks - self.charged);
        } else {
            self.pool.release(self.charged - blocks);
        }
        self.charged = blocks;
    }

    /// Charges up to `blocks` in total, if the budget allows; keeps a larger charge.
    pub(crate) fn try_grow(&mut self, blocks: usize) -> bool {
        let need = blocks.saturating_sub(self.charged);
        if self.pool.try_charge(need) {
            self.charged += need;
            true
        } else {
            false
        }
    }
}

impl Drop for BlockLease {
    fn drop(&mut self) {
        self.pool.release(self.charged);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_all_or_nothing_and_leases_give_back() {
        let pool = BlockPool::new(10);
        assert!(pool.try_charge(6));
        assert!(!pool.try_charge(5));
        assert_eq!(pool.used(), 6);
        assert_eq!(pool.usage().refusals, 1);
        {
            let mut lease = BlockLease::new(pool.clone(), 0);
            assert!(lease.try_grow(4));
            assert_eq!(pool.free(), 0);
            assert!(!lease.try_grow(5));
            lease.settle(2);
            assert_eq!(pool.used(), 8);
        }
        assert_eq!(pool.used(), 6);
        pool.release(6);
        assert_eq!(pool.usage().peak_blocks, 10);
        assert_eq!(pool.used(), 0);
    }
}
