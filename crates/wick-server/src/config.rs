//! [`ServerConfig`]: everything the server needs besides the model and engine, already
//! checked (the CLI turns its flags into one of these).
use std::time::Duration;

use wick_chat::tool_call::ToolFormat;

/// Request body limit when none is configured: one media item at its 20 MB limit still
/// fits once base64 inflates it by 4/3 (26.7 MB), with room for the rest of the request.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

/// How long a connection may take to send a request's headers, counted from when it opened
/// or answered its previous request (so it is also the keep-alive idle timeout).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request body may take before [`DEFAULT_MIN_BODY_RATE`] applies.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes per second a request body must average once [`DEFAULT_BODY_TIMEOUT`] has passed.
pub const DEFAULT_MIN_BODY_RATE: u64 = 64 << 10;

/// Open connections at most; past it the longest-idle connection is closed for a new one.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How long in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long a prompt-cache flush (`POST /admin/cache/flush`, and the one at shutdown) may
/// take before it answers with what is still pending.
pub const DEFAULT_CACHE_FLUSH_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// Serve `GET /get_load` without the API key (`--public-load`): routers poll it
    /// without one. It tells only how many requests wait and run and how full the KV is.
    pub public_load: bool,
    /// The tool-call format, overriding detection from the chat template (`--tool-parser`).
    pub tool_format: Option<ToolFormat>,
    /// A chat template that replaces the model's: `(source name, Jinja text)`.
    pub chat_template: Option<(String, String)>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Grace period for in-flight work at shutdown.
    pub shutdown_grace: Duration,
    /// Bound on a prompt-cache flush (the admin endpoint's and the one at shutdown).
    pub cache_flush_timeout: Duration,
    /// Other names `/v1/models/{id}` answers to (what the user typed, the file name).
    pub model_aliases: Vec<String>,
    /// Host names (besides localhost, IP addresses and the bind address) that `Host`
    /// headers may carry; `*` allows any (DNS-rebinding protection off).
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host[:port]`) allowed to call the API cross-origin; empty:
    /// no CORS headers, cross-origin requests refused.
    pub cors_origins: Vec<String>,
    /// The header-read (and keep-alive idle) timeout.
    pub header_timeout: Duration,
    /// Time a request body may take before the minimum rate applies.
    pub body_timeout: Duration,
    /// Bytes per second a request body must average after `body_timeout`.
    pub min_body_rate: u64,
    /// Open connections at most.
    pub max_connections: usize,
    /// LoRA adapters mounted at startup (`--adapter`), each under its folder name; the
    /// first is the default of requests that name none.
    pub adapters: Vec<std::path::PathBuf>,
    /// Training jobs over HTTP (`/api/finetune/*`, `/api/jobs`); `None`: those routes
    /// answer 503.
    pub jobs: Option<crate::jobs::JobsConfig>,
    /// Limits on images and audio in requests, and whether URLs may reach private
    /// addresses (`--allow-private-media`).
    pub media: crate::media::MediaPolicy,
}

impl ServerConfig {
    /// Defaults for serving `model_id`.
    pub fn new(model_id: impl Into<String>) -> Self {
        ServerConfig {
            model_id: model_id.into(),
            defaults: SamplingDefaults::default(),
            api_key: None,
            public_load: false,
            tool_format: None,
            chat_template: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            cache_flush_timeout: DEFAULT_CACHE_FLUSH_TIMEOUT,
            model_aliases: Vec::new(),
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            min_body_rate: DEFAULT_MIN_BODY_RATE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            adapters: Vec::new(),
            jobs: None,
            media: crate::media::MediaPolicy::default(),
        }
    }
}
