//! An agent loop on models whose caches cannot be cut back (Qwen 3.5's recurrent layers,
//! Gemma's wrapped sliding windows): each turn resends the history with the model's
//! reply rendered its own way plus a tool output. The prompt cache keeps an entry at the
//! end of the last complete message ([`GenerationRequest::cache_points`]), so the next
//! turn reuses everything up to it; without the point nothing is reused. Greedy tokens
//! equal a cold run.
mod common;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use wick_engine::generation::CachePoint;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, EngineHandle};
use wick_engine::{GenerationRequest, LoadOptions, Model};

fn load(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&common::golden::golden_dir(name), &LoadOptions::default()).unwrap())
}

/// Ids below the tiny vocabularies, seeded.
fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % 200)
        .collect()
}

/// A reply longer than the tiny models' sliding windows (8) and a KV block (16), so a
/// finished turn's cache cannot be cut back to the end of its history.
fn reply_request(prompt: &[u32]) -> GenerationRequest {
    let mut req = GenerationRequest::new(prompt.to_vec()).max_tokens(30);
    req.ignore_eos = true;
    req
}

/// Runs `prompt` (with a point at `point`), returning its tokens and cached-token count.
fn turn(engine: &EngineHandle, prompt: &[u32], point: Option<usize>) -> (Vec<u32>, usize) {
    let mut req = reply_request(prompt);
    req.cache_points = point
        .map(|at| CachePoint { at, pin: None })
        .into_iter()
        .collect();
    let mut h = engine.submit(req).unwrap();
    let mut tokens = Vec::new();
    while let Some(e) = h.blocking_next() {
        match e {
            EngineEvent::Token(t) => tokens.push(t.id),
            EngineEvent::Done(d) => return (tokens, d.usage.cached_tokens),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("no Done");
}

/// Six turns: each prompt is the history (ending a message at `history.len()`) and a
/// generation prompt of 4 tokens; the next history adds the reply re-rendered (without
/// the generation prompt, with an end marker) and a tool output. Returns each turn's cached tokens over the previous turn's prompt length.
fn agent_loop(model: &Arc<Model>, points: bool, prompt_checkpoint_tokens: usize) -> Vec<f64> {
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            step_token_budget: 64,
            prompt_checkpoint_tokens,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let mut history = ids(150, 1);
    let mut last_prompt = 0;
    let mut ratios = Vec::new();
    for t in 0..6u32 {
        let mut prompt = history.clone();
        prompt.extend([7, 8, 9, 10]);
        let (out, cached) = turn(&engine, &prompt, points.then_some(history.len()));
        let mut req = reply_request(&prompt);
        req.prefill_chunk = 64;
        let cold = model
            .generate(&req, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        assert_eq!(out, cold, "turn {t}: greedy tokens of a reused prefix");
        if t > 0 {
            ratios.push(cached as f64 / last_prompt as f64);
        }
        last_prompt = prompt.len();
        // The reply comes back rendered otherwise (no generation prompt, an end marker),
        // then a tool output.
        history.extend([11, 12]);
        history.extend(&out);
        history.push(13);
        history.extend(ids(40 + 10 * t as usize, 10 + t));
    }
    engine.shutdown(Duration::from_secs(5));
    ratios
}

#[test]
fn each_turn_reuses_the_last_one_on_untrimmable_caches() {
    for name in ["qwen35", "gemma4", "gemma3"] {
        let model = load(name);
        let cold = agent_loop(&model, false, 0);
        let warm = agent_loop(&model, true, 0);
        eprintln!("{name}: without points {cold:.2?}, with points {warm:.2?}");
        assert!(
            warm.iter().all(|&r| r >= 0.95),
            "{name}: a turn reused less than 0.95 of the last: {warm:.2?}"
        );
        assert!(
            cold.iter().any(|&r| r < 0.95),
            "{name}: the test needs a model whose caches cannot be cut back: {cold:.2?}"
        );
    }
}

#[test]
fn periodic_entries_serve_a_conversation_that_parts_anywhere() {
    // No message boundary given: entries every 64 tokens still give most of the prefix.
    let model = load("qwen35");
    let ratios = agent_loop(&model, false, 64);
    assert!(
        ratios.iter().all(|&r| r >= 0.5),
        "periodic entries reused too little: {ratios:.2?}"
    );
}
