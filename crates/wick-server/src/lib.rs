//! wick's OpenAI-compatible HTTP server.
//!
//! A request travels a chain of small stages: the router ([`routes::app`]) and its
//! middleware (span, metrics, auth, panic guard) → the JSON extractor ([`extract::ApiJson`],
//! bad bodies answer in OpenAI's shape) → the handler, which makes one call into
//! [`prepare`]: validation into a checked request ([`validation`]: ranges, defaults with the
//! precedence request → server flag → `generation_config.json` → built-in, adapters,
//! grammars), media loading ([`media`]), prompt building on blocking workers
//! ([`prepare::prompt`]), admission into the engine's queue ([`generation::Generation`]; a
//! full queue is 429) → the engine thread (continuous batching, in `wick-engine`) → the
//! request's token channel → the reply pipeline ([`reply`]: `<think>` split, then tool
//! calls, finish reason and usage, the same for every protocol) → the protocol's encoder
//! ([`encoders`]: a JSON body or SSE frames), which the handler picks. Every failure is an
//! [`ApiError`], mapped to status and body in one place. Dropping a response (client gone)
//! drops its [`generation::Generation`], which cancels the work in the engine within one
//! step.
//!
//! ```no_run
//! use std::sync::Arc;
//! use wick_engine::scheduler::{Engine, EngineConfig};
//! use wick_engine::{LoadOptions, Model};
//! use wick_server::{AppState, ServerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let model = Arc::new(Model::load("model.gguf".as_ref(), &LoadOptions::default())?);
//! let engine = Engine::start(model, EngineConfig::default())?;
//! let state = AppState::new(engine, ServerConfig::new("my-model"))?;
//! let listener = wick_server::bind("127.0.0.1", 8080)?;
//! wick_server::run(listener, state, |addr| println!("http://{addr}/v1"))?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod anthropic;
pub mod cache_report;
pub mod config;
pub mod connections;
pub mod encoders;
pub mod error;
pub mod extract;
pub mod generation;
pub mod jobs;
pub mod logprobs;
pub mod media;
pub mod metrics;
pub mod middleware;
pub mod openai;
pub mod prepare;
pub mod replica;
pub mod reply;
pub mod response_store;
pub mod routes;
mod server;
pub mod sse;
pub mod state;
pub mod validation;

pub use config::{SamplingDefaults, ServerConfig};
pub use error::{ApiError, StartupError};
pub use jobs::JobsConfig;
pub use routes::app;
pub use server::{bind, run, serve, shutdown_signal};
pub use state::AppState;
