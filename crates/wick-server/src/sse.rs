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

/// The client side: splits a response body, fed in whatever chunks the network delivers,
/// into the JSON payloads of its `data:` events (`[DONE]` and other lines left out). Bytes
/// are buffered until an event is complete, so a character split across chunks survives.
#[derive(Debug, Default)]
pub struct SseReader {
    buffer: Vec<u8>,
}

impl SseReader {
    /// Adds `chunk` and returns the payloads of the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(chunk);
        let mut payloads = Vec::new();
        while let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            // An `event: <name>` line (Anthropic, Responses) may come before the data.
            let data = event.lines().find_map(|line| line.strip_prefix("data: "));
            if let Some(payload) = data {
                if payload != "[DONE]" {
                    payloads.push(payload.to_string());
                }
            }
        }
        payloads
    }
}

#[cfg(test)]
mod reader_tests {
    use super::SseReader;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = "data: {\"t\":\"é\"}\n\n: keep-alive\n\ndata: {\"t\":2}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut r = SseReader::default();
            let mut got = r.push(&stream.as_bytes()[..cut]);
            got.extend(r.push(&stream.as_bytes()[cut..]));
            assert_eq!(got, ["{\"t\":\"é\"}", "{\"t\":2}"], "cut at {cut}");
        }
    }

    #[test]
    fn named_events_give_their_data() {
        let mut r = SseReader::default();
        let got = r.push(b"event: message_start\ndata: {\"a\":1}\n\nevent: ping\ndata: {}\n\n");
        assert_eq!(got, ["{\"a\":1}", "{}"]);
    }
}
