//! The engine loop with the real default model: batched greedy output equals running
//! each request alone, queue limits, cancellation.

use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, SubmitError};
use wick_engine::GenerationRequest;

#[path = "common/serving.rs"]
mod serving;
use serving::{assert_replies, collect, default_model, run_alone, run_one};

#[test]
fn batched_greedy_equals_single_runs() {
    let model = default_model();
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "1, 2, 3, 4,",
        "Once upon a time in a small village, there lived an old man who",
        "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
        "Water boils at",
    ];
    let requests: Vec<GenerationRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest::new(model.tokenize(p).unwrap()).max_tokens(12 + 3 * i))
        .collect();
    let alone = run_alone(&model, &requests);
    // A small step budget forces chunked prefill to overlap with other sequences' decode.
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 4,
            max_queue: 16,
            step_token_budget: 7,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_replies(&engine, &requests, &alone, "batched");
    let stats = engine.stats();
    assert!(stats.completed >= 6 && stats.steps > 0, "{stats:?}");
    assert!(engine.shutdown(std::time::Duration::from_secs(5)));
}

#[test]
fn seeded_sampling_is_reproducible_inside_a_batch() {
    let model = default_model();
    let prompt = model.tokenize("Write a word:").unwrap();
    let sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 42,
        ..SamplingParams::default()
    };
    let req = GenerationRequest::new(prompt)
        .max_tokens(16)
        .sampling(sampling);
    let alone = run_one(&model, &req);
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let other = GenerationRequest::new(model.tokenize("Noise noise").unwrap()).max_tokens(20);
    let h1 = engine.submit(other).unwrap();
    let h2 = engine.submit(req).unwrap();
    assert_eq!(collect(h2).0, alone);
    collect(h1);
}

#[test]
fn queue_limit_and_invalid_requests_are_refused_up_front() {
    let model = default_model();
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 1,
            max_queue: 1,
            step_token_budget: 64,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let too_long = GenerationRequest::new(vec![1; 10]).max_tokens(1_000_000);
    assert!(matches!(
        engine.submit(too_long),
        Err(SubmitError::Invalid(_))
    ));
    assert!(matches!(
        engine.submit(GenerationRequest::new(vec![])),
        Err(SubmitError::Invalid(_))
    ));
    let long =
        || GenerationRequest::new(model.tokenize("Count to a thousand:").unwrap()).max_tokens(200);
    let running = engine.submit(long()).unwrap();
    // Let it get admitted, then fill the queue.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _waiting = engine.submit(long()).unwrap();
    assert!(matches!(
        engine.submit(long()),
        Err(SubmitError::QueueFull { limit: 1 })
    ));
    drop(running);
    engine.shutdown(std::time::Duration::from_millis(100));
}

#[test]
fn dropping_the_handle_cancels_within_a_step() {
    let model = default_model();
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let mut req =
        GenerationRequest::new(model.tokenize("Tell me a long story.").unwrap()).max_tokens(2000);
    req.ignore_eos = true;
    let mut h = engine.submit(req).unwrap();
    // Wait for the first token and for the step's figures, then walk away.
    while !matches!(h.blocking_next(), Some(EngineEvent::Token(_))) {}
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while engine.stats().kv_bytes == 0 {
        assert!(std::time::Instant::now() < deadline, "no KV bytes reported");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(h);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while engine.stats().cancelled == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "cancelled request still running"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The last running request is gone: nothing is held any more, right away.
    let stats = engine.stats();
    assert_eq!(
        (
            stats.cancelled,
            stats.running,
            stats.completed,
            stats.kv_bytes
        ),
        (1, 0, 0, 0)
    );
    assert_eq!(stats.kv_pool.used_blocks, 0, "{stats:?}");
    assert!(stats.generated_tokens_total < 100, "{stats:?}");
}

#[test]
fn a_burst_takes_free_batch_places_before_the_queue_limit() {
    let model = default_model();
    // No queue beyond the batch: exactly `max_batch` requests are accepted at once, however
    // fast they arrive, and a finished one gives its place back.
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 3,
            max_queue: 0,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let long = || {
        let mut r =
            GenerationRequest::new(model.tokenize("Count to a thousand:").unwrap()).max_tokens(400);
        r.ignore_eos = true;
        r
    };
    let burst: Vec<_> = (0..3).map(|_| engine.submit(long()).unwrap()).collect();
    assert!(matches!(
        engine.submit(long()),
        Err(SubmitError::QueueFull { limit: 0 })
    ));
    drop(burst);
    let short = GenerationRequest::new(model.tokenize("Hi").unwrap()).max_tokens(2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let h = loop {
        match engine.submit(short.clone()) {
            Ok(h) => break h,
            Err(SubmitError::QueueFull { .. }) => {
                assert!(std::time::Instant::now() < deadline, "places never freed");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    };
    collect(h);
    // The finished request's place is free the moment its last event arrives.
    let again: Vec<_> = (0..3)
        .map(|_| engine.submit(short.clone()).unwrap())
        .collect();
    for h in again {
        collect(h);
    }
    assert!(engine.shutdown(std::time::Duration::from_secs(5)));
}
