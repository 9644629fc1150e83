//! The engine loop: one thread owns the model and runs every admitted request in one
//! batched forward pass per step (continuous batching); callers talk to it through a
//! cloneable [`EngineHandle`] and get each request's tokens back on its own channel.
//!
//! ```no_run
//! # async fn demo(model: std::sync::Arc<wick_engine::Model>) -> Result<(), Box<dyn std::error::Error>> {
//! use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent};
//! let engine = Engine::start(model.clone(), EngineConfig::default())?;
//! let prompt = model.tokenize("Hello")?;
//! let mut request = engine.submit(wick_engine::GenerationRequest::new(prompt).max_tokens(16))?;
//! while let Some(event) = request.next().await {
//!     match event {
//!         EngineEvent::Token(t) => print!("{}", t.text),
//!         EngineEvent::Done(done) => println!("\n{:?}", done.finish_reason),
//!         EngineEvent::Failed(e) => eprintln!("{e}"),
//!     }
//! }
//! # Ok(()) }
//! ```
mod engine_loop;
mod handle;
mod stats;

pub use handle::{Engine, EngineHandle, RequestHandle, SubmitError};
pub use stats::EngineStats;

use crate::generation::{FinishReason, TokenEvent, Usage};

/// How the engine loop schedules work.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests waiting beyond the running batch before `submit` answers
    /// [`SubmitError::QueueFull`].
    pub max_queue: usize,
    /// Tokens one forward pass may carry: decode tokens first, the rest goes to
    /// prompt chunks, so a long prompt never stalls the others' decoding for long.
    pub step_token_budget: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 8,
            max_queue: 64,
            step_token_budget: 512,
        }
    }
}

/// What a request's channel carries.
#[derive(Debug, Clone)]
pub enum EngineEvent {
    /// A sampled token and the text it released.
    Token(TokenEvent),
    /// The request finished (always the last event unless `Failed`).
    Done(Completion),
    /// The request failed mid-way (always the last event).
    Failed(String),
}

/// The end of a request.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token counts and timings.
    pub usage: Usage,
    /// Generated ids.
    pub tokens: Vec<u32>,
    /// The generated text (stop string removed).
    pub text: String,
}
