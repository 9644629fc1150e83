//! Continuous batching under a KV memory budget, with the real default model: batched
//! output equals each request run alone even when the pool is so small that sequences
//! wait and get preempted, no block leaks, and requests that could never fit are
//! refused before any work; greedy tokens picked on the backend equal the host sampler's.
use std::time::Duration;

use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, KvBudget, SubmitError};
use wick_engine::{EngineError, GenerationRequest, Model};

#[path = "common/serving.rs"]
mod serving;
use serving::{
    assert_replies, batched, blocks_for_two_longest, collect, default_model, run_alone, run_one,
};

/// A prompt of about `words` words of ordinary text (built line by line: tokenizing one
/// huge string is slow).
fn prompt(model: &Model, topic: &str, words: usize) -> Vec<u32> {
    let mut ids = model.tokenize(topic).unwrap();
    let line = " The river runs past the old mill, and the miller counts the sacks of grain.";
    while ids.len() < words {
        ids.extend(model.tokenize(line).unwrap().into_iter().skip(1));
    }
    ids
}

/// Several requests of mixed prompt lengths, greedy and seeded: the pool holds about two
/// of them at full length, so the engine queues, preempts and recomputes — and every
/// output equals the request run alone.
#[test]
fn outputs_equal_single_runs_when_the_pool_forces_preemption() {
    let model = default_model();
    let lengths = [12usize, 140, 40, 220, 8, 90, 60, 30];
    let requests: Vec<GenerationRequest> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut r = GenerationRequest::new(prompt(&model, &format!("Story {i}:"), n))
                .max_tokens(40 + 4 * i);
            r.ignore_eos = true;
            if i % 3 == 1 {
                r = r.sampling(SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    seed: 100 + i as u64,
                    ..SamplingParams::default()
                });
            }
            r
        })
        .collect();
    let alone = run_alone(&model, &requests);
    // Room for about two of the longest sequences, all layers.
    let blocks = blocks_for_two_longest(&model, &requests, 0);
    let engine = Engine::start(model.clone(), batched(&model, Some(blocks))).unwrap();
    let pool = engine.stats().kv_pool;
    assert_eq!(pool.total_blocks, Some(blocks));
    let longest = requests.iter().map(|r| r.prompt.len() + r.max_tokens);
    assert!(
        pool.max_sequence_tokens >= longest.max().unwrap(),
        "{pool:?}"
    );
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    // Watch the pool while the requests run: never over budget.
    let watcher = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            let mut seen_waiting = 0;
            let mut max_used = 0;
            for _ in 0..2000 {
                let s = engine.stats();
                max_used = max_used.max(s.kv_pool.used_blocks);
                seen_waiting = seen_waiting.max(s.queued);
                if s.completed == 8 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (seen_waiting, max_used)
        })
    };
    for (i, (h, want)) in handles.into_iter().zip(&alone).enumerate() {
        assert_eq!(
            &collect(h).0,
            want,
            "request {i} differs from its single run"
        );
    }
    let (seen_waiting, max_used) = watcher.join().unwrap();
    let stats = engine.stats();
    assert!(
        stats.preemptions > 0,
        "the pool was meant to force preemption: {stats:?}"
    );
    assert!(seen_waiting > 0, "no request ever waited");
    assert!(max_used <= blocks, "{max_used} blocks used of {blocks}");
    assert!(stats.kv_pool.peak_blocks <= blocks);
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert_eq!(stats.completed, 8);
    assert!(stats.batch_size.count > 0 && stats.batch_size.mean() > 1.0);
    assert!(engine.shutdown(Duration::from_secs(5)));
}

