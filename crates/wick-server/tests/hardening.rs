//! Hostile clients and web pages: `Host` checks (DNS rebinding), cross-origin refusal and
//! CORS, JSON-only POSTs, early 413, `Connection: close` after an unread body, and — over a
//! real loopback socket — the header timeout and the connection cap.
mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;
use support::*;
use wick_engine::scheduler::EngineConfig;

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::from(body.to_string())).unwrap()
}

fn chat() -> String {
    json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0})
        .to_string()
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test]
async fn hosts_other_than_local_names_and_ip_addresses_are_403() {
    let st = state();
    let r = router(&st);
    for host in [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example",
    ] {
        send(&r, request("GET", "/stats", &[("host", host)], ""))
            .await
            .assert_error(StatusCode::FORBIDDEN, "host_not_allowed");
    }
    send(
        &r,
        request(
            "POST",
            "/v1/chat/completions",
            &[("host", "evil.example"), JSON],
            &chat(),
        ),
    )
    .await
    .assert_error(StatusCode::FORBIDDEN, "host_not_allowed");
    for host in [
        "localhost:8080",
        "127.0.0.1:8080",
        "[::1]:8080",
        "LOCALHOST",
        "192.168.1.20",
    ] {
        let a = send(&r, request("GET", "/stats", &[("host", host)], "")).await;
        assert_eq!(a.status, StatusCode::OK, "{host}: {}", a.text());
    }
    // Listed names, and `*`.
    let st = state_with(EngineConfig::default(), |c| {
        c.allowed_hosts = vec!["gpu-box.lan".into()]
    });
    let r = router(&st);
    let a = send(
        &r,
        request("GET", "/stats", &[("host", "gpu-box.lan:8080")], ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    send(
        &r,
        request("GET", "/stats", &[("host", "evil.example")], ""),
    )
    .await
    .assert_error(StatusCode::FORBIDDEN, "host_not_allowed");
    let st = state_with(EngineConfig::default(), |c| {
        c.allowed_hosts = vec!["*".into()]
    });
    let a = send(
        &router(&st),
        request("GET", "/stats", &[("host", "evil.example")], ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
}

#[tokio::test]
async fn posts_must_be_json() {
    let st = state();
    let r = router(&st);
    for headers in [
        vec![("content-type", "text/plain")],
        vec![("content-type", "application/x-www-form-urlencoded")],
        vec![("content-type", "multipart/form-data; boundary=x")],
        vec![],
    ] {
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/admin/cache/flush",
        ] {
            let a = send(&r, request("POST", path, &headers, &chat())).await;
            a.assert_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type");
        }
    }
    assert_eq!(
        st.engine().stats().prompt_tokens_total,
        0,
        "a refused POST ran"
    );
    // Declared JSON goes through (a bad body is then the parser's 400).
    send(&r, request("POST", "/v1/chat/completions", &[JSON], "{"))
        .await
        .assert_error(StatusCode::BAD_REQUEST, "invalid_json");
    let a = send(
        &r,
        request(
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json; charset=utf-8")],
            &chat(),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    // A POST without a body needs no type.
    let a = send(&r, request("POST", "/admin/cache/flush", &[], "")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}

#[tokio::test]
async fn cross_origin_requests_are_refused_and_send_no_cors_headers() {
    let st = state();
    let r = router(&st);
    let page = ("origin", "http://127.0.0.2:8000");
    let host = ("host", "127.0.0.1:8080");
    let a = send(
        &r,
        request("POST", "/v1/chat/completions", &[page, host, JSON], &chat()),
    )
    .await;
    a.assert_error(StatusCode::FORBIDDEN, "origin_not_allowed");
    assert!(a.headers.get("access-control-allow-origin").is_none());
    let a = send(&r, request("POST", "/admin/cache/flush", &[page, host], "")).await;
    a.assert_error(StatusCode::FORBIDDEN, "origin_not_allowed");
    let preflight = request(
        "OPTIONS",
        "/v1/chat/completions",
        &[page, host, ("access-control-request-method", "POST")],
        "",
    );
    let a = send(&r, preflight).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert!(a.headers.get("access-control-allow-origin").is_none());
    // The server's own origin is not cross-origin.
    let own = ("origin", "http://127.0.0.1:8080");
    let a = send(&r, request("GET", "/v1/models", &[own, host], "")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        st.engine().stats().prompt_tokens_total,
        0,
        "a refused POST ran"
    );
}

#[tokio::test]
async fn a_cors_origin_gets_exactly_its_origin_and_preflights() {
    let st = state_with(EngineConfig::default(), |c| {
        c.cors_origins = vec!["http://localhost:3000".into()]
    });
    let r = router(&st);
    let page = ("origin", "http://localhost:3000");
    let preflight = request(
        "OPTIONS",
        "/v1/chat/completions",
        &[
            page,
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type",
            ),
        ],
        "",
    );
    let a = send(&r, preflight).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text());
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "http://localhost:3000"
    );
    assert!(a.headers["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));
    assert_eq!(
        a.headers["access-control-allow-headers"],
        "authorization, content-type"
    );
    let a = send(
        &r,
        request("POST", "/v1/chat/completions", &[page, JSON], &chat()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "http://localhost:3000"
    );
    assert_eq!(a.headers["vary"], "origin");
    // Another origin is still refused, and gets no CORS headers.
    let other = ("origin", "http://localhost:3001");
    let a = send(
        &r,
        request("POST", "/v1/chat/completions", &[other, JSON], &chat()),
    )
    .await;
    a.assert_error(StatusCode::FORBIDDEN, "origin_not_allowed");
    assert!(a.headers.get("access-control-allow-origin").is_none());
    // So does a request without an Origin (not a browser).
    let a = send(&r, request("GET", "/v1/models", &[], "")).await;
    assert!(a.headers.get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn an_answer_that_leaves_the_body_unread_drains_it_or_closes() {
    let st = state_with(EngineConfig::default(), |c| c.api_key = Some("k".into()));
    let r = router(&st);
    // A short body is read and dropped: the connection stays usable.
    let a = send(
        &r,
        request("POST", "/v1/chat/completions", &[JSON], &chat()),
    )
    .await;
    a.assert_error(StatusCode::UNAUTHORIZED, "invalid_api_key");
    assert!(a.headers.get("connection").is_none());
    // A long one, or one of unknown length, is not waited for: the answer says so.
    let long = "x".repeat(100 << 10);
    let a = send(&r, request("POST", "/v1/chat/completions", &[JSON], &long)).await;
    a.assert_error(StatusCode::UNAUTHORIZED, "invalid_api_key");
    assert_eq!(a.headers["connection"], "close");
    let stream =
        futures_util::stream::iter([Ok::<_, std::io::Error>(axum::body::Bytes::from("{"))]);
    let unknown = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap();
    let a = send(&r, unknown).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.headers["connection"], "close");
    // A body read to its end needs neither.
    let ok = request(
        "POST",
        "/v1/chat/completions",
        &[JSON, ("authorization", "Bearer k")],
        &chat(),
    );
    let a = send(&r, ok).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.headers.get("connection").is_none());
}

/// Issue 45: without the key, a wrong method or an unknown path answers 401 like every
/// guarded route, so a client without the key cannot tell which routes exist.
#[tokio::test]
async fn without_the_key_wrong_methods_and_unknown_paths_are_401() {
    let st = state_with(EngineConfig::default(), |c| c.api_key = Some("k".into()));
    let r = router(&st);
    let cases = [
        (
            "DELETE",
            "/v1/chat/completions",
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            "POST",
            "/v1/models",
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            "POST",
            "/health",
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            "GET",
            "/v1/no-such-route",
            StatusCode::NOT_FOUND,
            "route_not_found",
        ),
    ];
    for (method, path, status, code) in cases {
        send(&r, request(method, path, &[], ""))
            .await
            .assert_error(StatusCode::UNAUTHORIZED, "invalid_api_key");
        let keyed = request(method, path, &[("authorization", "Bearer k")], "");
        send(&r, keyed).await.assert_error(status, code);
    }
    // Without `--api-key` nothing changes.
    let r = router(&state());
    send(&r, request("DELETE", "/v1/chat/completions", &[], ""))
        .await
        .assert_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
}

/// Serves `state` on a loopback port until the returned sender is dropped or sent.
async fn start(st: wick_server::AppState) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(wick_server::serve(listener, st, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// Writes `head` on a new connection and reads until the server closes it or `within`.
fn exchange(addr: SocketAddr, head: &str, within: Duration) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(within)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_limit_content_length_is_413_without_waiting_for_the_body() {
    let (addr, _stop) = start(state()).await;
    let started = Instant::now();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 999999999\r\n\r\n{";
    let answer = tokio::task::spawn_blocking(move || exchange(addr, head, Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(answer.contains("payload_too_large"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// Issue 45: a client that sends its whole body before reading the answer (what most HTTP
/// libraries do) reads the 413 instead of a reset: the server reads and drops what it still
/// sends before closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_all_of_an_oversized_body_reads_the_413() {
    let st = state_with(EngineConfig::default(), |c| c.max_body_bytes = 1000);
    let (addr, _stop) = start(st).await;
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        // More than the loopback socket buffers hold, so the writes wait for the server.
        let body = vec![b' '; 32 << 20];
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(&body)
            .map_err(|e| format!("sending the body failed: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .map_err(|e| format!("reading the answer failed: {e}"))?;
        Ok::<_, String>(String::from_utf8_lossy(&out).into_owned())
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_no_headers_is_closed_after_the_header_timeout() {
    let st = state_with(EngineConfig::default(), |c| {
        c.header_timeout = Duration::from_millis(300)
    });
    let (addr, _stop) = start(st).await;
    let closed_after = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let started = Instant::now();
        // Half a request line, then nothing.
        s.write_all(b"GET /hea").unwrap();
        let mut buf = [0u8; 512];
        let _ = s.read(&mut buf);
        started.elapsed()
    })
    .await
    .unwrap();
    assert!(
        closed_after >= Duration::from_millis(250),
        "{closed_after:?}"
    );
    assert!(closed_after < Duration::from_secs(3), "{closed_after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_while_idle_sockets_fill_the_connection_cap() {
    let st = state_with(EngineConfig::default(), |c| c.max_connections = 50);
    let (addr, _stop) = start(st).await;
    let latencies = tokio::task::spawn_blocking(move || {
        // Four times the cap of sockets that never send a byte.
        let flood: Vec<TcpStream> = (0..200)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut latencies = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            let answer = exchange(
                addr,
                "GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n",
                Duration::from_secs(5),
            );
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
            latencies.push(started.elapsed());
        }
        drop(flood);
        latencies
    })
    .await
    .unwrap();
    for l in &latencies {
        assert!(*l < Duration::from_secs(2), "{latencies:?}");
    }
}

#[test]
fn request_types_know_every_field_they_read() {
    use wick_server::extract::RequestBody;
    use wick_server::openai::chat::ChatCompletionRequest;
    use wick_server::openai::completions::CompletionRequest;
    let chat = ChatCompletionRequest::known_fields();
    for field in [
        "model",
        "messages",
        "tools",
        "temperature",
        "max_tokens",
        "stream",
        "stream_options",
        "seed",
    ] {
        assert!(chat.contains(&field), "{field}: {chat:?}");
    }
    let completion = CompletionRequest::known_fields();
    for field in ["prompt", "echo", "logprobs", "top_p", "stop"] {
        assert!(completion.contains(&field), "{field}: {completion:?}");
    }
    assert!(
        !chat.contains(&"lora") && !chat.contains(&"sampling"),
        "{chat:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_is_408_and_the_connection_closes() {
    let st = state_with(EngineConfig::default(), |c| {
        c.body_timeout = Duration::from_millis(300);
        c.min_body_rate = 1000;
    });
    let (addr, _stop) = start(st).await;
    let started = Instant::now();
    // 100 kB announced, 10 bytes sent, then nothing.
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"messages\"";
    let answer = tokio::task::spawn_blocking(move || exchange(addr, head, Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_half_sent_headers() {
    let st = state_with(EngineConfig::default(), |c| {
        c.header_timeout = Duration::from_secs(60)
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(wick_server::serve(listener, st, async move {
        let _ = rx.await;
    }));
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(b"GET /hea").unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("shutdown waited for the half-open connection")
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// The fuzzer's keep-alive drop after `POST /admin/cache/flush`: the flush never reads its
/// body, and when the body had not fully arrived by the answer, hyper closed the kept-alive
/// connection without `Connection: close`, so the client's next request on it got no answer.
/// The unread rest is now drained (or the answer says `Connection: close`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_whose_body_arrives_late_keeps_the_connection_usable() {
    let (addr, _stop) = start(state()).await;
    let answers = tokio::task::spawn_blocking(move || {
        let body = format!("{{\"pad\": \"{}\"}}", "x".repeat(4000));
        let (first, rest) = body.split_at(10);
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let head = format!(
            "POST /admin/cache/flush HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{first}",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        // The answer is computed before the rest of the body is sent.
        std::thread::sleep(Duration::from_millis(300));
        s.write_all(rest.as_bytes()).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
            if String::from_utf8_lossy(&out).matches("HTTP/1.1 ").count() >= 2 {
                break;
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
    .unwrap();
    let first = answers.split("HTTP/1.1 ").nth(1).unwrap_or_default();
    assert!(first.starts_with("200"), "{answers}");
    if !first.to_ascii_lowercase().contains("connection: close") {
        assert_eq!(
            answers.matches("HTTP/1.1 200").count(),
            2,
            "a kept-alive connection must answer its next request: {answers}"
        );
    }
}
