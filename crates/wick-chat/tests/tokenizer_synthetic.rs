//! Small hand-made GGUF vocabularies: the corner cases real files rarely show (unknown
//! tokenizer names, broken metadata, merges outside the vocabulary, bytes the vocabulary cannot
//! spell, SentencePiece space prefixes after special tokens), each checked on its own.
use std::path::PathBuf;

use wick_chat::tokenizer::{Tokenizer, TokenizerError};
use wick_gguf::{GgufFile, GgufWriter, MetadataValue};

fn strings(items: &[&str]) -> MetadataValue {
    MetadataValue::Array(
        items
            .iter()
            .map(|s| MetadataValue::String(s.to_string()))
            .collect(),
    )
}

/// The character GPT-2's byte-level alphabet uses for byte `b`.
fn byte_char(b: u8) -> char {
    let printable =
        |x: u32| (33..=126).contains(&x) || (161..=172).contains(&x) || (174..=255).contains(&x);
    let b = u32::from(b);
    if printable(b) {
        return char::from_u32(b).unwrap();
    }
    char::from_u32(256 + (0..b).filter(|&x| !printable(x)).count() as u32).unwrap()
}

/// Writes a vocabulary-only GGUF and opens it.
fn gguf(entries: Vec<(&str, MetadataValue)>) -> (tempfile::TempDir, GgufFile) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path: PathBuf = dir.path().join("vocab.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in entries {
        w.metadata(k, v);
    }
    std::fs::write(&path, w.to_bytes()).expect("writes");
    let file = GgufFile::open(&path).expect("opens");
    (dir, file)
}

/// A byte-level BPE vocabulary: all 256 byte characters, then `extra` tokens.
fn byte_level(extra: &[&str], skip_bytes: &[u8]) -> Vec<String> {
    let mut tokens: Vec<String> = (0..=255u8)
        .filter(|b| !skip_bytes.contains(b))
        .map(|b| byte_char(b).to_string())
        .collect();
    tokens.extend(extra.iter().map(|s| s.to_string()));
    tokens
}

