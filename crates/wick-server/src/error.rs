//! The server's errors: [`ApiError`] for requests, mapped to an HTTP status and OpenAI's error
//! body in one place ([`IntoResponse`]), and [`StartupError`] for `serve` itself.
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use wick_engine::constraint::ConstraintError;
use wick_engine::sampler::SamplingError;
use wick_engine::scheduler::SubmitError;
use wick_engine::EngineError;

/// Seconds a client is told to wait after a full queue (`Retry-After`).
pub const RETRY_AFTER_SECS: u32 = 1;

/// Why a request was refused or failed. Every variant has a status, an OpenAI `type`, a
/// stable `code` and, where one field is to blame, a `param`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON.
    #[error("invalid JSON body: {0}")]
    InvalidJson(String),
    /// A field has the wrong type or an out-of-range value.
    #[error("{param}: {message}")]
    InvalidField {
        /// The field's path, e.g. `messages[1].role`.
        param: String,
        /// What is wrong, e.g. `must be at least 1, got 0`.
        message: String,
    },
    /// A required field is missing or empty.
    #[error("{param} is required and must not be empty")]
    Missing {
        /// The field.
        param: String,
    },
    /// A field asks for something wick does not do (yet).
    #[error("{param}: {message}")]
    Unsupported {
        /// The field.
        param: String,
        /// What is not supported and what to do instead.
        message: String,
    },
    /// The prompt plus the tokens to generate do not fit the context.
    #[error(
        "this request needs {needed} tokens of context (prompt {prompt} + max_tokens {max_tokens}) \
         but the model's context is {limit} tokens; shorten the prompt or lower max_tokens"
    )]
    ContextOverflow {
        /// The field holding the prompt (`messages` or `prompt`).
        param: &'static str,
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// `prompt + max_tokens`.
        needed: usize,
        /// The context limit.
        limit: usize,
    },
    /// The prompt alone is longer than the context: found while tokenizing it piece by
    /// piece, which stopped there (a prompt far past the context is not tokenized whole).
    #[error(
        "the prompt is longer than the model's context of {limit} tokens (tokenizing stopped \
         after {counted} tokens); shorten the prompt"
    )]
    PromptTooLong {
        /// The field holding the prompt (`messages` or `prompt`).
        param: &'static str,
        /// Tokens counted before tokenizing stopped (more than `limit`).
        counted: usize,
        /// The context limit.
        limit: usize,
    },
    /// The prompt plus the tokens to generate could never fit the KV memory budget, even
    /// with nothing else running (the engine's message says how much it holds).
    #[error("{message}")]
    KvCapacityExceeded {
        /// The field to lower or shorten (`max_tokens`).
        param: &'static str,
        /// What was asked, what fits and what to do.
        message: String,
    },
    /// A grammar (structured output, a forced or strict tool call) that compiles but cannot
    /// be followed: one of llguidance's limits was hit, or no token can continue it. Found
    /// on its first step at validation (`param` names the field), or while generating.
    #[error("the grammar cannot be followed: {reason}")]
    GrammarFailed {
        /// The field holding the grammar, when known.
        param: Option<String>,
        /// What happened, naming the limit.
        reason: String,
    },
    /// The chat template or the tokenizer rejected the conversation.
    #[error("prompt build failed: {0}")]
    PromptBuild(String),
    /// `--api-key` is set and the request did not carry it.
    #[error(
        "invalid or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    )]
    Unauthorized,
    /// The `Host` header names a host this server does not answer to (DNS-rebinding
    /// protection; `--allowed-hosts` adds names).
    #[error("Host '{host}' is not allowed: wick answers to localhost, IP addresses, the --host name and --allowed-hosts (add it with --allowed-hosts {host})")]
    HostNotAllowed {
        /// The host asked for (without the port).
        host: String,
    },
    /// A browser sent the request from another origin (`--cors-origin` allows one).
    #[error("cross-origin request from '{origin}' refused: start wick with --cors-origin {origin} to allow that page")]
    OriginNotAllowed {
        /// The `Origin` header.
        origin: String,
    },
    /// A POST body that is not declared as JSON.
    #[error("Content-Type must be application/json, got '{content_type}'")]
    UnsupportedMediaType {
        /// The `Content-Type` header (empty when absent).
        content_type: String,
    },
    /// The request body arrived too slowly.
    #[error("the request body arrived too slowly ({received} bytes in {seconds:.1} s; at least {min_rate} bytes/s after the first {grace_s:.0} s)")]
    BodyTimeout {
        /// Bytes received before giving up.
        received: usize,
        /// Seconds spent waiting.
        seconds: f64,
        /// The minimum rate (`--min-body-rate`).
        min_rate: u64,
        /// The grace period (`--body-timeout`).
        grace_s: f64,
    },
    /// No route for this path.
    #[error("no route for {method} {path}")]
    RouteNotFound {
        /// The method.
        method: String,
        /// The path.
        path: String,
    },
    /// No adapter with this id is mounted (`DELETE /v1/adapters/{id}`).
    #[error("adapter {id} not mounted")]
    AdapterNotFound {
        /// The id asked for.
        id: String,
    },
    /// No job with this id (`/api/jobs/{id}`).
    #[error("job {id} not found")]
    JobNotFound {
        /// The id asked for.
        id: String,
    },
    /// Training jobs cannot run on this server (the reason says why).
    #[error("training jobs are unavailable: {0}")]
    JobsUnavailable(String),
    /// No model with this id is served.
    #[error("model '{id}' not found (served: {served})")]
    ModelNotFound {
        /// The id asked for.
        id: String,
        /// The served model's id.
        served: String,
    },
    /// The route exists, but not with this method.
    #[error("method {method} is not allowed for {path}")]
    MethodNotAllowed {
        /// The method.
        method: String,
        /// The path.
        path: String,
    },
    /// The body is larger than the server accepts.
    #[error("request body too large (limit {limit} bytes)")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// Too many requests are waiting.
    #[error("{}", queue_full_message(*limit))]
    QueueFull {
        /// The queue limit.
        limit: usize,
    },
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Generation failed inside the engine.
    #[error("generation failed: {0}")]
    Generation(String),
    /// A bug: a panic or an impossible state.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The message of a 429: with `--max-queue 0` no request waits at all, so it is every batch
