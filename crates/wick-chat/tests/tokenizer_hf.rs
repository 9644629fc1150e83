//! `Tokenizer::from_hf_dir` on Hugging Face-style directories. The `tokenizer.json` files are
//! the pipelines wick builds from the real GGUFs, saved by `tokenizers`; loaded back through the
//! Hugging Face path they must encode and decode the goldens' texts like the GGUF tokenizer.
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use wick_chat::tokenizer::{Tokenizer, TokenizerError};

const GOLDEN: &str = include_str!("goldens/tokenizer_models.json");
const QWEN: &str = "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const GEMMA3: &str = "gemma-3-270m/gemma-3-270m-q4_k_m.gguf";

fn wick_home() -> PathBuf {
    match std::env::var_os("WICK_HOME") {
        Some(home) => PathBuf::from(home),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/wick"),
    }
}

fn load(rel: &str) -> Tokenizer {
    let path = wick_home().join("models").join(rel);
    let model = rel.split('/').next().unwrap_or(rel);
    assert!(
        path.is_file(),
        "model file {} is missing: run `wick pull {model}`",
        path.display()
    );
    let gguf = wick_gguf::GgufFile::open(&path).expect("opens GGUF");
    Tokenizer::from_gguf(&gguf).expect("builds tokenizer")
}

fn write_json(dir: &Path, name: &str, value: &Value) {
    std::fs::write(
        dir.join(name),
        serde_json::to_vec_pretty(value).expect("json"),
    )
    .expect("writes");
}

/// A directory holding `gguf`'s pipeline as `tokenizer.json` plus the given config files.
fn hf_dir(gguf: &Tokenizer, configs: &[(&str, Value)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    gguf.inner()
        .save(dir.path().join("tokenizer.json"), false)
        .expect("saves tokenizer.json");
    for (name, value) in configs {
        write_json(dir.path(), name, value);
    }
    dir
}

fn golden_texts(rel: &str) -> Vec<String> {
    let golden: Value = serde_json::from_str(GOLDEN).expect("golden JSON");
    golden["models"][rel]["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| c["text"].as_str().expect("text").to_string())
        .collect()
}

/// Encodes and decodes every golden text through both tokenizers.
fn assert_same_as_gguf(rel: &str, gguf: &Tokenizer, hf: &Tokenizer) {
    for text in golden_texts(rel) {
        let expected = gguf.encode(&text, false).expect("gguf encodes");
        assert_eq!(
            hf.encode(&text, false).expect("hf encodes"),
            expected,
            "{rel}: {text:?}"
        );
        let literal = gguf.encode_literal(&text, false).expect("gguf encodes");
        assert_eq!(
            hf.encode_literal(&text, false).expect("hf encodes"),
            literal,
            "{rel} literal: {text:?}"
        );
        for skip in [false, true] {
            assert_eq!(
                hf.decode(&expected, skip).expect("hf decodes"),
                gguf.decode(&expected, skip).expect("gguf decodes"),
                "{rel} decode (skip {skip}): {text:?}"
            );
        }
    }
}

#[test]
fn qwen_directory_matches_the_gguf_tokenizer() {
    let gguf = load(QWEN);
    let dir = hf_dir(
        &gguf,
        &[
            (
                "tokenizer_config.json",
                json!({"bos_token": null, "eos_token": "<|im_end|>", "add_bos_token": false}),
            ),
            (
                "config.json",
                json!({"eos_token_id": 151645, "bos_token_id": 151643}),
            ),
            (
                "generation_config.json",
                json!({"eos_token_id": [151645, 151643]}),
            ),
        ],
    );
    let hf = Tokenizer::from_hf_dir(dir.path()).expect("loads directory");
    assert_eq!(hf.vocab_size(), gguf.vocab_size());
    assert_eq!(hf.eos_ids(), [151645, 151643]);
    assert_eq!(hf.eos_token(), Some("<|im_end|>"));
    assert_eq!(hf.bos_id(), Some(151643));
    assert!(!hf.add_bos());
    assert_eq!(hf.token_piece(9707), gguf.token_piece(9707));
    assert_eq!(hf.token_id("<|im_start|>"), Some(151644));
    assert!(hf.is_special(151644));
    assert!(
        !hf.is_special(151657),
        "<tool_call> is an added, non-special token"
    );
    assert_same_as_gguf(QWEN, &gguf, &hf);
}

#[test]
fn gemma_directory_matches_the_gguf_tokenizer() {
    let gguf = load(GEMMA3);
    let dir = hf_dir(
        &gguf,
        &[(
            "tokenizer_config.json",
            json!({
                "bos_token": {"content": "<bos>", "special": true},
                "eos_token": "<eos>",
                "add_bos_token": true,
                "add_eos_token": false
            }),
        )],
    );
    let hf = Tokenizer::from_hf_dir(dir.path()).expect("loads directory");
    assert_eq!(hf.bos_token(), Some("<bos>"));
    assert_eq!(hf.bos_id(), Some(2));
    assert!(hf.add_bos());
    let ids = hf.encode("Hello", true).expect("encodes");
    assert_eq!(ids, gguf.encode("Hello", true).expect("encodes"));
    assert_eq!(ids[0], 2);
    assert_same_as_gguf(GEMMA3, &gguf, &hf);
}

#[test]
fn bos_comes_from_the_post_processor_without_explicit_flags() {
    let gguf = load(GEMMA3);
    let dir = hf_dir(&gguf, &[]);
    let hf = Tokenizer::from_hf_dir(dir.path()).expect("loads directory");
    // The saved pipeline carries the BOS template; with no tokenizer_config.json it decides.
    assert!(hf.add_bos());
    assert_eq!(hf.bos_id(), Some(2));
    assert_eq!(hf.encode("Hi", true).expect("encodes")[0], 2);
    assert_ne!(hf.encode("Hi", false).expect("encodes")[0], 2);
}

#[test]
fn missing_or_broken_files_are_named() {
    let empty = tempfile::tempdir().expect("temp dir");
    match Tokenizer::from_hf_dir(empty.path()) {
        Err(TokenizerError::Io { path, .. }) => assert!(path.ends_with("tokenizer.json")),
        other => panic!("expected an Io error naming tokenizer.json, got {other:?}"),
    }
    std::fs::write(empty.path().join("tokenizer.json"), "{not json").expect("writes");
    match Tokenizer::from_hf_dir(empty.path()) {
        Err(TokenizerError::HfConfig { path, .. }) => assert!(path.ends_with("tokenizer.json")),
        other => panic!("expected an HfConfig error, got {other:?}"),
    }
}
