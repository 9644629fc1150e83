//! Middleware: a tracing span and metrics per request (route, status, error code), the
//! guard against web pages and hostile clients (`Host` check, cross-origin refusal or CORS,
//! JSON-only POSTs, an over-limit `Content-Length` refused before the body), `Connection:
//! close` on answers that leave a body unread, Bearer authentication, and panics turned
//! into 500 answers in OpenAI's shape.
use std::any::Any;
use std::net::IpAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD,
    AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HOST, ORIGIN, VARY,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use crate::config::ServerConfig;
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

/// Refuses what only a hostile web page or client sends, before any work:
///
/// - a `Host` that is not localhost, an IP address, the bind address or an
///   `--allowed-hosts` name (a DNS-rebinding page names its own domain): 403;
/// - a browser request from another origin (its `Origin` is not this server's and not a
///   `--cors-origin`): 403; a preflight from an allowed origin is answered here (204);
/// - a POST whose body is not declared `application/json` (a page's "simple" `text/plain`
///   POST needs no preflight): 415;
/// - a `Content-Length` over the body limit: 413 at once, without waiting for the body.
///
/// Answers from an allowed `--cors-origin` carry `Access-Control-Allow-Origin` for it.
pub async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let config = state.config();
    let headers = req.headers();
    if let Err(e) = check_host(headers, config) {
        return e.into_response();
    }
    let origin = headers.get(ORIGIN).cloned();
    let cors = match &origin {
        None => false,
        Some(origin) => match check_origin(origin, headers, config) {
            Ok(cors) => cors,
            Err(e) => return e.into_response(),
        },
    };
    if let (true, Some(origin)) = (cors, &origin) {
        if req.method() == Method::OPTIONS && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD) {
            return preflight(origin, headers);
        }
    }
    if let Err(e) = check_body(&req, config) {
        return e.into_response();
    }
    let mut response = next.run(req).await;
    if let (true, Some(origin)) = (cors, origin) {
        let headers = response.headers_mut();
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.append(VARY, HeaderValue::from_static("origin"));
    }
    response
}

/// The host part of a `Host` header value (`[::1]:8080` → `::1`, `Example.COM.:80` →
/// `example.com`).
fn host_name(value: &str) -> String {
    let value = value.trim();
    let host = match value.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => match value.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => value,
        },
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether a server configured with `allowed` answers to `Host: host` (the host part):
/// IP addresses (a rebinding page cannot make a browser send one for its own domain),
/// localhost and `*.localhost`, and the listed names; `*` allows any.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    host.parse::<IpAddr>().is_ok()
        || host == "localhost"
        || host.ends_with(".localhost")
        || allowed.iter().any(|a| a == "*" || host_name(a) == host)
}

fn check_host(headers: &HeaderMap, config: &ServerConfig) -> Result<(), ApiError> {
    // HTTP/1.0 clients may send none; every browser does.
    let Some(value) = headers.get(HOST) else {
        return Ok(());
    };
    let host = match value.to_str() {
        Ok(v) => host_name(v),
        Err(_) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
    };
    if host_allowed(&host, &config.allowed_hosts) {
        Ok(())
    } else {
        tracing::warn!(host = %host, "refused a request for a host not allowed (DNS rebinding?)");
        Err(ApiError::HostNotAllowed { host })
    }
}

/// `Ok(false)`: same origin; `Ok(true)`: a `--cors-origin`; else refused.
fn check_origin(
    origin: &HeaderValue,
    headers: &HeaderMap,
    config: &ServerConfig,
) -> Result<bool, ApiError> {
    let text = origin.to_str().unwrap_or("");
    if config.cors_origins.iter().any(|o| o == text) {
        return Ok(true);
    }
    let authority = text
        .strip_prefix("http://")
        .or_else(|| text.strip_prefix("https://"));
    let host = headers.get(HOST).and_then(|h| h.to_str().ok());
    if let (Some(authority), Some(host)) = (authority, host) {
        if authority.eq_ignore_ascii_case(host.trim()) {
            return Ok(false);
        }
    }
    tracing::warn!(origin = %text, "refused a cross-origin request");
    Err(ApiError::OriginNotAllowed {
        origin: String::from_utf8_lossy(origin.as_bytes()).into_owned(),
    })
}

/// The answer to a CORS preflight from an allowed origin.
fn preflight(origin: &HeaderValue, headers: &HeaderMap) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    let out = response.headers_mut();
    out.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    out.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    let asked = headers
        .get(ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    out.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked);
    out.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    out.insert(VARY, HeaderValue::from_static("origin"));
    response
}