/// slot being taken that refuses it, not a queue of zero.
fn queue_full_message(limit: usize) -> String {
    match limit {
        0 => "the server is busy: every batch slot is taken and no request may wait \
              (--max-queue 0); retry later"
            .to_string(),
        1 => "the server is busy: 1 request is already waiting; retry later".to_string(),
        n => format!("the server is busy: {n} requests are already waiting; retry later"),
    }
}

impl ApiError {
    /// A field with a bad value.
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidField {
            param: param.into(),
            message: message.into(),
        }
    }

    /// A field asking for something unsupported.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Unsupported {
            param: param.into(),
            message: message.into(),
        }
    }

    /// A grammar that llguidance could not follow (`message` is its error), on `param`
    /// when known: the reason names the limit that was hit.
    pub fn grammar_failed(param: Option<String>, message: &str) -> Self {
        ApiError::GrammarFailed {
            param,
            reason: grammar_reason(message),
        }
    }

    /// The error of a generation the engine failed with `message`: a grammar that could
    /// not be followed is the request's ([`ApiError::GrammarFailed`]), anything else the
    /// server's ([`ApiError::Generation`]).
    pub fn from_generation_failure(message: String) -> Self {
        match message.split_once(ConstraintError::FAILED_PREFIX) {
            Some((_, grammar)) => ApiError::grammar_failed(None, grammar),
            None => ApiError::Generation(message),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_)
            | ApiError::InvalidField { .. }
            | ApiError::Missing { .. }
            | ApiError::Unsupported { .. }
            | ApiError::ContextOverflow { .. }
            | ApiError::PromptTooLong { .. }
            | ApiError::GrammarFailed { .. }
            | ApiError::KvCapacityExceeded { .. }
            | ApiError::PromptBuild(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::HostNotAllowed { .. } | ApiError::OriginNotAllowed { .. } => {
                StatusCode::FORBIDDEN
            }
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::RouteNotFound { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::AdapterNotFound { .. }
            | ApiError::JobNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::ShuttingDown | ApiError::JobsUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Generation(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's error `type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "authentication_error",
            ApiError::HostNotAllowed { .. } | ApiError::OriginNotAllowed { .. } => {
                "permission_error"
            }
            ApiError::RouteNotFound { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::AdapterNotFound { .. }
            | ApiError::JobNotFound { .. } => "not_found_error",
            ApiError::QueueFull { .. } => "rate_limit_error",
            ApiError::ShuttingDown | ApiError::JobsUnavailable(_) => "service_unavailable_error",
            ApiError::Generation(_) | ApiError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// A stable machine name of the variant (`code` in the body, a label in `/metrics`).
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidField { .. } => "invalid_value",
            ApiError::Missing { .. } => "missing_required_parameter",
            ApiError::Unsupported { .. } => "unsupported_parameter",
            ApiError::ContextOverflow { .. } | ApiError::PromptTooLong { .. } => {
                "context_length_exceeded"
            }
            ApiError::KvCapacityExceeded { .. } => "kv_capacity_exceeded",
            ApiError::GrammarFailed { .. } => "grammar_failed",
            ApiError::PromptBuild(_) => "prompt_build_failed",
            ApiError::Unauthorized => "invalid_api_key",
            ApiError::HostNotAllowed { .. } => "host_not_allowed",
            ApiError::OriginNotAllowed { .. } => "origin_not_allowed",
            ApiError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ApiError::BodyTimeout { .. } => "body_timeout",
            ApiError::RouteNotFound { .. } => "route_not_found",
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::AdapterNotFound { .. } => "adapter_not_found",
            ApiError::JobNotFound { .. } => "job_not_found",
            ApiError::JobsUnavailable(_) => "jobs_unavailable",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Generation(_) => "generation_failed",
            ApiError::Internal(_) => "internal_error",
        }
    }

    /// The request field to blame, if one is.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidField { param, .. }
            | ApiError::Missing { param }
            | ApiError::Unsupported { param, .. } => Some(param),
            ApiError::ContextOverflow { param, .. } | ApiError::PromptTooLong { param, .. } => {
                Some(param)
            }
            ApiError::KvCapacityExceeded { param, .. } => Some(param),
            ApiError::GrammarFailed { param, .. } => param.as_deref(),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.code(),
        }})
    }
}

