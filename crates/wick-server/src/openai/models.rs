//! `GET /v1/models` wire types.
use serde::Serialize;

/// `{"object": "list", "data": [...]}`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The id requests may name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds the server started.
    pub created: u64,
    /// `wick`.
    pub owned_by: &'static str,
    /// Context limit in tokens.
    pub context_window: usize,
    /// Architecture.
    pub arch: String,
    /// Whether the chat template writes `<think>` reasoning.
    pub reasoning: bool,
    /// Whether the chat template renders tools.
    pub tools: bool,
}
