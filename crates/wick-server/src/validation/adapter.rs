//! Which mounted LoRA adapters a generation request runs with: its `adapter` field, a
//! `model` naming mounted adapters, or the server's default adapter.
use wick_engine::adapters::AdapterStack;

use crate::error::ApiError;
use crate::state::AppState;

/// The adapters a request runs with: its `adapter` field when given; else, following
/// vLLM, a `model` that names mounted adapters (and not the served model); else the
/// default adapter (`serve --adapter`), if any. An unknown adapter is a 400 on `adapter`.
pub fn select(
    state: &AppState,
    adapter: Option<&str>,
    model: Option<&str>,
) -> Result<AdapterStack, ApiError> {
    let registry = state.adapters();
    if let Some(sel) = adapter {
        return registry
            .resolve(Some(sel))
            .map_err(|e| ApiError::field("adapter", e.to_string()));
    }
    if let Some(m) = model.filter(|m| !state.answers_to(m)) {
        if let Ok(stack) = registry.resolve(Some(m)) {
            if !stack.is_empty() {
                return Ok(stack);
            }
        }
    }
    registry
        .resolve(None)
        .map_err(|e| ApiError::field("adapter", e.to_string()))
}
