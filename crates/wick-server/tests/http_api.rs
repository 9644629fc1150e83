//! The HTTP layer end to end on the tiny model: response shapes, streams, limits, errors.
mod support;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::{json, Value};
use support::*;
use wick_engine::scheduler::{EngineConfig, KvBudget};

fn chat_body(extra: Value) -> Value {
    let mut body = json!({
        "model": "whatever",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5,
        "ignore_eos": true,
        "temperature": 0,
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

#[tokio::test]
async fn health_is_exact() {
    let r = router(&state());
    let a = send(&r, get("/health")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body.as_ref(), br#"{"status": "ok"}"#);
    assert_eq!(a.headers["content-type"], "application/json");
}

#[tokio::test]
async fn chat_whole_reply() {
    let r = router(&state());
    let a = send(&r, post_json("/v1/chat/completions", &chat_body(json!({})))).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 3);
    assert_eq!(v["usage"]["total_tokens"], prompt + 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn chat_stream_frames_match_the_whole_reply() {
    let st = state();
    let r = router(&st);
    let whole = send(
        &r,
        post_json("/v1/chat/completions", &chat_body(json!({"max_tokens": 8}))),
    )
    .await
    .json();
    let a = send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(
                json!({"max_tokens": 8, "stream": true, "stream_options": {"include_usage": true},
                              "logprobs": true, "top_logprobs": 2}),
            ),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let frames = a.sse_data();
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut logprobs = 0;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        for choice in c["choices"].as_array().unwrap() {
            text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            if let Some(content) = choice["logprobs"]["content"].as_array() {
                logprobs += content.len();
                for e in content {
                    assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
                }
            }
        }
    }
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(logprobs, 8);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn completions_with_token_ids_and_echo() {
    let r = router(&state());
    let a = send(
        &r,
        post_json(
            "/v1/completions",
            &json!({"prompt": [10, 20, 30], "max_tokens": 4, "ignore_eos": true, "echo": true,
                    "logprobs": 1, "temperature": 0}),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 7);
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["token_logprobs"][6].is_number());
    let text_prompt = send(
        &r,
        post_json(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 2, "stream": true}),
        ),
    )
    .await;
    assert_eq!(
        text_prompt.sse_data().last().map(String::as_str),
        Some("[DONE]")
    );
}

#[tokio::test]
async fn client_errors_have_the_openai_shape() {
    let r = router(&state());
    send(&r, post_raw("/v1/chat/completions", "{nope"))
        .await
        .assert_error(StatusCode::BAD_REQUEST, "invalid_json");
    let e = send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(json!({"temperature": "x"})),
        ),
    )
    .await;
    assert_eq!(
        e.assert_error(StatusCode::BAD_REQUEST, "invalid_value")["error"]["param"],
        "temperature"
    );
    send(
        &r,
        post_json("/v1/chat/completions", &json!({"messages": []})),
    )
    .await
    .assert_error(StatusCode::BAD_REQUEST, "missing_required_parameter");
    send(
        &r,
        post_json("/v1/chat/completions", &chat_body(json!({"n": 2}))),
    )
    .await
    .assert_error(StatusCode::BAD_REQUEST, "unsupported_parameter");
    send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(json!({"max_tokens": 100000})),
        ),
    )
    .await
    .assert_error(StatusCode::BAD_REQUEST, "context_length_exceeded");
    send(&r, get("/nowhere"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "route_not_found");
    send(&r, get("/v1/models/other"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "model_not_found");
    send(&r, get("/v1/chat/completions"))
        .await
        .assert_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    assert_eq!(send(&r, get("/v1/models/tiny")).await.json()["id"], "tiny");
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let st = state_with(EngineConfig::default(), |c| c.max_body_bytes = 1000);
    let r = router(&st);
    let big = chat_body(json!({"messages": [{"role": "user", "content": "a".repeat(5000)}]}));
    send(&r, post_json("/v1/chat/completions", &big))
        .await
        .assert_error(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let st = state_with(EngineConfig::default(), |c| c.api_key = Some("k".into()));
    let r = router(&st);
    assert_eq!(send(&r, get("/health")).await.status, StatusCode::OK);
    for path in ["/v1/models", "/stats", "/metrics", "/v1"] {
        let a = send(&r, get(path)).await;
        a.assert_error(StatusCode::UNAUTHORIZED, "invalid_api_key");
        assert_eq!(a.headers["www-authenticate"], "Bearer");
    }
    let ok = axum::http::Request::get("/v1/models")
        .header("authorization", "Bearer k")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(send(&r, ok).await.status, StatusCode::OK);
}

#[tokio::test]
async fn full_queue_is_429_with_retry_after() {
    let st = state_with(
        EngineConfig {
            max_batch: 1,
            max_queue: 0,
            step_token_budget: 64,
            ..EngineConfig::default()
        },
        |_| {},
    );
    let r = router(&st);
    // The one batch place is free: no queue is needed.
    let a = send(&r, post_json("/v1/chat/completions", &chat_body(json!({})))).await;
    assert_eq!(a.status, StatusCode::OK);
    // Taken (and no queue beyond it): refused.
    let mut long = wick_engine::GenerationRequest::new(vec![1, 2, 3]).max_tokens(1000);
    long.ignore_eos = true;
    let _running = st.engine().submit(long).unwrap();
    let a = send(&r, post_json("/v1/chat/completions", &chat_body(json!({})))).await;
    a.assert_error(StatusCode::TOO_MANY_REQUESTS, "queue_full");
    assert_eq!(a.headers["retry-after"], "1");
}

#[tokio::test]
async fn hanging_up_cancels_the_generation() {
    let st = state();
    let r = router(&st);
    let body = chat_body(json!({"max_tokens": 1500, "stream": true}));
    let frames = first_frames_then_hang_up(&r, post_json("/v1/chat/completions", &body), 3).await;
    assert_eq!(frames.len(), 3);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = st.engine().stats();
        if s.cancelled >= 1 && s.running == 0 {
            assert!(s.generated_tokens_total < 1500, "{s:?}");
            break;
        }
        assert!(Instant::now() < deadline, "still running: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn stats_and_metrics_report_requests() {
    let st = state();
    let r = router(&st);
    send(&r, post_json("/v1/chat/completions", &chat_body(json!({})))).await;
    send(&r, get("/missing")).await;
    let stats = send(&r, get("/stats")).await.json();
    assert_eq!(stats["engine"]["completed"], 1);
    assert_eq!(stats["queue"]["limit"], 64);
    let metrics = send(&r, get("/metrics")).await.text();
    assert!(metrics.contains(
        "wick_http_requests_total{route=\"/v1/chat/completions\",method=\"POST\",status=\"200\"} 1"
    ), "{metrics}");
    assert!(metrics.contains("wick_http_errors_total{code=\"route_not_found\"} 1"));
    assert!(metrics.contains("wick_generation_tokens_total 5"));
    assert!(metrics.contains("wick_time_to_first_token_seconds_count 1"));
    assert!(metrics.contains("wick_inter_token_latency_seconds_count 4"));
}

#[tokio::test]
async fn a_prompt_that_opens_think_streams_reasoning() {
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/python/templates/think.jinja"),
    )
    .expect("think template");
    let st = state_with(EngineConfig::default(), |c| {
        c.chat_template = Some(("think.jinja".into(), template))
    });
    let r = router(&st);
    let whole = send(
        &r,
        post_json("/v1/chat/completions", &chat_body(json!({"max_tokens": 6}))),
    )
    .await
    .json();
    let message = &whole["choices"][0]["message"];
    assert_eq!(message["content"], "", "{whole}");
    let reasoning = message["reasoning_content"]
        .as_str()
        .expect("reasoning")
        .to_string();
    assert!(!reasoning.is_empty());
    let streamed = send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(json!({"max_tokens": 6, "stream": true})),
        ),
    )
    .await;
    let mut text = String::new();
    for frame in streamed.sse_data() {
        if frame == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&frame).unwrap();
        text.push_str(
            v["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .unwrap_or(""),
        );
        assert!(v["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("")
            .is_empty());
    }
    assert_eq!(text, reasoning);
    // Thinking off: the template closes the block, the output is content.
    let off = send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(json!({"chat_template_kwargs": {"enable_thinking": false}})),
        ),
    )
    .await
    .json();
    assert!(
        off["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{off}"
    );
}

