//! LoRA adapters at serve time (reference A.9): `GET/POST /v1/adapters`,
//! `DELETE /v1/adapters/{id}`, `GET /v1/adapters/available`, vLLM's
//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and how the adapter tools
//! find an adapter a request names ([`resolve_path`]). Which adapters a generation request
//! runs with is validation's ([`crate::validation::adapter::select`]).
//!
//! Mounting reads and uploads the adapter on a blocking worker, then inserts it into the
//! registry (a map insert): the engine keeps stepping meanwhile. Unmounting removes it from
//! the registry; running requests hold their adapters and finish with them.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use wick_engine::adapters::{default_id, validate_id, Adapter};

use crate::error::ApiError;
use crate::extract::{struct_fields, typed, ApiJson, RequestBody};
use crate::state::AppState;

fn card(a: &Adapter, default: Option<&str>) -> Value {
    let i = a.info();
    json!({
        "id": i.id,
        "path": i.path.display().to_string(),
        "format": i.format.name(),
        "rank": i.rank,
        "scale": i.scale,
        "size_bytes": i.size_bytes,
        "dtype": i.factor_dtype.name(),
        "mounted_layers": i.mounted_layers,
        "skipped_tensors": i.skipped_tensors,
        "base_model": i.base_model,
        "default": default == Some(i.id.as_str()),
    })
}

/// `GET /v1/adapters`: the mounted adapters.
pub async fn list(State(state): State<AppState>) -> Json<Value> {
    let default = state.adapters().default_id();
    let adapters: Vec<Value> = state
        .adapters()
        .list()
        .iter()
        .map(|a| card(a, default.as_deref()))
        .collect();
    Json(json!({ "adapters": adapters }))
}

/// `POST /v1/adapters` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MountRequest {
    /// The id (default: the folder name).
    pub id: Option<String>,
    /// The adapter directory (or GGUF file).
    pub path: Option<String>,
}

impl RequestBody for MountRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<MountRequest>().to_vec()
    }
}

/// Loads `path` under `id` (the folder name when `None`) and mounts it.
async fn mount(
    state: &AppState,
    id: Option<String>,
    path: Option<String>,
    fields: (&'static str, &'static str),
) -> Result<Arc<Adapter>, ApiError> {
    let (id_field, path_field) = fields;
    let path = path
        .filter(|p| !p.trim().is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: path_field.into(),
        })?;
    let path = PathBuf::from(path);
    let id = match id {
        Some(id) => id,
        None => default_id(&path),
    };
    validate_id(&id).map_err(|e| ApiError::field(id_field, e.to_string()))?;
    if state.adapters().contains(&id) {
        return Err(ApiError::field(
            id_field,
            format!("adapter '{id}' is already mounted; unmount it first"),
        ));
    }
    let model = state.model().clone();
    let started = std::time::Instant::now();
    let loaded = {
        let (id, path) = (id.clone(), path.clone());
        tokio::task::spawn_blocking(move || model.load_adapter(&id, &path))
            .await
            .map_err(|e| ApiError::Internal(format!("adapter load failed: {e}")))?
    };
    let adapter = Arc::new(loaded.map_err(|e| ApiError::field(path_field, e.to_string()))?);
    state
        .adapters()
        .insert(adapter.clone())
        .map_err(|e| ApiError::field(id_field, e.to_string()))?;
    tracing::info!(
        id = %id,
        path = %path.display(),
        rank = adapter.info().rank,
        layers = adapter.info().mounted_layers,
        ms = started.elapsed().as_millis() as u64,
        "adapter mounted"
    );
    Ok(adapter)
}

/// `POST /v1/adapters {id, path}`: mounts an adapter.
pub async fn create(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<MountRequest>,
) -> Result<Json<Value>, ApiError> {
    let a = mount(&state, req.id, req.path, ("id", "path")).await?;
    let i = a.info();
    Ok(Json(json!({
        "id": i.id,
        "mounted_layers": i.mounted_layers,
        "rank": i.rank,
        "scale": i.scale,
    })))
}

/// `DELETE /v1/adapters/{id}`: unmounts an adapter (requests running with it finish).
pub async fn delete(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let removed = state
        .adapters()
        .remove(&id)
        .ok_or(ApiError::AdapterNotFound { id: id.clone() })?;
    tracing::info!(id = %id, "adapter unmounted");
    Ok(Json(json!({
        "id": id,
        "removed_layers": removed.info().mounted_layers,
    })))
}

/// Where `GET /v1/adapters/available` looks: `$WICK_HOME/adapters` (default
/// `~/.cache/wick/adapters`) and the folders holding adapters mounted at startup.
fn scan_roots(state: &AppState) -> Vec<PathBuf> {
    let home = std::env::var_os("WICK_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/wick")));
    let mut roots: Vec<PathBuf> = home.map(|h| h.join("adapters")).into_iter().collect();
    for dir in &state.config().adapters {
        if let Some(parent) = dir.parent() {
            let parent = parent.to_path_buf();
            if !roots.contains(&parent) {
                roots.push(parent);
            }
        }
    }
    roots
}

