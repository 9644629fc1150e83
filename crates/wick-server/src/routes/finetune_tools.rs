//! Adapter tools over HTTP (reference E.6): `POST /api/finetune/merge` merges two adapters
//! into a new one in `$WICK_HOME/adapters`, `POST /api/finetune/export` fuses an adapter
//! into a copy of its base model in `$WICK_HOME/models`, where `wick ls`, `/library` and
//! `wick serve NAME` find it. Both read and write whole weight files (seconds to minutes),
//! so they run on blocking workers, never on the async executor.
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use wick_engine::adapters::load_host;
use wick_hub::{HubError, Store};
use wick_train::fuse::{fuse, FuseReport};
use wick_train::merge::{merge as merge_adapters, save_merged};
use wick_train::TrainError;

use crate::error::ApiError;
use crate::extract::{struct_fields, typed, ApiJson, RequestBody};
use crate::routes::adapters::resolve_path;
use crate::state::AppState;

/// `POST /api/finetune/merge` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MergeRequest {
    /// The first adapter: a path, a mounted id, or a folder in `$WICK_HOME/adapters`.
    pub adapter_a: Option<String>,
    /// The second adapter, named the same ways.
    pub adapter_b: Option<String>,
    /// The weight of each adapter's delta (default `[1, 1]`: their sum).
    pub scales: Option<Vec<f32>>,
}

impl RequestBody for MergeRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<MergeRequest>().to_vec()
    }
}

/// `POST /api/finetune/export` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ExportRequest {
    /// The base model: a path, a local model's name or a catalog name (default: the
    /// served model).
    pub base_model: Option<String>,
    /// The adapter, named as in a merge.
    pub adapter_path: Option<String>,
    /// `fuse` (the default and the only one).
    pub method: Option<String>,
}

impl RequestBody for ExportRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<ExportRequest>().to_vec()
    }
}

fn store() -> Result<Store, ApiError> {
    Store::from_env().map_err(|e| ApiError::Internal(e.to_string()))
}

/// Held while a merge or an export picks its folder and writes it: two requests in the same
/// second would otherwise pick the same name (the folder only exists once it is complete),
/// and two fuses at once would only share the same cores.
static WRITING: Mutex<()> = Mutex::new(());

/// A new folder `PREFIX-<unix time>` in `dir` (`-2`, `-3` … within the same second); call
/// it holding [`WRITING`].
fn fresh_folder(dir: &Path, prefix: &str) -> PathBuf {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut path = dir.join(format!("{prefix}-{ts}"));
    let mut n = 2;
    while path.exists() {
        path = dir.join(format!("{prefix}-{ts}-{n}"));
        n += 1;
    }
    path
}

fn join_failed(what: &str) -> impl FnOnce(tokio::task::JoinError) -> ApiError + '_ {
    move |e| ApiError::Internal(format!("{what} failed: {e}"))
}

/// `POST /api/finetune/merge {adapter_a, adapter_b, scales?}` → `{ok, merged_path, stats}`:
/// one adapter whose delta is `scales[0]·Δa + scales[1]·Δb`, exactly (stacked factors of
/// rank `r_a + r_b`), read against the served model's shapes.
pub async fn merge(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MergeRequest>,
) -> Result<Json<Value>, ApiError> {
    let scales = match req.scales.as_deref() {
        None => [1.0, 1.0],
        Some(&[x, y]) if x.is_finite() && y.is_finite() => [x, y],
        Some(_) => {
            return Err(ApiError::field(
                "scales",
                "must be two finite numbers, one per adapter",
            ))
        }
    };
    let adapters = store()?.root().join("adapters");
    let cfg = state.model().config().clone();
    let served = state.config().model_id.clone();
    let (merged, out, bytes) = tokio::task::spawn_blocking(move || {
        let a = resolve_path(&state, "adapter_a", req.adapter_a.as_deref())?;
        let b = resolve_path(&state, "adapter_b", req.adapter_b.as_deref())?;
        let read = |path: &Path, param: &str| {
            load_host(path, &cfg, None).map_err(|e| ApiError::field(param, e.to_string()))
        };
        let (ha, hb) = (read(&a, "adapter_a")?, read(&b, "adapter_b")?);
        let merged = merge_adapters(&cfg, &ha, &hb, scales)
            .map_err(|e| ApiError::field("adapter_b", e.to_string()))?;
        let base = ha.base_model.or(hb.base_model).unwrap_or(served);
        let _writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        std::fs::create_dir_all(&adapters).map_err(|e| ApiError::Internal(e.to_string()))?;
        let out = fresh_folder(&adapters, "merged");
        let bytes = save_merged(&out, &merged, cfg.num_layers, &base)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        Ok::<_, ApiError>((merged, out, bytes))
    })
    .await
    .map_err(join_failed("merging"))??;
    let s = &merged.stats;
    tracing::info!(path = %out.display(), rank = s.rank, modules = s.modules, "adapters merged");
    Ok(Json(json!({
        "ok": true,
        "merged_path": out.display().to_string(),
        "stats": {
            "modules": s.modules,
            "shared_modules": s.shared,
            "only_a": s.only_a,
            "only_b": s.only_b,
            "rank": s.rank,
            "ranks": s.ranks,
            "scales": s.weights,
            "params": s.params,
            "bytes": bytes,
        },
    })))
}

