//! The seam between the cache and the engine: [`CacheValue`] (what a cached KV state must
//! do), [`ValueLoader`] (how the engine rebuilds one), and [`KvSnapshot`], the host form
//! that crosses to the SSD tier.
//!
//! The cache never looks inside a value: it asks for its length, whether it can be cut
//! back, a fork of a prefix, its size, and a host copy. A contiguous per-sequence cache
//! implements `fork` by copying; a paged block pool implements it by sharing blocks
//! copy-on-write, and nothing in this crate changes.
use crate::{CacheError, Result};

/// A cached KV state of one token sequence (all layers).
///
/// `to_host` may be called on another thread than the one that made the value (the SSD
/// writer converts evicted entries there), so values are `Send`.
pub trait CacheValue: Send + 'static {
    /// Tokens held (the next token's position).
    fn len(&self) -> usize;

    /// Whether no token is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the value can be cut back to its first `len` tokens. A sliding-window ring
    /// that already dropped keys the shorter sequence needs cannot.
    fn can_trim_to(&self, len: usize) -> bool;

    /// An independent value holding the first `len` tokens (`len <= self.len()` and
    /// `can_trim_to(len)`); the original is left as it was.
    fn fork(&self, len: usize) -> Result<Self>
    where
        Self: Sized;

    /// Bytes the value holds (what the RAM tier's cap counts).
    fn byte_size(&self) -> usize;

    /// A host copy of every layer.
    fn to_host(&self) -> Result<KvSnapshot>;
}

/// Rebuilds live values from host copies (the engine's model implements it).
pub trait ValueLoader<V> {
    /// A value holding exactly what `snapshot` holds.
    fn load(&self, snapshot: KvSnapshot) -> Result<V>;
}

/// Host copy of one layer's keys and values.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSnapshot {
    /// Logical position of the first stored token (non-zero once a window dropped tokens).
    pub start: usize,
    /// Logical length (tokens seen).
    pub len: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window of the layer, if any.
    pub window: Option<usize>,
    /// Keys, `[len - start][kv_heads][head_dim]`.
    pub keys: Vec<f32>,
    /// Values, same layout.
    pub values: Vec<f32>,
}

impl LayerSnapshot {
    /// Floats per stored token.
    pub fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Tokens physically stored (`len - start`).
    pub fn stored(&self) -> usize {
        self.len.saturating_sub(self.start)
    }

    /// The shortest length this layer can be cut back to: a window layer that dropped
    /// tokens still needs `window - 1` keys before the next query.
    pub fn trim_floor(&self) -> usize {
        match self.window {
            Some(w) if self.start > 0 => (self.start + w).saturating_sub(1).min(self.len),
            _ => 0,
        }
    }

    /// Checks that the buffers hold what the shape says.
    pub fn validate(&self) -> Result<()> {
        if self.start > self.len {
            return Err(CacheError::InvalidSnapshot(format!(
                "layer starts at {} after its length {}",
                self.start, self.len
            )));
        }
        let want = self
            .stored()
            .checked_mul(self.row())
            .ok_or_else(|| CacheError::InvalidSnapshot("layer size overflows".into()))?;
        if self.keys.len() != want || self.values.len() != want {
            return Err(CacheError::InvalidSnapshot(format!(
                "layer holds {} key and {} value floats, {} expected for {} tokens of {}x{}",
                self.keys.len(),
                self.values.len(),
                want,
                self.stored(),
                self.kv_heads,
                self.head_dim
            )));
        }
        Ok(())
    }

    fn trim(&mut self, len: usize) {
        let keep = len.saturating_sub(self.start) * self.row();
        self.keys.truncate(keep);
        self.values.truncate(keep);
        self.len = len;
    }
}

/// Host copy of one recurrent layer's state (a linear-attention layer of a hybrid model:
/// its convolution history and its delta-rule state). Such state summarizes every token
/// seen, so a snapshot holding any cannot be cut back.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StateSnapshot {
    /// The convolution's recent inputs.
    pub conv: Vec<f32>,
    /// The recurrent (delta-rule) state.
    pub ssm: Vec<f32>,
}

/// Host copy of a whole sequence cache: one [`LayerSnapshot`] per layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvSnapshot {
    /// The layers, first to last.
    pub layers: Vec<LayerSnapshot>,
    /// The recurrent layers' states after [`KvSnapshot::len`] tokens (empty for a model
    /// without recurrent layers).
    pub recurrent: Vec<StateSnapshot>,
}

impl KvSnapshot {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shortest length every layer can be cut back to.
    pub fn trim_floor(&self) -> usize {
        if !self.recurrent.is_empty() {
            return self.len();
        }
        self.layers
            .iter()
            .map(LayerSnapshot::trim_floor)
            .max()
            .unwrap_or(0)
    }

    /// Whether the snapshot can be cut back to `len` tokens.
    pub fn can_trim_to(&self, len: usize) -> bool {
        len <= self.len() && len >= self.trim_floor()
    }

    /// Cuts every layer back to `len` tokens.
    pub fn trim(&mut self, len: usize) -> Result<()> {
        if !self.can_trim_to(len) {
            return Err(CacheError::InvalidSnapshot(format!(
                "cannot trim {} tokens to {len} (shortest possible {})",
                self.len(),
                self.trim_floor()
            )));
        }
        for l in &mut self.layers {
            l.trim(len);
        }
        Ok(())
    }

