//! wick's inference engine: loads models (GGUF, Hugging Face safetensors), runs them on a
//! compute backend, and generates tokens.
//!
//! How the parts fit:
//! - [`weights`] reads tensors from GGUF files and safetensors directories under one
//!   naming; [`config`] reads hyperparameters from GGUF metadata or `config.json`.
//! - [`models`] holds one file per architecture (llama, qwen2, qwen3, gemma3; the other
//!   dense families in `models/dense.rs`) and the decoder they share, written once against
//!   the [`backend::Backend`] op surface; [`config::rope`] holds the long-context rotary scalings;
//!   [`backend::candle`] is the CPU backend.
//! - [`Model`] bundles decoder, tokenizer, chat template and defaults; [`Model::execute`]
//!   runs a planned step ([`StepPlan`]): several sequences in one batched pass, each saying
//!   what it wants back ([`Want`]) and with its own adapters and trimmable, cloneable,
//!   serializable [`KvCache`], charged while it runs to the [`kv_pool`] (the memory budget,
//!   the same on every backend).
//! - [`sampler`] turns logits into tokens (mlx-lm semantics), [`generation`] drives one
//!   sequence from prompt to finish (chunked prefill, sampling, detokenization, stop
//!   strings), and [`scheduler`] runs many of them at once on the engine thread.
//!
//! ```no_run
//! use std::ops::ControlFlow;
//! use wick_engine::{GenerationRequest, LoadOptions, Model};
//!
//! let model = Model::load("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), &LoadOptions::default())?;
//! let chat = [serde_json::json!({"role": "user", "content": "Say hi"})];
//! let prompt = model.render_chat(&chat, None, &Default::default())?;
//! let out = model.generate(&GenerationRequest::new(model.tokenize(&prompt)?).max_tokens(16), |t| {
//!     print!("{}", t.text);
//!     ControlFlow::Continue(())
//! })?;
//! assert!(out.tokens.len() <= 16);
//! # Ok::<(), wick_engine::EngineError>(())
//! ```
#![warn(missing_docs)]

pub mod adapters;
pub mod backend;
mod cache_value;
pub mod config;
pub mod constraint;
pub mod embedding;
mod error;
pub mod models;
pub mod sampler;
pub mod speculative;
pub mod weights;

pub use error::{EngineError, Result};
pub mod generation;
pub mod kv_pool;
pub mod media;
mod model;

pub use backend::BackendKind;
pub use generation::{
    FinishReason, GenerationOutput, GenerationRequest, PromptLogprob, Sequence, SequenceStep,
    TokenEvent, Usage, DEFAULT_PREFILL_CHUNK,
};
pub use model::{
    DeviceMemory, GenerationDefaults, KvCache, LoadOptions, Model, ModelFormat, ModelInfo, Step,
    StepPlan, StepRow,
};
pub use models::decoder::{Logits, LogitsRequest, RowOutput, StepMasks, Want};
pub use models::greedy::GreedyRun;
pub mod scheduler;
