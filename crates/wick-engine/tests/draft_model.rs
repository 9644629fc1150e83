//! Speculative decoding with a draft model (`EngineConfig::draft_model`), with the real
//! default model: drafting for itself keeps greedy output token for token (batched, under
//! a pool small enough to preempt) and keeps nearly every draft; a random-weight draft of
//! the same vocabulary keeps the output too and backs off to few drafts; a draft with
//! another vocabulary is refused at start-up, naming both models.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use wick_engine::constraint::ConstraintSpec;
use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig, EngineHandle};
use wick_engine::speculative::{DraftModel, SpeculativeConfig};
use wick_engine::{GenerationRequest, LoadOptions, Model};
use wick_gguf::{GgmlType, GgufFile, GgufWriter, MetadataValue as V};

#[path = "common/serving.rs"]
mod serving;
use serving::{
    assert_replies, batched, blocks_for_two_longest, collect, default_model, pool, replies,
    run_alone, smollm2_path,
};

#[path = "common/gguf.rs"]
mod gguf;

/// A one-layer llama of hidden size 32 with fixed pseudo-random F32 weights and
/// SmolLM2's tokenizer (every `tokenizer.*` key copied), or a 259-token byte vocabulary
/// when `own_vocab`: a draft that agrees with SmolLM2 almost never.
fn tiny_draft(dir: &Path, own_vocab: bool) -> PathBuf {
    let source = GgufFile::open(smollm2_path()).unwrap();
    let mut w = GgufWriter::new();
    let mut vocab = 0u64;
    for (key, value) in source.metadata().entries() {
        if key.starts_with("tokenizer.") && !own_vocab {
            if key == "tokenizer.ggml.tokens" {
                vocab = value.as_array().unwrap().len() as u64;
            }
            w.metadata(key.clone(), value.clone());
        }
    }
    if own_vocab {
        let mut tokens: Vec<V> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| V::String(s.to_string()))
            .collect();
        tokens.extend((0..256u32).map(|b| V::String(format!("<0x{b:02X}>"))));
        vocab = tokens.len() as u64;
        w.metadata("tokenizer.ggml.model", V::String("gpt2".into()))
            .metadata("tokenizer.ggml.pre", V::String("gpt-2".into()))
            .metadata("tokenizer.ggml.tokens", V::Array(tokens))
            .metadata(
                "tokenizer.ggml.merges",
                V::Array(vec![V::String("a b".into())]),
            )
            .metadata("tokenizer.ggml.bos_token_id", V::U32(1))
            .metadata("tokenizer.ggml.eos_token_id", V::U32(2));
    }
    w.metadata("general.architecture", V::String("llama".into()))
        .metadata("general.name", V::String("tiny-draft".into()));
    for (key, value) in gguf::hyperparameters("llama", 2048) {
        w.metadata(key, value);
    }
    for (name, dims) in gguf::tensors(vocab) {
        let n: u64 = dims.iter().product();
        let bytes = gguf::f32_bytes(n as usize, name.len() as u32);
        w.tensor(name, dims, GgmlType::F32, bytes);
    }
    let path = dir.join(if own_vocab {
        "tiny-bytes.gguf"
    } else {
        "tiny-smollm2-vocab.gguf"
    });
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

/// Greedy requests that repeat and edit text (prompt lengths mixed), one with a stop
/// string, one with log-probabilities and a repetition penalty.
fn greedy_requests(model: &Model) -> Vec<GenerationRequest> {
    let topics = [
        "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry.",
        "Write a short poem about the sea.",
        "Count from one to twenty in words.",
        "The river runs past the old mill, and the miller counts the sacks of grain. \
         The river runs past the old mill, and",
    ];
    topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let prompt = model.tokenize(t).unwrap();
            let mut r = GenerationRequest::new(prompt).max_tokens(24 + 6 * i);
            r.ignore_eos = true;
            if i == 1 {
                r.stop = vec!["\n\n".into()];
            }
            if i == 2 {
                r = r.sampling(SamplingParams {
                    logprobs: Some(2),
                    repetition_penalty: 1.1,
                    ..SamplingParams::greedy()
                });
            }
            r
        })
        .collect()
}

