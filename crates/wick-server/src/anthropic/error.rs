//! Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`, rendered from
//! the one [`ApiError`] (whose status mapping it reuses) for every `/v1/messages` path, the
//! extractor's, the middleware's and the handler's errors alike.
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::error::{ApiError, ErrorCode};

/// Anthropic's "overloaded" status: a full queue or a server shutting down.
pub const OVERLOADED: u16 = 529;

/// The status Anthropic clients expect for `error` (529 where OpenAI's would be 429/503).
pub fn status(error: &ApiError) -> StatusCode {
    match error {
        ApiError::QueueFull { .. } | ApiError::ShuttingDown => {
            StatusCode::from_u16(OVERLOADED).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
        }
        other => other.status(),
    }
}

/// Anthropic's error `type` of a status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        OVERLOADED => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The message; a prompt that fills the context says so in the words Claude Code's
/// compaction looks for.
pub fn message(error: &ApiError) -> String {
    match error {
        ApiError::ContextOverflow { prompt, limit, .. } if prompt >= limit => {
            format!("prompt is too long: {prompt} tokens > {limit} maximum")
        }
        ApiError::PromptTooLong { counted, limit, .. } => {
            format!("prompt is too long: {counted} tokens > {limit} maximum")
        }
        other => other.to_string(),
    }
}

/// The error body.
pub fn body(error: &ApiError) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(status(error)), "message": message(error)},
    })
}

/// Middleware: the error answers of Anthropic's paths (`/v1/messages…`) in Anthropic's shape,
/// whichever layer produced them.
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    let anthropic = is_anthropic_path(req.uri().path());
    let response = next.run(req).await;
    if !anthropic {
        return response;
    }
    match response.extensions().get::<ApiError>() {
        Some(error) => response_for(error.clone(), response),
        None => response,
    }
}

/// `error`'s answer in Anthropic's shape, with the headers (`Retry-After`, `Connection`, …)
/// and the metrics code of its OpenAI rendering `original`.
fn response_for(error: ApiError, mut original: Response) -> Response {
    let mut converted = (status(&error), axum::Json(body(&error))).into_response();
    for (name, value) in original.headers() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            converted.headers_mut().insert(name.clone(), value.clone());
        }
    }
    if let Some(code) = original.extensions_mut().remove::<ErrorCode>() {
        converted.extensions_mut().insert(code);
    }
    converted
}

/// Whether `path` is one of Anthropic's endpoints.
pub fn is_anthropic_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_types_follow_anthropic() {
        let cases = [
            (
                ApiError::field("max_tokens", "x"),
                400,
                "invalid_request_error",
            ),
            (ApiError::Unauthorized, 401, "authentication_error"),
            (
                ApiError::RouteNotFound {
                    method: "GET".into(),
                    path: "/v1/messages/x".into(),
                },
                404,
                "not_found_error",
            ),
            (
                ApiError::PayloadTooLarge { limit: 1 },
                413,
                "request_too_large",
            ),
            (ApiError::QueueFull { limit: 1 }, 529, "overloaded_error"),
            (ApiError::Internal("x".into()), 500, "api_error"),
        ];
        for (error, code, kind) in cases {
            let body = body(&error);
            assert_eq!(status(&error).as_u16(), code, "{error:?}");
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], kind, "{error:?}");
            assert!(body["error"]["message"].is_string());
        }
    }

    #[test]
    fn a_full_context_says_prompt_is_too_long() {
        let error = ApiError::ContextOverflow {
            param: "messages",
            prompt: 40000,
            max_tokens: 1,
            needed: 40001,
            limit: 32768,
        };
        assert_eq!(
            message(&error),
            "prompt is too long: 40000 tokens > 32768 maximum"
        );
    }
}
