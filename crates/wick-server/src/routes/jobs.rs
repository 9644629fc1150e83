//! Fine-tuning over HTTP (reference E.3, E.9): `POST /api/finetune/inspect-dataset`,
//! `POST /api/finetune/submit`, `GET /api/jobs`, `GET /api/jobs/{id}`,
//! `GET /api/jobs/{id}/stream` (server-sent events) and `POST /api/jobs/{id}/cancel`.
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::response::sse::Event;
use axum::response::Response;
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use wick_hub::hf::RepoRef;
use wick_hub::{HubError, Store};
use wick_train::data::{PromptStyle, TemplateKnown};

use crate::error::ApiError;
use crate::extract::{struct_fields, typed, ApiJson, RequestBody};
use crate::jobs::finetune::FinetuneSubmit;
use crate::jobs::{JobError, JobRow, Jobs};
use crate::state::AppState;

fn jobs(state: &AppState) -> Result<&Arc<Jobs>, ApiError> {
    state
        .jobs()
        .map_err(|reason| ApiError::JobsUnavailable(reason.to_string()))
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::NotFound(id) => ApiError::JobNotFound { id },
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// `POST /api/finetune/inspect-dataset` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct InspectRequest {
    /// The dataset directory.
    pub path: Option<String>,
    /// The base model the job would train (as `model_dir` of a submit): when it is the
    /// served model, the answer says for sure whether prompts meet its chat template.
    pub model_dir: Option<String>,
    /// As a submit's `raw_prompt`: string prompts as plain text.
    pub raw_prompt: Option<bool>,
}

impl RequestBody for InspectRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<InspectRequest>().to_vec()
    }
}

/// The dataset's format, row counts and how its prompts become tokens (`prompt_rendering`
/// `chat_template` or `raw`, and `rendering`, a sentence saying so).
fn inspect(dir: &Path, style: PromptStyle, template: TemplateKnown) -> Result<Value, String> {
    let s = wick_train::data::inspect(dir).map_err(|e| e.to_string())?;
    let rendering = s.rendering(style, template);
    Ok(
        json!({"format": s.format.name(), "n_train": s.n_train, "n_valid": s.n_valid,
              "string_prompts": s.string_prompts, "prompt_rendering": rendering.name(),
              "rendering": rendering.describe()}),
    )
}

/// Whether the model a job would train has a chat template: known when `model_dir` names
/// the served model (the trainer reads the model's own template, never `--chat-template`).
fn template_of(state: &AppState, model_dir: Option<&str>) -> TemplateKnown {
    let Some(arg) = model_dir.map(str::trim).filter(|a| !a.is_empty()) else {
        return TemplateKnown::Unknown;
    };
    let served = &state.model().info().path;
    let same_path = |p: &Path| match (p.canonicalize(), served.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => p == served,
    };
    let is_served = state.answers_to(arg)
        || same_path(Path::new(arg))
        || Store::from_env()
            .ok()
            .and_then(|store| store.resolve(arg).ok())
            .is_some_and(|m| same_path(&m.path));
    if is_served {
        TemplateKnown::from(state.model().chat_template().is_some())
    } else {
        TemplateKnown::Unknown
    }
}

/// `POST /api/finetune/inspect-dataset {path, model_dir?, raw_prompt?}` → `{ok, n_train,
/// n_valid, format, string_prompts, prompt_rendering, rendering, error?}` (a dataset that
/// cannot be used is `ok: false` with the reason, not an HTTP error).
pub async fn inspect_dataset(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<InspectRequest>,
) -> Result<Json<Value>, ApiError> {
    let path = req
        .path
        .filter(|p| !p.trim().is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: "path".into(),
        })?;
    let style = PromptStyle::from_raw_flag(req.raw_prompt.unwrap_or(false));
    let found = tokio::task::spawn_blocking(move || {
        let template = template_of(&state, req.model_dir.as_deref());
        inspect(Path::new(&path), style, template)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("inspecting failed: {e}")))?;
    Ok(Json(match found {
        Ok(mut v) => {
            v["ok"] = json!(true);
            v
        }
        Err(error) => {
            json!({"ok": false, "n_train": 0, "n_valid": 0, "format": null, "error": error})
        }
    }))
}