/// What an llguidance error `message` means for the client, naming the limit it hit (the
/// limits are llguidance's defaults, `ParserLimits`), with llguidance's first line.
fn grammar_reason(message: &str) -> String {
    let first = message.lines().next().unwrap_or(message).trim();
    let why = if first.contains("too many states") {
        "its lexer needs more states than llguidance allows (max_lexer_states); a regular \
         expression with a counted repetition after a wildcard, such as `.*a.{20}`, grows \
         exponentially"
    } else if first.contains("too many expressions") || first.contains("fuel") {
        "its lexer needs more work per token than llguidance allows (lexer fuel); simplify \
         the regular expressions"
    } else if first.contains("Current row has") {
        "it is too ambiguous: one step has more parser items than llguidance allows \
         (max_items_in_row); merge alternatives that start alike, or make right-recursive \
         rules left-recursive"
    } else if first.contains("Too many items") {
        "one token mask needs more parser items than llguidance allows (step_max_items); \
         merge alternatives that start alike or avoid many short optional pieces"
    } else if first.contains("NoExtensionBias") || first.contains("allows no token") {
        "no token of the model's vocabulary can continue it here (a schema or pattern \
         that cannot be completed)"
    } else if first.contains("no allowed token has a finite logit") {
        "every token it allows next is excluded (logit_bias)"
    } else {
        return first.to_string();
    };
    format!("{why} (llguidance: {first})")
}

