//! The prompt cache over HTTP on the tiny model: `cached_tokens` in JSON and streamed usage,
//! `/stats` and `/metrics`, `POST /admin/cache/flush`, and the flush at shutdown.
mod support;

use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use support::*;
use wick_engine::scheduler::EngineConfig;

fn completion(prompt: &str, stream: bool) -> Value {
    json!({
        "model": "m",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

const PROMPT: &str = "one two three four five six seven eight nine ten eleven twelve";

fn ssd_config(dir: &Path, write_behind: bool) -> EngineConfig {
    EngineConfig {
        ssd_cache_dir: Some(dir.to_path_buf()),
        ssd_write_behind: write_behind,
        ..EngineConfig::default()
    }
}

fn wkv_files(dir: &Path) -> usize {
    fn walk(dir: &Path, n: &mut usize) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.is_dir() {
                walk(&p, n);
            } else if p.extension().is_some_and(|e| e == "wkv") {
                *n += 1;
            }
        }
    }
    let mut n = 0;
    walk(dir, &mut n);
    n
}

#[tokio::test]
async fn cached_tokens_are_reported_in_json_and_in_the_stream() {
    let st = state();
    let r = router(&st);
    let cold = send(&r, post_json("/v1/completions", &completion(PROMPT, false))).await;
    assert_eq!(cold.status, StatusCode::OK, "{}", cold.text());
    let cold = cold.json();
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt = cold["usage"]["prompt_tokens"].as_u64().unwrap();

    let warm = send(&r, post_json("/v1/completions", &completion(PROMPT, false))).await;
    let warm = warm.json();
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt - 1
    );
    assert_eq!(warm["choices"][0]["text"], cold["choices"][0]["text"]);

    let streamed = send(&r, post_json("/v1/completions", &completion(PROMPT, true))).await;
    let usage: Vec<Value> = streamed
        .sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|v| !v["usage"].is_null())
        .collect();
    assert_eq!(usage.len(), 1, "{}", streamed.text());
    assert_eq!(
        usage[0]["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt - 1
    );

    let stats = send(&r, get("/stats")).await.json();
    let pc = &stats["prompt_cache"];
    assert_eq!(pc["enabled"], true);
    assert_eq!(pc["hits"], 2);
    assert_eq!(pc["misses"], 1);
    assert_eq!(pc["hit_tokens"], 2 * (prompt - 1));
    assert!(pc["entries"].as_u64().unwrap() >= 1);
    assert!(pc["ssd"].is_null() && stats["ssd_cache"].is_null());
    let metrics = send(&r, get("/metrics")).await.text();
    assert!(metrics.contains("wick_prompt_cache_hits_total{tier=\"ram\"} 2\n"));
    assert!(metrics.contains("wick_prompt_cache_misses_total 1\n"));
}

#[tokio::test]
async fn flush_without_an_ssd_tier_has_nothing_to_do() {
    let r = router(&state());
    let a = send(&r, post_raw("/admin/cache/flush", "")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["enabled"], false);
    assert_eq!(v["durable"], true);
}

#[tokio::test]
async fn flush_writes_every_entry_and_answers_200() {
    let dir = tempfile::tempdir().unwrap();
    let st = state_with(ssd_config(dir.path(), false), |c| {
        c.api_key = Some("k".into())
    });
    let r = router(&st);
    let denied = send(&r, post_raw("/admin/cache/flush", "")).await;
    denied.assert_error(StatusCode::UNAUTHORIZED, "invalid_api_key");
    let authed = |req: Request<Body>| {
        let (mut parts, body) = req.into_parts();
        parts
            .headers
            .insert("authorization", "Bearer k".parse().unwrap());
        Request::from_parts(parts, body)
    };
    let a = send(
        &r,
        authed(post_json("/v1/completions", &completion(PROMPT, false))),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(wkv_files(dir.path()), 0, "write-behind is off");
    let before = send(&r, authed(get("/stats"))).await.json();
    assert_eq!(before["ssd_cache"]["pending_snapshots"], 1);

    let a = send(&r, authed(post_raw("/admin/cache/flush", ""))).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["durable"], true);
    assert_eq!(v["flushed_snapshots"], 1);
    assert_eq!(v["pending_snapshots"], 0);
    assert_eq!(v["entries"], 1);
    assert!(v["longest_durable_prefix_tokens"].as_u64().unwrap() > 0);
    assert_eq!(wkv_files(dir.path()), 1);
    let metrics = send(&r, authed(get("/metrics"))).await.text();
    assert!(metrics.contains("wick_prompt_cache_ssd_enabled 1\n"));
    assert!(metrics.contains("wick_prompt_cache_ssd_entries 1\n"));
    assert!(metrics.contains("wick_prompt_cache_ssd_writes_total 1\n"));
}

#[tokio::test]
async fn shutdown_flushes_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let st = state_with(ssd_config(dir.path(), false), |c| {
        c.shutdown_grace = Duration::from_secs(1)
    });
    let r = router(&st);
    let a = send(&r, post_json("/v1/completions", &completion(PROMPT, false))).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(wkv_files(dir.path()), 0, "write-behind is off");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(wick_server::serve(listener, st.clone(), async move {
        let _ = stopped.await;
    }));
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("shutdown is bounded")
        .unwrap()
        .unwrap();
    assert_eq!(
        wkv_files(dir.path()),
        1,
        "the shutdown flush wrote the entry"
    );
}
