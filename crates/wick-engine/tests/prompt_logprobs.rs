//! Scoring a prompt (`GenerationRequest::prompt_logprobs`, what `echo` + `logprobs` of the
//! completions API needs): the score of each prompt token equals the log-probability the
//! model reported when it generated that token, alone and through the engine loop, in
//! chunks and with the prefix in the prompt cache.
use std::ops::ControlFlow;

use wick_engine::sampler::SamplingParams;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent};
use wick_engine::{GenerationRequest, Model, PromptLogprob, TokenEvent};

#[path = "common/serving.rs"]
mod serving;
use serving::default_model;

const TOP: usize = 3;

/// Greedy generation of `n` tokens after `prompt`, with their log-probabilities.
fn generated(model: &Model, prompt: &[u32], n: usize) -> Vec<TokenEvent> {
    let sampling = SamplingParams {
        logprobs: Some(TOP),
        ..SamplingParams::default()
    };
    let request = GenerationRequest::new(prompt.to_vec())
        .max_tokens(n)
        .sampling(sampling);
    let mut events = Vec::new();
    model
        .generate(&request, |t| {
            events.push(t.clone());
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(events.len(), n, "the model stopped early");
    events
}

fn scoring(prompt: Vec<u32>, max_tokens: usize, chunk: usize) -> GenerationRequest {
    let mut request = GenerationRequest::new(prompt).max_tokens(max_tokens);
    request.prompt_logprobs = Some(TOP);
    request.prefill_chunk = chunk;
    request
}

/// The scores of the generated part of `full` equal what generating it reported.
fn assert_scores_match(scores: &[PromptLogprob], prompt: usize, events: &[TokenEvent]) {
    assert_eq!(scores.len(), prompt + events.len() - 1);
    for (i, e) in events.iter().enumerate() {
        let s = &scores[prompt - 1 + i];
        assert!(
            (s.logprob - e.logprob).abs() <= 1e-4,
            "token {i}: scored {} but generated with {}",
            s.logprob,
            e.logprob
        );
        let ids: Vec<u32> = s.top_logprobs.iter().map(|t| t.0).collect();
        let want: Vec<u32> = e.top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, want, "token {i}: alternatives differ");
        for (a, b) in s.top_logprobs.iter().zip(&e.top_logprobs) {
            assert!((a.1 - b.1).abs() <= 1e-4, "token {i}: {a:?} vs {b:?}");
        }
    }
    assert!(scores
        .iter()
        .all(|s| s.logprob <= 0.0 && s.logprob.is_finite()));
}

#[test]
fn prompt_scores_equal_generation_logprobs() {
    let model = default_model();
    let prompt = model.tokenize("The capital of France is").unwrap();
    let events = generated(&model, &prompt, 10);
    let mut full = prompt.clone();
    full.extend(events.iter().map(|e| e.id));

    // Alone, in chunks of 4 (several chunks, the last one short), nothing generated.
    let mut first = Vec::new();
    let out = model
        .generate(&scoring(full.clone(), 0, 4), |t| {
            first.push(t.clone());
            ControlFlow::Continue(())
        })
        .unwrap();
    assert!(first.is_empty(), "max_tokens 0 generated a token");
    assert_eq!(out.usage.prompt_tokens, full.len());
    assert_scores_match(&out.prompt_logprobs, prompt.len(), &events);

    // One token: the first token event carries the scores, and it is the greedy token.
    let mut first = Vec::new();
    let out = model
        .generate(&scoring(prompt.clone(), 1, 512), |t| {
            first.push(t.clone());
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].id, events[0].id);
    assert_eq!(first[0].prompt_logprobs, out.prompt_logprobs);
    assert_eq!(out.prompt_logprobs.len(), prompt.len() - 1);

    // A one-token prompt has nothing to score; with max_tokens 0 nothing is generated.
    let out = model
        .generate(&scoring(prompt[..1].to_vec(), 0, 512), |_| {
            panic!("max_tokens 0 generated a token")
        })
        .unwrap();
    assert!(out.prompt_logprobs.is_empty() && out.tokens.is_empty());
}

fn engine_scores(
    engine: &wick_engine::scheduler::EngineHandle,
    request: GenerationRequest,
) -> (Vec<PromptLogprob>, usize, usize) {
    let mut handle = engine.submit(request).unwrap();
    let mut scores = Vec::new();
    let mut tokens = 0;
    while let Some(event) = handle.blocking_next() {
        match event {
            EngineEvent::Token(t) => {
                if tokens == 0 {
                    scores = t.prompt_logprobs;
                } else {
                    assert!(t.prompt_logprobs.is_empty(), "scores sent twice");
                }
                tokens += 1;
            }
            EngineEvent::Done(done) => {
                if tokens == 0 {
                    scores = done.prompt_logprobs;
                } else {
                    assert!(done.prompt_logprobs.is_empty(), "scores sent twice");
                }
                return (scores, tokens, done.usage.cached_tokens);
            }
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("channel closed without Done");
}

#[test]
fn the_engine_scores_prompts_past_the_prompt_cache() {
    let model = default_model();
    let prompt = model
        .tokenize("Water boils at one hundred degrees, and ice melts at")
        .unwrap();
    let events = generated(&model, &prompt, 8);
    let mut full = prompt.clone();
    full.extend(events.iter().map(|e| e.id));
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            // Prompt chunks of at most 5 tokens.
            step_token_budget: 5,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    // Puts the prompt in the prompt cache; a plain request then reuses it.
    let plain = GenerationRequest::new(prompt.clone()).max_tokens(2);
    engine_scores(&engine, plain.clone());
    let (_, _, cached) = engine_scores(&engine, plain);
    assert!(cached > 0, "the prompt cache did not serve the prefix");
    // A scored request computes every position anyway.
    let (scores, tokens, cached) = engine_scores(&engine, scoring(full.clone(), 0, 512));
    assert_eq!((tokens, cached), (0, 0));
    assert_scores_match(&scores, prompt.len(), &events);
    let (scores, tokens, _) = engine_scores(&engine, scoring(full, 2, 512));
    assert_eq!(tokens, 2);
    assert_scores_match(&scores, prompt.len(), &events);
    engine.shutdown(std::time::Duration::from_secs(10));
}
