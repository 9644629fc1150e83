//! The three real model GGUFs (SmolLM2, Qwen2.5-Coder, Gemma 3) tokenize exactly like llama.cpp:
//! ids, rendered text, BOS/EOS, end-of-generation and special ids are compared with goldens made
//! by `scripts/goldens/tokenizer_models.py` (llama-cpp-python).
use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;
use wick_chat::tokenizer::Tokenizer;

const GOLDEN: &str = include_str!("goldens/tokenizer_models.json");

const SMOLLM2: &str = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
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

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Compares everything the golden records for one model; panics listing every mismatch.
fn check_against_llama_cpp(rel: &str) {
    let golden: Value = serde_json::from_str(GOLDEN).expect("golden JSON");
    let g = &golden["models"][rel];
    assert!(g.is_object(), "golden has no entry for {rel}");
    let tok = load(rel);
    let mut problems = Vec::new();

    assert_eq!(tok.vocab_size() as u64, g["vocab_size"].as_u64().unwrap());
    if tok.bos_id().map(u64::from) != g["bos"].as_u64() {
        problems.push(format!("bos {:?} != {}", tok.bos_id(), g["bos"]));
    }
    if tok.eos_ids().first().map(|&e| u64::from(e)) != g["eos"].as_u64() {
        problems.push(format!("eos {:?} != {}", tok.eos_ids().first(), g["eos"]));
    }
    if tok.add_bos() != g["add_bos"].as_bool().unwrap() {
        problems.push(format!("add_bos {} != {}", tok.add_bos(), g["add_bos"]));
    }
    let eog: BTreeSet<u32> = ids(&g["eog"]).into_iter().collect();
    let ours: BTreeSet<u32> = tok.eos_ids().iter().copied().collect();
    if eog != ours {
        problems.push(format!("end-of-generation ids {ours:?} != {eog:?}"));
    }
    let mut special = BTreeSet::new();
    for r in g["special_ranges"].as_array().unwrap() {
        let (a, b) = (r[0].as_u64().unwrap() as u32, r[1].as_u64().unwrap() as u32);
        special.extend(a..=b);
    }
    let ours: BTreeSet<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_special(id))
        .collect();
    if special != ours {
        let missing: Vec<_> = special.difference(&ours).take(10).collect();
        let extra: Vec<_> = ours.difference(&special).take(10).collect();
        problems.push(format!(
            "special ids differ: missing {missing:?}, extra {extra:?}"
        ));
    }
    for (id, piece) in g["pieces"].as_object().unwrap() {
        let id: u32 = id.parse().unwrap();
        let expected = hex(piece.as_str().unwrap());
        let got = tok.token_bytes(id).map(|b| b.into_owned());
        if got.as_deref() != Some(expected.as_slice()) {
            problems.push(format!("piece of {id}: {got:?} != {expected:?}"));
        }
    }

    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let plain = tok.encode_literal(text, false).expect("encodes");
        if plain != ids(&case["plain"]) {
            problems.push(format!(
                "plain {text:?}\n   expected {:?}\n   got      {plain:?}",
                ids(&case["plain"])
            ));
        }
        let chat = tok.encode(text, true).expect("encodes");
        if chat != ids(&case["chat"]) {
            problems.push(format!(
                "chat {text:?}\n   expected {:?}\n   got      {chat:?}",
                ids(&case["chat"])
            ));
        }
        let rendered = tok.decode(&ids(&case["chat"]), false).expect("decodes");
        if rendered != case["rendered"].as_str().unwrap() {
            problems.push(format!(
                "rendered {text:?}: {rendered:?} != {:?}",
                case["rendered"]
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{rel} differs from llama.cpp in {} places:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn smollm2_tokenizes_like_llama_cpp() {
    check_against_llama_cpp(SMOLLM2);
}

#[test]
fn qwen2_5_coder_tokenizes_like_llama_cpp() {
    check_against_llama_cpp(QWEN);
}

#[test]
fn gemma3_tokenizes_like_llama_cpp() {
    check_against_llama_cpp(GEMMA3);
}