/// Marks an error response so the metrics layer can count it by code.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(code = self.code(), "{self}");
        } else {
            tracing::debug!(code = self.code(), "client error: {self}");
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        // Other protocols' layers re-render the error in their own shape.
        response.extensions_mut().insert(self.clone());
        let headers = response.headers_mut();
        match self {
            ApiError::QueueFull { .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            ApiError::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response.extensions_mut().insert(ErrorCode(self.code()));
        response
    }
}

impl From<SamplingError> for ApiError {
    fn from(e: SamplingError) -> Self {
        let param = match &e {
            SamplingError::OutOfRange { field, .. } => field,
            SamplingError::TooManyTopLogprobs { .. } => "top_logprobs",
            SamplingError::LogitBiasNotFinite { .. }
            | SamplingError::LogitBiasTokenOutOfVocab { .. } => "logit_bias",
        };
        // The sampler's messages start with the field name, which `param` already gives.
        let message = e.to_string();
        let message = message
            .strip_prefix(param)
            .map(str::trim_start)
            .unwrap_or(&message)
            .to_string();
        ApiError::field(param.to_string(), message)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Sampling(s) => s.into(),
            EngineError::ContextOverflow { needed, limit } => ApiError::InvalidField {
                param: "max_tokens".into(),
                message: format!(
                    "the request needs {needed} tokens of context but the model allows {limit}"
                ),
            },
            EngineError::KvCapacity { .. } => ApiError::KvCapacityExceeded {
                param: "max_tokens",
                message: e.to_string(),
            },
            EngineError::InvalidInput(m) => ApiError::field("prompt", m),
            EngineError::Adapter(a) => ApiError::field("adapter", a.to_string()),
            EngineError::Tokenizer(t) => ApiError::PromptBuild(t.to_string()),
            EngineError::Template(t) => ApiError::PromptBuild(t.to_string()),
            EngineError::NoChatTemplate(_) => ApiError::PromptBuild(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => e.into(),
            SubmitError::QueueFull { limit } => ApiError::QueueFull { limit },
            SubmitError::ShuttingDown => ApiError::ShuttingDown,
        }
    }
}

/// Why `wick serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The address is taken or not ours to bind.
    // The OS error is part of the message, not a `source`: error reports that print the
    // chain would show it twice.
    #[error("cannot listen on {addr}: {reason}{hint}")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        reason: std::io::Error,
        /// Advice for the common case.
        hint: &'static str,
    },
    /// The `--chat-template` file could not be read or compiled.
    #[error("chat template {source_name}: {reason}")]
    ChatTemplate {
        /// The file.
        source_name: String,
        /// What is wrong.
        reason: String,
    },
    /// The engine did not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The server loop failed.
    #[error("server error: {0}")]
    Serve(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_error_is_4xx_and_has_the_openai_shape() {
        let errors = [
            ApiError::InvalidJson("x".into()),
            ApiError::field("temperature", "must be >= 0"),
            ApiError::Missing {
                param: "messages".into(),
            },
            ApiError::unsupported("n", "only 1"),
            ApiError::ContextOverflow {
                param: "messages",
                prompt: 10,
                max_tokens: 5,
                needed: 15,
                limit: 12,
            },
            ApiError::PromptBuild("bad".into()),
            ApiError::Unauthorized,
            ApiError::RouteNotFound {
                method: "GET".into(),
                path: "/x".into(),
            },
            ApiError::ModelNotFound {
                id: "a".into(),
                served: "b".into(),
            },
            ApiError::MethodNotAllowed {
                method: "GET".into(),
                path: "/v1/chat/completions".into(),
            },
            ApiError::PayloadTooLarge { limit: 1 },
            ApiError::QueueFull { limit: 1 },
            ApiError::HostNotAllowed {
                host: "evil.example".into(),
            },
            ApiError::OriginNotAllowed {
                origin: "http://evil.example".into(),
            },
            ApiError::UnsupportedMediaType {
                content_type: "text/plain".into(),
            },
            ApiError::BodyTimeout {
                received: 1,
                seconds: 10.0,
                min_rate: 1024,
                grace_s: 10.0,
            },
        ];
        for e in errors {
            assert!(e.status().is_client_error(), "{e:?}");
            let body = e.body();
            let err = &body["error"];
            assert!(err["message"].is_string());
            assert!(err["type"].is_string());
            assert!(err["code"].is_string());
            assert!(err.get("param").is_some());
        }
        assert!(ApiError::Internal("x".into()).status().is_server_error());
    }

    #[test]
    fn queue_full_with_no_queue_says_the_batch_is_full() {
        let none = ApiError::QueueFull { limit: 0 }.to_string();
        assert!(!none.contains("0 requests"), "{none}");
        assert!(none.contains("every batch slot is taken"), "{none}");
        assert!(ApiError::QueueFull { limit: 1 }
            .to_string()
            .contains("1 request is already waiting"));
        assert!(ApiError::QueueFull { limit: 8 }
            .to_string()
            .contains("8 requests are already waiting"));
    }

    #[test]
    fn queue_full_says_when_to_retry() {
        let response = ApiError::QueueFull { limit: 4 }.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn sampling_errors_name_their_field() {
        let e: ApiError = SamplingError::OutOfRange {
            field: "top_p",
            bound: "in (0, 1]",
            value: 2.0,
        }
        .into();
        assert_eq!(e.param(), Some("top_p"));
        assert_eq!(e.to_string(), "top_p: must be in (0, 1], got 2");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }
}