    /// Bytes of key and value data.
    pub fn byte_size(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.keys.len() + l.values.len()) * std::mem::size_of::<f32>())
            .chain(
                self.recurrent
                    .iter()
                    .map(|s| (s.conv.len() + s.ssm.len()) * std::mem::size_of::<f32>()),
            )
            .sum()
    }

    /// Checks every layer and that all layers have the same length.
    pub fn validate(&self) -> Result<()> {
        let len = self.len();
        for (i, l) in self.layers.iter().enumerate() {
            l.validate()
                .map_err(|e| CacheError::InvalidSnapshot(format!("layer {i}: {e}")))?;
            if l.len != len {
                return Err(CacheError::InvalidSnapshot(format!(
                    "layer {i} holds {} tokens, layer 0 holds {len}",
                    l.len
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A small in-memory [`CacheValue`] for the tier tests.
    use super::{CacheValue, KvSnapshot, LayerSnapshot, Result, ValueLoader};

    /// A fake value: one layer whose keys encode the tokens, so a restored value can be
    /// checked against the tokens it claims to hold.
    #[derive(Debug, Clone, PartialEq)]
    pub struct FakeKv {
        pub snapshot: KvSnapshot,
    }

    impl FakeKv {
        /// A value for `tokens`, one layer of 1×2 floats per token; with `window`, tokens
        /// before `len - window` are dropped like a wrapped ring.
        pub fn new(tokens: &[u32], window: Option<usize>) -> Self {
            let len = tokens.len();
            let start = match window {
                Some(w) if len > 2 * w => len + 1 - w,
                _ => 0,
            };
            Self::dropped_before(tokens, window, start)
        }

        /// A value for `tokens` whose window layer dropped the tokens before `start` (a
        /// ring that keeps more than its window: it can be cut back, but not below them).
        pub fn dropped_before(tokens: &[u32], window: Option<usize>, start: usize) -> Self {
            let len = tokens.len();
            let keys: Vec<f32> = tokens[start..]
                .iter()
                .flat_map(|&t| [t as f32, 1.0])
                .collect();
            let values: Vec<f32> = tokens[start..]
                .iter()
                .flat_map(|&t| [-(t as f32), 2.0])
                .collect();
            FakeKv {
                snapshot: KvSnapshot {
                    recurrent: Vec::new(),
                    layers: vec![LayerSnapshot {
                        start,
                        len,
                        kv_heads: 1,
                        head_dim: 2,
                        window,
                        keys,
                        values,
                    }],
                },
            }
        }

        /// The tokens the keys encode (stored part only).
        pub fn stored_tokens(&self) -> Vec<u32> {
            self.snapshot.layers[0]
                .keys
                .iter()
                .step_by(2)
                .map(|&k| k as u32)
                .collect()
        }
    }

    impl CacheValue for FakeKv {
        fn len(&self) -> usize {
            self.snapshot.len()
        }
        fn can_trim_to(&self, len: usize) -> bool {
            self.snapshot.can_trim_to(len)
        }
        fn fork(&self, len: usize) -> Result<Self> {
            let mut s = self.snapshot.clone();
            s.trim(len)?;
            Ok(FakeKv { snapshot: s })
        }
        fn byte_size(&self) -> usize {
            self.snapshot.byte_size()
        }
        fn to_host(&self) -> Result<KvSnapshot> {
            Ok(self.snapshot.clone())
        }
    }

    /// Loads [`FakeKv`] values.
    #[allow(dead_code)]
    pub struct FakeLoader;

    impl ValueLoader<FakeKv> for FakeLoader {
        fn load(&self, snapshot: KvSnapshot) -> Result<FakeKv> {
            snapshot.validate()?;
            Ok(FakeKv { snapshot })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::FakeKv;

    #[test]
    fn trim_floor_follows_the_window() {
        let tokens: Vec<u32> = (0..100).collect();
        let full = FakeKv::new(&tokens, None);
        assert!(full.snapshot.can_trim_to(0));
        let ring = FakeKv::new(&tokens, Some(16));
        let l = &ring.snapshot.layers[0];
        assert_eq!(l.start, 85);
        assert_eq!(ring.snapshot.trim_floor(), 100);
        assert!(!ring.snapshot.can_trim_to(99));
        assert!(ring.snapshot.can_trim_to(100));
        let short = FakeKv::new(&tokens[..20], Some(16));
        assert!(short.snapshot.can_trim_to(3));
    }

    #[test]
    fn trim_keeps_a_valid_prefix() {
        let tokens: Vec<u32> = (10..40).collect();
        let mut s = FakeKv::new(&tokens, None).snapshot;
        s.trim(7).unwrap();
        s.validate().unwrap();
        assert_eq!(s.len(), 7);
        assert_eq!(
            FakeKv { snapshot: s }.stored_tokens(),
            (10..17).collect::<Vec<_>>()
        );
    }

    #[test]
    fn recurrent_state_makes_a_snapshot_untrimmable() {
        let tokens: Vec<u32> = (0..30).collect();
        let mut s = FakeKv::new(&tokens, None).snapshot;
        assert!(s.can_trim_to(10));
        let before = s.byte_size();
        s.recurrent.push(super::StateSnapshot {
            conv: vec![1.0; 3],
            ssm: vec![2.0; 5],
        });
        assert_eq!(s.byte_size(), before + 32);
        assert_eq!(s.trim_floor(), 30);
        assert!(!s.can_trim_to(29) && s.can_trim_to(30));
        assert!(s.trim(10).is_err());
    }

    #[test]
    fn validate_rejects_bad_buffers() {
        let mut s = FakeKv::new(&[1, 2, 3], None).snapshot;
        s.layers[0].keys.pop();
        assert!(s.validate().is_err());
    }
}
