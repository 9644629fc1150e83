//! [`KvCache`]: one sequence's KV cache on whichever backend, and its charge to the KV
//! pool ([`crate::kv_pool`]), the same on every backend.
use std::sync::Arc;

use super::dispatch::{with_cache, AnyCache};
use crate::backend::{KvLayer, KvLayerSnapshot};
use crate::kv_pool::BlockPool;
use crate::models::recurrent::RecurrentSnapshot;
use crate::Result;

/// A sequence's KV cache, whatever the backend.
#[derive(Clone)]
pub struct KvCache {
    pub(super) inner: AnyCache,
}

impl KvCache {
    /// Tokens cached (the next token's position).
    pub fn len(&self) -> usize {
        with_cache!(&self.inner, c => c.len())
    }

    /// The end of a prefill chunk that starts at `from` and would end at `to`, moved so
    /// that it cuts none of the sequence's images ([`crate::Model::attach_media`]): before
    /// an image it would cut, or past the whole image when the chunk starts at one.
    pub fn chunk_end(&self, from: usize, to: usize) -> usize {
        with_cache!(&self.inner, c => crate::models::vision::chunk_end(c.images(), from, to))
    }

    /// Takes over `other`'s media rows (a preempted sequence's fresh cache).
    pub fn adopt_media(&mut self, other: &KvCache) {
        match (&mut self.inner, &other.inner) {
            (AnyCache::Candle(a), AnyCache::Candle(b)) => a.set_images(b.images().to_vec()),
            #[cfg(feature = "mlx")]
            (AnyCache::Mlx(a), AnyCache::Mlx(b)) => a.set_images(b.images().to_vec()),
            #[cfg(feature = "cuda")]
            (AnyCache::Cuda(a), AnyCache::Cuda(b)) => a.set_images(b.images().to_vec()),
            #[cfg(any(feature = "mlx", feature = "cuda"))]
            _ => {}
        }
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        with_cache!(&self.inner, c => c.is_empty())
    }

    /// Whether the cache can be cut back to `len` tokens (a sliding window that already
    /// dropped keys cannot).
    pub fn can_trim_to(&self, len: usize) -> bool {
        with_cache!(&self.inner, c => c.can_trim_to(len))
    }

    /// Forgets every token from position `len` on.
    pub fn trim(&mut self, len: usize) -> Result<()> {
        with_cache!(&mut self.inner, c => c.trim(len))
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        with_cache!(&self.inner, c => c.byte_size())
    }

    /// Host copies of every layer (for persistence).
    pub fn snapshot(&self) -> Vec<KvLayerSnapshot> {
        with_cache!(&self.inner, c => c.snapshot())
    }

    /// Host copy of the recurrent states (a hybrid model's linear-attention layers).
    pub fn recurrent_snapshot(&self) -> Option<RecurrentSnapshot> {
        with_cache!(&self.inner, c => c.recurrent().map(|r| r.snapshot()))
    }

    /// Charges the blocks this cache holds to `pool` (the caller checked there is room);
    /// from now on its storage is charged there as it grows and shrinks, and dropping the
    /// cache gives the charge back. A clone is never charged until attached itself.
    pub fn attach(&mut self, pool: &Arc<BlockPool>) {
        with_cache!(&mut self.inner, c => c.layers_mut().iter_mut().for_each(|l| l.attach(pool)))
    }

    /// Gives the pool charge back (the storage stays with the cache). On MLX, also moves
    /// the cache out of the batch buffer it decoded in, so that a stored cache holds no
    /// row of a running batch.
    pub fn detach(&mut self) {
        match &mut self.inner {
            AnyCache::Candle(c) => c.layers_mut().iter_mut().for_each(KvLayer::detach),
            #[cfg(feature = "mlx")]
            AnyCache::Mlx(c) => c.layers_mut().iter_mut().for_each(|l| {
                l.detach();
                l.leave_batch();
            }),
            #[cfg(feature = "cuda")]
            AnyCache::Cuda(c) => c.layers_mut().iter_mut().for_each(KvLayer::detach),
        }
    }

