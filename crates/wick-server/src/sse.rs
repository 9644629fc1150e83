//! Server-sent events: JSON frames, the `[DONE]` terminator, error frames, and a response
//! that turns a panic while streaming into an error frame instead of a torn connection.
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use serde::Serialize;

use crate::error::ApiError;

/// `data: <json>`.
pub fn json_event<T: Serialize>(value: &T) -> Event {
    match serde_json::to_string(value) {
        Ok(text) => Event::default().data(text),
        Err(e) => error_event(&ApiError::Internal(format!("cannot encode a chunk: {e}"))),
    }
}

/// `data: [DONE]`, the last frame of a successful stream.
pub fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// `data: {"error": {...}}`, the last frame of a failed stream.
pub fn error_event(error: &ApiError) -> Event {
    if error.status().is_server_error() {
        tracing::error!(code = error.code(), "stream failed: {error}");
    }
    Event::default().data(error.body().to_string())
}

/// A `text/event-stream` response of `events`; a panic while producing them becomes a final
/// error frame.
pub fn response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    let guarded = AssertUnwindSafe(events).catch_unwind().map(|item| {
        Ok::<_, Infallible>(match item {
            Ok(event) => event,
            Err(panic) => error_event(&ApiError::Internal(crate::middleware::panic_message(
                panic.as_ref(),
            ))),
        })
    });
    Sse::new(guarded).into_response()
}
