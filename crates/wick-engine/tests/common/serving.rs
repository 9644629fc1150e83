//! What the engine tests that serve a real model share (`batching`, `draft_model`,
//! `scheduler`, `structured`, `prompt_cache`, the media goldens' engine tests …): where the
//! models are, the default model, each request's reference run alone through
//! `Model::generate`, and the engine's replies. Stands alone, so that a test that needs
//! nothing else includes it with `#[path = "common/serving.rs"] mod serving;`.
#![allow(dead_code)] // each test crate uses its own subset

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wick_engine::scheduler::{
    Completion, EngineConfig, EngineEvent, EngineHandle, KvBudget, RequestHandle,
};
use wick_engine::{GenerationRequest, LoadOptions, Model};

/// Where `wick pull` puts models: `WICK_HOME`, or `~/.cache/wick`.
pub fn wick_home() -> PathBuf {
    std::env::var_os("WICK_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").expect("HOME")).join(".cache/wick"))
}

/// The file `rel` under the models folder, which `wick pull {pull}` fetches.
pub fn model_file(rel: &str, pull: &str) -> PathBuf {
    let path = wick_home().join("models").join(rel);
    assert!(
        path.is_file(),
        "{} missing: run `wick pull {pull}`",
        path.display()
    );
    path
}

/// The default model's file (SmolLM2-135M-Instruct Q4_1).
pub fn smollm2_path() -> PathBuf {
    model_file(
        "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
        "default",
    )
}

/// The default model on the CPU backend.
pub fn default_model() -> Arc<Model> {
    Arc::new(Model::load(&smollm2_path(), &LoadOptions::default()).unwrap())
}

/// A request's tokens run alone through `Model::generate` (the host sampler, a fresh
/// cache).
pub fn run_one(model: &Model, request: &GenerationRequest) -> Vec<u32> {
    model
        .generate(request, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens
}

/// Each request's tokens run alone through `Model::generate` (see [`run_one`]).
pub fn run_alone(model: &Model, requests: &[GenerationRequest]) -> Vec<Vec<u32>> {
    requests.iter().map(|r| run_one(model, r)).collect()
}

/// KV blocks (of 16 tokens, every layer) for about two of the longest of `requests`, each
/// with `slack` more tokens (drafts): a pool small enough that a batch of them preempts.
pub fn blocks_for_two_longest(
    model: &Model,
    requests: &[GenerationRequest],
    slack: usize,
) -> usize {
    let longest = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_tokens)
        .max()
        .unwrap_or(0);
    let layers = model.config().num_layers;
    2 * layers * (longest + slack).div_ceil(16) + layers
}

/// Batches of up to 8 in steps of 64 tokens, no prompt cache, a pool of `blocks` KV
/// blocks (unbounded for `None`).
pub fn batched(model: &Model, blocks: Option<usize>) -> EngineConfig {
    EngineConfig {
        max_batch: 8,
        step_token_budget: 64,
        prompt_cache_bytes: 0,
        kv_budget: blocks.map_or(KvBudget::Unbounded, |b| pool(model, b)),
        ..EngineConfig::default()
    }
}

/// A pool of `blocks` KV blocks.
pub fn pool(model: &Model, blocks: usize) -> KvBudget {
    KvBudget::Bytes((blocks * model.kv_block_bytes()) as u64)
}

/// A request's streamed token ids and text, checked against its `Done` (a failure fails
/// the test).
pub fn collect(mut h: RequestHandle) -> (Vec<u32>, String) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(e) = h.blocking_next() {
        match e {
            EngineEvent::Token(t) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            EngineEvent::Done(d) => {
                assert_eq!(d.tokens, ids);
                assert_eq!(d.text, text);
                return (ids, text);
            }
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("channel closed without Done");
}

/// A request through the engine to its end: the streamed token ids (checked against its
/// `Done`) and the completion.
pub fn completion(engine: &EngineHandle, req: GenerationRequest) -> (Vec<u32>, Completion) {
    let mut h = engine.submit(req).unwrap();
    let mut ids = Vec::new();
    while let Some(e) = h.blocking_next() {
        match e {
            EngineEvent::Token(t) => ids.push(t.id),
            EngineEvent::Done(d) => {
                assert_eq!(d.tokens, ids);
                return (ids, d);
            }
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("channel closed without Done");
}

/// A request's token ids (see [`completion`]) and how many prompt tokens the prompt
/// cache served.
pub fn reply_and_cached(engine: &EngineHandle, req: GenerationRequest) -> (Vec<u32>, usize) {
    let (ids, done) = completion(engine, req);
    (ids, done.usage.cached_tokens)
}

/// Every request submitted at once (so they run batched), then each one's token ids.
pub fn replies(engine: &EngineHandle, requests: &[GenerationRequest]) -> Vec<Vec<u32>> {
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    handles.into_iter().map(|h| collect(h).0).collect()
}

/// Asserts that the engine's replies to `requests`, submitted at once, are `alone`.
pub fn assert_replies(
    engine: &EngineHandle,
    requests: &[GenerationRequest],
    alone: &[Vec<u32>],
    case: &str,
) {
    for (i, (got, want)) in replies(engine, requests).iter().zip(alone).enumerate() {
        assert_eq!(got, want, "request {i} differs from its run alone ({case})");
    }
}
