//! The ids a model may produce: those its tokenizer has. Qwen's checkpoints (and others)
//! pad the embedding and the output head to a round number of rows (151,936 for 151,665
//! tokens); the padded rows are not tokens, so no sampler, argmax, grammar, draft or
//! `logit_bias` may ever pick one, and a client that got one could not be sent its text.
//!
//! The output head adds a bias of `-inf` at the padded columns, so every route of a pass
//! sees them as impossible: host logits, the backend's argmax (with or without a grammar's
//! mask) and the argmax of every verified position. A final soft cap (`cap · tanh(x / cap)`)
//! maps `-inf` to `-cap`, the least any logit can be after it: an argmax, which takes the
//! first maximum, still never lands there (every real id comes first), and the host sets
//! the padded columns back to `-inf` before anything samples them.
use crate::backend::{Backend, HostWeight};
use crate::Result;

/// The `-inf` bias of the padded columns of a model's output head.
pub(crate) struct VocabMask<B: Backend> {
    /// Ids the tokenizer has: the columns kept.
    tokens: usize,
    /// `[rows]`: 0 for the first `tokens` columns, `-inf` after.
    bias: B::Tensor,
}

impl<B: Backend> VocabMask<B> {
    /// The mask of an output head of `rows` columns whose tokenizer has `tokens` ids;
    /// `None` when every column is a token.
    pub(crate) fn new(backend: &B, rows: usize, tokens: usize) -> Result<Option<Self>> {
        if tokens >= rows {
            return Ok(None);
        }
        let bytes: Vec<u8> = (0..rows)
            .flat_map(|i| {
                let v = if i < tokens {
                    0.0f32
                } else {
                    f32::NEG_INFINITY
                };
                v.to_le_bytes()
            })
            .collect();
        let bias = backend.vector(HostWeight {
            name: "vocabulary mask".into(),
            dtype: wick_gguf::GgmlType::F32,
            shape: vec![rows],
            bytes: bytes.into(),
        })?;
        tracing::info!(
            tokens,
            rows,
            "the output head has more rows than the tokenizer has ids: the padded ones are never produced"
        );
        Ok(Some(VocabMask { tokens, bias }))
    }

    /// Ids the tokenizer has.
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// The bias the output head adds.
    pub(crate) fn bias(&self) -> &B::Tensor {
        &self.bias
    }

    /// Sets the padded columns of host logits `[rows][vocab]` to `-inf` (after a soft cap
    /// they hold `-cap`).
    pub(crate) fn apply_on_host(&self, data: &mut [f32], vocab: usize) {
        if vocab <= self.tokens {
            return;
        }
        for row in data.chunks_exact_mut(vocab) {
            row[self.tokens..].fill(f32::NEG_INFINITY);
        }
    }
}
