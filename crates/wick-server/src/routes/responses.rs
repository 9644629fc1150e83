//! `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the Responses request
//! converted for the chat path ([`crate::prepare::responses`]: continued from a stored
//! response with `previous_response_id`), started like a chat request, answered as a
//! `response` object or its event stream ([`crate::encoders::responses`]).
use std::time::Instant;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::encoders::responses::{failed_stream, whole, ResponseMeta, ResponsesEncoder};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::responses::ResponsesRequest;
use crate::openai::{response_id, unix_now};
use crate::prepare::chat::{start, LimitPolicy};
use crate::prepare::responses::{convert, ResponsesChat};
use crate::sse;
use crate::state::AppState;

/// The request fields a response object echoes.
fn echo(req: &ResponsesRequest) -> Map<String, Value> {
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(req.instructions));
    echo.insert("tools".into(), json!(req.tools.clone().unwrap_or_default()));
    echo.insert(
        "tool_choice".into(),
        req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
    );
    echo.insert(
        "parallel_tool_calls".into(),
        json!(req.parallel_tool_calls.unwrap_or(true)),
    );
    echo.insert("temperature".into(), json!(req.temperature));
    echo.insert("top_p".into(), json!(req.top_p));
    echo.insert("max_output_tokens".into(), json!(req.max_output_tokens));
    echo.insert(
        "previous_response_id".into(),
        json!(req.previous_response_id),
    );
    echo.insert("store".into(), json!(req.store.unwrap_or(true)));
    echo.insert(
        "text".into(),
        req.text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
    );
    echo.insert(
        "reasoning".into(),
        req.reasoning
            .clone()
            .unwrap_or_else(|| json!({"effort": null, "summary": null})),
    );
    echo.insert(
        "metadata".into(),
        req.metadata.clone().unwrap_or_else(|| json!({})),
    );
    echo
}

/// Handles a Responses request.
pub async fn create(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let ResponsesChat { chat, store } = convert(&state, &req)?;
    let streamed = req.stream.unwrap_or(false);
    let meta = ResponseMeta {
        id: response_id("resp_"),
        created_at: unix_now(),
        model: state.config().model_id.clone(),
        echo: echo(&req),
        tools: req.tools.clone().unwrap_or_default(),
        store,
    };
    let started = match start(&state, chat, arrived, LimitPolicy::Cap).await {
        Ok(started) => started,
        // A stream reports an over-long prompt in-band, as the Responses API does.
        Err(e @ (ApiError::ContextOverflow { .. } | ApiError::PromptTooLong { .. }))
            if streamed =>
        {
            let frames = failed_stream(&meta, &e);
            return Ok(sse::response(futures_util::stream::iter(frames)));
        }
        Err(e) => return Err(e),
    };
    if streamed {
        Ok(stream(
            started.reply,
            ResponsesEncoder::new(meta, state.clone()),
        ))
    } else {
        let collected = started.reply.collect().await?;
        Ok(Json(whole(&state, collected, meta)).into_response())
    }
}

/// `GET /v1/responses/{id}`.
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match state.responses().get(&id) {
        Some(stored) => Ok(Json(stored.response).into_response()),
        None => Err(ApiError::RouteNotFound {
            method: "GET".into(),
            path: format!("/v1/responses/{id} (no stored response with this id)"),
        }),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if state.responses().remove(&id) {
        Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
    } else {
        Err(ApiError::RouteNotFound {
            method: "DELETE".into(),
            path: format!("/v1/responses/{id} (no stored response with this id)"),
        })
    }
}
