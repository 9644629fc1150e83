//! `POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's request converted into
//! the chat path's messages ([`crate::anthropic`]), the same prompt, generation and parsing,
//! answered as a `message` or its event stream ([`crate::encoders::anthropic`]). Errors are
//! rendered in Anthropic's shape by [`crate::anthropic::error::anthropic_errors`].
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::chat::{prepare_chat, start_chat, LimitPolicy, PreparedChat};
use crate::anthropic::{merge_system_turns, to_chat, MessagesRequest, Purpose};
use crate::encoders::anthropic::{whole, AnthropicEncoder, MessageMeta};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::chat::ChatCompletionRequest;
use crate::openai::response_id;
use crate::state::AppState;

/// Renders the converted request; a template that refuses a `system` turn after the first
/// message gets those turns merged into the system prompt instead.
async fn prepare(state: &AppState, chat: ChatCompletionRequest) -> Result<PreparedChat, ApiError> {
    let merged = merge_system_turns(&chat);
    match prepare_chat(state, chat).await {
        Err(ApiError::PromptBuild(reason)) => match merged {
            Some(merged) => {
                tracing::debug!(%reason, "template refused a late system turn: merged into the system prompt");
                prepare_chat(state, merged).await
            }
            None => Err(ApiError::PromptBuild(reason)),
        },
        other => other,
    }
}

/// Handles a Messages request.
pub async fn messages(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let chat = prepare(&state, to_chat(req, Purpose::Generate)?).await?;
    let stream_reply = chat.generation.stream;
    let meta = MessageMeta {
        id: response_id("msg_"),
        model: state.config().model_id.clone(),
        prompt_tokens: chat.prompt.ids.len(),
    };
    let reply = start_chat(&state, chat, arrived, LimitPolicy::Cap)?;
    if stream_reply {
        Ok(stream(reply, AnthropicEncoder::new(meta)))
    } else {
        let collected = reply.collect().await?;
        Ok(Json(whole(collected, meta)).into_response())
    }
}

/// Handles `count_tokens`: the prompt `/v1/messages` would run, counted.
pub async fn count_tokens(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let chat = prepare(&state, to_chat(req, Purpose::Count)?).await?;
    Ok(Json(json!({"input_tokens": chat.prompt.ids.len()})).into_response())
}
