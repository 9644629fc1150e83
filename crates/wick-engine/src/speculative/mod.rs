//! Speculative decoding: a decoding sequence guesses its next few tokens — from what it
//! has already seen ([`ngram`], prompt lookup) or with a smaller model of the same
//! vocabulary ([`draft_model`]) — and one forward pass scores the guesses together with
//! the token it would have fed anyway. The longest prefix the model agrees
//! with is kept ([`acceptance`]), plus the model's own next token, so a step can emit up
//! to `1 + k` tokens for about the weight reads of one.
//!
//! The output is the one plain decoding gives: a greedy row keeps a draft only when it
//! is the token the sampler picks from that position's processed logits (penalties,
//! logit bias, logprobs as usual), so greedy output is the same token for token; a
//! sampled row keeps it with its probability under the final distribution and otherwise
//! draws from that distribution without it ([`acceptance::accept_one_hot`]); a draft
//! model's draft, drawn from its distribution `q`, is kept with probability
//! `min(1, p/q)` and otherwise replaced by a draw from `max(0, p − q)`
//! ([`acceptance::accept_sampled`]). Either way its tokens are distributed as plain
//! sampling's (a seed gives other tokens than without
//! speculation). The rejected positions are trimmed from the KV cache, so what stays
//! cached is exactly what plain decoding would have cached.
//!
//! Each verified draft is a row of the pass: [`budget`] keeps, each step, only the drafts
//! worth their rows by the recorded time of decode steps of each size (a batch that is
//! already compute-bound drafts little). Greedy rows without processors verify by the
//! backend's argmax of every position ([`crate::Model::forward_argmax_rows`]).
//!
//! Under a structured-output constraint a row's drafts are cut where the grammar stops
//! accepting them, and each verified position is picked under the grammar's mask in the
//! state the tokens kept so far leave it (greedy: the token plain decoding picks; sampled:
//! the rejection rule against the masked distribution).
//!
//! Rows that decode plainly: requests that opt out, models whose cache cannot be cut
//! back (sliding-window layers, Qwen 3.5's recurrent state, Gemma 4's shared KV) or that
//! run on CUDA, and on MLX every row while more than one decodes: MLX decodes a batch in
//! one buffer per layer whose rows end in the same column, which a row feeding several
//! tokens would leave, so there a sequence speculates while it decodes alone. Requests with images or audio draft by prompt lookup, never with a
//! draft model (which has no tower and would read their soft tokens as text).
pub mod acceptance;
pub mod budget;
pub mod draft_model;
pub mod ngram;

pub use acceptance::{accept_one_hot, accept_sampled, DraftLength};
pub use budget::{DraftBudget, RowDrafts};
pub use draft_model::DraftModel;
pub use ngram::draft;

/// Prompt-lookup settings (`wick serve --spec ngram`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Shortest suffix looked up (`--ngram-min`): 1 finds more drafts but worse ones.
    pub ngram_min: usize,
    /// Longest suffix looked up first (`--ngram-max`).
    pub ngram_max: usize,
    /// Most tokens drafted per step (`--num-draft-tokens`); the adaptive length stays
    /// at or below it.
    pub num_draft_tokens: usize,
    /// Whether a step verifies only the drafts worth their rows by the recorded cost of
    /// decode steps ([`DraftBudget`], `--draft-budget`); off, every draft is verified.
    pub budget: bool,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            ngram_min: 2,
            ngram_max: 4,
            num_draft_tokens: 4,
            budget: true,
        }
    }
}

/// Drafted and kept tokens of one request, or of the whole engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpeculationUsage {
    /// Tokens proposed by the drafter and scored.
    pub drafted: usize,
    /// Of those, tokens the model agreed with (emitted without a forward pass of their own).
    pub accepted: usize,
}
