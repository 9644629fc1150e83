//! The recurrent cache kind: per linear-attention layer, the state a gated DeltaNet
//! carries from token to token (convolution history and delta-rule state), beside the
//! paged KV of the full-attention layers.
//!
//! Unlike KV, the state cannot be cut back: it summarizes every token seen, so a cache
//! holding it is trimmable only to its own length. The prompt cache therefore reuses such
//! a cache only at the exact boundary it was stored at (a prompt-boundary snapshot), and
//! the SSD tier stores the state as it is.
use super::deltanet::DeltaState;
use crate::backend::DeltaStore;
use crate::config::qwen35::DeltaShape;
use crate::{EngineError, Result};

/// The recurrent part of one sequence's cache: one state per linear-attention layer, in
/// layer order, after `len` tokens. `S` is how the backend keeps a layer's state
/// ([`crate::backend::Backend::DeltaState`]; host memory by default).
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentCache<S = DeltaState> {
    /// Tokens the states have absorbed.
    pub len: usize,
    /// One state per linear-attention layer.
    pub layers: Vec<S>,
}

impl<S: DeltaStore> RecurrentCache<S> {
    /// Whether the states can stand for the first `len` tokens: only at their own length.
    pub fn can_trim_to(&self, len: usize) -> bool {
        len == self.len
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        self.layers.iter().map(DeltaStore::byte_size).sum()
    }

    /// A host copy for persistence.
    pub fn snapshot(&self) -> RecurrentSnapshot {
        RecurrentSnapshot {
            len: self.len,
            layers: self
                .layers
                .iter()
                .map(|l| {
                    let h = l.to_host();
                    (h.conv, h.ssm)
                })
                .collect(),
        }
    }
}

impl RecurrentCache {
    /// Zero states for layers of `shapes`.
    pub fn new(shapes: &[DeltaShape]) -> Self {
        RecurrentCache {
            len: 0,
            layers: shapes.iter().map(DeltaState::new).collect(),
        }
    }

    /// Rebuilds the states from `s`, checked against the layer `shapes` of the model.
    pub fn from_snapshot(s: &RecurrentSnapshot, shapes: &[DeltaShape]) -> Result<Self> {
        if s.layers.len() != shapes.len() {
            return Err(EngineError::Cache(format!(
                "snapshot has {} recurrent layers, the model {}",
                s.layers.len(),
                shapes.len()
            )));
        }
        let mut layers = Vec::with_capacity(shapes.len());
        for ((conv, ssm), shape) in s.layers.iter().zip(shapes) {
            if conv.len() != shape.conv_state_len() || ssm.len() != shape.ssm_state_len() {
                return Err(EngineError::Cache(
                    "recurrent snapshot layout does not match the model".into(),
                ));
            }
            layers.push(DeltaState {
                conv: conv.clone(),
                ssm: ssm.clone(),
            });
        }
        Ok(RecurrentCache { len: s.len, layers })
    }
}

/// Host copy of a [`RecurrentCache`]: per layer, `(conv state, delta-rule state)`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RecurrentSnapshot {
    /// Tokens absorbed.
    pub len: usize,
    /// Per linear-attention layer.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_length_is_a_valid_trim_and_snapshots_are_checked() {
        let shape = DeltaShape {
            k_heads: 1,
            v_heads: 2,
            k_dim: 4,
            v_dim: 3,
            conv_kernel: 4,
        };
        let mut c = RecurrentCache::new(&[shape, shape]);
        c.len = 5;
        assert!(c.can_trim_to(5));
        assert!(!c.can_trim_to(4) && !c.can_trim_to(6));
        assert_eq!(c.byte_size(), 2 * (3 * 14 + 24) * 4);
        let s = c.snapshot();
        assert_eq!(
            RecurrentCache::from_snapshot(&s, &[shape, shape]).unwrap(),
            c
        );
        assert!(RecurrentCache::from_snapshot(&s, &[shape]).is_err());
        let mut bad = s.clone();
        bad.layers[1].1.pop();
        assert!(RecurrentCache::from_snapshot(&bad, &[shape, shape]).is_err());
    }
}
