//! Test support: the tiny Hugging Face Qwen2 model from the engine's goldens (random weights,
//! ChatML template, loads in milliseconds) behind the real router, driven without a socket.
#![allow(dead_code)]
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use futures_util::StreamExt;
use serde_json::Value;
use tower::ServiceExt;
use wick_engine::scheduler::{Engine, EngineConfig};
use wick_engine::{LoadOptions, Model};
use wick_server::{app, AppState, ServerConfig};

/// The tiny model's directory.
pub fn tiny_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../wick-engine/tests/goldens/hf/qwen2")
}

/// A loaded tiny model (shared per test binary would be nicer, but it loads in ms).
pub fn tiny_model() -> Arc<Model> {
    let dir = tiny_model_dir();
    assert!(
        dir.join("config.json").is_file(),
        "{} missing",
        dir.display()
    );
    Arc::new(Model::load(&dir, &LoadOptions::default()).expect("tiny model loads"))
}

/// State for the tiny model with `config` changes and engine settings.
pub fn state_with(engine: EngineConfig, edit: impl FnOnce(&mut ServerConfig)) -> AppState {
    let mut config = ServerConfig::new("tiny");
    edit(&mut config);
    let engine = Engine::start(tiny_model(), engine).expect("engine starts");
    AppState::new(engine, config).expect("state builds")
}

/// State with defaults.
pub fn state() -> AppState {
    state_with(EngineConfig::default(), |_| {})
}

/// A finished exchange.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }

    /// Asserts an OpenAI error body with `status` and `code`.
    pub fn assert_error(&self, status: StatusCode, code: &str) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        let body = self.json();
        let err = &body["error"];
        for key in ["message", "type", "param", "code"] {
            assert!(err.get(key).is_some(), "no {key}: {body}");
        }
        assert_eq!(err["code"], code, "{body}");
        body
    }
}

/// Sends one request through the router.
pub async fn send(router: &Router, request: Request<Body>) -> Answer {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body reads");
    Answer {
        status,
        headers,
        body,
    }
}

pub fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

pub fn post_json(path: &str, body: &Value) -> Request<Body> {
    post_raw(path, body.to_string())
}

pub fn post_raw(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap()
}

/// Reads the first `n` SSE frames of a streaming answer, then drops the connection.
pub async fn first_frames_then_hang_up(
    router: &Router,
    request: Request<Body>,
    n: usize,
) -> Vec<String> {
    let response = router.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.into_body().into_data_stream();
    let mut frames = Vec::new();
    let mut text = String::new();
    while frames.len() < n {
        let Some(chunk) = stream.next().await else {
            break;
        };
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        while let Some(end) = text.find("\n\n") {
            frames.push(text[..end].to_string());
            text.drain(..end + 2);
        }
    }
    frames
}

/// The router for `state`.
pub fn router(state: &AppState) -> Router {
    app(state.clone())
}
