//! `POST /v1/completions`: raw text completion (no chat template), whole or streamed
//! ([`crate::encoders::completions`]), with `echo` and the legacy `logprobs` columns.
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use wick_engine::GenerationRequest;

use crate::encoders::completions::{whole, CompletionEncoder, CompletionMeta, Echo};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::logprobs::LegacyColumns;
use crate::openai::completions::CompletionRequest;
use crate::openai::{response_id, unix_now};
use crate::prompt;
use crate::reply::{Reply, ReplyOptions};
use crate::state::AppState;
use crate::validation::completion::{validate, PromptInput};

/// Handles a text completion request.
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let valid = validate(req, &state)?;
    let (ids, prompt_text) = match valid.prompt {
        PromptInput::Text(text) => {
            let ids = prompt::tokenize(&state, text.clone()).await?;
            (ids, text)
        }
        PromptInput::Tokens(ids) => {
            check_token_ids(&state, &ids)?;
            let text = if valid.echo {
                prompt::detokenize(&state, ids.clone()).await?
            } else {
                String::new()
            };
            (ids, text)
        }
    };
    let gen = valid.generation;
    let context = state.model().info().context_length;
    let kv_limit = state.engine().max_sequence_tokens();
    let max_tokens = gen
        .max_tokens
        .resolve_within(ids.len(), context, kv_limit, "prompt")?;
    let echo = valid.echo.then(|| Echo {
        text: prompt_text,
        ids: ids.clone(),
    });
    let columns = valid.logprobs.map(|_| LegacyColumns::new(0));
    let mut request = GenerationRequest::new(ids)
        .max_tokens(max_tokens)
        .sampling(gen.sampling)
        .stop(gen.stop)
        .adapters(gen.adapters);
    request.ignore_eos = gen.ignore_eos;
    request.speculative = gen.speculative;
    if echo.is_some() {
        // The echoed prompt's tokens get their log-probabilities too (the engine scores
        // the whole prompt, bypassing the prompt cache for this request).
        request.prompt_logprobs = valid.logprobs;
    }
    let reply = Reply::start(&state, request, ReplyOptions::plain(), arrived)?;
    let meta = CompletionMeta {
        id: response_id("cmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    if gen.stream {
        let encoder = CompletionEncoder::new(meta, state.clone(), echo, columns, gen.include_usage);
        Ok(stream(reply, encoder))
    } else {
        let collected = reply.collect().await?;
        let body = whole(collected, &meta, &state, echo, columns);
        Ok(Json(body).into_response())
    }
}

/// A token-id prompt's ids must be in the model's vocabulary (`prompt[i]` names the first
/// that is not).
pub fn check_token_ids(state: &AppState, ids: &[u32]) -> Result<(), ApiError> {
    let vocab = state.model().vocab_size();
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(i) => Err(ApiError::field(
            format!("prompt[{i}]"),
            format!("token id {} is outside the vocabulary ({vocab})", ids[i]),
        )),
        None => Ok(()),
    }
}
