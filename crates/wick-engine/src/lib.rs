//! wick's inference engine: loads models (GGUF, Hugging Face safetensors), runs them on a
//! compute backend, and generates tokens.
#![warn(missing_docs)]

pub mod backend;
pub mod config;
mod error;
pub mod models;
pub mod sampler;
pub mod weights;

pub use error::{EngineError, Result};
pub mod generation;
mod model;

pub use backend::BackendKind;
pub use generation::{
    FinishReason, GenerationOutput, GenerationRequest, Sequence, SequenceStep, TokenEvent, Usage,
};
pub use model::{GenerationDefaults, KvCache, LoadOptions, Model, ModelFormat, ModelInfo, Step};
pub use models::decoder::{Logits, LogitsRequest};
pub use models::greedy::GreedyRun;
pub mod scheduler;
