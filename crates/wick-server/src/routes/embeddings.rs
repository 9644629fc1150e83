//! `POST /v1/embeddings`.
//!
//! A server started for a generation model answers it with 400 ([`refuse`]). An embedding
//! model (an encoder, or a decoder started with `--embedding`) is served by its own small
//! application ([`embedding_app`]): `/v1/embeddings`, `/v1/models`, `/v1` and `/health`,
//! with the generation endpoints answering 400. Embedding requests run inline on blocking
//! workers, one batch at a time (not through the generation queue): each request's inputs
//! are one batched forward pass.
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderMap;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use wick_engine::embedding::Embedder;
use wick_engine::EngineError;

use crate::connections;
use crate::encoders::embeddings::{response_body, EmbeddingInput, EmbeddingsRequest};
use crate::error::{ApiError, StartupError};
use crate::middleware::{self, ServerState};
use crate::openai::models::{rfc3339, ModelCard, ModelList};
use crate::state::AppState;
use crate::ServerConfig;

/// The generation endpoints an embedding server refuses with 400.
const GENERATION_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
];

/// `/v1/embeddings` on a generation server: 400, saying how to serve embeddings.
pub async fn refuse(State(state): State<AppState>) -> ApiError {
    ApiError::Unsupported {
        param: "model".into(),
        message: format!(
            "{} is served as a generation model; embeddings need an embedding model \
             (an encoder such as `wick serve minilm`, or a decoder started with `wick serve MODEL --embedding`)",
            state.config().model_id
        ),
    }
}

/// What an embedding server holds.
#[derive(Clone)]
pub struct EmbedState {
    embedder: Arc<Embedder>,
    config: Arc<ServerConfig>,
    /// One batch at a time: a forward pass already uses every core.
    busy: Arc<tokio::sync::Semaphore>,
    started_unix: u64,
}

