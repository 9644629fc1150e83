//! `POST /admin/cache/flush`: the prompt cache's durability boundary. It answers 200 only
//! when everything the cache holds is on the SSD; otherwise 503 with what is still
//! pending, and what was dropped, failed or lost (reference C.3).
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::cache_report;
use crate::error::ErrorCode;
use crate::state::AppState;

/// Flushes the prompt cache within the configured timeout (`--cache-flush-timeout`).
///
/// The flush blocks on disk work, so it runs on a blocking worker; requests keep being
/// served meanwhile. Without an SSD tier there is nothing to make durable: 200 with
/// `enabled: false`.
pub async fn flush_cache(State(state): State<AppState>) -> Response {
    let engine = state.engine().clone();
    let timeout = state.config().cache_flush_timeout;
    let flushed = tokio::task::spawn_blocking(move || {
        let report = engine.flush_cache(timeout);
        (report, engine.stats().prompt_cache)
    })
    .await;
    let (report, after) = match flushed {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("cache flush failed: {e}");
            let body = json!({"durable": false, "error": {
                "message": format!("the cache flush failed: {e}"),
                "type": "server_error", "param": null, "code": "cache_flush_failed"}});
            let mut response = (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
            response
                .extensions_mut()
                .insert(ErrorCode("cache_flush_failed"));
            return response;
        }
    };
    let mut body = cache_report::flush_json(&report, &after);
    if report.durable {
        tracing::info!(
            flushed = report.flushed_snapshots,
            elapsed_ms = report.elapsed_ms,
            "prompt cache flushed: durable"
        );
        return (StatusCode::OK, Json(body)).into_response();
    }
    tracing::warn!(
        pending_snapshots = report.pending_snapshots,
        pending_spills = report.pending_spills,
        dropped = report.dropped_spills,
        failed = report.failed_spills,
        missing = report.missing_snapshots,
        timed_out = report.timed_out,
        "prompt cache flush: not durable"
    );
    body["error"] = json!({
        "message": not_durable_message(&report),
        "type": "server_error",
        "param": null,
        "code": "cache_not_durable",
    });
    let mut response = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    response
        .extensions_mut()
        .insert(ErrorCode("cache_not_durable"));
    response
}

/// One sentence naming what kept the flush from being durable.
fn not_durable_message(r: &wick_engine::scheduler::FlushReport) -> String {
    let mut why = Vec::new();
    if r.timed_out {
        why.push("the flush timed out".to_string());
    }
    if r.pending_snapshots > 0 {
        why.push(format!("{} entries not yet on disk", r.pending_snapshots));
    }
    if r.pending_spills > 0 {
        why.push(format!("{} writes still queued", r.pending_spills));
    }
    if r.dropped_spills > 0 {
        why.push(format!("{} writes dropped", r.dropped_spills));
    }
    if r.failed_spills > 0 {
        why.push(format!(
            "{} writes failed (disk full or I/O error)",
            r.failed_spills
        ));
    }
    if r.missing_snapshots > 0 {
        why.push(format!(
            "{} entries left RAM before reaching the disk",
            r.missing_snapshots
        ));
    }
    if why.is_empty() {
        why.push("the SSD tier did not confirm every entry".into());
    }
    format!("the prompt cache is not durable: {}", why.join(", "))
}
