//! The engine loop with the real default model: batched greedy output equals running
//! each request alone, queue limits, cancellation, what a panic on the engine thread
//! does; and a padded vocabulary's extra rows never produced, on any route.

use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, SubmitError};
use wick_engine::GenerationRequest;

#[path = "common/safetensors.rs"]
mod safetensors;
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
fn a_lone_prompt_goes_through_in_prompt_step_chunks() {
    let model = default_model();
    let prompt = model
        .tokenize("Once upon a time in a small village, there lived an old man who kept bees")
        .unwrap();
    let n = prompt.len();
    assert!(n > 8 && n <= 64, "{n} tokens");
    let req = GenerationRequest::new(prompt).max_tokens(3);
    let alone = run_one(&model, &req);
    let steps = |prompt_step_tokens| {
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                step_token_budget: 8,
                prompt_step_tokens,
                itl_factor: Some(0.0),
                ..EngineConfig::default()
            },
        )
        .unwrap();
        assert_eq!(collect(engine.submit(req.clone()).unwrap()).0, alone);
        let steps = engine.stats().steps;
        assert!(engine.shutdown(std::time::Duration::from_secs(5)));
        steps
    };
    // The prompt in chunks of the step budget when a prompt step may carry no more, then
    // two decode steps (its last chunk gives the first token) — or in one chunk when a
    // prompt step may carry 64 tokens, or the CPU backend's preference (2,048) holds.
    assert_eq!(steps(Some(8)), n.div_ceil(8) as u64 + 2);
    assert_eq!(steps(Some(64)), 3);
    assert_eq!(steps(None), 3);
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

/// Ids of the tiny Qwen2 golden's tokenizer, and the rows of its padded copy.
const TOKENS: usize = 512;
const PADDED_ROWS: usize = 640;

/// The tiny Qwen2 golden (random weights) with its embedding and output head padded from
/// 512 to 640 rows and `vocab_size` 640, its tokenizer untouched: what Qwen's checkpoints
/// do (151,936 rows for 151,665 tokens). Padded embedding rows are zero; padded head row
/// `512 + j` is real row `j` times −50, so whatever the hidden state, some padded id
/// outscores every real one by far (50 × the most negative of 128 real logits). With
/// `named`, the tokenizer gets 128 added tokens for them (nothing is masked): the control.
fn padded_qwen2(dir: &std::path::Path, named: bool) -> std::path::PathBuf {
    let dir = safetensors::copy_golden("qwen2", dir);
    safetensors::edit_config(&dir, |c| c["vocab_size"] = PADDED_ROWS.into());
    let weights = dir.join("model.safetensors");
    let mut tensors = safetensors::read(&weights);
    for t in &mut tensors {
        let hidden = t.shape[t.shape.len() - 1];
        let mut values = t.f32s();
        match t.name.as_str() {
            "model.embed_tokens.weight" => values.resize(PADDED_ROWS * hidden, 0.0),
            "lm_head.weight" => {
                let mirrored: Vec<f32> = values[..(PADDED_ROWS - TOKENS) * hidden]
                    .iter()
                    .map(|v| -50.0 * v)
                    .collect();
                values.extend(mirrored);
            }
            _ => continue,
        }
        t.set_f32s(&values, vec![PADDED_ROWS, hidden]);
    }
    safetensors::write(&weights, &tensors);
    if named {
        let path = dir.join("tokenizer.json");
        let mut tok: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let added = tok["added_tokens"].as_array_mut().unwrap();
        for id in TOKENS..PADDED_ROWS {
            added.push(serde_json::json!({
                "id": id, "content": format!("<|pad{id}|>"), "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true
            }));
        }
        std::fs::write(&path, tok.to_string()).unwrap();
    }
    dir
}

