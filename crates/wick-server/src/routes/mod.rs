//! The router: one handler file per endpoint family, middleware applied once here.
pub mod adapters;
pub mod admin;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod finetune_tools;
pub mod jobs;
pub mod library;
pub mod messages;
pub mod models;
pub mod ops;
pub mod render;
pub mod replica;
pub mod responses;
pub mod ui;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::handler::Handler;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{delete, get, post, MethodRouter};
use axum::{Extension, Router};

use crate::anthropic::error::anthropic_errors;
use crate::middleware;
use crate::state::AppState;

/// The endpoints a router serves, as `GET /v1` lists them: recorded as routes are added, so
/// the list cannot drift from the router.
#[derive(Debug, Clone, Default)]
pub struct Endpoints(pub Arc<Vec<String>>);

/// A router that records each route it adds.
struct Table {
    router: Router<AppState>,
    listed: Vec<String>,
}

impl Table {
    fn new() -> Self {
        Table {
            router: Router::new(),
            listed: Vec::new(),
        }
    }

    fn route(mut self, methods: &[&str], path: &str, handler: MethodRouter<AppState>) -> Self {
        // `{*id}` is axum's syntax; the list shows the parameter.
        for method in methods {
            self.listed
                .push(format!("{method} {}", path.replace("{*", "{")));
        }
        self.router = self.router.route(path, handler);
        self
    }

    fn get<H, T>(self, path: &str, handler: H) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static,
    {
        self.route(&["GET"], path, get(handler))
    }

    fn post<H, T>(self, path: &str, handler: H) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static,
    {
        self.route(&["POST"], path, post(handler))
    }
}

/// The whole HTTP application for `state`; tests drive it without a socket.
pub fn app(state: AppState) -> Router {
    let mut api = Table::new()
        .post("/v1/chat/completions", chat::chat_completions)
        .post("/v1/completions", completions::completions)
        .post("/v1/chat/completions/render", render::chat)
        .post("/v1/completions/render", render::completions)
        .post("/v1/embeddings", embeddings::refuse)
        .post("/v1/messages", messages::messages)
        .post("/v1/messages/count_tokens", messages::count_tokens)
        .post("/v1/responses", responses::create)
        .route(
            &["GET", "DELETE"],
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .get("/v1/models", models::list)
        .get("/v1/models/{*id}", models::get)
        .get("/v1", ops::index)
        .get("/stats", ops::stats)
        .get("/metrics", ops::metrics)
        .get("/version", replica::version)
        .get("/server_info", replica::server_info)
        .post("/admin/cache/flush", admin::flush_cache)
        .get("/library", library::library)
        .get("/fit", library::fit)
        .get("/downloads", library::downloads)
        .route(
            &["GET", "POST"],
            "/v1/adapters",
            get(adapters::list).post(adapters::create),
        )
        .get("/v1/adapters/available", adapters::available)
        .route(&["DELETE"], "/v1/adapters/{id}", delete(adapters::delete))
        .post("/v1/load_lora_adapter", adapters::load_lora)
        .post("/v1/unload_lora_adapter", adapters::unload_lora)
        .post("/api/finetune/inspect-dataset", jobs::inspect_dataset)
        .post("/api/finetune/submit", jobs::submit)
        .post("/api/finetune/merge", finetune_tools::merge)
        .post("/api/finetune/export", finetune_tools::export)
        .get("/api/jobs", jobs::list)
        .get("/api/jobs/{id}", jobs::get)
        .get("/api/jobs/{id}/stream", jobs::stream)
        .post("/api/jobs/{id}/cancel", jobs::cancel);
    // The UI's files hold no data: the page asks for the key and sends it on its API calls.
    let mut open = Table::new()
        .get("/health", ops::health)
        .get("/", ui::index)
        .get("/ui/{*file}", ui::file);
    // `--public-load`: routers' load polls carry no key (vllm-router's power_of_two).
    if state.config().public_load {
        open = open.get("/get_load", replica::get_load);
    } else {
        api = api.get("/get_load", replica::get_load);
    }
    let mut listed = api.listed;
    listed.extend(open.listed);
    let api = api.router.route_layer(from_fn_with_state(
        state.clone(),
        middleware::require_api_key::<AppState>,
    ));
    let limit = state.config().max_body_bytes;
    api.merge(open.router)
        .fallback(ops::not_found::<AppState>)
        .method_not_allowed_fallback(ops::method_not_allowed::<AppState>)
        .layer(Extension(Endpoints(Arc::new(listed))))
        .layer(DefaultBodyLimit::max(limit))
        .layer(from_fn(middleware::catch_panic))
        .layer(from_fn_with_state(state.clone(), middleware::guard))
        .layer(from_fn(middleware::close_if_body_unread))
        .layer(from_fn(anthropic_errors))
        .layer(from_fn_with_state(state.clone(), middleware::observe))
        .with_state(state)
}
