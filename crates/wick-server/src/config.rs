//! [`ServerConfig`]: everything the server needs besides the model and engine, already
//! checked (the CLI turns its flags into one of these).
use std::time::Duration;

use wick_chat::tool_call::ToolFormat;

/// Request body limit when none is configured.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// How long in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Built-in temperature when neither the request, a server flag nor `generation_config.json`
/// gives one (the reference's).
pub const BUILTIN_TEMPERATURE: f32 = 0.7;

/// Built-in `max_tokens` for chat when neither the request nor `--max-tokens` gives one; it is
/// always capped to what the context leaves after the prompt.
pub const BUILTIN_CHAT_MAX_TOKENS: usize = 65536;

/// Built-in `max_tokens` for raw completions.
pub const BUILTIN_COMPLETION_MAX_TOKENS: usize = 512;

/// Sampling defaults set by server flags; `None` falls through to `generation_config.json`,
/// then to the built-in value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDefaults {
    /// `--max-tokens`.
    pub max_tokens: Option<usize>,
    /// `--temperature`.
    pub temperature: Option<f32>,
    /// `--top-p`.
    pub top_p: Option<f32>,
    /// `--top-k`.
    pub top_k: Option<usize>,
    /// `--min-p`.
    pub min_p: Option<f32>,
    /// `--repetition-penalty`.
    pub repetition_penalty: Option<f32>,
}

/// The server's settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The id `/v1/models` lists and responses echo.
    pub model_id: String,
    /// Sampling defaults from flags.
    pub defaults: SamplingDefaults,
    /// When set, every route but `/health` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The tool-call format, overriding detection from the chat template (`--tool-parser`).
    pub tool_format: Option<ToolFormat>,
    /// A chat template that replaces the model's: `(source name, Jinja text)`.
    pub chat_template: Option<(String, String)>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Grace period for in-flight work at shutdown.
    pub shutdown_grace: Duration,
}

impl ServerConfig {
    /// Defaults for serving `model_id`.
    pub fn new(model_id: impl Into<String>) -> Self {
        ServerConfig {
            model_id: model_id.into(),
            defaults: SamplingDefaults::default(),
            api_key: None,
            tool_format: None,
            chat_template: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}