/// The adapter a request names in `param`: an existing path, the id of a mounted adapter,
/// or a folder name in the places `GET /v1/adapters/available` looks.
pub fn resolve_path(
    state: &AppState,
    param: &str,
    name: Option<&str>,
) -> Result<PathBuf, ApiError> {
    let name = name
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: param.into(),
        })?;
    let path = Path::new(name);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if let Some(mounted) = state.adapters().get(name) {
        return Ok(mounted.info().path.clone());
    }
    let plain = !name.contains(['/', '\\']) && name != "." && name != "..";
    if plain {
        if let Some(dir) = scan_roots(state)
            .into_iter()
            .map(|root| root.join(name))
            .find(|dir| dir.exists())
        {
            return Ok(dir);
        }
    }
    Err(ApiError::field(
        param,
        format!(
            "no adapter '{name}': not an existing path, a mounted adapter's id, or a folder in {}",
            scan_roots(state)
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

/// Rank, scale and recorded base of an adapter directory, from its config alone.
fn describe(dir: &Path) -> Option<(Option<u64>, Option<f64>, Option<String>)> {
    let has_weights = ["adapter_model.safetensors", "adapters.safetensors"]
        .iter()
        .any(|f| dir.join(f).is_file());
    if !has_weights {
        return None;
    }
    let config: Value = std::fs::read_to_string(dir.join("adapter_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())?;
    let lp = config.get("lora_parameters");
    let rank = lp
        .and_then(|p| p.get("rank"))
        .or_else(|| config.get("r"))
        .and_then(Value::as_u64);
    let scale = lp
        .and_then(|p| p.get("scale"))
        .and_then(Value::as_f64)
        .or_else(|| {
            let alpha = config.get("lora_alpha").and_then(Value::as_f64)?;
            Some(alpha / rank.filter(|&r| r > 0)? as f64)
        });
    let base = config
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string);
    Some((rank, scale, base))
}

/// The bare name of a model id or path: `models--ORG--NAME/snapshots/...` → `NAME`,
/// `ORG/NAME` → `NAME`, lower-cased and without a file extension.
fn bare_name(s: &str) -> String {
    let from_snapshot = s
        .split('/')
        .find_map(|part| part.strip_prefix("models--"))
        .and_then(|p| p.rsplit("--").next());
    let name = from_snapshot.unwrap_or_else(|| {
        s.trim_end_matches('/')
            .rsplit(['/', '\\'])
            .next()
            .unwrap_or(s)
    });
    let name = name.strip_suffix(".gguf").unwrap_or(name);
    name.to_ascii_lowercase()
}

/// Whether an adapter recorded for `base` fits the served model: same bare name, allowing
/// a quantization suffix on the served file (`SmolLM2-135M-Instruct.Q4_1`).
fn base_matches(base: &str, state: &AppState) -> bool {
    let want = bare_name(base);
    let served = [
        state.config().model_id.as_str(),
        state.model().info().name.as_str(),
    ];
    served.iter().any(|s| {
        let s = bare_name(s);
        s == want || s.starts_with(&format!("{want}.")) || s.starts_with(&format!("{want}-q"))
    })
}

/// `GET /v1/adapters/available`: adapters found on disk for the served base.
pub async fn available(State(state): State<AppState>) -> Json<Value> {
    let roots = scan_roots(&state);
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        for dir in dirs {
            let Some((rank, scale, base)) = describe(&dir) else {
                continue;
            };
            if base.as_deref().is_some_and(|b| !base_matches(b, &state)) {
                continue;
            }
            let id = default_id(&dir);
            out.push(json!({
                "id": id,
                "path": dir.display().to_string(),
                "rank": rank,
                "scale": scale,
                "base_model": base,
                "mounted": state.adapters().contains(&id),
            }));
        }
    }
    Json(json!({ "adapters": out }))
}

/// vLLM's `POST /v1/load_lora_adapter` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LoadLoraRequest {
    /// The id.
    pub lora_name: Option<String>,
    /// The adapter directory.
    pub lora_path: Option<String>,
}

impl RequestBody for LoadLoraRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<LoadLoraRequest>().to_vec()
    }
}

/// `POST /v1/load_lora_adapter {lora_name, lora_path}` (vLLM): answers in vLLM's plain
/// text on success.
pub async fn load_lora(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<LoadLoraRequest>,
) -> Result<Response, ApiError> {
    let name = req
        .lora_name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: "lora_name".into(),
        })?;
    mount(
        &state,
        Some(name.clone()),
        req.lora_path,
        ("lora_name", "lora_path"),
    )
    .await?;
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// `POST /v1/unload_lora_adapter {lora_name}` (vLLM).
pub async fn unload_lora(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<LoadLoraRequest>,
) -> Result<Response, ApiError> {
    let name = req
        .lora_name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: "lora_name".into(),
        })?;
    state
        .adapters()
        .remove(&name)
        .ok_or(ApiError::AdapterNotFound { id: name.clone() })?;
    tracing::info!(id = %name, "adapter unmounted");
    Ok(format!("Success: LoRA adapter '{name}' removed successfully.").into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names() {
        assert_eq!(
            bare_name("/c/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/abc"),
            "smollm2-135m-instruct"
        );
        assert_eq!(
            bare_name("HuggingFaceTB/SmolLM2-135M-Instruct"),
            "smollm2-135m-instruct"
        );
        assert_eq!(bare_name("/m/x.gguf"), "x");
    }
}