/// An engine of `model` drafting with `draft` on `config`, every draft verified (so the
/// counts the tests check do not hang on step timings).
fn engine_with(model: &Arc<Model>, draft: DraftModel, config: EngineConfig) -> EngineHandle {
    Engine::start(
        model.clone(),
        EngineConfig {
            speculative: Some(SpeculativeConfig {
                budget: false,
                ..SpeculativeConfig::default()
            }),
            draft_model: Some(draft),
            ..config
        },
    )
    .unwrap()
}

/// The default model drafting for itself: every greedy reply is the plain one, batched
/// and under a pool that preempts; nearly every draft is kept; a sampled request runs
/// beside them to its length, keeping drafts too.
#[test]
fn a_model_drafting_for_itself_keeps_greedy_output_and_its_drafts() {
    let model = default_model();
    let mut requests = greedy_requests(&model);
    // A row under a grammar drafts too: its drafts are cut where the grammar refuses them.
    let digits = model
        .grammars()
        .unwrap()
        .compile(&ConstraintSpec::Regex("([0-9]{3}-[0-9]{4} ){3}".into()))
        .unwrap();
    let prompt = model
        .tokenize("Copy these numbers exactly: 555-1234 555-1234 555-1234")
        .unwrap();
    requests.push(
        GenerationRequest::new(prompt)
            .max_tokens(30)
            .sampling(SamplingParams {
                constraint: Some(digits),
                ..SamplingParams::greedy()
            }),
    );
    let alone = run_alone(&model, &requests);
    // Room for about two of the longest sequences (with their drafts), all layers.
    let blocks = blocks_for_two_longest(&model, &requests, 8);
    let draft = DraftModel::new(&model, model.clone()).unwrap();
    let engine = engine_with(&model, draft, batched(&model, Some(blocks)));
    let mut sampled = requests[1].clone().sampling(SamplingParams {
        temperature: 0.7,
        seed: 9,
        ..SamplingParams::default()
    });
    sampled.stop.clear();
    sampled.max_tokens = 40;
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let sampled = engine.submit(sampled).unwrap();
    for (i, (h, want)) in handles.into_iter().zip(&alone).enumerate() {
        assert_eq!(
            &collect(h).0,
            want,
            "request {i} differs from its plain run"
        );
    }
    assert_eq!(collect(sampled).0.len(), 40);
    let stats = engine.stats();
    let spec = &stats.speculation;
    assert!(
        spec.drafted > 40 && spec.accepted as f64 >= 0.8 * spec.drafted as f64,
        "a model drafting for itself keeps nearly every draft: {spec:?}"
    );
    assert!(stats.preemptions > 0, "meant to preempt: {stats:?}");
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// A random-weight draft with the same vocabulary: replies are still the plain ones, it
/// is almost never right, and the adaptive length backs off to a draft every few steps.
#[test]
fn a_draft_that_is_never_right_keeps_the_output_and_backs_off() {
    let model = default_model();
    let dir = tempfile::tempdir().unwrap();
    let tiny =
        Arc::new(Model::load(&tiny_draft(dir.path(), false), &LoadOptions::default()).unwrap());
    let requests = greedy_requests(&model);
    let alone = run_alone(&model, &requests);
    let draft = DraftModel::new(&model, tiny).unwrap();
    let engine = engine_with(&model, draft, batched(&model, None));
    let got = replies(&engine, &requests);
    assert_eq!(got, alone, "the replies differ from the plain runs");
    let generated: u64 = got.iter().map(|g| g.len() as u64).sum();
    let spec = engine.stats().speculation;
    assert!(spec.accepted * 5 <= spec.drafted.max(1), "{spec:?}");
    assert!(
        spec.drafted * 4 <= generated,
        "the draft length backs off: {spec:?} over {generated} tokens"
    );
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// A draft with another tokenizer is refused, naming both models.
#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let model = default_model();
    let dir = tempfile::tempdir().unwrap();
    let other =
        Arc::new(Model::load(&tiny_draft(dir.path(), true), &LoadOptions::default()).unwrap());
    let err = DraftModel::new(&model, other.clone())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&other.info().name)
            && err.contains(&model.info().name)
            && err.contains("tokenizers differ"),
        "{err}"
    );
}

