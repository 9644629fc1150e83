//! Middleware: a tracing span and metrics per request (route, status, error code), Bearer
//! authentication, and panics turned into 500 answers in OpenAI's shape.
use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use crate::error::{ApiError, ErrorCode};
use crate::state::AppState;

/// Numbers requests for the logs.
static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

/// Runs the request in a span named after its route, then counts the answer by route,
/// method and status (and error code).
pub async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let id = NEXT_REQUEST.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!("request", id, method = %method, route = %route);
    let started = Instant::now();
    let response = next.run(req).instrument(span.clone()).await;
    let status = response.status();
    let metrics = state.metrics();
    metrics.record_request(&route, method.as_str(), status.as_u16());
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>() {
        metrics.record_error(code);
    }
    span.in_scope(|| {
        tracing::info!(
            status = status.as_u16(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "answered"
        )
    });
    response
}

/// With `--api-key`, refuses requests without `Authorization: Bearer <key>`.
pub async fn require_api_key(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &state.config().api_key {
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(req).await)
}

/// Compares secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Turns a panic in a handler into a 500 answer; the server keeps running.
pub async fn catch_panic(req: Request, next: Next) -> Response {
    match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => ApiError::Internal(panic_message(panic.as_ref())).into_response(),
    }
}

/// The message of a caught panic.
pub fn panic_message(panic: &(dyn Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("a handler panicked: {text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_exactly() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"", b"a"));
    }
}