/// A model argument the trainer will be able to load: a path, a stored model, a catalog
/// name (fetched by the job if not downloaded yet) or a Hub repository id.
fn check_model(arg: &str) -> Result<(), ApiError> {
    let store = Store::from_env().map_err(|e| ApiError::Internal(e.to_string()))?;
    match store.resolve(arg) {
        Ok(_) | Err(HubError::NotDownloaded { .. }) => Ok(()),
        Err(_) if RepoRef::looks_like_repo(arg) => Ok(()),
        Err(e) => Err(ApiError::field("model_dir", e.to_string())),
    }
}

/// `POST /api/finetune/submit` → `{ok, job_id, adapter_path}`: queues a fine-tune job.
pub async fn submit(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<FinetuneSubmit>,
) -> Result<Json<Value>, ApiError> {
    let jobs = jobs(&state)?.clone();
    let adapters = jobs.adapters_dir().to_path_buf();
    let config = tokio::task::spawn_blocking(move || {
        let template = template_of(&state, req.model_dir.as_deref());
        let config = req.check(
            |dir, style| inspect(dir, style, template),
            &adapters,
            crate::jobs::db::now(),
        )?;
        check_model(&config.model_dir)?;
        Ok::<_, ApiError>(config)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("checking the job failed: {e}")))??;
    let id = jobs.submit_finetune(&config)?;
    Ok(Json(json!({
        "ok": true,
        "job_id": id,
        "adapter_path": config.adapter_path,
        "status": "queued",
    })))
}

/// `GET /api/jobs`: every job, newest first.
pub async fn list(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let rows = jobs(&state)?.list()?;
    Ok(Json(json!({ "jobs": rows })))
}

/// `GET /api/jobs/{id}`.
pub async fn get(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<JobRow>, ApiError> {
    Ok(Json(jobs(&state)?.get(&id)?))
}

/// `POST /api/jobs/{id}/cancel` → `{ok, id, status}`: a queued job is cancelled at once; a
/// running one is asked to stop (it saves the adapter so far) and streams `cancelled`.
pub async fn cancel(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let status = jobs(&state)?.cancel(&id)?;
    Ok(Json(json!({"ok": true, "id": id, "status": status.name()})))
}

/// How often the stream looks for new events.
const POLL: Duration = Duration::from_millis(200);

struct Tail {
    jobs: Arc<Jobs>,
    id: String,
    offset: u64,
    over: bool,
}

/// `GET /api/jobs/{id}/stream`: `retry: 1500`, then one `data:` frame per logged event (the
/// whole log so far, then new ones as they come) until the job has ended, then
/// `event: end` with `data: {}`.
pub async fn stream(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Response, ApiError> {
    let jobs = jobs(&state)?.clone();
    jobs.get(&id)?;
    let first = stream::once(async { Event::default().retry(Duration::from_millis(1500)) });
    let tail = Tail {
        jobs,
        id,
        offset: 0,
        over: false,
    };
    let events = stream::unfold(tail, |mut t| async move {
        if t.over {
            return None;
        }
        loop {
            let row = match t.jobs.get(&t.id) {
                Ok(row) => row,
                Err(e) => {
                    t.over = true;
                    let failed = json!({"type": "failed", "error": e.to_string(), "ts": crate::jobs::db::now()});
                    let frames = vec![Event::default().data(failed.to_string()), end()];
                    return Some((stream::iter(frames), t));
                }
            };
            let (lines, offset) = t.jobs.events_from(&row, t.offset);
            t.offset = offset;
            if !lines.is_empty() {
                let frames: Vec<Event> = lines.into_iter().map(|l| Event::default().data(l)).collect();
                return Some((stream::iter(frames), t));
            }
            if row.status.is_terminal() {
                t.over = true;
                return Some((stream::iter(vec![end()]), t));
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .flatten();
    Ok(crate::sse::response(first.chain(events)))
}

fn end() -> Event {
    Event::default().event("end").data("{}")
}
