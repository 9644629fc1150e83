//! The KV pool: the memory budget every running sequence's KV cache is charged to, on
//! every backend, so memory — not the longest request — bounds how many sequences run.
//!
//! The unit is a *block*: the keys and values of [`BLOCK_TOKENS`] tokens of one layer
//! ([`block_bytes`]). The CPU backend stores its caches in blocks of exactly that size;
//! the MLX backend's buffers grow by whole blocks, and a layer is charged the blocks its
//! buffers really hold (a batch row is charged the columns its batch buffer allocated).
//!
//! Charging is per holder: a layer cache attached to the pool holds a [`BlockLease`] for
//! the blocks it references (shared ones included, so the count is an upper bound of the
//! memory really used) and gives them back when it drops them or is dropped itself.
//! Caches not attached to any pool (the single-request path, prompt-cache entries) are
//! not charged.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Tokens per block. 16 keeps the waste of a sequence's last, partly filled block small
/// (≤ 15 tokens per layer) while a CPU block of a small model (3 KV heads × 64 dims) is
/// still 12 KiB of keys, long enough for the attention loop to stream through.
pub const BLOCK_TOKENS: usize = 16;

/// Bytes of one block of one layer: keys and values of [`BLOCK_TOKENS`] tokens of `row`
/// numbers (KV heads × head size) of `number_bytes` each.
pub fn block_bytes(row: usize, number_bytes: usize) -> usize {
    BLOCK_TOKENS * row * 2 * number_bytes
}

/// Blocks that hold `tokens` tokens of one layer.
pub fn blocks_for_tokens(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_TOKENS)
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

/// The shared block budget (counts one layer's block as one block). An unbounded pool
/// (capacity `usize::MAX`) only counts.
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

    /// Whether the pool has a budget (an unbounded pool only counts).
    pub fn is_bounded(&self) -> bool {
        self.capacity() != usize::MAX
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
