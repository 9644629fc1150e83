//! `/v1/embeddings` through the HTTP layer: an embedding server on the tiny Qwen3 embedder
//! (vectors against sentence-transformers' goldens, float and base64, ids, errors), and a
//! generation server refusing the route.
mod support;

use std::path::Path;
use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use support::*;
use wick_engine::embedding::Embedder;
use wick_engine::LoadOptions;
use wick_server::routes::embeddings::{embedding_app, EmbedState};
use wick_server::ServerConfig;

fn goldens() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../wick-engine/tests/goldens/embed")
}

fn embed_router(api_key: Option<&str>) -> axum::Router {
    let embedder = Embedder::load(&goldens().join("tiny-qwen3-embed"), &LoadOptions::default())
        .expect("loads the tiny embedder");
    let mut config = ServerConfig::new("tiny-embed");
    config.api_key = api_key.map(str::to_string);
    embedding_app(EmbedState::new(Arc::new(embedder), config))
}

fn golden() -> Value {
    let text = std::fs::read_to_string(goldens().join("tiny-qwen3-embed.json")).expect("golden");
    serde_json::from_str(&text).expect("JSON")
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("vector")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[tokio::test]
async fn vectors_match_in_both_formats_and_for_ids() {
    let r = embed_router(None);
    let g = golden();
    let a = send(
        &r,
        post_json(
            "/v1/embeddings",
            &json!({"input": g["sentences"], "model": "x"}),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "tiny-embed");
    let want = g["vectors"].as_array().expect("vectors");
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), want.len());
    for (i, (d, w)) in data.iter().zip(want).enumerate() {
        assert_eq!(d["index"], i);
        assert_eq!(d["object"], "embedding");
        let c = cosine(&floats(&d["embedding"]), &floats(w));
        assert!(c >= 0.9999, "sentence {i}: cosine {c}");
    }
    let tokens: usize = g["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| i.as_array().expect("ids").len())
        .sum();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": tokens, "total_tokens": tokens})
    );

    // Token ids give the same vector; base64 carries the same floats.
    let ids = &g["ids"][0];
    let b = send(
        &r,
        post_json(
            "/v1/embeddings",
            &json!({"input": ids, "encoding_format": "base64"}),
        ),
    )
    .await;
    assert_eq!(b.status, StatusCode::OK, "{}", b.text());
    let b64 = b.json()["data"][0]["embedding"]
        .as_str()
        .expect("base64 string")
        .to_string();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64");
    let back: Vec<f64> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
        .collect();
    assert!(cosine(&back, &floats(&want[0])) >= 0.9999);
}

#[tokio::test]
async fn client_mistakes_are_400s_in_openai_shape() {
    let r = embed_router(None);
    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": "x", "dimensions": 8}), "dimensions"),
        (json!({"input": [[1, 100000]]}), "input"),
        (json!({"input": ["ok", {"a": 1}]}), "input[1]"),
        (json!({"input": "x", "prompt_name": "nope"}), "prompt_name"),
        (
            json!({"input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
    ] {
        let a = send(&r, post_json("/v1/embeddings", &body)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
        let e = &a.json()["error"];
        assert_eq!(e["type"], "invalid_request_error", "{body}");
        assert_eq!(e["param"], param, "{body}");
    }
    let a = send(&r, post_raw("/v1/embeddings", "{not json")).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = send(
        &r,
        post_json("/v1/chat/completions", &json!({"messages": []})),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.text().contains("embedding model"), "{}", a.text());
    let a = send(&r, get("/v1/models")).await;
    assert_eq!(a.json()["data"][0]["id"], "tiny-embed");
    assert_eq!(send(&r, get("/health")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn the_api_key_guards_embeddings() {
    let r = embed_router(Some("sekret"));
    let a = send(&r, post_json("/v1/embeddings", &json!({"input": "x"}))).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(send(&r, get("/health")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_generation_server_refuses_embeddings() {
    let r = router(&state());
    let a = send(&r, post_json("/v1/embeddings", &json!({"input": "hello"}))).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    let e = &a.json()["error"];
    assert_eq!(e["type"], "invalid_request_error");
    assert!(
        e["message"]
            .as_str()
            .expect("message")
            .contains("--embedding"),
        "{e}"
    );
}
