//! A cache value whose contents are a function of its tokens, so any restored entry
//! can be checked against the tokens it claims to hold.
#![allow(dead_code)]
use wick_cache::{CacheValue, KvSnapshot, LayerSnapshot, Result, ValueLoader};

pub const LAYERS: usize = 3;
pub const HEADS: usize = 2;
pub const DIM: usize = 32;

fn key(token: u32, pos: usize, layer: usize, h: usize, d: usize) -> f32 {
    (token as f32) * 0.5 + pos as f32 * 1e-3 + (layer * 100 + h * 10 + d) as f32
}

/// The KV a deterministic "model" computes for `tokens`.
pub fn snapshot_for(tokens: &[u32]) -> KvSnapshot {
    let layers = (0..LAYERS)
        .map(|l| {
            let mut keys = Vec::with_capacity(tokens.len() * HEADS * DIM);
            for (pos, &t) in tokens.iter().enumerate() {
                for h in 0..HEADS {
                    for d in 0..DIM {
                        keys.push(key(t, pos, l, h, d));
                    }
                }
            }
            let values = keys.iter().map(|k| -k).collect();
            LayerSnapshot {
                start: 0,
                len: tokens.len(),
                kv_heads: HEADS,
                head_dim: DIM,
                window: None,
                keys,
                values,
            }
        })
        .collect();
    KvSnapshot {
        layers,
        recurrent: Vec::new(),
    }
}

/// Whether `snap` is exactly what [`snapshot_for`] gives for `tokens`.
pub fn holds(snap: &KvSnapshot, tokens: &[u32]) -> bool {
    *snap == snapshot_for(tokens)
}

/// The value type of the tests.
#[derive(Debug, Clone, PartialEq)]
pub struct TestKv(pub KvSnapshot);

impl TestKv {
    pub fn new(tokens: &[u32]) -> Self {
        TestKv(snapshot_for(tokens))
    }
}

impl CacheValue for TestKv {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn can_trim_to(&self, len: usize) -> bool {
        self.0.can_trim_to(len)
    }
    fn fork(&self, len: usize) -> Result<Self> {
        let mut s = self.0.clone();
        s.trim(len)?;
        Ok(TestKv(s))
    }
    fn byte_size(&self) -> usize {
        self.0.byte_size()
    }
    fn to_host(&self) -> Result<KvSnapshot> {
        Ok(self.0.clone())
    }
}

pub struct Loader;

impl ValueLoader<TestKv> for Loader {
    fn load(&self, snapshot: KvSnapshot) -> Result<TestKv> {
        snapshot.validate()?;
        Ok(TestKv(snapshot))
    }
}
