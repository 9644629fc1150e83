//! Structured output costs on the real vocabularies of SmolLM2 (49,152 tokens) and
//! Qwen2.5 (151,936): building a model's token trie (once per model), compiling a typical
//! schema (once per request: the first-token latency it adds) and a mask at the start of
//! an object (what a rejected draw costs).
//!
//! `cargo bench -p wick-engine --bench constraint` (models from `wick pull default
//! qwen2.5-coder`; a missing one is skipped).
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::json;
use wick_chat::tokenizer::Tokenizer;
use wick_engine::constraint::{ConstraintSpec, Grammars};
use wick_engine::sampler::{Sampler, SamplerTokens, SamplingParams};

fn tokenizer(file: &str) -> Option<Tokenizer> {
    let home = std::env::var_os("WICK_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/wick")))?;
    let path = home.join("models").join(file);
    let gguf = wick_gguf::GgufFile::open(&path).ok()?;
    Tokenizer::from_gguf(&gguf).ok()
}

/// A schema like the ones clients send: nested objects, enums, a bounded array, a pattern,
/// a format, an optional union.
fn typical_schema() -> ConstraintSpec {
    ConstraintSpec::JsonSchema(json!({
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "created": {"type": "string", "format": "date-time"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 64},
                    "email": {"type": "string", "format": "email"},
                    "tier": {"enum": ["free", "pro", "enterprise"]}
                },
                "required": ["name", "tier"],
                "additionalProperties": false
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                        "price": {"type": "number"}
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": false
                }
            },
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}
        },
        "required": ["id", "customer", "items"],
        "additionalProperties": false
    }))
}

fn bench_constraint(c: &mut Criterion) {
    let models = [
        (
            "smollm2",
            "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        (
            "qwen2.5",
            "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
    ];
    let mut group = c.benchmark_group("constraint");
    group.sample_size(10);
    for (name, file) in models {
        let Some(tok) = tokenizer(file) else {
            eprintln!("{file} missing: skipped");
            continue;
        };
        group.bench_function(format!("{name}/token_trie"), |b| {
            b.iter(|| Grammars::new(&tok, tok.eos_ids()).unwrap())
        });
        let grammars = Grammars::new(&tok, tok.eos_ids()).unwrap();
        let spec = typical_schema();
        group.bench_function(format!("{name}/compile_typical_schema"), |b| {
            b.iter(|| grammars.compile(&spec).unwrap())
        });
        let constraint = grammars.compile(&spec).unwrap();
        group.bench_function(format!("{name}/first_mask"), |b| {
            b.iter(|| constraint.first_mask_allowed().unwrap())
        });
        // A whole valid reply sampled token by token, each token the row's argmax (the
        // common case: the first draw is accepted), against the plain sampler on the same
        // rows: the difference is the constraint's cost per token.
        let reply = r#"{"id": "ABC-1234", "customer": {"name": "Ada Lovelace", "tier": "pro"}, "items": [{"sku": "x-1", "quantity": 3, "price": 9.5}, {"sku": "y-2", "quantity": 1}], "note": null}"#;
        let ids = tok.encode_literal(reply, false).unwrap();
        let vocab = tok.vocab_size();
        let rows: Vec<Vec<f32>> = ids
            .iter()
            .map(|&id| {
                let mut row: Vec<f32> = (0..vocab)
                    .map(|i| ((i * 7919) % 1000) as f32 / 250.0)
                    .collect();
                row[id as usize] = 10.0;
                row
            })
            .collect();
        let per_reply = |b: &mut criterion::Bencher, constrained: bool| {
            b.iter(|| {
                let mut sampler =
                    Sampler::new(SamplingParams::greedy(), SamplerTokens::default()).unwrap();
                let mut state = constraint.start(&[]);
                for row in &rows {
                    let mut row = row.clone();
                    let picked = if constrained {
                        state.sample(&mut sampler, &mut row, &[]).unwrap()
                    } else {
                        sampler.sample(&mut row, &[])
                    };
                    if constrained {
                        state.commit(picked.id).unwrap();
                    }
                }
            })
        };
        group.bench_function(format!("{name}/reply_{}_tokens_free", ids.len()), |b| {
            per_reply(b, false)
        });
        group.bench_function(
            format!("{name}/reply_{}_tokens_constrained", ids.len()),
            |b| per_reply(b, true),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_constraint);
criterion_main!(benches);
