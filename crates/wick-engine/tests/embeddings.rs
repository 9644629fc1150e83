//! Embedding models against sentence-transformers (goldens made by
//! scripts/goldens/embeddings.py): the tokenizer's ids, and every sentence's vector with
//! cosine ≥ 0.9999, batched and one at a time; prompts, Matryoshka truncation and the
//! refusals. The tiny Qwen3 embedder is committed; all-MiniLM-L6-v2 comes from
//! `wick pull minilm`.
use std::path::PathBuf;

use serde_json::Value;
use wick_engine::embedding::{Embedder, Pooling};
use wick_engine::LoadOptions;

mod common;
use common::golden::{goldens, ids_of, read_json};
use common::serving::model_file;

const MIN_COSINE: f64 = 0.9999;

fn embed_dir() -> PathBuf {
    goldens().join("embed")
}

fn golden(name: &str) -> Value {
    read_json(&embed_dir().join(format!("{name}.json")))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|s| s.as_str().expect("string").to_string())
        .collect()
}

fn id_lists(v: &Value) -> Vec<Vec<u32>> {
    v.as_array().expect("list").iter().map(ids_of).collect()
}

fn vectors(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|l| {
            l.as_array()
                .expect("vector")
                .iter()
                .map(|x| x.as_f64().expect("number") as f32)
                .collect()
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn assert_vectors(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}[{i}]: length");
        let c = cosine(g, w);
        assert!(c >= MIN_COSINE, "{what}[{i}]: cosine {c} < {MIN_COSINE}");
        let norm: f64 = g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{what}[{i}]: norm {norm}");
    }
}

/// Each of `ids` embedded in a call of its own.
fn one_at_a_time(embedder: &Embedder, ids: &[Vec<u32>]) -> Vec<Vec<f32>> {
    ids.iter()
        .map(|i| {
            embedder
                .embed(std::slice::from_ref(i), None)
                .expect("embeds")
                .remove(0)
        })
        .collect()
}

/// Ids from the tokenizer equal sentence-transformers'; vectors match batched and alone.
fn check_sentences(embedder: &Embedder, g: &Value, prompt: Option<&str>) -> Vec<Vec<u32>> {
    let sentences = strings(&g["sentences"]);
    let ids: Vec<Vec<u32>> = sentences
        .iter()
        .map(|s| embedder.encode_text(s, prompt).expect("encodes"))
        .collect();
    if prompt.is_none() {
        assert_eq!(ids, id_lists(&g["ids"]), "token ids");
    }
    ids
}

#[test]
fn tiny_qwen3_embedder_matches_sentence_transformers() {
    let dir = embed_dir().join("tiny-qwen3-embed");
    let g = golden("tiny-qwen3-embed");
    let embedder = Embedder::load(&dir, &LoadOptions::default()).expect("loads");
    let info = embedder.info();
    assert!(!info.encoder);
    assert_eq!(
        (info.dimensions, info.pooling, info.normalize),
        (64, Pooling::LastToken, true)
    );
    assert_eq!(info.max_tokens, 128);

    let ids = check_sentences(&embedder, &g, None);
    let want = vectors(&g["vectors"]);
    let batched = embedder.embed(&ids, None).expect("embeds");
    assert_vectors("batched", &batched, &want);
    assert_vectors("one at a time", &one_at_a_time(&embedder, &ids), &want);

    // The named prompt and the instruction give the same query format.
    let instruction = g["query_instruction"].as_str().expect("instruction");
    let by_name = embedder
        .prompt(Some("query"), None)
        .expect("prompt")
        .expect("some");
    let by_instruction = embedder
        .prompt(None, Some(instruction))
        .expect("prompt")
        .expect("some");
    assert_eq!(by_name, by_instruction);
    let q_ids = check_sentences(&embedder, &g, Some(&by_name));
    let q = embedder.embed(&q_ids, None).expect("embeds");
    assert_vectors("query prompt", &q, &vectors(&g["query_vectors"]));
    assert!(embedder.prompt(Some("nope"), None).is_err());

    // Matryoshka: cut and renormalised.
    let d = g["truncate_to"].as_u64().expect("dim") as usize;
    let cut = embedder.embed(&ids, Some(d)).expect("embeds");
    assert_vectors("truncated", &cut, &vectors(&g["truncated_vectors"]));
    assert!(
        embedder.embed(&ids, Some(8)).is_err(),
        "below the declared dimensions"
    );
    assert!(
        embedder.embed(&ids, Some(65)).is_err(),
        "above the model's width"
    );

    // Bad ids are errors, not panics.
    assert!(embedder.embed(&[vec![]], None).is_err());
    assert!(embedder.embed(&[vec![100_000]], None).is_err());
    assert!(embedder.embed(&[vec![5; 129]], None).is_err());
}

#[test]
fn minilm_matches_sentence_transformers() {
    let weights = model_file("all-minilm-l6-v2/model.safetensors", "minilm");
    let dir = weights.parent().unwrap();
    assert!(Embedder::is_encoder(dir));
    let g = golden("minilm");
    let embedder = Embedder::load(dir, &LoadOptions::default()).expect("loads");
    let info = embedder.info();
    assert!(info.encoder);
    assert_eq!(
        (info.dimensions, info.pooling, info.normalize),
        (384, Pooling::Mean, true)
    );
    assert_eq!(info.max_tokens, 256);
    assert_eq!(info.matryoshka_min, None);

    let ids = check_sentences(&embedder, &g, None);
    let want = vectors(&g["vectors"]);
    assert_vectors(
        "batched",
        &embedder.embed(&ids, None).expect("embeds"),
        &want,
    );
    assert_vectors("one at a time", &one_at_a_time(&embedder, &ids), &want);
    // No Matryoshka dimensions declared: only the full length.
    assert!(embedder.embed(&ids[..1], Some(128)).is_err());
    assert!(embedder.embed(&ids[..1], Some(384)).is_ok());
}
