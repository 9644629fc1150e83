//! `GET /library` (local models with their fit), `GET /fit` (the fit report of the served
//! model or `?model=`) and `GET /downloads` (this process's recent and running downloads).
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use wick_engine::backend::candle::KvDtype;
use wick_hub::fit::{Device, FitModel, Machine, DEFAULT_CTX};
use wick_hub::Store;

use crate::error::ApiError;
use crate::state::AppState;

/// How long a library scan is reused.
const LIBRARY_TTL: Duration = Duration::from_secs(30);

/// The context `/fit`'s SKU matrix is computed at.
const SKU_MATRIX_CTX: usize = 32768;

static LIBRARY: Mutex<Option<(Instant, Vec<Value>)>> = Mutex::new(None);

/// Bits per weight a quantization name says (`Q4_K_M` → 4, `BF16` → 16, `4-bit` → 4).
fn quant_bits(quant: &str) -> Option<u32> {
    let q = quant.to_ascii_uppercase();
    let digits: String = q
        .trim_start_matches("IQ")
        .trim_start_matches('Q')
        .trim_start_matches("BF")
        .trim_start_matches('F')
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn machine() -> (Machine, Option<Store>) {
    let store = Store::from_env().ok();
    let root = store
        .as_ref()
        .map(|s| s.root().to_path_buf())
        .unwrap_or_default();
    (Machine::detect(Device::Cpu, &root), store)
}

/// `towers`: the served model's `(vision, audio)`, which its row reports (other rows can
/// only say whether their config declares a vision tower).
fn scan_library(served: &std::path::Path, towers: (bool, bool)) -> Vec<Value> {
    let (machine, store) = machine();
    let Some(store) = store else {
        return Vec::new();
    };
    let mut rows: Vec<Value> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for m in store.list() {
        // One row per repository: the HF cache's `ORG/NAME/<file>` rows fold into the first.
        let repo_id = match m.origin {
            wick_hub::ModelOrigin::HfCache => {
                m.name.splitn(3, '/').take(2).collect::<Vec<_>>().join("/")
            }
            wick_hub::ModelOrigin::Store => m.name.clone(),
        };
        if !seen.insert(repo_id.clone()) {
            continue;
        }
        let fit = FitModel::read(&m.path, m.format).ok();
        let vision = m.format == wick_hub::ModelKind::HfDir
            && std::fs::read_to_string(m.path.join("config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|c| c.get("vision_config").is_some());
        let assessment = fit.as_ref().map(|f| {
            let r = f.assess(
                Some(DEFAULT_CTX.min(f.context_length)),
                None,
                &machine,
                None,
            );
            json!({
                "fits": r.fits,
                "max_safe_context": r.max_safe_context,
                "predicted_decode_tps": r.predicted_decode_tps,
            })
        });
        let serving = std::fs::canonicalize(&m.path).ok() == std::fs::canonicalize(served).ok();
        let (vision, audio) = if serving { towers } else { (vision, false) };
        rows.push(json!({
            "repo_id": repo_id,
            "model_type": m.arch,
            "size_bytes": m.size_bytes,
            "quant_bits": fit.as_ref().and_then(|f| quant_bits(&f.quant)),
            "vision": vision,
            "audio": audio,
            "supported": fit.is_some(),
            "support_tier": fit.as_ref().map(|_| "targeted"),
            "serving": serving,
            "assessment": assessment,
        }));
    }
    rows
}

/// `GET /library`.
pub async fn library(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let served = state.model().info().path.clone();
    let media = &state.model().info().media;
    let towers = (media.vision.is_some(), media.audio.is_some());
    let cached = LIBRARY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .filter(|(at, _)| at.elapsed() < LIBRARY_TTL)
        .map(|(_, rows)| rows.clone());
    let rows = match cached {
        Some(rows) => rows,
        None => {
            let rows = tokio::task::spawn_blocking(move || scan_library(&served, towers))
                .await
                .map_err(|e| ApiError::Internal(format!("library scan: {e}")))?;
            *LIBRARY.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((Instant::now(), rows.clone()));
            rows
        }
    };
    Ok(Json(json!({ "models": rows })))
}

/// `GET /fit` query parameters.
#[derive(Debug, Deserialize)]
pub struct FitQuery {
    /// A local model (default: the served one).
    model: Option<String>,
    /// Context tokens (default 8192, capped at the model's).
    ctx: Option<String>,
    /// `f16` or `f32` (default: the format's).
    kv_type: Option<String>,
}

/// `GET /fit`.
pub async fn fit(
    State(state): State<AppState>,
    Query(q): Query<FitQuery>,
) -> Result<Json<Value>, ApiError> {
    let ctx = match q.ctx.as_deref() {
        None | Some("") => None,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if n > 0 && n <= 1 << 30 => Some(n),
            _ => {
                return Err(ApiError::field(
                    "ctx",
                    format!("must be a positive integer, got '{s}'"),
                ))
            }
        },
    };
    let kv = match q.kv_type.as_deref() {
        None | Some("") => None,
        Some(s) => Some(
            s.parse::<KvDtype>()
                .map_err(|e| ApiError::field("kv_type", e))?,
        ),
    };
    let served = state.model().info().path.clone();
    let model_arg = q.model.clone();
    let result = tokio::task::spawn_blocking(move || -> Result<Value, ApiError> {
        let (machine, store) = machine();
        let (path, kind) = match &model_arg {
            None => {
                let kind = if served.is_dir() {
                    wick_hub::ModelKind::HfDir
                } else {
                    wick_hub::ModelKind::Gguf
                };
                (served, kind)
            }
            Some(name) => {
                let store = store.ok_or_else(|| ApiError::Internal("no model store".into()))?;
                let r = store.resolve(name).map_err(|e| ApiError::field("model", e.to_string()))?;
                (r.path, r.kind)
            }
        };
        let model = FitModel::read(&path, kind).map_err(|e| ApiError::field("model", e.to_string()))?;
        let report = model.assess(ctx, kv, &machine, None);
        let typical_ctx = DEFAULT_CTX.min(model.context_length);
        let typical = model.assess(Some(typical_ctx), kv, &machine, None);
        let kv = kv.unwrap_or(model.default_kv);
        let matrix: Vec<Value> = model
            .sku_matrix(SKU_MATRIX_CTX.min(model.context_length), kv)
            .into_iter()
            .map(|(sku, gb, r)| {
                json!({"sku": sku, "ram_gb": gb, "fits": r.fits, "max_context": r.max_context, "decode_tps": r.predicted_decode_tps})
            })
            .collect();
        Ok(json!({
            "machine": {
                "chip": machine.chip,
                "ram_bytes": machine.ram_bytes,
                "bandwidth_gbs": machine.bandwidth_gbs,
                "bandwidth_source": machine.bandwidth_source,
            },
            "model": model.path,
            "context_tokens": report.context_tokens,
            "typical_context_tokens": typical_ctx,
            "typical_decode_tps": typical.predicted_decode_tps,
            "measured_decode_tps": Value::Null,
            "measured_at": machine.measured_at,
            "report": report,
            "sku_matrix_ctx": SKU_MATRIX_CTX.min(model.context_length),
            "sku_matrix": matrix,
        }))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("fit: {e}")))??;
    Ok(Json(result))
}

/// `GET /downloads`: the last downloads of this process (running ones always).
pub async fn downloads() -> Json<Value> {
    Json(json!({ "downloads": wick_hub::hf::recent_downloads() }))
}

#[cfg(test)]
mod tests {
    use super::quant_bits;

    #[test]
    fn quant_names_give_bits() {
        assert_eq!(quant_bits("Q4_K_M"), Some(4));
        assert_eq!(quant_bits("Q8_0"), Some(8));
        assert_eq!(quant_bits("IQ2_XS"), Some(2));
        assert_eq!(quant_bits("BF16"), Some(16));
        assert_eq!(quant_bits("F32"), Some(32));
        assert_eq!(quant_bits("4-bit"), Some(4));
        assert_eq!(quant_bits("?"), None);
    }
}