#[test]
fn requests_that_could_never_fit_are_refused_before_any_work() {
    let model = default_model();
    let layers = model.config().num_layers;
    // 64 tokens' worth of blocks in every layer.
    let budget = (4 * layers * model.kv_block_bytes()) as u64;
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            kv_budget: KvBudget::Bytes(budget),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(engine.max_sequence_tokens(), 64);
    let too_big = GenerationRequest::new(model.tokenize("Hello there").unwrap()).max_tokens(100);
    match engine.submit(too_big) {
        Err(SubmitError::Invalid(EngineError::KvCapacity { needed, limit, .. })) => {
            assert!(needed > 100);
            assert_eq!(limit, 64);
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("an impossible request was accepted"),
    }
    let stats = engine.stats();
    assert_eq!((stats.steps, stats.queued), (0, 0));
    // One that fits runs.
    let fits = GenerationRequest::new(model.tokenize("Hello there").unwrap()).max_tokens(20);
    let alone = run_one(&model, &fits);
    assert_eq!(collect(engine.submit(fits).unwrap()).0, alone);
    assert_eq!(engine.stats().kv_pool.used_blocks, 0);

    // A budget below one block per layer cannot start at all.
    let tiny = Engine::start(
        model.clone(),
        EngineConfig {
            kv_budget: KvBudget::Bytes(model.kv_block_bytes() as u64),
            ..EngineConfig::default()
        },
    );
    assert!(tiny.is_err());
}

/// Greedy requests without log-probabilities get their tokens picked on the backend (no
/// logits reach the host); with log-probabilities the host sampler picks them from the
/// logits. Both give each request's tokens run alone through `Model::generate`.
#[test]
fn backend_argmax_and_host_sampler_pick_the_same_greedy_tokens() {
    let model = default_model();
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            prompt_cache_bytes: 0,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let requests: Vec<GenerationRequest> = [10usize, 70, 25]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut r =
                GenerationRequest::new(prompt(&model, &format!("Note {i}:"), n)).max_tokens(24);
            r.ignore_eos = true;
            r
        })
        .collect();
    let with_logprobs = |r: &GenerationRequest| {
        r.clone().sampling(SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::default()
        })
    };
    for r in &requests {
        assert!(r.sampling.is_raw_argmax());
        assert!(!with_logprobs(r).sampling.is_raw_argmax());
    }
    let alone = run_alone(&model, &requests);
    assert_replies(&engine, &requests, &alone, "argmax on the backend");
    let on_host: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(with_logprobs(r)).unwrap())
        .collect();
    for (i, (mut h, want)) in on_host.into_iter().zip(&alone).enumerate() {
        let mut ids = Vec::new();
        while let Some(e) = h.blocking_next() {
            match e {
                EngineEvent::Token(t) => {
                    assert!(t.logprob.is_finite() && t.top_logprobs.len() == 2);
                    ids.push(t.id);
                }
                EngineEvent::Done(_) => break,
                EngineEvent::Failed(e) => panic!("request failed: {e}"),
            }
        }
        assert_eq!(&ids, want, "request {i}, sampled on the host");
    }
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// Prompt-lookup speculation in a pool that forces preemption: greedy outputs equal the
/// plain single runs token for token, drafts were kept, sampled rows still finish, and
/// every block comes back (the trimmed drafts' blocks included).
#[test]
fn speculative_greedy_outputs_equal_single_runs_under_preemption() {
    let model = default_model();
    let lengths = [30usize, 140, 60, 200, 12, 90];
    let requests: Vec<GenerationRequest> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut r = GenerationRequest::new(prompt(&model, &format!("Story {i}:"), n))
                .max_tokens(30 + 7 * i);
            r.ignore_eos = true;
            r
        })
        .collect();
    let alone = run_alone(&model, &requests);
    let blocks = blocks_for_two_longest(&model, &requests, 0);
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            // Every draft verified, so the counts below do not hang on step timings.
            speculative: Some(wick_engine::speculative::SpeculativeConfig {
                budget: false,
                ..Default::default()
            }),
            ..batched(&model, Some(blocks))
        },
    )
    .unwrap();
    let mut sampled = requests[1].clone().sampling(SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        seed: 5,
        ..SamplingParams::default()
    });
    sampled.max_tokens = 50;
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let sampled = engine.submit(sampled).unwrap();
    for (i, (h, want)) in handles.into_iter().zip(&alone).enumerate() {
        assert_eq!(
            &collect(h).0,
            want,
            "request {i} differs from its plain single run"
        );
    }
    assert_eq!(collect(sampled).0.len(), 50);
    let stats = engine.stats();
    assert!(
        stats.preemptions > 0,
        "meant to force preemption: {stats:?}"
    );
    let spec = &stats.speculation;
    assert!(
        spec.accepted > 0 && spec.accepted <= spec.drafted,
        "{spec:?}"
    );
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// Issue 23: eight greedy rows speculating together (their drafts verified by the
/// backend's argmax of every position, no logits on the host) give each request's plain
/// single-run tokens, with every draft verified and with the step's draft budget on.
#[test]
fn speculative_greedy_batch_of_eight_equals_single_runs() {
    let model = default_model();
    let requests: Vec<GenerationRequest> = (0..8)
        .map(|i| {
            // Repeated text, so prompt lookup finds drafts and the model keeps many.
            let mut r = GenerationRequest::new(prompt(&model, &format!("Copy {i}:"), 40 + 9 * i))
                .max_tokens(24 + 3 * i);
            r.ignore_eos = true;
            r
        })
        .collect();
    let alone = run_alone(&model, &requests);
    for budget in [false, true] {
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                max_batch: 8,
                prompt_cache_bytes: 0,
                speculative: Some(wick_engine::speculative::SpeculativeConfig {
                    budget,
                    ..Default::default()
                }),
                ..EngineConfig::default()
            },
        )
        .unwrap();
        assert_replies(&engine, &requests, &alone, &format!("budget {budget}"));
        let stats = engine.stats();
        if !budget {
            let spec = &stats.speculation;
            assert!(
                spec.accepted > 0 && spec.accepted <= spec.drafted,
                "{spec:?}"
            );
        }
        assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
        assert!(engine.shutdown(Duration::from_secs(5)));
    }
}
