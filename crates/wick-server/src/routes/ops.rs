//! Operational endpoints: `/health`, `/v1` (endpoint index), `/stats`, `/metrics` (wick's
//! figures and the vLLM-named gauges of [`crate::replica`]), and the
//! answers for unknown routes and wrong methods.
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use wick_engine::scheduler::EngineStats;

use crate::cache_report;
use crate::error::ApiError;
use crate::middleware::{check_api_key, ServerState};
use crate::routes::Endpoints;
use crate::state::AppState;

/// `{"status": "ok"}`, byte for byte.
pub async fn health() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"status": "ok"}"#,
    )
        .into_response()
}

/// Name, version, model and endpoints.
pub async fn index(
    State(state): State<AppState>,
    Extension(endpoints): Extension<Endpoints>,
) -> Json<Value> {
    Json(json!({
        "name": "wick",
        "version": env!("CARGO_PKG_VERSION"),
        "model": state.config().model_id,
        "endpoints": endpoints.0.as_slice(),
    }))
}

/// Runtime state: queue, batch, speed, cache and memory.
pub async fn stats(State(state): State<AppState>) -> Json<Value> {
    let engine = state.engine();
    let s = engine.stats();
    let cfg = engine.config();
    let info = state.model().info();
    let prompt_cache = cache_report::prompt_cache_json(&s.prompt_cache);
    let ssd_cache = s
        .prompt_cache
        .ssd
        .as_ref()
        .map(cache_report::ssd_cache_json);
    Json(json!({
        "server": {
            "model": state.config().model_id,
            "model_path": info.path.display().to_string(),
            "arch": info.arch.to_string(),
            "backend": info.backend,
            "kv_type": info.kv_type,
            "context_length": info.context_length,
            "tool_format": state.tool_format().name(),
            "version": env!("CARGO_PKG_VERSION"),
            "started_at": state.started_unix(),
            "uptime_s": state.uptime_secs(),
        },
        "queue": {"waiting": s.queued, "limit": cfg.max_queue},
        "batch": {
            "configured": cfg.max_batch,
            "active_rows": s.running,
            "last_batch_size": s.last_batch_size,
            "last_step_tokens": s.last_step_tokens,
            "step_token_budget": cfg.step_token_budget,
            "kv_budget_bytes": s.kv_pool.budget_bytes,
        },
        "batching": batching_stats(&s),
        "admission": admission_stats(&s, info.weight_bytes),
        "tokens_per_second": {"decode": s.decode_tokens_per_second},
        "cache": {"kv_bytes": s.kv_bytes, "prompt_cache": prompt_cache},
        "prompt_cache": prompt_cache,
        "ssd_cache": ssd_cache,
        "memory": {
            "weights_bytes": info.weight_bytes,
            "kv_bytes": s.kv_bytes,
            "rss_bytes": resident_bytes(),
        },
        "requests": {
            "in_flight": state.metrics().generations_in_flight(),
            "completed": s.completed,
            "cancelled": s.cancelled,
            "failed": s.failed,
            "tool_call_repairs": state.metrics().repairs(),
        },
        "engine": s,
    }))
}

/// Continuous batching: sequences, KV blocks, preemptions, batch size and tokens per step.
fn batching_stats(s: &EngineStats) -> Value {
    let pool = &s.kv_pool;
    json!({
        "running": s.running,
        "waiting": s.queued,
        "preempted_waiting": s.preempted_waiting,
        "preemptions": s.preemptions,
        "kv_blocks": {
            "block_tokens": pool.block_tokens,
            "used": pool.used_blocks,
            "free": pool.free_blocks,
            "total": pool.total_blocks,
            "peak": pool.peak_blocks,
            "block_bytes": pool.block_bytes,
        },
        "batch_size": {"last": s.last_batch_size, "avg": s.batch_size.mean()},
        "tokens_per_step": {"last": s.last_step_tokens, "avg": s.step_tokens.mean()},
        "steps": s.steps,
    })
}

/// Memory admission (reference A.7 `admission`): what one sequence may hold and the
/// budget behind it.
fn admission_stats(s: &EngineStats, weights_bytes: usize) -> Value {
    json!({
        "max_safe_context": s.kv_pool.max_sequence_tokens,
        "memory_budget_bytes": s.kv_pool.budget_bytes,
        "weights_bytes": weights_bytes,
    })
}

/// Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let engine = state.engine();
    let cfg = engine.config();
    let stats = engine.stats();
    let mut text = state.metrics().render(&stats, cfg.max_batch, cfg.max_queue);
    crate::replica::render_vllm_gauges(
        &mut text,
        &state.config().model_id,
        &crate::replica::ReplicaLoad::from(&stats),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// 404 for unknown routes.
///
/// With `--api-key`, a request without the key gets the 401 every guarded route gives, so
/// which routes exist is not told to a client without the key.
pub async fn not_found<S: ServerState>(
    State(state): State<S>,
    headers: HeaderMap,
    method: Method,
    uri: Uri,
) -> ApiError {
    if let Err(e) = check_api_key(state.server_config(), &headers) {
        return e;
    }
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

/// 405 for a known route with the wrong method; without the key (`--api-key`), 401 as for
/// [`not_found`].
pub async fn method_not_allowed<S: ServerState>(
    State(state): State<S>,
    headers: HeaderMap,
    method: Method,
    uri: Uri,
) -> ApiError {
    if let Err(e) = check_api_key(state.server_config(), &headers) {
        return e;
    }
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

/// Resident memory of this process (Linux `/proc`; `null` elsewhere).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
