//! Generation checkpoints: the KV of an in-flight `[prompt + generated]` sequence, saved
//! every N tokens so the identical request can resume after a crash.
//!
//! A checkpoint is keyed by everything that decides the output ([`CheckpointKey`]): the
//! model fingerprint, the prompt, sampling, stop strings, limits and the namespace. It
//! lives in a namespace of its own (`__generation_checkpoint__:<key>`), so a partial
//! output never seeds an unrelated prefill.
use serde::{Deserialize, Serialize};

use crate::namespace::CHECKPOINT_PREFIX;

/// The identity of a generation: a 128-bit hash of labelled parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CheckpointKey(pub u128);

impl CheckpointKey {
    /// Starts a key derivation.
    pub fn builder() -> KeyBuilder {
        KeyBuilder { bytes: Vec::new() }
    }

    /// Lower-case hex, 32 digits.
    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }

    /// Parses [`CheckpointKey::hex`] output.
    pub fn from_hex(s: &str) -> Option<Self> {
        (s.len() == 32)
            .then(|| u128::from_str_radix(s, 16).ok())
            .flatten()
            .map(CheckpointKey)
    }

    /// The namespace its checkpoints are stored under.
    pub fn namespace(&self) -> String {
        format!("{CHECKPOINT_PREFIX}{}", self.hex())
    }
}

/// Collects labelled parts and hashes them into a 128-bit key: checkpoint keys, and the
/// model fingerprints that name SSD directories. Each part is written with its label
/// and length, so `("a", "bc")` and `("ab", "c")` never collide.
#[derive(Debug, Clone, Default)]
pub struct KeyBuilder {
    bytes: Vec<u8>,
}

impl KeyBuilder {
    /// Adds a labelled byte string.
    pub fn bytes(mut self, label: &str, value: &[u8]) -> Self {
        for part in [label.as_bytes(), value] {
            self.bytes
                .extend_from_slice(&(part.len() as u64).to_le_bytes());
            self.bytes.extend_from_slice(part);
        }
        self
    }

    /// Adds a labelled string.
    pub fn str(self, label: &str, value: &str) -> Self {
        self.bytes(label, value.as_bytes())
    }

    /// Adds labelled tokens.
    pub fn tokens(self, label: &str, tokens: &[u32]) -> Self {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.bytes(label, &bytes)
    }

    /// Adds a labelled number.
    pub fn u64(self, label: &str, value: u64) -> Self {
        self.bytes(label, &value.to_le_bytes())
    }

    /// The key.
    pub fn finish(self) -> CheckpointKey {
        CheckpointKey(xxhash_rust::xxh3::xxh3_128(&self.bytes))
    }

    /// The key as 32 lower-case hex digits (a file-name-safe fingerprint).
    pub fn finish_hex(self) -> String {
        self.finish().hex()
    }
}

/// What a checkpoint file records besides its KV (the `checkpoint` field of the header).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`CheckpointKey::hex`].
    pub key: String,
    /// The namespace the generation's prompt computes under.
    pub cache_namespace: String,
    /// Length of the original prompt.
    pub prompt_tokens: usize,
    /// Every token generated so far. The KV holds the prompt and all of them but the
    /// last, which was sampled and not yet fed.
    pub generated: Vec<u32>,
}

/// A checkpoint found for a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume<V> {
    /// The KV of the prompt and `generated[..generated.len() - 1]`.
    pub value: V,
    /// Tokens generated before the checkpoint (replayed to the client).
    pub generated: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_their_parts() {
        let a = CheckpointKey::builder().str("a", "bc").finish();
        let b = CheckpointKey::builder().str("ab", "c").finish();
        assert_ne!(a, b);
        let c = CheckpointKey::builder().tokens("p", &[1, 2]).finish();
        let d = CheckpointKey::builder().tokens("p", &[1, 2]).finish();
        assert_eq!(c, d);
        assert_eq!(CheckpointKey::from_hex(&c.hex()), Some(c));
        assert!(c.namespace().starts_with(CHECKPOINT_PREFIX));
        assert!(CheckpointKey::from_hex("xyz").is_none());
    }
}
