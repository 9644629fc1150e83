//! Structured output with the real default model: constrained replies parse and match
//! their schema, a batch under a pool small enough to preempt gives each constrained row
//! exactly its single run, and a grammar that cannot finish within `max_tokens` ends with
//! `Length`.
use std::ops::ControlFlow;
use std::time::Duration;

use serde_json::{json, Value};
use wick_engine::constraint::{Constraint, ConstraintSpec};
use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig};
use wick_engine::{FinishReason, GenerationRequest, Model};

#[path = "common/serving.rs"]
mod serving;
use serving::{assert_replies, batched, blocks_for_two_longest, collect, default_model, run_alone};

fn chat(model: &Model, user: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    model.tokenize(&text).unwrap()
}

fn constraint(model: &Model, spec: ConstraintSpec) -> Constraint {
    model.grammars().unwrap().compile(&spec).unwrap()
}

fn person() -> ConstraintSpec {
    ConstraintSpec::JsonSchema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user"]}
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    }))
}

#[test]
fn a_constrained_reply_parses_and_ends_with_the_grammar() {
    let model = default_model();
    let c = constraint(&model, person());
    for (temperature, seed) in [(0.0, 0), (0.9, 7)] {
        let request = GenerationRequest::new(chat(&model, "Describe a person as JSON."))
            .max_tokens(80)
            .sampling(SamplingParams {
                temperature,
                seed,
                constraint: Some(c.clone()),
                ..SamplingParams::default()
            });
        let out = model
            .generate(&request, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(
            out.finish_reason,
            FinishReason::EndOfSequence,
            "{}",
            out.text
        );
        let v: Value =
            serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {}", out.text));
        assert!(
            v["name"].as_str().is_some_and(|n| n.chars().count() <= 12),
            "{v}"
        );
        assert!((0..=120).contains(&v["age"].as_i64().unwrap()), "{v}");
        assert!(
            ["admin", "user"].contains(&v["role"].as_str().unwrap()),
            "{v}"
        );
    }
}

#[test]
fn a_grammar_unfinished_at_max_tokens_ends_with_length() {
    let model = default_model();
    let c = constraint(&model, ConstraintSpec::Regex("a{50}".into()));
    let request = GenerationRequest::new(chat(&model, "Say a."))
        .max_tokens(5)
        .sampling(SamplingParams {
            constraint: Some(c),
            ..SamplingParams::default()
        });
    let out = model
        .generate(&request, |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.finish_reason, FinishReason::Length);
    assert!(
        out.text.chars().all(|ch| ch == 'a') && !out.text.is_empty(),
        "{}",
        out.text
    );
}

/// Constrained and free rows in one batch, with a pool that forces preemption: every row's
/// tokens equal its run alone, so the matcher kept step through the recompute. Greedy
/// constrained rows are picked both ways: sampled on the host from their logits, and by the
/// backend's argmax under the grammar's mask (what device backends do).
#[test]
fn constrained_rows_survive_batching_and_preemption() {
    let model = default_model();
    let json = constraint(&model, person());
    let digits = constraint(&model, ConstraintSpec::Regex("[0-9]{3}-[0-9]{4}".into()));
    // Free text until the first space, then the digits: the mask starts mid-reply.
    let lazy = digits.clone().triggered_by(" ");
    let requests: Vec<GenerationRequest> = (0..8)
        .map(|i| {
            let c = match i % 4 {
                0 => Some(json.clone()),
                1 => Some(digits.clone()),
                2 => Some(lazy.clone()),
                _ => None,
            };
            GenerationRequest::new(chat(&model, &format!("Person number {i}, please.")))
                .max_tokens(48)
                .sampling(SamplingParams {
                    temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                    seed: 40 + i as u64,
                    constraint: c,
                    ..SamplingParams::default()
                })
        })
        .collect();
    let alone = run_alone(&model, &requests);
    let blocks = blocks_for_two_longest(&model, &requests, 0);
    for masked_argmax in [false, true] {
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                masked_argmax: Some(masked_argmax),
                ..batched(&model, Some(blocks))
            },
        )
        .unwrap();
        let case = format!("masked argmax: {masked_argmax}");
        assert_replies(&engine, &requests, &alone, &case);
        let stats = engine.stats();
        assert!(
            stats.preemptions > 0,
            "the pool was meant to force preemption: {stats:?}"
        );
        assert!(engine.shutdown(Duration::from_secs(5)));
    }
}

/// Constrained rows speculate (prompt lookup, every draft verified): drafts are cut where
/// the grammar stops accepting them and each verified position is picked under the
/// grammar's mask, so greedy rows — a JSON schema, a regex, and a lazy grammar whose mask
/// starts mid-reply — equal their plain single runs token for token, sampled constrained
/// rows still parse, and drafts were kept (the prompts ask to copy what they show).
#[test]
fn constrained_rows_speculate_and_keep_their_replies() {
    let model = default_model();
    assert!(model.can_speculate());
    let json = constraint(&model, person());
    let digits = constraint(&model, ConstraintSpec::Regex("[0-9]{3}-[0-9]{4}".into()));
    let lazy = digits.clone().triggered_by(" ");
    let copy_json =
        r#"Copy this JSON exactly: {"name": "Ada Lovelace", "age": 36, "role": "admin"}"#;
    let asks = [
        (copy_json, json.clone(), 0.0),
        ("Copy this number exactly: 555-1234.", digits, 0.0),
        ("Say exactly: call 555-1234 today.", lazy, 0.0),
        (copy_json, json, 0.8),
    ];
    let requests: Vec<GenerationRequest> = asks
        .iter()
        .enumerate()
        .map(|(i, (ask, c, temperature))| {
            GenerationRequest::new(chat(&model, ask))
                .max_tokens(48)
                .sampling(SamplingParams {
                    temperature: *temperature,
                    seed: 90 + i as u64,
                    constraint: Some(c.clone()),
                    ..SamplingParams::default()
                })
        })
        .collect();
    let alone = run_alone(&model, &requests);
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 8,
            prompt_cache_bytes: 0,
            speculative: Some(wick_engine::speculative::SpeculativeConfig {
                budget: false,
                ..Default::default()
            }),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    for (i, ((h, want), (_, _, temperature))) in
        handles.into_iter().zip(&alone).zip(&asks).enumerate()
    {
        let (ids, text) = collect(h);
        if *temperature == 0.0 {
            assert_eq!(&ids, want, "request {i} differs from its plain single run");
        } else {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(
                ["admin", "user"].contains(&v["role"].as_str().unwrap()),
                "{v}"
            );
        }
    }
    let spec = engine.stats().speculation;
    assert!(
        spec.accepted > 0 && spec.accepted <= spec.drafted,
        "{spec:?}"
    );
    assert!(engine.shutdown(Duration::from_secs(5)));
}
