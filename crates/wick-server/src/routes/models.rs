//! `GET /v1/models` and `GET /v1/models/{id}`: the served model.
use axum::extract::{Path, State};
use axum::Json;

use crate::error::ApiError;
use crate::openai::models::{rfc3339, ModelCard, ModelList};
use crate::state::AppState;

fn card(state: &AppState) -> ModelCard {
    let info = state.model().info();
    let caps = state.template_capabilities();
    ModelCard {
        id: state.config().model_id.clone(),
        object: "model",
        kind: "model",
        display_name: state.config().model_id.clone(),
        created: state.started_unix(),
        created_at: rfc3339(state.started_unix()),
        owned_by: "wick",
        context_window: info.context_length,
        arch: info.arch.to_string(),
        reasoning: caps.is_some_and(|c| c.uses_think_tags),
        tools: caps.is_some_and(|c| c.uses_tools),
        vision: info.media.vision.is_some(),
        audio: info.media.audio.is_some(),
        parent: None,
        root: None,
    }
}

/// The cards of the mounted adapters (requests select one with `model: "<id>"`, as vLLM).
fn adapter_cards(state: &AppState) -> Vec<ModelCard> {
    let base = card(state);
    state
        .adapters()
        .list()
        .iter()
        .map(|a| ModelCard {
            id: a.id().to_string(),
            display_name: a.id().to_string(),
            parent: Some(base.id.clone()),
            root: Some(a.info().path.display().to_string()),
            ..base.clone()
        })
        .collect()
}

/// Lists the served model.
pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    let card = card(&state);
    let mut data = vec![card];
    data.extend(adapter_cards(&state));
    Json(ModelList {
        object: "list",
        has_more: false,
        first_id: data.first().map(|c| c.id.clone()),
        last_id: data.last().map(|c| c.id.clone()),
        data,
    })
}

/// The served model when `id` names it (its id, an alias or the model's file name), else 404.
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let served = &state.config().model_id;
    if state.answers_to(&id) {
        Ok(Json(card(&state)))
    } else if let Some(c) = adapter_cards(&state).into_iter().find(|c| c.id == id) {
        Ok(Json(c))
    } else {
        Err(ApiError::ModelNotFound {
            id,
            served: served.clone(),
        })
    }
}
