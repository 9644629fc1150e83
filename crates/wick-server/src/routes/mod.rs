//! The router: one handler file per endpoint family, middleware applied once here.
pub mod admin;
pub mod chat;
pub mod completions;
pub mod messages;
pub mod models;
pub mod ops;
pub mod responses;

use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, post};
use axum::Router;

use crate::anthropic::error::anthropic_errors;
use crate::middleware;
use crate::state::AppState;

/// The whole HTTP application for `state`; tests drive it without a socket.
pub fn app(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::get))
        .route("/v1", get(ops::index))
        .route("/stats", get(ops::stats))
        .route("/metrics", get(ops::metrics))
        .route("/admin/cache/flush", post(admin::flush_cache))
        .route_layer(from_fn_with_state(
            state.clone(),
            middleware::require_api_key,
        ));
    let open = Router::new().route("/health", get(ops::health));
    let limit = state.config().max_body_bytes;
    api.merge(open)
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(from_fn(middleware::catch_panic))
        .layer(from_fn_with_state(state.clone(), middleware::guard))
        .layer(from_fn(middleware::close_if_body_unread))
        .layer(from_fn(anthropic_errors))
        .layer(from_fn_with_state(state.clone(), middleware::observe))
        .with_state(state)
}