    /// Whether the cache is charged to a pool.
    pub fn is_attached(&self) -> bool {
        with_cache!(&self.inner, c => c.layers().iter().any(|l| l.lease().is_some()))
    }

    /// Blocks of the pool's unit its storage holds, all layers together.
    pub fn blocks(&self) -> usize {
        with_cache!(&self.inner, c => c.layers().iter().map(KvLayer::held_blocks).sum())
    }

    /// Blocks charged to the pool, all layers together (0 when not attached).
    pub fn charged_blocks(&self) -> usize {
        with_cache!(&self.inner, c => c.layers().iter().map(KvLayer::charged_blocks).sum())
    }

    /// Blocks the pool must grant before `tokens` more tokens can be appended.
    pub fn blocks_to_append(&self, tokens: usize) -> usize {
        with_cache!(&self.inner, c => c.layers().iter().map(|l| l.extra_blocks_for(tokens)).sum())
    }

    /// Charges, all layers or none, the blocks that appending `tokens` more needs.
    /// Returns false (charging nothing) when the pool has no room. A detached cache
    /// needs no room.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        with_cache!(&mut self.inner, c => reserve_layers(c.layers_mut(), |l| l.extra_blocks_for(tokens)))
    }

    /// Tokens each layer stores once a decode step appended one
    /// ([`KvLayer::stored_after_step`]).
    pub fn stored_after_step(&self) -> Vec<usize> {
        with_cache!(&self.inner, c => c.layers().iter().map(KvLayer::stored_after_step).collect())
    }

    /// Whether the backend's KV storage grows by reallocating and copying (CUDA), so that
    /// a prompt's room is best made at once ([`KvCache::preallocate`]).
    pub fn grows_by_copying(&self) -> bool {
        match &self.inner {
            #[cfg(feature = "cuda")]
            AnyCache::Cuda(_) => true,
            _ => false,
        }
    }

    /// Makes room for `tokens` more tokens in every layer at once
    /// ([`KvLayer::preallocate`]): what a prompt's first step does with the pool's charge
    /// for the whole prompt already taken ([`KvCache::reserve`]).
    pub fn preallocate(&mut self, tokens: usize) -> Result<()> {
        with_cache!(&mut self.inner, c => c
            .layers_mut()
            .iter_mut()
            .try_for_each(|l| l.preallocate(tokens)))
    }

    /// [`KvCache::reserve`] of one token for a decode step whose participants' layers store
    /// at most `widest[layer]` tokens after it (the element-wise maximum of their
    /// [`KvCache::stored_after_step`]): on a backend that decodes a batch in one buffer per
    /// layer (MLX), joining or widening that buffer is charged before the step rather than
    /// settled past the budget after it.
    pub fn reserve_decode_step(&mut self, widest: &[usize]) -> bool {
        with_cache!(&mut self.inner, c => {
            let layers = c.layers_mut();
            let widest: Vec<usize> = (0..layers.len())
                .map(|i| widest.get(i).copied().unwrap_or(0))
                .collect();
            let mut i = 0;
            reserve_layers(layers, |l| {
                let w = widest[i];
                i += 1;
                l.blocks_after_decode_step(w.max(l.stored_after_step()))
                    .saturating_sub(l.charged_blocks())
            })
        })
    }
}

/// [`KvCache::reserve`] over one backend's layers.
fn reserve_layers<L: KvLayer>(layers: &mut [L], mut extra: impl FnMut(&L) -> usize) -> bool {
    let Some(pool) = layers
        .iter()
        .find_map(|l| l.lease().map(|x| x.pool().clone()))
    else {
        return true;
    };
    let need: Vec<usize> = layers.iter().map(&mut extra).collect();
    if !pool.try_charge(need.iter().sum()) {
        return false;
    }
    for (l, n) in layers.iter_mut().zip(need) {
        if let Some(lease) = l.lease_mut() {
            lease.add_charged(n);
        } else {
            // Not charged itself (never happens to a cache attached whole): give it back.
            pool.release(n);
        }
    }
    true
}
