//! The MLX backend's decoding paths agree with each other and with candle on the real
//! SmolLM2 GGUF (MLX's CPU device, f32): host-sampled greedy generation, pipelined greedy
//! with the argmax on the backend, and lockstep batches of prompts of different lengths
//! (one shared, left-padded KV buffer, one attention call per step). Needs
//! `--features mlx` and `wick pull smollm2-135m-instruct`.
#![cfg(feature = "mlx")]
use std::ops::ControlFlow;

use wick_engine::backend::candle::KvDtype;
use wick_engine::backend::BackendKind;
use wick_engine::{GenerationRequest, LoadOptions, LogitsRequest, Model};

mod common;
use common::logits::{argmax, model_pass};
use common::serving::{assert_replies, collect, run_alone, smollm2_path};

/// The model on `backend`; candle keeps its KV cache in f32 like MLX here, so the two
/// differ only in how the products are computed.
fn load(backend: BackendKind) -> Model {
    Model::load(
        &smollm2_path(),
        &LoadOptions {
            backend,
            kv_dtype: Some(KvDtype::F32),
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Once upon a time",
    ]
    .iter()
    .map(|t| m.tokenize(t).unwrap())
    .collect()
}

/// Greedy tokens through the host sampler (`Model::generate`, temperature 0).
fn sampled(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut request = GenerationRequest::new(prompt.to_vec()).max_tokens(n);
    request.ignore_eos = true;
    m.generate(&request, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens
}

const STEPS: usize = 12;

#[test]
fn pipelined_and_lockstep_greedy_equal_host_sampling() {
    let mlx = load(BackendKind::Mlx);
    let ps = prompts(&mlx);
    let batch = mlx.generate_greedy(&ps, STEPS, 512).unwrap();
    for (i, p) in ps.iter().enumerate() {
        let alone = mlx
            .generate_greedy(std::slice::from_ref(p), STEPS, 512)
            .unwrap();
        let host = sampled(&mlx, p, STEPS);
        assert_eq!(
            alone.tokens[0], host,
            "prompt {i}: pipelined vs host-sampled"
        );
        assert_eq!(batch.tokens[i], host, "prompt {i}: lockstep batch vs alone");
    }
    // Chunked prompts (chunk smaller than the prompts) give the same tokens.
    let chunked = mlx.generate_greedy(&ps, STEPS, 5).unwrap();
    assert_eq!(chunked.tokens, batch.tokens);
}

/// candle's logits over MLX's greedy continuation (teacher forced): candle picks MLX's
/// token at every step, or that token is within `NEAR_TIE` logits of candle's best
/// (candle quantizes activations to 8 bits inside its Q4_1 products, MLX multiplies the
/// exact dequantized weights, so near-ties may flip).
#[test]
fn mlx_and_candle_agree_on_greedy_tokens() {
    const NEAR_TIE: f32 = 0.25;
    let mlx = load(BackendKind::Mlx);
    let candle = load(BackendKind::Candle);
    let (mut exact, mut total) = (0, 0);
    for p in prompts(&mlx) {
        let ours = mlx
            .generate_greedy(std::slice::from_ref(&p), STEPS, 512)
            .unwrap();
        let mut all = p.clone();
        all.extend_from_slice(&ours.tokens[0][..STEPS - 1]);
        let logits =
            model_pass(&candle, &all, &mut candle.new_cache(), LogitsRequest::All).unwrap();
        for (i, &want) in ours.tokens[0].iter().enumerate() {
            let row = logits.row(p.len() - 1 + i);
            let best = argmax(row);
            total += 1;
            if best == want {
                exact += 1;
            } else {
                let gap = row[best as usize] - row[want as usize];
                assert!(
                    gap < NEAR_TIE,
                    "step {i}: candle {best} vs mlx {want}, margin {gap}"
                );
            }
        }
    }
    eprintln!("candle agrees with MLX's greedy tokens at {exact}/{total} steps (rest near-ties)");
    assert!(exact * 10 >= total * 9, "only {exact}/{total} exact");
}

#[test]
fn cache_copies_and_snapshots_continue_like_the_original() {
    let mlx = load(BackendKind::Mlx);
    let ps = prompts(&mlx);
    let run = |cache: &mut wick_engine::KvCache, tokens: &[u32]| -> Vec<f32> {
        model_pass(&mlx, tokens, cache, LogitsRequest::Last)
            .unwrap()
            .data
    };
    let mut cache = mlx.new_cache();
    run(&mut cache, &ps[0]);
    let mut copy = cache.clone();
    let mut restored = mlx.cache_from_snapshot(&cache.snapshot()).unwrap();
    let a = run(&mut cache, &[42]);
    let b = run(&mut copy, &[42]);
    let c = run(&mut restored, &[42]);
    assert_eq!(a, b, "a cloned cache continues identically");
    let gap = a
        .iter()
        .zip(&c)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(gap < 1e-3, "a restored snapshot continues within {gap}");
    // Trimming back and refeeding gives the same logits again.
    cache.trim(ps[0].len()).unwrap();
    assert_eq!(run(&mut cache, &[42]), a);
}

/// Greedy tokens of `prompts` fed through `Model::forward` the way the scheduler feeds a
/// continuous batch: sequence `i` arrives at step `arrivals[i]`, its prompt goes in chunks
/// of 4 tokens beside the others' decode steps, and its cache is dropped once it has
/// `STEPS` tokens while the others go on (so sequences join and leave the MLX batch
/// buffer mid-run). Before its last token, the first sequence's cache is replaced by a
/// clone (taken out of the buffer) and, for the second, by a trimmed-and-refed copy; the
/// third's cache is detached and stored when it ends, and makes one more token at the end.
fn continuous(m: &Model, prompts: &[Vec<u32>], arrivals: &[usize]) -> Vec<Vec<u32>> {
    use wick_engine::{KvCache, Step};
    struct Seq {
        fed: usize,
        out: Vec<u32>,
        cache: Option<KvCache>,
    }
    let mut stored = None;
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .map(|_| Seq {
            fed: 0,
            out: Vec::new(),
            cache: Some(m.new_cache()),
        })
        .collect();
    for step in 0.. {
        if seqs.iter().all(|s| s.cache.is_none()) {
            break;
        }
        let inputs: Vec<Option<(Vec<u32>, LogitsRequest)>> = seqs
            .iter()
            .zip(prompts)
            .zip(arrivals)
            .map(|((s, p), &at)| {
                s.cache.as_ref()?;
                if step < at {
                    return None;
                }
                Some(if s.fed < p.len() {
                    let end = (s.fed + 4).min(p.len());
                    let want = if end == p.len() {
                        LogitsRequest::Last
                    } else {
                        LogitsRequest::None
                    };
                    (p[s.fed..end].to_vec(), want)
                } else {
                    (vec![*s.out.last().unwrap()], LogitsRequest::Last)
                })
            })
            .collect();
        let mut steps: Vec<Step<'_>> = seqs
            .iter_mut()
            .zip(&inputs)
            .filter_map(|(s, i)| {
                let (tokens, logits) = i.as_ref()?;
                Some(Step {
                    tokens,
                    cache: s.cache.as_mut()?,
                    logits: *logits,
                })
            })
            .collect();
        let mut outs = m.forward(&mut steps).unwrap().into_iter();
        drop(steps);
        for (i, (s, input)) in seqs.iter_mut().zip(&inputs).enumerate() {
            let Some((tokens, _)) = input else { continue };
            if s.fed < prompts[i].len() {
                s.fed += tokens.len();
            }
            if let Some(logits) = outs.next().unwrap() {
                s.out.push(argmax(logits.last()));
            }
            if s.out.len() == STEPS {
                if let Some(mut cache) = s.cache.take() {
                    if i == 2 {
                        // Stored like the prompt cache stores a finished sequence.
                        cache.detach();
                        stored = Some(cache);
                    }
                }
            } else if s.out.len() == STEPS - 1 && i < 2 {
                let cache = s.cache.as_mut().unwrap();
                if i == 0 {
                    *cache = cache.clone();
                } else {
                    // Drop the last token and feed it again alone.
                    let len = cache.len();
                    cache.trim(len - 1).unwrap();
                    let last = prompts[i]
                        .iter()
                        .chain(&s.out)
                        .nth(len - 1)
                        .copied()
                        .unwrap();
                    m.forward(&mut [Step {
                        tokens: &[last],
                        cache,
                        logits: LogitsRequest::None,
                    }])
                    .unwrap();
                }
            }
        }
    }
    // The stored cache continues where its sequence stopped.
    let (mut cache, third) = (stored.unwrap(), &seqs[2].out);
    let logits = m
        .forward(&mut [Step {
            tokens: &third[STEPS - 1..],
            cache: &mut cache,
            logits: LogitsRequest::Last,
        }])
        .unwrap()
        .remove(0)
        .unwrap();
    let mut outs: Vec<Vec<u32>> = seqs.into_iter().map(|s| s.out).collect();
    outs[2].push(argmax(logits.last()));
    outs
}

#[test]
fn continuous_batch_steps_equal_each_sequence_alone() {
    let mlx = load(BackendKind::Mlx);
    let mut ps = prompts(&mlx);
    let more = prompts(&mlx);
    ps.extend(more.into_iter().map(|mut p| {
        p.insert(0, p[0]);
        p
    }));
    // Arrivals spread so that sequences join a running batch, one arrives after the
    // first has left, and the batch grows past its first size.
    let arrivals = [0, 2, 3, 14, 15, 20];
    let batched = continuous(&mlx, &ps, &arrivals);
    for (i, p) in ps.iter().enumerate() {
        // The third sequence's stored cache made one more token.
        let n = if i == 2 { STEPS + 1 } else { STEPS };
        assert_eq!(batched[i], sampled(&mlx, p, n), "prompt {i}");
    }
}

/// Structured output on MLX: greedy rows under a grammar (a regex, a JSON schema, a lazy
/// grammar that starts mid-reply) picked in one batch by the backend's argmax under their
/// masks give the tokens the host sampler gives each alone.
#[test]
fn masked_argmax_on_the_backend_equals_host_sampling() {
    use std::sync::Arc;
    use std::time::Duration;
    use wick_engine::constraint::ConstraintSpec;
    use wick_engine::sampler::SamplingParams;
    use wick_engine::scheduler::{Engine, EngineConfig};

    let m = Arc::new(load(BackendKind::Mlx));
    let grammars = m.grammars().unwrap();
    let digits = grammars
        .compile(&ConstraintSpec::Regex("[0-9]{3}-[0-9]{4}".into()))
        .unwrap();
    let person = grammars
        .compile(&ConstraintSpec::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10},
                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name", "age"], "additionalProperties": false
        })))
        .unwrap();
    let constraints = [
        Some(digits.clone()),
        Some(person),
        Some(digits.triggered_by(" ")),
        None,
    ];
    let requests: Vec<GenerationRequest> = constraints
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let text = format!("<|im_start|>user\nA phone number and a person, #{i}.<|im_end|>\n<|im_start|>assistant\n");
            GenerationRequest::new(m.tokenize(&text).unwrap())
                .max_tokens(24)
                .sampling(SamplingParams {
                    constraint: c,
                    ..SamplingParams::default()
                })
        })
        .collect();
    let alone = run_alone(&m, &requests);
    let engine = Engine::start(
        m.clone(),
        EngineConfig {
            prompt_cache_bytes: 0,
            masked_argmax: Some(true),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_replies(&engine, &requests, &alone, "masked argmax on the backend");
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// Speculative decoding on MLX: a sequence decoding alone verifies its drafts (prompt
/// lookup, or the model drafting for itself) in one pass and keeps the greedy tokens of
/// plain decoding; sequences decoding together stay in the lockstep batch and decode
/// plainly, with the same tokens.
#[test]
fn speculation_keeps_greedy_tokens_alone_and_in_batches() {
    use std::sync::Arc;
    use std::time::Duration;
    use wick_engine::scheduler::{Engine, EngineConfig};
    use wick_engine::speculative::{DraftModel, SpeculativeConfig};

    let m = Arc::new(load(BackendKind::Mlx));
    assert!(m.can_speculate() && !m.speculates_in_batches());
    let requests: Vec<GenerationRequest> = [
        "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple,",
        "The river runs past the old mill, and the miller counts the sacks of grain. \
         The river runs past the old mill, and",
        "Count from one to twenty in words: one, two, three,",
    ]
    .iter()
    .map(|t| {
        let mut r = GenerationRequest::new(m.tokenize(t).unwrap()).max_tokens(24);
        r.ignore_eos = true;
        r
    })
    .collect();
    let alone = run_alone(&m, &requests);
    let spec = SpeculativeConfig {
        budget: false,
        ..SpeculativeConfig::default()
    };
    for draft in [None, Some(DraftModel::new(&m, m.clone()).unwrap())] {
        let self_drafting = draft.is_some();
        let engine = Engine::start(
            m.clone(),
            EngineConfig {
                prompt_cache_bytes: 0,
                speculative: Some(spec),
                draft_model: draft,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        for (i, (r, want)) in requests.iter().zip(&alone).enumerate() {
            let got = collect(engine.submit(r.clone()).unwrap()).0;
            assert_eq!(
                &got, want,
                "request {i} alone (draft model: {self_drafting})"
            );
        }
        let s = engine.stats().speculation;
        assert!(
            s.accepted > 0 && s.accepted <= s.drafted,
            "drafts verified and kept alone: {s:?}"
        );
        if self_drafting {
            assert!(s.accepted as f64 >= 0.8 * s.drafted as f64, "{s:?}");
        }
        let handles: Vec<_> = requests
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        for (i, (h, want)) in handles.into_iter().zip(&alone).enumerate() {
            assert_eq!(
                &collect(h).0,
                want,
                "request {i} in a batch (draft model: {self_drafting})"
            );
        }
        assert_eq!(engine.stats().kv_pool.used_blocks, 0);
        assert!(engine.shutdown(Duration::from_secs(5)));
    }
}