/// A padded vocabulary's extra rows are never produced (issue 44): through `generate` and
/// every route of the engine — the backend's argmax, host sampling with and without a
/// `logit_bias` on real ids, a grammar's mask applied on the host and by the backend, greedy
/// verification of prompt-lookup drafts, and a draft model — while the same weights with
/// a tokenizer naming those rows produce nothing else. A `logit_bias` naming a padded id is
/// refused up front.
#[test]
fn padded_vocabulary_rows_are_never_produced() {
    use std::sync::Arc;
    use wick_engine::constraint::ConstraintSpec;
    use wick_engine::speculative::{DraftModel, SpeculativeConfig};
    use wick_engine::{LoadOptions, Model};

    let dir = tempfile::tempdir().unwrap();
    let load = |named: bool, sub: &str| {
        Arc::new(
            Model::load(
                &padded_qwen2(&dir.path().join(sub), named),
                &LoadOptions::default(),
            )
            .unwrap(),
        )
    };
    let request = |model: &Model, sampling: SamplingParams| {
        let mut r = GenerationRequest::new(model.tokenize("hello world, hello").unwrap())
            .max_tokens(12)
            .sampling(sampling);
        r.ignore_eos = true;
        r
    };
    let control = load(true, "named");
    assert_eq!(control.vocab_size(), PADDED_ROWS);
    let out = run_alone(&control, &[request(&control, SamplingParams::default())]);
    assert!(
        out[0].iter().all(|&id| id as usize >= TOKENS),
        "the padded rows were meant to win unmasked: {:?}",
        out[0]
    );

    let model = load(false, "padded");
    assert_eq!(model.config().vocab_size, PADDED_ROWS);
    assert_eq!(model.vocab_size(), TOKENS);
    let grammar = model
        .grammars()
        .unwrap()
        .compile(&ConstraintSpec::Regex("[a-z ]{4,40}".into()))
        .unwrap();
    let sampled = |seed| SamplingParams {
        temperature: 1.5,
        seed,
        ..SamplingParams::default()
    };
    let requests = vec![
        request(&model, SamplingParams::default()),
        request(
            &model,
            SamplingParams {
                logprobs: Some(5),
                ..SamplingParams::default()
            },
        ),
        request(&model, sampled(7)),
        request(
            &model,
            SamplingParams {
                logit_bias: vec![(300, 4.0), (301, -4.0)],
                ..sampled(8)
            },
        ),
        request(
            &model,
            SamplingParams {
                constraint: Some(grammar.clone()),
                ..SamplingParams::default()
            },
        ),
        request(
            &model,
            SamplingParams {
                constraint: Some(grammar),
                ..sampled(9)
            },
        ),
    ];
    let alone = run_alone(&model, &requests);
    let check = |ids: &[u32], case: &str| {
        // A grammar may end a reply before the limit.
        assert!(!ids.is_empty() && ids.len() <= 12, "{case}: {ids:?}");
        assert!(
            ids.iter().all(|&id| (id as usize) < TOKENS),
            "{case}: a padded id was produced: {ids:?}"
        );
        model.tokenizer().decode(ids, false).unwrap();
    };
    for ids in &alone {
        check(ids, "generate");
    }
    let spec = SpeculativeConfig {
        budget: false,
        ..SpeculativeConfig::default()
    };
    let draft = DraftModel::new(&model, model.clone()).unwrap();
    let configs = [
        (
            "backend masks",
            EngineConfig {
                masked_argmax: Some(true),
                ..EngineConfig::default()
            },
        ),
        (
            "host masks",
            EngineConfig {
                masked_argmax: Some(false),
                ..EngineConfig::default()
            },
        ),
        (
            "prompt lookup",
            EngineConfig {
                speculative: Some(spec),
                ..EngineConfig::default()
            },
        ),
        (
            "draft model",
            EngineConfig {
                speculative: Some(spec),
                draft_model: Some(draft),
                ..EngineConfig::default()
            },
        ),
    ];
    for (case, config) in configs {
        let engine = Engine::start(model.clone(), config).unwrap();
        for h in requests
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect::<Vec<_>>()
        {
            check(&collect(h).0, case);
        }
        let biased = request(
            &model,
            SamplingParams {
                logit_bias: vec![(600, 100.0)],
                ..SamplingParams::default()
            },
        );
        match engine.submit(biased) {
            Err(SubmitError::Invalid(e)) => assert!(e.to_string().contains("600"), "{e}"),
            Err(e) => panic!("{case}: {e}"),
            Ok(_) => panic!("{case}: a logit_bias on a padded id was accepted"),
        }
        assert!(engine.shutdown(std::time::Duration::from_secs(5)));
    }
}

/// A panic on the engine thread (injected; it stands for any bug in a pass) fails the
/// request it was running and the one waiting behind it with the reason, refuses later
/// submits with it and reports the engine halted; shutting down still returns.
#[test]
fn an_engine_panic_fails_every_request_and_halts_the_engine() {
    let model = default_model();
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 1,
            max_queue: 4,
            panic_at_step: Some(4),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(engine.halted(), None);
    let mut req =
        GenerationRequest::new(model.tokenize("Once upon a time").unwrap()).max_tokens(64);
    req.ignore_eos = true;
    let running = engine.submit(req.clone()).unwrap();
    let waiting = engine.submit(req.clone()).unwrap();
    for (name, mut h) in [("running", running), ("waiting", waiting)] {
        let mut failed = None;
        while let Some(e) = h.blocking_next() {
            match e {
                EngineEvent::Token(_) => {}
                EngineEvent::Done(_) => panic!("{name}: finished despite the panic"),
                EngineEvent::Failed(e) => failed = Some(e),
            }
        }
        let e = failed.unwrap_or_else(|| panic!("{name}: its channel closed without a reason"));
        assert!(
            e.contains("the engine stopped after an internal error")
                && e.contains("a panic injected at step 4"),
            "{name}: {e}"
        );
    }
    let reason = engine.halted().expect("the engine reports it halted");
    assert!(reason.contains("a panic injected at step 4"), "{reason}");
    match engine.submit(req) {
        Err(SubmitError::Halted { reason }) => assert!(reason.contains("panic"), "{reason}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a halted engine accepted a request"),
    }
    let stats = engine.stats();
    assert_eq!(
        (stats.failed, stats.running, stats.queued),
        (2, 0, 0),
        "{stats:?}"
    );
    assert!(engine.shutdown(std::time::Duration::from_secs(5)));
}
