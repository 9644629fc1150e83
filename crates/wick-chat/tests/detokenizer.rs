//! The incremental decoder on the three real tokenizers: whatever ids arrive (byte tokens that
//! split characters, emoji, CJK, special tokens), the streamed text equals a full decode, no
//! chunk holds half a character, and the window stays short.
use std::path::PathBuf;

use wick_chat::detokenizer::{IncrementalDecoder, SpecialTokens};
use wick_chat::tokenizer::Tokenizer;

const MODELS: &[&str] = &[
    "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m/gemma-3-270m-q4_k_m.gguf",
];

fn wick_home() -> PathBuf {
    match std::env::var_os("WICK_HOME") {
        Some(home) => PathBuf::from(home),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/wick"),
    }
}

fn load_gguf(path: PathBuf, hint: &str) -> Tokenizer {
    assert!(
        path.is_file(),
        "{} is missing: run `{hint}`",
        path.display()
    );
    let gguf = wick_gguf::GgufFile::open(&path).expect("opens GGUF");
    Tokenizer::from_gguf(&gguf).expect("builds tokenizer")
}

fn load(rel: &str) -> Tokenizer {
    let model = rel.split('/').next().unwrap_or(rel);
    load_gguf(
        wick_home().join("models").join(rel),
        &format!("wick pull {model}"),
    )
}

/// xorshift64*: a small deterministic generator, so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, pool: &'a [u32]) -> &'a u32 {
        &pool[self.below(pool.len())]
    }
}

/// Ids grouped by what they decode to.
struct Pools {
    /// Bytes that are not valid UTF-8 alone (pieces of a character: byte-fallback tokens,
    /// byte-level tokens of a partial character).
    partial: Vec<u32>,
    /// Whole multi-byte characters: accents, CJK, emoji.
    multibyte: Vec<u32>,
    ascii: Vec<u32>,
    special: Vec<u32>,
}

fn pools(tok: &Tokenizer) -> Pools {
    let mut p = Pools {
        partial: Vec::new(),
        multibyte: Vec::new(),
        ascii: Vec::new(),
        special: Vec::new(),
    };
    for id in 0..tok.vocab_size() as u32 {
        if tok.is_special(id) {
            p.special.push(id);
            continue;
        }
        let Some(bytes) = tok.token_bytes(id) else {
            continue;
        };
        if bytes.is_empty() {
            continue;
        }
        match std::str::from_utf8(&bytes) {
            Err(_) => p.partial.push(id),
            Ok(s) if s.is_ascii() => p.ascii.push(id),
            Ok(_) => p.multibyte.push(id),
        }
    }
    assert!(
        !p.partial.is_empty(),
        "vocabulary has no partial-character tokens"
    );
    assert!(!p.multibyte.is_empty() && !p.ascii.is_empty() && !p.special.is_empty());
    p
}

/// Streams `ids` through a decoder; returns the chunks.
fn stream(tok: &Tokenizer, ids: &[u32], special: SpecialTokens) -> Vec<String> {
    let mut decoder = IncrementalDecoder::new(tok, special);
    let mut chunks = Vec::new();
    for &id in ids {
        chunks.push(decoder.push(id).expect("id in vocabulary"));
    }
    chunks.push(decoder.flush());
    chunks
}

#[test]
fn random_ids_stream_to_the_full_decode() {
    for rel in MODELS {
        let tok = load(rel);
        let pools = pools(&tok);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for round in 0..300 {
            let len = 1 + rng.below(40);
            let ids: Vec<u32> = (0..len)
                .map(|_| match rng.below(10) {
                    0..=3 => *rng.pick(&pools.partial),
                    4..=5 => *rng.pick(&pools.multibyte),
                    6..=7 => *rng.pick(&pools.ascii),
                    8 => *rng.pick(&pools.special),
                    _ => rng.below(tok.vocab_size()) as u32,
                })
                .collect();
            for special in [SpecialTokens::Skip, SpecialTokens::Keep] {
                let skip = special == SpecialTokens::Skip;
                let full = tok.decode(&ids, skip).expect("decodes");
                let streamed: String = stream(&tok, &ids, special).concat();
                assert_eq!(
                    streamed, full,
                    "{rel} round {round} ({special:?}): streamed text differs for {ids:?}"
                );
            }
        }
    }
}