impl EmbedState {
    /// State for serving `embedder` with `config` (its id, aliases, API key, limits).
    pub fn new(embedder: Arc<Embedder>, config: ServerConfig) -> Self {
        EmbedState {
            embedder,
            config: Arc::new(config),
            busy: Arc::new(tokio::sync::Semaphore::new(1)),
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// The model.
    pub fn embedder(&self) -> &Arc<Embedder> {
        &self.embedder
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }
}

fn engine_error(param: &str, e: EngineError) -> ApiError {
    match e {
        EngineError::InvalidInput(m) => ApiError::field(param, m),
        EngineError::ContextOverflow { needed, limit } => ApiError::field(
            param,
            format!("an input of {needed} tokens is longer than the model's {limit}"),
        ),
        EngineError::Tokenizer(t) => ApiError::PromptBuild(t.to_string()),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Tokenizes, checks and embeds a request: the response body.
pub fn embed_request(
    embedder: &Embedder,
    model_id: &str,
    req: &EmbeddingsRequest,
) -> Result<Value, ApiError> {
    if let Some(d) = req.dimensions {
        embedder
            .check_dimensions(d)
            .map_err(|e| engine_error("dimensions", e))?;
    }
    let prompt = embedder
        .prompt(req.prompt_name.as_deref(), req.instruction.as_deref())
        .map_err(|e| engine_error("prompt_name", e))?;
    let mut batch = Vec::with_capacity(req.inputs.len());
    for (i, input) in req.inputs.iter().enumerate() {
        let param = if req.inputs.len() == 1 {
            "input".to_string()
        } else {
            format!("input[{i}]")
        };
        let ids = match input {
            EmbeddingInput::Text(text) => embedder
                .encode_text(text, prompt.as_deref())
                .map_err(|e| engine_error(&param, e))?,
            EmbeddingInput::Ids(ids) => {
                embedder
                    .check_ids(ids)
                    .map_err(|e| engine_error(&param, e))?;
                ids.clone()
            }
        };
        batch.push(ids);
    }
    let tokens = batch.iter().map(Vec::len).sum();
    let started = std::time::Instant::now();
    let vectors = embedder
        .embed(&batch, req.dimensions)
        .map_err(|e| engine_error("input", e))?;
    tracing::info!(
        inputs = batch.len(),
        tokens,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "embedded"
    );
    Ok(response_body(
        model_id,
        &vectors,
        req.encoding_format,
        tokens,
    ))
}

/// `POST /v1/embeddings` on an embedding server.
pub async fn create(
    State(state): State<EmbedState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.to_ascii_lowercase().contains("json") {
        return Err(ApiError::UnsupportedMediaType {
            content_type: content_type.to_string(),
        });
    }
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    let req = EmbeddingsRequest::parse(&value)?;
    let _turn = state
        .busy
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::ShuttingDown)?;
    let embedder = state.embedder.clone();
    let model_id = state.config.model_id.clone();
    let body = tokio::task::spawn_blocking(move || embed_request(&embedder, &model_id, &req))
        .await
        .map_err(|e| ApiError::Internal(format!("embedding worker failed: {e}")))??;
    Ok(Json(body))
}

fn card(state: &EmbedState) -> ModelCard {
    let info = state.embedder.info();
    ModelCard {
        id: state.config.model_id.clone(),
        object: "model",
        kind: "model",
        display_name: state.config.model_id.clone(),
        created: state.started_unix,
        created_at: rfc3339(state.started_unix),
        owned_by: "wick",
        context_window: info.max_tokens,
        arch: info.arch.clone(),
        reasoning: false,
        tools: false,
        vision: false,
        audio: false,
        parent: None,
        root: None,
    }
}

async fn list_models(State(state): State<EmbedState>) -> Json<ModelList> {
    let card = card(&state);
    Json(ModelList {
        object: "list",
        has_more: false,
        first_id: Some(card.id.clone()),
        last_id: Some(card.id.clone()),
        data: vec![card],
    })
}

async fn get_model(
    State(state): State<EmbedState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let cfg = &state.config;
    if id == cfg.model_id || cfg.model_aliases.contains(&id) {
        Ok(Json(card(&state)))
    } else {
        Err(ApiError::ModelNotFound {
            id,
            served: cfg.model_id.clone(),
        })
    }
}

async fn index(State(state): State<EmbedState>) -> Json<Value> {
    let info = state.embedder.info();
    let mut endpoints = vec![
        "POST /v1/embeddings",
        "GET /v1/models",
        "GET /v1/models/{id}",
        "GET /v1",
        "GET /health",
    ];
    endpoints.sort_unstable();
    Json(json!({
        "name": "wick",
        "version": env!("CARGO_PKG_VERSION"),
        "model": state.config.model_id,
        "embedding": {
            "dimensions": info.dimensions,
            "max_tokens": info.max_tokens,
            "pooling": info.pooling.name(),
            "normalize": info.normalize,
            "matryoshka_min_dimensions": info.matryoshka_min,
        },
        "endpoints": endpoints,
    }))
}

async fn generation_refused(State(state): State<EmbedState>) -> ApiError {
    ApiError::Unsupported {
        param: "model".into(),
        message: format!(
            "{} is served as an embedding model: only /v1/embeddings answers; start `wick serve` with a generation model (without --embedding) for completions",
            state.config.model_id
        ),
    }
}

impl ServerState for EmbedState {
    fn server_config(&self) -> &ServerConfig {
        &self.config
    }
}

/// The HTTP application of an embedding server; tests drive it without a socket.
pub fn embedding_app(state: EmbedState) -> Router {
    let mut api = Router::new()
        .route("/v1/embeddings", post(create))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1", get(index));
    for path in GENERATION_ROUTES {
        api = api.route(path, post(generation_refused));
    }
    let api = api.route_layer(from_fn_with_state(
        state.clone(),
        middleware::require_api_key::<EmbedState>,
    ));
    let limit = state.config.max_body_bytes;
    api.route("/health", get(super::ops::health))
        .fallback(super::ops::not_found::<EmbedState>)
        .method_not_allowed_fallback(super::ops::method_not_allowed::<EmbedState>)
        .layer(DefaultBodyLimit::max(limit))
        .layer(from_fn(middleware::catch_panic))
        .with_state(state)
}

/// Serves an embedding model on `listener` until `shutdown` resolves.
pub async fn serve_embeddings(
    listener: tokio::net::TcpListener,
    state: EmbedState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let grace = state.config.shutdown_grace;
    let limits = connections::Limits::from_config(&state.config);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut server = tokio::spawn(connections::serve(
        listener,
        embedding_app(state),
        limits,
        stop_rx,
    ));
    tokio::select! {
        result = &mut server => {
            return match result {
                Ok(r) => r.map_err(StartupError::Serve),
                Err(e) => Err(StartupError::Serve(std::io::Error::other(e))),
            };
        }
        _ = shutdown => {}
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(grace + Duration::from_secs(1), &mut server).await {
        Ok(Ok(result)) => result.map_err(StartupError::Serve),
        Ok(Err(e)) => Err(StartupError::Serve(std::io::Error::other(e))),
        Err(_) => {
            server.abort();
            Ok(())
        }
    }
}

/// Builds a runtime and serves an embedding model until SIGINT/SIGTERM; `on_ready` gets
/// the bound address.
pub fn run_embeddings(
    listener: std::net::TcpListener,
    state: EmbedState,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), StartupError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("wick-http")
        .build()
        .map_err(StartupError::Serve)?;
    connections::raise_fd_limit();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(StartupError::Serve)?;
        let addr = listener.local_addr().map_err(StartupError::Serve)?;
        let shutdown = crate::shutdown_signal();
        on_ready(addr);
        serve_embeddings(listener, state, shutdown).await
    })?;
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}
