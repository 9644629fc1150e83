//! `POST /v1/chat/completions`: the request prepared and started ([`crate::prepare::chat`]),
//! answered whole or as a stream of `chat.completion.chunk` frames
//! ([`crate::encoders::chat`]).
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::encoders::chat::{whole, ChatEncoder, ChatMeta};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::chat::ChatCompletionRequest;
use crate::openai::{response_id, unix_now};
use crate::prepare::chat::{start, LimitPolicy};
use crate::state::AppState;

/// Handles a chat completion request.
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let started = start(&state, req, Instant::now(), LimitPolicy::Refuse).await?;
    let meta = ChatMeta {
        id: response_id("chatcmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    let logprobs = started.logprobs.is_some();
    if started.stream {
        let encoder = ChatEncoder::new(meta, state.clone(), logprobs, started.include_usage);
        Ok(stream(started.reply, encoder))
    } else {
        let collected = started.reply.collect().await?;
        let body = whole(collected, meta, state.model().tokenizer(), logprobs);
        Ok(Json(body).into_response())
    }
}