#[test]
fn characters_split_over_byte_tokens_are_held_back() {
    for rel in MODELS {
        let tok = load(rel);
        let pools = pools(&tok);
        let mut rng = Rng(42);
        // Valid text spelled with byte tokens wherever the tokenizer does (emoji, rare CJK).
        let text = "Llamas 🦙 and rockets 🚀 say 你好世界, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ẞ ✅ done";
        for special in [SpecialTokens::Skip, SpecialTokens::Keep] {
            let ids = tok.encode(text, false).expect("encodes");
            assert!(
                ids.iter().any(|id| pools.partial.contains(id)),
                "{rel}: the text should need partial-character tokens"
            );
            let chunks = stream(&tok, &ids, special);
            for chunk in &chunks {
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "{rel}: chunk {chunk:?} holds a broken character"
                );
            }
            assert_eq!(chunks.concat(), text, "{rel}");
        }
        // A lone partial character only comes out at flush, as U+FFFD.
        let lone = *rng.pick(&pools.partial);
        let mut decoder = IncrementalDecoder::new(&tok, SpecialTokens::Skip);
        assert_eq!(decoder.push(lone).expect("pushes"), "", "{rel}");
        assert!(decoder.flush().contains('\u{FFFD}'), "{rel}");
    }
}

#[test]
fn window_stays_short_on_long_output() {
    for rel in MODELS {
        let tok = load(rel);
        let text = "Streaming a long answer: 😀 日本語 — ".repeat(200);
        let ids = tok.encode(&text, false).expect("encodes");
        let mut decoder = IncrementalDecoder::new(&tok, SpecialTokens::Skip);
        let mut out = String::new();
        let mut widest = 0;
        for &id in &ids {
            out.push_str(&decoder.push(id).expect("pushes"));
            widest = widest.max(decoder.window_len());
        }
        out.push_str(&decoder.flush());
        assert_eq!(out, text, "{rel}");
        assert!(
            widest <= 8,
            "{rel}: the window grew to {widest} ids over {} ids",
            ids.len()
        );
    }
}

#[test]
fn special_tokens_are_kept_or_skipped() {
    let tok = load(MODELS[1]);
    let ids = tok
        .encode("<|im_start|>assistant\nHi there<|im_end|>", false)
        .expect("encodes");
    assert_eq!(
        stream(&tok, &ids, SpecialTokens::Keep).concat(),
        "<|im_start|>assistant\nHi there<|im_end|>"
    );
    assert_eq!(
        stream(&tok, &ids, SpecialTokens::Skip).concat(),
        "assistant\nHi there"
    );
}

#[test]
fn sentencepiece_leading_space_streams_like_a_full_decode() {
    let path = wick_home().join("assets/llama.cpp/ggml-vocab-llama-spm.gguf");
    let tok = load_gguf(path, "wick pull test-assets");
    let ids = tok.encode("Hello world, again", true).expect("encodes");
    assert_eq!(ids[0], tok.bos_id().expect("has BOS"));
    let chunks = stream(&tok, &ids, SpecialTokens::Skip);
    assert_eq!(chunks.concat(), "Hello world, again");
    assert_eq!(chunks[1], "Hello", "the prefix space is not emitted");
    assert_eq!(chunks[2], " world", "later spaces are");
    // Without the BOS the first piece still loses its prefix space, as in a full decode.
    let chunks = stream(&tok, &ids[1..], SpecialTokens::Keep);
    assert_eq!(chunks.concat(), "Hello world, again");
}

#[test]
fn ids_outside_the_vocabulary_are_rejected() {
    let tok = load(MODELS[0]);
    let mut decoder = IncrementalDecoder::new(&tok, SpecialTokens::Skip);
    assert!(decoder.push(tok.vocab_size() as u32).is_err());
    assert_eq!(decoder.window_len(), 0);
}
