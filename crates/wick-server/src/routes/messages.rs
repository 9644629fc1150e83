//! `POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's request prepared on the
//! chat path ([`crate::prepare::chat::start_messages`]: converted into chat messages, the
//! same prompt, generation and parsing), answered as a `message` or its event stream
//! ([`crate::encoders::anthropic`]). Errors are rendered in Anthropic's shape by
//! [`crate::anthropic::error::anthropic_errors`].
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::anthropic::{MessagesRequest, Purpose};
use crate::encoders::anthropic::{whole, AnthropicEncoder, MessageMeta};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::response_id;
use crate::prepare::chat::{prepare_messages, start_messages};
use crate::state::AppState;

/// Handles a Messages request.
pub async fn messages(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let started = start_messages(&state, req, Instant::now()).await?;
    let meta = MessageMeta {
        id: response_id("msg_"),
        model: state.config().model_id.clone(),
        prompt_tokens: started.prompt_tokens,
    };
    if started.stream {
        Ok(stream(started.reply, AnthropicEncoder::new(meta)))
    } else {
        let collected = started.reply.collect().await?;
        Ok(Json(whole(collected, meta)).into_response())
    }
}

/// Handles `count_tokens`: the prompt `/v1/messages` would run, counted.
pub async fn count_tokens(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let chat = prepare_messages(&state, req, Purpose::Count).await?;
    Ok(Json(json!({"input_tokens": chat.prompt.ids.len()})).into_response())
}
