//! `POST /v1/chat/completions/render` and `POST /v1/completions/render`: the prompt a
//! request would run, as token ids, without running it (vLLM's render endpoints).
//!
//! vllm-router's `cache_aware` policy sends every request to every worker's render
//! endpoint and matches token prefixes instead of request text; a plain client can use it
//! to count or inspect a rendered prompt. Same validation and errors as the generating
//! endpoint, so a request that renders here is one the endpoint would accept.
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};
use wick_engine::sampler::SamplingParams;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::chat::ChatCompletionRequest;
use crate::openai::completions::CompletionRequest;
use crate::openai::response_id;
use crate::prepare::{self, max_tokens};
use crate::state::AppState;
use crate::validation::ValidGeneration;

/// Renders a chat request: `{request_id, token_ids, features, sampling_params, model}`.
pub async fn chat(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Json<Value>, ApiError> {
    let chat = prepare::chat::prepare(&state, req).await?;
    let ids = chat.prompt.ids;
    let limit = max_tokens(&state, chat.generation.max_tokens, ids.len(), "messages")?;
    Ok(Json(rendered(
        &state,
        "chatcmpl-",
        ids,
        &chat.generation,
        limit,
    )))
}

/// Renders a completion request: a list with one rendered prompt, as vLLM answers.
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Json<Value>, ApiError> {
    let prepared = prepare::completion::prepare(&state, req).await?;
    Ok(Json(Value::Array(vec![rendered(
        &state,
        "cmpl-",
        prepared.ids,
        &prepared.generation,
        prepared.max_tokens,
    )])))
}

fn rendered(
    state: &AppState,
    id_prefix: &str,
    ids: Vec<u32>,
    generation: &ValidGeneration,
    max_tokens: usize,
) -> Value {
    json!({
        "request_id": response_id(id_prefix),
        "model": state.config().model_id,
        "token_ids": ids,
        "features": null,
        "sampling_params": sampling_json(&generation.sampling, &generation.stop, max_tokens),
        "stream": generation.stream,
    })
}

fn sampling_json(p: &SamplingParams, stop: &[String], max_tokens: usize) -> Value {
    json!({
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": p.seed,
        "stop": stop,
        "max_tokens": max_tokens,
        "logprobs": p.logprobs,
    })
}
