//! The endpoints routers in front of several replicas read: `GET /get_load` (the load
//! `power_of_two` compares), `GET /version` and `GET /server_info` (what a router or an
//! operator identifies a worker by). They sit behind `--api-key` like every route but
//! `/health`.
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::replica::ReplicaLoad;
use crate::state::AppState;

/// `{"load": waiting + running, "num_waiting_reqs", "num_running_reqs", "kv_cache_usage"}`;
/// vllm-router reads `load`.
pub async fn get_load(State(state): State<AppState>) -> Json<ReplicaLoad> {
    Json(ReplicaLoad::from(&state.engine().stats()))
}

/// `{"version": "<wick version>"}`, as vLLM answers it.
pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// The served model and the limits that size a replica: batch, queue, context, KV pool.
pub async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let engine = state.engine();
    let cfg = engine.config();
    let s = engine.stats();
    let info = state.model().info();
    Json(json!({
        "server": "wick",
        "version": env!("CARGO_PKG_VERSION"),
        "model": state.config().model_id,
        "model_path": info.path.display().to_string(),
        "arch": info.arch.to_string(),
        "backend": info.backend,
        "context_length": info.context_length,
        "max_batch": cfg.max_batch,
        "max_queue": cfg.max_queue,
        "kv_block_tokens": s.kv_pool.block_tokens,
        "kv_total_blocks": s.kv_pool.total_blocks,
        "prompt_cache": s.prompt_cache.enabled,
        "ssd_cache": engine.ssd_cache_path().map(|p| p.display().to_string()),
        "started_at": state.started_unix(),
        "load": ReplicaLoad::from(&s),
    }))
}