/// Whether a `Content-Type` value is JSON (`application/json`, any parameters).
fn is_json(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

fn check_body(req: &Request, config: &ServerConfig) -> Result<(), ApiError> {
    let headers = req.headers();
    if req.method() == Method::POST {
        let content_type = headers.get(CONTENT_TYPE);
        let declared_json = content_type
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json);
        // A POST without a body (`POST /admin/cache/flush`) needs no type; a page can send
        // one, but only with an `Origin`, refused above.
        if !declared_json && (content_type.is_some() || !req.body().is_end_stream()) {
            return Err(ApiError::UnsupportedMediaType {
                content_type: content_type
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .unwrap_or_default(),
            });
        }
    }
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body_bytes as u64) {
        return Err(ApiError::PayloadTooLarge {
            limit: config.max_body_bytes,
        });
    }
    Ok(())
}

/// Bodies left unread by an answer (a 401, a 404 …) that are read to their end so the
/// connection stays usable, when they are at most this long …
const DRAIN_MAX_BYTES: u64 = 64 << 10;

/// … and arrive within this time.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Keeps a connection usable after an answer that did not read the request body: a short
/// rest is read and dropped; otherwise (larger, or slow) the answer says `Connection:
/// close`, so the client opens a new connection for its next request instead of finding
/// this one closed under it.
pub async fn close_if_body_unread(req: Request, next: Next) -> Response {
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let shared = Arc::new(Leftover::default());
    let req = req.map(|body| {
        Body::new(Tracked {
            inner: Some(body),
            shared: shared.clone(),
        })
    });
    let mut response = next.run(req).await;
    if shared.finished.load(Ordering::Acquire) {
        return response;
    }
    let rest = shared.body.lock().unwrap_or_else(|e| e.into_inner()).take();
    let drained = match rest {
        Some(rest) => drain(rest).await,
        // Still held somewhere (it should not be): the connection cannot be reused.
        None => false,
    };
    if !drained {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Reads `body` to its end when it is short and prompt; whether it got there.
async fn drain(body: Body) -> bool {
    if body.size_hint().upper().is_none_or(|n| n > DRAIN_MAX_BYTES) {
        return false;
    }
    let limited = http_body_util::Limited::new(body, DRAIN_MAX_BYTES as usize);
    matches!(
        tokio::time::timeout(DRAIN_TIMEOUT, http_body_util::BodyExt::collect(limited)).await,
        Ok(Ok(_))
    )
}

/// What a [`Tracked`] body leaves behind: whether it was read to its end, else the rest.
#[derive(Default)]
struct Leftover {
    finished: AtomicBool,
    body: std::sync::Mutex<Option<Body>>,
}

/// A request body that records when it has been read to its end, and hands back what is
/// left when it is dropped before.
struct Tracked {
    inner: Option<Body>,
    shared: Arc<Leftover>,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || inner.is_end_stream() {
            self.shared.finished.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.shared.finished.load(Ordering::Acquire) {
            return;
        }
        if let Some(rest) = self.inner.take() {
            *self.shared.body.lock().unwrap_or_else(|e| e.into_inner()) = Some(rest);
        }
    }
}

/// The state of a server `wick serve` runs (the generation server's [`AppState`], the
/// embedding server's), as the middleware and the fallback answers need it.
pub trait ServerState: Clone + Send + Sync + 'static {
    /// The configuration it serves with.
    fn server_config(&self) -> &ServerConfig;
}

impl ServerState for AppState {
    fn server_config(&self) -> &ServerConfig {
        self.config()
    }
}

/// With `--api-key`, refuses requests without `Authorization: Bearer <key>`.
pub async fn require_api_key<S: ServerState>(
    State(state): State<S>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    check_api_key(state.server_config(), req.headers())?;
    Ok(next.run(req).await)
}

/// With `--api-key`, whether `headers` carry the key (`Authorization: Bearer <key>` or
/// `x-api-key: <key>`); a 401 otherwise.
pub fn check_api_key(config: &ServerConfig, headers: &HeaderMap) -> Result<(), ApiError> {
    if let Some(key) = &config.api_key {
        let given = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(())
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
    fn host_names_drop_ports_and_brackets() {
        assert_eq!(host_name("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(host_name("[::1]:8080"), "::1");
        assert_eq!(host_name("[::1]"), "::1");
        assert_eq!(host_name("LocalHost"), "localhost");
        assert_eq!(host_name("example.com.:80"), "example.com");
        assert_eq!(host_name("evil.example"), "evil.example");
    }

    #[test]
    fn hosts_allowed_are_local_names_ip_addresses_and_the_list() {
        let none: Vec<String> = Vec::new();
        for host in [
            "localhost",
            "app.localhost",
            "127.0.0.1",
            "::1",
            "10.1.2.3",
            "0.0.0.0",
        ] {
            assert!(host_allowed(host, &none), "{host}");
        }
        for host in [
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!host_allowed(host, &none), "{host}");
        }
        let listed = vec!["gpu-box.lan".to_string()];
        assert!(host_allowed("gpu-box.lan", &listed));
        assert!(!host_allowed("evil.example", &listed));
        assert!(host_allowed("evil.example", &["*".to_string()]));
    }

    #[test]
    fn only_json_content_types_are_json() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
            "",
        ] {
            assert!(!is_json(t), "{t}");
        }
    }

    #[test]
    fn secrets_compare_exactly() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"", b"a"));
    }
}