/// The draft's KV of a prompt goes to the prompt cache beside the served model's: the
/// next turn of a conversation restores both, so the draft computes only what is new
/// instead of the whole history again; and the KV budget keeps the draft's share (a
/// model drafting for itself halves the blocks the served model's caches get).
#[test]
fn the_draft_restores_cached_prompts_and_takes_its_share_of_the_budget() {
    let model = default_model();
    let (turn1, reply, turn2, want2) = two_turns(&model);

    // Tokens the draft computed for turn 2, and prompt tokens it restored, with the
    // prompt cache on or off.
    let second_turn = |prompt_cache_bytes: u64| {
        let blocks = 4096;
        let engine = engine_with(
            &model,
            DraftModel::new(&model, model.clone()).unwrap(),
            EngineConfig {
                prompt_cache_bytes,
                kv_budget: pool(&model, blocks),
                ..EngineConfig::default()
            },
        );
        assert_eq!(
            engine.stats().kv_pool.total_blocks,
            Some(blocks / 2),
            "the draft's caches take half of the budget"
        );
        assert_eq!(collect(engine.submit(turn1.clone()).unwrap()).0, reply);
        let before = engine.stats().speculation;
        assert_eq!(collect(engine.submit(turn2.clone()).unwrap()).0, want2);
        let after = engine.stats().speculation;
        assert!(after.accepted > before.accepted, "{after:?}");
        assert!(engine.shutdown(Duration::from_secs(5)));
        (
            after.draft_model_tokens - before.draft_model_tokens,
            after.draft_model_cached_tokens - before.draft_model_cached_tokens,
        )
    };
    let (computed_cold, cached_cold) = second_turn(0);
    let (computed, cached) = second_turn(64 << 20);
    assert_eq!(cached_cold, 0);
    assert!(
        computed_cold >= turn2.prompt.len() as u64,
        "without a cache the draft computes the whole history: {computed_cold}"
    );
    // Turn 1's prompt and reply, but for the reply's last tokens: the draft had fed
    // the history up to its last drafting step.
    let slack = 1 + SpeculativeConfig::default().num_draft_tokens;
    assert!(
        cached as usize >= turn1.prompt.len() + reply.len() - slack,
        "the draft restores turn 1: {cached} of {}",
        turn2.prompt.len()
    );
    assert!(
        computed + cached <= computed_cold + 1,
        "what it restores it does not compute: {computed} + {cached} vs {computed_cold}"
    );
}

/// Two turns of a conversation, with the turn-1 reply the plain model gives.
fn two_turns(model: &Model) -> (GenerationRequest, Vec<u32>, GenerationRequest, Vec<u32>) {
    let story = "The river runs past the old mill, and the miller counts the sacks of grain. ";
    let first = model
        .tokenize(&format!("{}Continue the story:", story.repeat(12)))
        .unwrap();
    let mut turn1 = GenerationRequest::new(first).max_tokens(24);
    turn1.ignore_eos = true;
    let reply = run_alone(model, std::slice::from_ref(&turn1)).remove(0);
    let mut next = turn1.prompt.clone();
    next.extend_from_slice(&reply);
    next.extend(model.tokenize(" Now tell it once more:").unwrap());
    let mut turn2 = GenerationRequest::new(next).max_tokens(24);
    turn2.ignore_eos = true;
    let want2 = run_alone(model, std::slice::from_ref(&turn2)).remove(0);
    (turn1, reply, turn2, want2)
}