#[tokio::test]
async fn a_request_the_kv_memory_can_never_hold_is_400_before_any_work() {
    let model = tiny_model();
    // 48 tokens' worth of blocks in every layer.
    let bytes = 3 * model.config().num_layers * model.kv_block_bytes();
    let st = state_with(
        EngineConfig {
            kv_budget: KvBudget::Bytes(bytes as u64),
            ..EngineConfig::default()
        },
        |_| {},
    );
    assert_eq!(st.engine().max_sequence_tokens(), 48);
    let r = router(&st);
    let too_big = send(
        &r,
        post_json(
            "/v1/chat/completions",
            &chat_body(json!({"max_tokens": 100})),
        ),
    )
    .await;
    let body = too_big.assert_error(StatusCode::BAD_REQUEST, "kv_capacity_exceeded");
    assert_eq!(body["error"]["param"], "max_tokens");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("at most 48 tokens"), "{message}");
    assert_eq!(st.engine().stats().steps, 0);
    // Without max_tokens the default is capped to what the pool holds: the request runs.
    let mut body = chat_body(json!({}));
    body.as_object_mut().unwrap().remove("max_tokens");
    let ok = send(&r, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text());
    let usage = &ok.json()["usage"];
    let total = usage["total_tokens"].as_u64().unwrap();
    assert!(total <= 48, "{usage}");

    let stats = send(&r, get("/stats")).await.json();
    let kv = &stats["batching"]["kv_blocks"];
    assert_eq!(kv["total"], 3 * model.config().num_layers);
    assert_eq!(kv["used"], 0);
    assert_eq!(stats["admission"]["max_safe_context"], 48);
    assert!(stats["batching"]["steps"].as_u64().unwrap() > 0);
    let metrics = send(&r, get("/metrics")).await.text();
    for line in [
        format!(
            "wick_kv_blocks{{state=\"total\"}} {}",
            3 * model.config().num_layers
        ),
        "wick_preemptions_total 0".to_string(),
        "wick_step_batch_size_count".to_string(),
    ] {
        assert!(metrics.contains(&line), "{line} missing");
    }
}

