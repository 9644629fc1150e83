//! The engine's side of the prompt-cache seam: [`KvCache`] is a
//! [`wick_cache::CacheValue`], and [`Model`] rebuilds caches from host snapshots.
use wick_cache::{CacheError, CacheValue, KvSnapshot, LayerSnapshot, StateSnapshot, ValueLoader};

use crate::backend::KvLayerSnapshot;
use crate::model::{KvCache, Model};
use crate::models::recurrent::RecurrentSnapshot;

fn to_cache_layer(l: KvLayerSnapshot) -> LayerSnapshot {
    LayerSnapshot {
        start: l.start,
        len: l.len,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        window: l.window,
        keys: l.keys,
        values: l.values,
    }
}

fn to_engine_layer(l: LayerSnapshot) -> KvLayerSnapshot {
    KvLayerSnapshot {
        start: l.start,
        len: l.len,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        window: l.window,
        keys: l.keys,
        values: l.values,
    }
}

impl CacheValue for KvCache {
    fn len(&self) -> usize {
        KvCache::len(self)
    }

    fn can_trim_to(&self, len: usize) -> bool {
        KvCache::can_trim_to(self, len)
    }

    fn fork(&self, len: usize) -> wick_cache::Result<Self> {
        let mut copy = self.clone();
        copy.trim(len).map_err(|e| CacheError::Value {
            op: "fork",
            reason: e.to_string(),
        })?;
        Ok(copy)
    }

    fn byte_size(&self) -> usize {
        KvCache::byte_size(self)
    }

    fn to_host(&self) -> wick_cache::Result<KvSnapshot> {
        let recurrent = self
            .recurrent_snapshot()
            .map(|r| {
                r.layers
                    .into_iter()
                    .map(|(conv, ssm)| StateSnapshot { conv, ssm })
                    .collect()
            })
            .unwrap_or_default();
        Ok(KvSnapshot {
            layers: self.snapshot().into_iter().map(to_cache_layer).collect(),
            recurrent,
        })
    }
}

impl ValueLoader<KvCache> for Model {
    fn load(&self, snapshot: KvSnapshot) -> wick_cache::Result<KvCache> {
        let len = snapshot.len();
        let recurrent = (!snapshot.recurrent.is_empty()).then(|| RecurrentSnapshot {
            len,
            layers: snapshot
                .recurrent
                .into_iter()
                .map(|s| (s.conv, s.ssm))
                .collect(),
        });
        let layers: Vec<KvLayerSnapshot> =
            snapshot.layers.into_iter().map(to_engine_layer).collect();
        self.cache_from_snapshots(&layers, recurrent.as_ref())
            .map_err(|e| CacheError::Value {
                op: "load",
                reason: e.to_string(),
            })
    }
}
