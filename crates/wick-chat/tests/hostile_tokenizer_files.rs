//! Tokenizer files whose sizes are absurd give errors naming the file, never an abort on a
//! huge allocation.
use serde_json::json;
use wick_chat::tokenizer::{Tokenizer, TokenizerError};

fn word_level(vocab: serde_json::Value) -> serde_json::Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}
    })
}

fn load(tokenizer_json: &serde_json::Value) -> Result<Tokenizer, TokenizerError> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        serde_json::to_vec(tokenizer_json).unwrap(),
    )
    .unwrap();
    Tokenizer::from_hf_dir(dir.path())
}

#[test]
fn a_token_id_of_two_to_the_31_is_an_error() {
    let err = load(&word_level(json!({"a": 0, "b": 1, "c": 2147483648u64})))
        .expect_err("an id of 2^31 in a three-token vocabulary must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("2147483648"),
        "{msg}"
    );
}

#[test]
fn dense_vocabularies_with_small_holes_still_load() {
    let tok = load(&word_level(json!({"a": 0, "b": 1, "c": 5}))).unwrap();
    assert_eq!(tok.vocab_size(), 6);
    assert_eq!(tok.encode("b c", false).unwrap(), [1, 5]);
}

#[test]
fn a_malformed_literal_inside_the_pipeline_is_an_error() {
    // Found by wick-fuzz: a damaged `false` (`f\x02\x00se`) in the byte-level pre-tokenizer
    // made the tokenizers library panic while parsing.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        include_bytes!("corpus/hostile/tokenizer_panics_tokenizers.json"),
    )
    .unwrap();
    let err = Tokenizer::from_hf_dir(dir.path()).expect_err("malformed file");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}