/// Issue 45: a prompt far past the context is refused while it is tokenized, not after
/// tokenizing all of it (30 MB for an 8k context took 11 s and 3.4 GB).
#[tokio::test]
async fn a_prompt_far_past_the_context_stops_tokenizing_early() {
    let r = router(&state());
    let text = "word ".repeat(400_000);
    let chat = chat_body(json!({"messages": [{"role": "user", "content": text}]}));
    let completion = json!({"prompt": text, "max_tokens": 1});
    for (path, body, param) in [
        ("/v1/chat/completions", &chat, "messages"),
        ("/v1/completions", &completion, "prompt"),
        ("/v1/chat/completions/render", &chat, "messages"),
    ] {
        let a = send(&r, post_json(path, body)).await;
        let e = a.assert_error(StatusCode::BAD_REQUEST, "context_length_exceeded");
        assert_eq!(e["error"]["param"], param, "{path}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains("tokenizing stopped"), "{path}: {message}");
    }
}

/// `anyOf` of 1200 arrays: every branch starts with `[`, so the parser row after the `[`
/// holds more items than llguidance's `max_items_in_row` (2000). It compiles, and its first
/// mask is fine; at most 24 blanks may come before the `[`, so 32 tokens reach it.
fn ambiguous_schema() -> Value {
    let branches: Vec<Value> = (0..1200)
        .map(|i| json!({"type": "array", "items": {"const": i}}))
        .collect();
    json!({"anyOf": branches})
}

/// Issue 45: a grammar that hits one of llguidance's limits while generating ends the reply
/// with a client error in each protocol's shape — a 400 when whole, an error event when
/// streamed — not a 500.
#[tokio::test]
async fn a_grammar_that_hits_a_limit_while_generating_is_a_client_error() {
    let r = router(&state());
    let schema = ambiguous_schema();
    let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
    let chat = chat_body(json!({"response_format": format, "ignore_eos": false, "max_tokens": 32}));
    let a = send(&r, post_json("/v1/chat/completions", &chat)).await;
    let e = a.assert_error(StatusCode::BAD_REQUEST, "grammar_failed");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("max_items_in_row"), "{message}");

    let streamed = chat_body(
        json!({"response_format": format, "ignore_eos": false, "stream": true, "max_tokens": 32}),
    );
    let a = send(&r, post_json("/v1/chat/completions", &streamed)).await;
    assert_eq!(a.status, StatusCode::OK);
    let last: Value = serde_json::from_str(a.sse_data().last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "grammar_failed", "{}", a.text());
    assert_eq!(last["error"]["type"], "invalid_request_error");

    let completion = json!({"prompt": "Hi", "max_tokens": 32, "stream": true,
                            "structured_outputs": {"json": schema}});
    let a = send(&r, post_json("/v1/completions", &completion)).await;
    let last: Value = serde_json::from_str(a.sse_data().last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "grammar_failed", "{}", a.text());

    let messages = json!({"max_tokens": 32, "stream": true,
                          "messages": [{"role": "user", "content": "Hi"}],
                          "output_format": {"type": "json_schema", "schema": schema}});
    let a = send(&r, post_json("/v1/messages", &messages)).await;
    let text = a.text();
    assert!(text.contains("event: error"), "{text}");
    let last: Value = serde_json::from_str(a.sse_data().last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "invalid_request_error", "{text}");

    let responses = json!({"input": "Hi", "max_output_tokens": 32, "stream": true,
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}});
    let a = send(&r, post_json("/v1/responses", &responses)).await;
    let last: Value = serde_json::from_str(a.sse_data().last().unwrap()).unwrap();
    assert_eq!(last["type"], "response.failed", "{}", a.text());
    assert_eq!(last["response"]["error"]["code"], "grammar_failed");
}
