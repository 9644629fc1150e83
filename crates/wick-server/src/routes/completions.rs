//! `POST /v1/completions`: raw text completion (no chat template), prepared and started by
//! [`crate::prepare::completion`], answered whole or streamed
//! ([`crate::encoders::completions`]), with `echo` and the legacy `logprobs` columns.
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::encoders::completions::{whole, CompletionEncoder, CompletionMeta};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::logprobs::LegacyColumns;
use crate::openai::completions::CompletionRequest;
use crate::openai::{response_id, unix_now};
use crate::prepare::completion::start;
use crate::state::AppState;

/// Handles a text completion request.
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let started = start(&state, req, Instant::now()).await?;
    let meta = CompletionMeta {
        id: response_id("cmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    let columns = started.logprobs.map(|_| LegacyColumns::new(0));
    let echo = started.echo;
    if started.stream {
        let encoder =
            CompletionEncoder::new(meta, state.clone(), echo, columns, started.include_usage);
        Ok(stream(started.reply, encoder))
    } else {
        let collected = started.reply.collect().await?;
        let body = whole(collected, &meta, &state, echo, columns);
        Ok(Json(body).into_response())
    }
}
