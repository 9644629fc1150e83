//! The engine's error type: every variant says which file, tensor or value was wrong.
use std::path::PathBuf;

/// Errors from loading models and running them.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Structured output failed (a grammar that does not compile, a matcher error).
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
    /// The GGUF container is unreadable or damaged.
    #[error(transparent)]
    Gguf(#[from] wick_gguf::GgufError),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A configuration value is missing or out of range.
    #[error("{source_name}: invalid model configuration: {reason}")]
    Config {
        /// The file or metadata the value came from.
        source_name: String,
        /// What is wrong.
        reason: String,
    },
    /// The model's architecture is not implemented.
    #[error("{source_name}: unsupported architecture '{arch}' (supported: {supported})")]
    UnsupportedArch {
        /// Where the architecture name was read.
        source_name: String,
        /// The architecture name.
        arch: String,
        /// The supported set, comma separated.
        supported: String,
    },
    /// A tensor uses an element type the engine cannot compute with.
    #[error("{source_name}: tensor '{tensor}' has unsupported type {dtype}")]
    UnsupportedDtype {
        /// The file.
        source_name: String,
        /// The tensor.
        tensor: String,
        /// The type name.
        dtype: String,
    },
    /// A required tensor is absent.
    #[error("{source_name}: missing tensor '{tensor}'")]
    MissingTensor {
        /// The file or directory.
        source_name: String,
        /// The tensor name as the file spells it.
        tensor: String,
    },
    /// A tensor's shape disagrees with the configuration.
    #[error("{source_name}: tensor '{tensor}' has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file or directory.
        source_name: String,
        /// The tensor.
        tensor: String,
        /// Shape the configuration implies.
        expected: Vec<usize>,
        /// Shape found in the file.
        found: Vec<usize>,
    },
    /// A safetensors file is damaged.
    #[error("{path}: invalid safetensors file: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Tokenizer construction or use failed.
    #[error(transparent)]
    Tokenizer(#[from] wick_chat::tokenizer::TokenizerError),
    /// Chat template compilation or rendering failed.
    #[error(transparent)]
    Template(#[from] wick_chat::chat_template::TemplateError),
    /// Sampling parameters are invalid.
    #[error(transparent)]
    Sampling(#[from] crate::sampler::SamplingError),
    /// The model has no chat template and a chat was asked for.
    #[error("{0} has no chat template; use raw completion (--raw) or a model with a template")]
    NoChatTemplate(String),
    /// A request does not fit the model's context.
    #[error("request needs {needed} tokens of context but the model allows {limit}")]
    ContextOverflow {
        /// Tokens the request needs.
        needed: usize,
        /// The context limit.
        limit: usize,
    },
    /// A request could never fit the KV block pool, even running alone.
    #[error(
        "this request needs {needed} tokens of KV cache (prompt {prompt} + max_tokens \
         {max_tokens}) but the KV memory budget holds at most {limit} tokens for one sequence; \
         lower max_tokens or shorten the prompt, or give the server more KV memory (--kv-memory)"
    )]
    KvCapacity {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// `prompt + max_tokens`.
        needed: usize,
        /// Longest sequence the pool can hold.
        limit: usize,
    },
    /// Invalid input to a forward pass or generation (empty prompt, bad token id …).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The KV cache cannot do what was asked (e.g. trim a wrapped sliding window).
    #[error("kv cache: {0}")]
    Cache(String),
    /// The prompt cache could not be set up (SSD directory, configuration).
    #[error("prompt cache: {0}")]
    PromptCache(#[from] wick_cache::CacheError),
    /// A model (or a part of it) needs an op its backend does not implement.
    #[error(transparent)]
    Unsupported(#[from] crate::backend::capability::Unsupported),
    /// A compute backend failed.
    #[error("{backend} backend: {message}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// The backend's message.
        message: String,
    },

    /// A LoRA adapter could not be loaded or selected.
    #[error(transparent)]
    Adapter(crate::adapters::AdapterError),

    /// A draft model that cannot draft for the served model (`--draft-model`).
    #[error("draft model: {0}")]
    DraftModel(String),
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Backend {
            backend: "cpu",
            message: e.to_string(),
        }
    }
}

/// Result alias for the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