fn gpt2(
    tokens: &[String],
    merges: &[&str],
    more: Vec<(&'static str, MetadataValue)>,
) -> Vec<(&'static str, MetadataValue)> {
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut e = vec![
        ("tokenizer.ggml.model", MetadataValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", MetadataValue::String("gpt-2".into())),
        ("tokenizer.ggml.tokens", strings(&refs)),
        ("tokenizer.ggml.merges", strings(merges)),
    ];
    e.extend(more);
    e
}

fn id_of(tok: &Tokenizer, piece: &str) -> u32 {
    tok.token_id(piece)
        .unwrap_or_else(|| panic!("{piece:?} in vocabulary"))
}

#[test]
fn unknown_tokenizer_families_are_refused_by_name() {
    let (_d, f) = gguf(vec![
        ("tokenizer.ggml.model", MetadataValue::String("t5".into())),
        ("tokenizer.ggml.tokens", strings(&["a"])),
    ]);
    match Tokenizer::from_gguf(&f) {
        Err(e @ TokenizerError::UnsupportedModel { .. }) => {
            assert!(
                e.to_string().contains("'t5'") && e.to_string().contains("vocab.gguf"),
                "{e}"
            );
        }
        other => panic!("expected UnsupportedModel, got {other:?}"),
    }
    let tokens = byte_level(&[], &[]);
    let mut entries = gpt2(&tokens, &[], vec![]);
    entries[1].1 = MetadataValue::String("kimi-k2".into());
    let (_d, f) = gguf(entries);
    assert!(matches!(
        Tokenizer::from_gguf(&f),
        Err(TokenizerError::UnsupportedPreTokenizer { pre, .. }) if pre == "kimi-k2"
    ));
}

#[test]
fn broken_metadata_is_reported() {
    let mut tokens = byte_level(&[], &[]);
    tokens.push("a".into());
    let (_d, f) = gguf(gpt2(&tokens, &[], vec![]));
    assert!(matches!(
        Tokenizer::from_gguf(&f),
        Err(TokenizerError::DuplicateToken {
            first: 97,
            second: 256,
            ..
        })
    ));

    let tokens = byte_level(&[], &[]);
    let (_d, f) = gguf(gpt2(
        &tokens,
        &[],
        vec![(
            "tokenizer.ggml.token_type",
            MetadataValue::Array(vec![MetadataValue::I32(1); 3]),
        )],
    ));
    assert!(matches!(
        Tokenizer::from_gguf(&f),
        Err(TokenizerError::InvalidMetadata { key, .. }) if key == "tokenizer.ggml.token_type"
    ));

    let (_d, f) = gguf(gpt2(
        &tokens,
        &[],
        vec![("tokenizer.ggml.add_bos_token", MetadataValue::Bool(true))],
    ));
    assert!(matches!(
        Tokenizer::from_gguf(&f),
        Err(TokenizerError::InvalidMetadata { key, .. }) if key == "tokenizer.ggml.add_bos_token"
    ));

    let (_d, f) = gguf(vec![(
        "tokenizer.ggml.model",
        MetadataValue::String("gpt2".into()),
    )]);
    assert!(Tokenizer::from_gguf(&f).is_err());
}

#[test]
fn merges_outside_the_vocabulary_are_dropped_not_fatal() {
    let tokens = byte_level(&["he", "ll", "hell", "hello"], &[]);
    // "l lo" names "lo", which is not a token: the fast path fails and the checked one drops it.
    let (_d, f) = gguf(gpt2(
        &tokens,
        &["h e", "l l", "he ll", "l lo", "hell o"],
        vec![],
    ));
    let tok = Tokenizer::from_gguf(&f).expect("builds despite the bad merge");
    assert_eq!(tok.encode("hello", false).unwrap(), [id_of(&tok, "hello")]);
    assert_eq!(
        tok.decode(&tok.encode("hello", false).unwrap(), false)
            .unwrap(),
        "hello"
    );
}

#[test]
fn bytes_the_vocabulary_cannot_spell_vanish_and_separate() {
    // No token for byte 0x0B (vertical tab): llama.cpp drops it and merges never span the gap.
    let tokens = byte_level(&["ĠĠ"], &[0x0B]);
    let (_d, f) = gguf(gpt2(&tokens, &["Ġ Ġ"], vec![]));
    let tok = Tokenizer::from_gguf(&f).expect("builds");
    let space = id_of(&tok, "Ġ");
    assert_eq!(tok.encode(" \u{b} ", false).unwrap(), [space, space]);
    assert_eq!(tok.encode("  ", false).unwrap(), [id_of(&tok, "ĠĠ")]);
}

#[test]
fn empty_text_and_bos_framing() {
    let tokens = byte_level(&["<|bos|>", "<|eos|>"], &[]);
    let (_d, f) = gguf(gpt2(
        &tokens,
        &[],
        vec![
            ("tokenizer.ggml.bos_token_id", MetadataValue::U32(256)),
            ("tokenizer.ggml.eos_token_id", MetadataValue::U32(257)),
            ("tokenizer.ggml.add_bos_token", MetadataValue::Bool(true)),
            ("tokenizer.ggml.add_eos_token", MetadataValue::Bool(true)),
            (
                "tokenizer.ggml.token_type",
                MetadataValue::Array(
                    std::iter::repeat_n(MetadataValue::I32(1), 256)
                        .chain([MetadataValue::I32(3), MetadataValue::I32(3)])
                        .collect(),
                ),
            ),
        ],
    ));
    let tok = Tokenizer::from_gguf(&f).expect("builds");
    assert!(tok.encode("", false).unwrap().is_empty());
    assert_eq!(tok.encode("", true).unwrap(), [256, 257]);
    assert_eq!(tok.encode("a", true).unwrap(), [256, 97, 257]);
    assert_eq!(tok.bos_token(), Some("<|bos|>"));
    assert_eq!(tok.eos_token(), Some("<|eos|>"));
    assert_eq!(tok.eos_ids(), [257]);
    assert_eq!(tok.decode(&[256, 97, 257], true).unwrap(), "a");
    assert_eq!(
        tok.decode(&[256, 97, 257], false).unwrap(),
        "<|bos|>a<|eos|>"
    );
    assert!(matches!(
        tok.decode(&[9999], false),
        Err(TokenizerError::IdOutOfRange {
            id: 9999,
            vocab_size: 258
        })
    ));
    // The control token is text when special tokens are not parsed.
    assert_eq!(tok.encode_literal("<|bos|>", false).unwrap().len(), 7);
    assert_eq!(tok.encode("<|bos|>", false).unwrap(), [256]);
}

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, 256 byte tokens, then pieces.
fn spm(pieces: &[(&str, f32)], add_space_prefix: bool) -> (tempfile::TempDir, GgufFile) {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u32 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (p, s) in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(*s);
    }
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    gguf(vec![
        (
            "tokenizer.ggml.model",
            MetadataValue::String("llama".into()),
        ),
        ("tokenizer.ggml.tokens", strings(&refs)),
        (
            "tokenizer.ggml.scores",
            MetadataValue::Array(scores.into_iter().map(MetadataValue::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            MetadataValue::Array(types.into_iter().map(MetadataValue::I32).collect()),
        ),
        (
            "tokenizer.ggml.add_space_prefix",
            MetadataValue::Bool(add_space_prefix),
        ),
    ])
}

#[test]
fn sentencepiece_prefixes_a_space_at_the_start_and_after_special_tokens() {
    let (_d, f) = spm(
        &[
            ("▁", -1.0),
            ("h", -2.0),
            ("i", -3.0),
            ("▁h", -4.0),
            ("hi", -5.0),
            ("▁hi", -0.5),
        ],
        true,
    );
    let tok = Tokenizer::from_gguf(&f).expect("builds");
    let hi = id_of(&tok, "▁hi");
    assert_eq!(tok.encode("hi", false).unwrap(), [hi]);
    assert_eq!(
        tok.encode("hi", true).unwrap(),
        [1, hi],
        "BOS by default for SentencePiece"
    );
    assert_eq!(tok.encode("hi</s>hi", false).unwrap(), [hi, 2, hi]);
    assert_eq!(tok.decode(&[1, hi, hi], true).unwrap(), "hi hi");
    // Characters outside the vocabulary fall back to their UTF-8 bytes.
    let e_acute = tok.encode("é", false).unwrap();
    assert_eq!(e_acute, [id_of(&tok, "▁"), 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tok.decode(&e_acute, false).unwrap(), "é");
    assert_eq!(tok.token_bytes(3 + 0xC3).as_deref(), Some(&[0xC3u8][..]));

    let (_d, f) = spm(
        &[("▁", -1.0), ("h", -2.0), ("i", -3.0), ("hi", -5.0)],
        false,
    );
    let tok = Tokenizer::from_gguf(&f).expect("builds");
    assert_eq!(tok.encode("hi", false).unwrap(), [id_of(&tok, "hi")]);
}