/// The base model a request names, resolved as `wick serve` resolves its argument (a model
/// not downloaded is refused rather than fetched here); the served model by default.
fn resolve_base(state: &AppState, arg: Option<&str>) -> Result<(String, PathBuf), ApiError> {
    let Some(arg) = arg.map(str::trim).filter(|a| !a.is_empty()) else {
        let info = state.model().info();
        return Ok((state.config().model_id.clone(), info.path.clone()));
    };
    match store()?.resolve(arg) {
        Ok(m) => Ok((m.name, m.path)),
        Err(HubError::NotDownloaded { item, .. }) => Err(ApiError::field(
            "base_model",
            format!(
                "{} is not downloaded: run `wick pull {}`",
                item.name, item.name
            ),
        )),
        Err(e) => Err(ApiError::field("base_model", e.to_string())),
    }
}

/// The manifest of an export: what went in, what came out.
fn manifest(name: &str, base_name: &str, report: &FuseReport) -> Value {
    let files: Vec<Value> = report
        .files
        .iter()
        .map(|(file, bytes)| json!({"name": file, "bytes": bytes}))
        .collect();
    json!({
        "model": name,
        "model_path": report.model_path.display().to_string(),
        "base_model": base_name,
        "base_path": report.base.display().to_string(),
        "adapter_path": report.adapter.display().to_string(),
        "adapter_format": report.adapter_format.name(),
        "method": "fuse",
        "dtype": report.dtype.to_string(),
        "modules": report.modules,
        "files": files,
        "total_bytes": report.files.iter().map(|f| f.1).sum::<u64>(),
    })
}

/// `POST /api/finetune/export {base_model, adapter_path, method?}` →
/// `{ok, export_path, manifest}`: fuses the adapter into a copy of the base in
/// `$WICK_HOME/models/fused-<unix time>`, served by that name.
pub async fn export(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ExportRequest>,
) -> Result<Json<Value>, ApiError> {
    match req.method.as_deref().map(str::trim) {
        None | Some("") | Some("fuse") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                "method",
                format!(
                    "'{other}' is not supported: the only export is \"fuse\" (a GGUF base \
                     fuses to GGUF, a Hugging Face folder to safetensors)"
                ),
            ))
        }
    }
    let models = store()?.models_dir();
    let (base_name, report, out) = tokio::task::spawn_blocking(move || {
        let adapter = resolve_path(&state, "adapter_path", req.adapter_path.as_deref())?;
        let (base_name, base) = resolve_base(&state, req.base_model.as_deref())?;
        let _writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        std::fs::create_dir_all(&models).map_err(|e| ApiError::Internal(e.to_string()))?;
        let out = fresh_folder(&models, "fused");
        let report = fuse(&base, &adapter, &out).map_err(|e| match e {
            TrainError::Adapter(_) => ApiError::field("adapter_path", e.to_string()),
            TrainError::Fuse { .. } | TrainError::Engine(_) => {
                ApiError::field("base_model", e.to_string())
            }
            other => ApiError::Internal(other.to_string()),
        })?;
        Ok::<_, ApiError>((base_name, report, out))
    })
    .await
    .map_err(join_failed("exporting"))??;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    tracing::info!(path = %out.display(), modules = report.modules, dtype = %report.dtype, "adapter fused into a model");
    Ok(Json(json!({
        "ok": true,
        "export_path": out.display().to_string(),
        "manifest": manifest(&name, &base_name, &report),
    })))
}
