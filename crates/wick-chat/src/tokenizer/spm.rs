//! SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`): scores instead of merges.
//!
//! llama.cpp tokenizes them by repeatedly merging the adjacent pair of symbols whose
//! concatenation is the best-scoring vocabulary entry (leftmost on ties), starting from single
//! characters, and spells characters missing from the vocabulary as `<0xXX>` bytes. A BPE model
//! whose merge list holds every way of writing each token as two shorter tokens, ranked by the
//! score of the result, does the same; this module derives that list.
use std::cmp::Ordering;

use tokenizers::models::bpe::Vocab;

/// Every split of every token into two vocabulary entries, best-scoring result first.
///
/// Ties (equal scores) are ranked by token id, then by split position. NaN scores rank last.
pub(crate) fn merges_from_scores(
    tokens: &[String],
    scores: &[f32],
    index: &Vocab,
) -> Vec<(String, String)> {
    let mut splits: Vec<(u32, u32)> = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        for (at, _) in token.char_indices().skip(1) {
            if index.contains_key(&token[..at]) && index.contains_key(&token[at..]) {
                splits.push((id as u32, at as u32));
            }
        }
    }
    let score = |id: u32| {
        let s = scores.get(id as usize).copied().unwrap_or(0.0);
        if s.is_nan() {
            f32::NEG_INFINITY
        } else {
            s
        }
    };
    splits.sort_by(|a, b| {
        score(b.0)
            .partial_cmp(&score(a.0))
            .unwrap_or(Ordering::Equal)
            .then(a.0.cmp(&b.0))
            .then(a.1.cmp(&b.1))
    });
    splits
        .into_iter()
        .map(|(id, at)| {
            let token = &tokens[id as usize];
            let (left, right) = token.split_at(at as usize);
            (left.to_string(), right.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bpe::{build_bpe, vocab_map, BpeOptions};
    use tokenizers::Model;

    #[test]
    fn merges_rank_by_result_score() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores = [0.0, 0.0, 0.0, -3.0, -1.0, -2.0];
        let merges = merges_from_scores(&tokens, &scores, &vocab_map(&tokens));
        assert_eq!(
            merges,
            [
                ("b".to_string(), "c".to_string()),
                ("a".to_string(), "bc".to_string()),
                ("ab".to_string(), "c".to_string()),
                ("a".to_string(), "b".to_string()),
            ]
        );
    }

    #[test]
    fn derived_bpe_prefers_best_scoring_pairs_and_falls_back_to_bytes() {
        let mut tokens: Vec<String> = ["<unk>", "▁", "h", "i", "▁h", "hi", "▁hi"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        tokens.extend((0..=255u32).map(|b| format!("<0x{b:02X}>")));
        let mut scores = vec![0.0, -1.0, -1.0, -1.0, -5.0, -2.0, -3.0];
        scores.extend(std::iter::repeat_n(0.0, 256));
        let merges = merges_from_scores(&tokens, &scores, &vocab_map(&tokens));
        let bpe = build_bpe(
            vocab_map(&tokens),
            merges,
            &BpeOptions {
                byte_fallback: true,
                unk_token: Some("<unk>".into()),
                ..BpeOptions::default()
            },
        )
        .expect("builds");
        let ids = |s: &str| -> Vec<u32> {
            bpe.tokenize(s)
                .expect("tokenizes")
                .iter()
                .map(|t| t.id)
                .collect()
        };
        // "hi" (-2) merges before "▁h" (-5); then "▁" + "hi" = "▁hi" (-3).
        assert_eq!(ids("▁hi"), [6]);
        // "é" is not in the vocabulary: two byte tokens.
        assert_eq!(ids("é"), [7 + 0xC3, 7 + 0xA9]);
    }
}
