//! BPE models for GGUF vocabularies: the `tokenizers` BPE model built from the token list and
//! either the file's merge list (`gpt2`, `gemma4`) or merges derived from scores (`llama`).
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use tokenizers::models::bpe::{Vocab, BPE};

/// Options of a BPE model that differ between tokenizer families.
#[derive(Clone, Debug, Default)]
pub(crate) struct BpeOptions {
    /// Take a word found whole in the vocabulary without merging (Llama 3 and relatives).
    pub ignore_merges: bool,
    /// Spell characters missing from the vocabulary as `<0xXX>` byte tokens.
    pub byte_fallback: bool,
    /// The token for what neither the vocabulary nor byte fallback can spell.
    pub unk_token: Option<String>,
}

/// The token → id map of a vocabulary.
pub(crate) fn vocab_map(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

/// Splits a GGUF merge line (`"left right"`) at the first space after the first byte, as
/// llama.cpp does.
fn split_merge(line: &str) -> Option<(&str, &str)> {
    let space = line.as_bytes().iter().skip(1).position(|&b| b == b' ')? + 1;
    Some((&line[..space], &line[space + 1..]))
}

/// GGUF merges in rank order, keeping the first occurrence of each pair, without checking them
/// against the vocabulary (the BPE builder does). Returns the merges and how many lines were
/// dropped (malformed or repeated).
pub(crate) fn split_merges(raw: &[&str]) -> (Vec<(String, String)>, usize) {
    let mut seen: HashSet<&str> = HashSet::with_capacity(raw.len());
    let mut merges = Vec::with_capacity(raw.len());
    let mut dropped = 0;
    for line in raw {
        match split_merge(line) {
            Some((left, right)) if seen.insert(line) => {
                merges.push((left.to_string(), right.to_string()));
            }
            _ => dropped += 1,
        }
    }
    (merges, dropped)
}

/// Like [`split_merges`], also dropping merges whose parts or result are not in the vocabulary
/// (the `tokenizers` BPE model cannot represent them; llama.cpp would merge and then spell the
/// result as bytes).
pub(crate) fn parse_merges(raw: &[&str], vocab: &Vocab) -> (Vec<(String, String)>, usize) {
    let mut seen: HashSet<u64, BuildHasherDefault<PairHasher>> =
        HashSet::with_capacity_and_hasher(raw.len(), BuildHasherDefault::default());
    let mut merges = Vec::with_capacity(raw.len());
    let mut dropped = 0;
    let mut joined = String::new();
    for line in raw {
        let Some((left, right)) = split_merge(line) else {
            dropped += 1;
            continue;
        };
        joined.clear();
        joined.push_str(left);
        joined.push_str(right);
        let ids = vocab
            .get(left)
            .zip(vocab.get(right))
            .filter(|_| vocab.contains_key(joined.as_str()));
        let Some((&l, &r)) = ids else {
            dropped += 1;
            continue;
        };
        if !seen.insert(u64::from(l) << 32 | u64::from(r)) {
            dropped += 1;
            continue;
        }
        merges.push((left.to_string(), right.to_string()));
    }
    (merges, dropped)
}

/// A multiplicative hasher for pairs of ids packed in a `u64`.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Builds the `tokenizers` BPE model.
pub(crate) fn build_bpe(
    vocab: Vocab,
    merges: Vec<(String, String)>,
    options: &BpeOptions,
) -> Result<BPE, String> {
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(options.ignore_merges)
        .byte_fallback(options.byte_fallback);
    if let Some(unk) = &options.unk_token {
        builder = builder.unk_token(unk.clone());
    }
    builder.build().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::Model;

    fn toks(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn merges_split_at_first_space_after_first_byte() {
        let vocab = vocab_map(&toks(&["Ġ", "t", "Ġt", "h", "e", "he", "Ġthe"]));
        let (merges, dropped) =
            parse_merges(&["Ġ t", "h e", "Ġt he", "h e", "x y", "nospace"], &vocab);
        assert_eq!(
            merges,
            [
                ("Ġ".to_string(), "t".to_string()),
                ("h".to_string(), "e".to_string()),
                ("Ġt".to_string(), "he".to_string())
            ]
        );
        assert_eq!(dropped, 3);
    }

    #[test]
    fn unchecked_split_keeps_first_occurrence_only() {
        let (merges, dropped) = split_merges(&["a b", "a b", "x", "c d"]);
        assert_eq!(
            merges,
            [
                ("a".to_string(), "b".to_string()),
                ("c".to_string(), "d".to_string())
            ]
        );
        assert_eq!(dropped, 2);
    }

    #[test]
    fn merges_of_spaces_keep_a_leading_space_part() {
        // A merge line may start with the space-like marker itself; only a space after the
        // first byte separates the parts.
        let vocab = vocab_map(&toks(&["▁", "▁▁"]));
        let (merges, _) = parse_merges(&["▁ ▁"], &vocab);
        assert_eq!(merges, [("▁".to_string(), "▁".to_string())]);
    }

    #[test]
    fn built_model_merges_by_rank() {
        let tokens = toks(&["a", "b", "c", "ab", "bc", "abc"]);
        let vocab = vocab_map(&tokens);
        let (merges, _) = parse_merges(&["b c", "a b", "a bc"], &vocab);
        let bpe = build_bpe(vocab, merges, &BpeOptions::default()).expect("builds");
        let ids: Vec<u32> = bpe
            .tokenize("abc")
            .expect("tokenizes")
            .iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(ids, [5]);
    }
}
