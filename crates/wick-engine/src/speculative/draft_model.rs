//! Drafting with a smaller model of the same vocabulary (`wick serve --draft-model`): the
//! check that it can draft for the served model, and its proposal distribution.
//!
//! The engine loop runs the draft model over every drafting row at once, one batched
//! forward pass per draft position; each sequence keeps the draft's KV in a cache of its
//! own, which holds the tokens of its history the draft has seen (caught up at the start
//! of each step, cut back to the part the history still shares).
use std::sync::Arc;

use crate::model::Model;
use crate::EngineError;

/// The model that drafts tokens for the served one (`EngineConfig::draft_model`).
#[derive(Clone)]
pub struct DraftModel(pub Arc<Model>);

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DraftModel")
            .field(&self.0.info().name)
            .finish()
    }
}

impl DraftModel {
    /// `draft`, checked against `target`: the same vocabulary (every token's bytes, in
    /// the same order), and a cache that can be cut back (no sliding window, no
    /// recurrent state, the CPU backend). The error names both models.
    pub fn new(target: &Model, draft: Arc<Model>) -> Result<Self, EngineError> {
        let (t, d) = (&target.info().name, &draft.info().name);
        let (tv, dv) = (
            target.tokenizer().vocabulary_bytes(),
            draft.tokenizer().vocabulary_bytes(),
        );
        if tv != dv {
            let first = tv.iter().zip(&dv).position(|(a, b)| a != b);
            let why = match first {
                Some(i) => format!(
                    "token {i} is {:?} in {t} and {:?} in {d}",
                    String::from_utf8_lossy(&tv[i]),
                    String::from_utf8_lossy(&dv[i])
                ),
                None => format!("{t} has {} tokens and {d} has {}", tv.len(), dv.len()),
            };
            return Err(EngineError::DraftModel(format!(
                "{d} cannot draft for {t}: their tokenizers differ ({why}); a draft model \
                 must share the served model's vocabulary"
            )));
        }
        if let Err(e) = &draft.support().speculation {
            return Err(EngineError::DraftModel(format!(
                "{d} cannot draft for {t}: {e}"
            )));
        }
        Ok(DraftModel(draft))
    }

    /// The fraction of a KV memory budget the served model's caches get when every
    /// sequence also keeps this model's cache of (about) the same tokens: the served
    /// model's KV bytes per token over both models' together. The KV pool and the RAM
    /// prompt cache are cut to it, so the draft's caches fit the same budgets.
    pub fn target_share(&self, target: &Model) -> f64 {
        let per_token = |m: &Model| (m.kv_block_bytes() * m.config().num_layers.max(1)) as f64;
        let (t, d) = (per_token(target), per_token(&self.0));
        if t + d > 0.0 {
            t / (t + d)
        } else {
            1.0
        }
    }
}

/// The draft model's proposal distribution for a sampled row: `softmax(logits / T)` over
/// the first `vocab` entries (the tokens the served model knows), normalized.
pub fn distribution(logits: &[f32], temperature: f32, vocab: usize) -> Vec<f32> {
    let row = &logits[..vocab.min(logits.len())];
    let inv = 1.0 / temperature.max(1e-6);
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        let mut q = vec![0.0; row.len()];
        if let Some(first) = q.first_mut() {
            *first = 1.0;
        }
        return q;
    }
    let mut q: Vec<f32> = row.iter().map(|&l| ((l - max) * inv).exp()).collect();
    let total: f64 = q.iter().map(|&w| f64::from(w)).sum();
    let scale = (1.0 / total) as f32;
    q.iter_mut().for_each(|w| *w *= scale);
    q
}

/// The token at `u` in `[0, 1)` of the cumulative sum of `q` (its last token with mass
/// when rounding leaves `u` past the sum).
pub fn pick(q: &[f32], u: f64) -> u32 {
    let mut running = 0.0;
    for (i, &w) in q.iter().enumerate() {
        running += f64::from(w);
        if running > u && w > 0.0 {
            return i as u32;
        }
    }
    q.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distribution_is_a_tempered_softmax_over_the_shared_vocabulary() {
        let q = distribution(&[0.0, 1.0, 2.0, 50.0], 1.0, 3);
        assert_eq!(q.len(), 3);
        let z = 1.0 + 1f32.exp() + 2f32.exp();
        for (i, &w) in q.iter().enumerate() {
            assert!((w - (i as f32).exp() / z).abs() < 1e-6, "{q:?}");
        }
        let cold = distribution(&[0.0, 1.0], 0.1, 2);
        assert!(cold[1] > 0.9999, "{cold:?}");
        assert_eq!(pick(&[0.25, 0.0, 0.75], 0.2), 0);
        assert_eq!(pick(&[0.25, 0.0, 0.75], 0.25), 2);
        assert_eq!(pick(&[0.25, 0.0, 0.75], 0.9999999), 2);
    }
}