/// With an SSD directory the draft's entries go to disk beside the served model's (in a
/// directory of their own) and outlive a restart: the next process restores turn 1 for
/// the draft from the SSD instead of prefilling it.
#[test]
fn the_drafts_entries_outlive_a_restart_on_the_ssd() {
    let model = default_model();
    let (turn1, reply, turn2, want2) = two_turns(&model);
    let dir = tempfile::tempdir().unwrap();
    let start = || {
        engine_with(
            &model,
            DraftModel::new(&model, model.clone()).unwrap(),
            EngineConfig {
                prompt_cache_bytes: 64 << 20,
                ssd_cache_dir: Some(dir.path().to_path_buf()),
                ..EngineConfig::default()
            },
        )
    };
    let engine = start();
    assert!(engine
        .wait_for_cache_scan(Duration::from_secs(30))
        .is_some());
    assert_eq!(collect(engine.submit(turn1.clone()).unwrap()).0, reply);
    assert!(engine.shutdown(Duration::from_secs(5)));
    assert!(engine.flush_cache(Duration::from_secs(30)).durable);
    drop(engine);
    let drafts: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("draft-"))
        .collect();
    assert_eq!(drafts.len(), 1, "one directory for the draft's entries");

    let engine = start();
    assert!(engine
        .wait_for_cache_scan(Duration::from_secs(30))
        .is_some());
    assert_eq!(collect(engine.submit(turn2.clone()).unwrap()).0, want2);
    let stats = engine.stats();
    assert!(stats.prompt_cache.ssd_hits >= 1, "{:?}", stats.prompt_cache);
    let slack = 1 + SpeculativeConfig::default().num_draft_tokens;
    let cached = stats.speculation.draft_model_cached_tokens as usize;
    eprintln!(
        "after the restart the draft restored {cached} of {} prompt tokens and computed {}",
        turn2.prompt.len(),
        stats.speculation.draft_model_tokens
    );
    assert!(
        cached >= turn1.prompt.len() + reply.len() - slack,
        "the draft restores turn 1 from the SSD: {cached} of {}",
        turn2.prompt.len()
    );
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// A preempted sequence's draft KV goes to the prompt cache's draft entries and comes
/// back when it resumes (the served model recomputes its history; the draft does not):
/// replies stay the plain ones.
#[test]
fn a_preempted_sequence_gets_its_drafts_cache_back() {
    let model = default_model();
    let requests = greedy_requests(&model);
    let alone = run_alone(&model, &requests);
    // The draft takes half of the budget: room for about two of the longest sequences.
    let blocks = 2 * blocks_for_two_longest(&model, &requests, 8);
    // Whether the pool runs out depends on the requests overlapping: on a loaded machine
    // the engine may finish the first before the last is submitted. A run that did not
    // preempt still checks the replies, and the next engine tries again.
    let mut attempts = 0;
    let (engine, stats) = loop {
        attempts += 1;
        let engine = engine_with(
            &model,
            DraftModel::new(&model, model.clone()).unwrap(),
            EngineConfig {
                prompt_cache_bytes: 64 << 20,
                ..batched(&model, Some(blocks))
            },
        );
        assert_replies(&engine, &requests, &alone, "preempted, drafts restored");
        let stats = engine.stats();
        if stats.preemptions > 0 || attempts == 3 {
            break (engine, stats);
        }
        assert!(engine.shutdown(Duration::from_secs(5)));
    };
    assert!(
        stats.preemptions > 0,
        "meant to preempt ({attempts} runs): {stats:?}"
    );
    eprintln!(
        "{} preemptions; the draft restored {} tokens, computed {}",
        stats.preemptions,
        stats.speculation.draft_model_cached_tokens,
        stats.speculation.draft_model_tokens
    );
    let shortest = requests.iter().map(|r| r.prompt.len()).min().unwrap();
    assert!(
        stats.speculation.draft_model_cached_tokens as usize >= shortest,
        "a resumed sequence restores its draft's KV: {:?} after {} preemptions",
        stats.speculation,
        stats.preemptions
    );
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert!(engine.shutdown(Duration::from_secs(5)));
}
