//! `wick serve [MODEL]`: the OpenAI-compatible HTTP server. The flags (each also read from a
//! `WICK_*` environment variable) become one checked `ServerConfig` and `EngineConfig`.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use wick_chat::tool_call::ToolFormat;
use wick_engine::scheduler::{Engine, EngineConfig};
use wick_engine::{LoadOptions, Model};
use wick_server::{AppState, SamplingDefaults, ServerConfig};

#[derive(Args)]
pub struct ServeArgs {
    /// Model: a .gguf path, a model directory, or a name in the store (default: the embedded default model).
    #[arg(env = "WICK_MODEL")]
    model: Option<String>,
    /// Address to listen on.
    #[arg(long, env = "WICK_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "WICK_PORT", default_value_t = 8080)]
    port: u16,
    /// Default max tokens per reply (requests may ask for other values; always capped to the context).
    #[arg(long, env = "WICK_MAX_TOKENS")]
    max_tokens: Option<usize>,
    /// Default sampling temperature (0 = greedy).
    #[arg(long, alias = "temp", env = "WICK_TEMPERATURE")]
    temperature: Option<f32>,
    /// Default nucleus sampling mass (1 = off).
    #[arg(long, env = "WICK_TOP_P")]
    top_p: Option<f32>,
    /// Default top-k (0 = off).
    #[arg(long, env = "WICK_TOP_K")]
    top_k: Option<usize>,
    /// Default min-p (0 = off).
    #[arg(long, env = "WICK_MIN_P")]
    min_p: Option<f32>,
    /// Default repetition penalty (1 = off).
    #[arg(long, env = "WICK_REPETITION_PENALTY")]
    repetition_penalty: Option<f32>,
    /// Require `Authorization: Bearer <KEY>` on every route but /health.
    #[arg(long, env = "WICK_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests that may wait for a batch slot before new ones get 429.
    #[arg(long, env = "WICK_MAX_QUEUE", default_value_t = 64)]
    max_queue: usize,
    /// Sequences decoded together at most.
    #[arg(long, env = "WICK_MAX_BATCH", default_value_t = 8)]
    max_batch: usize,
    /// Tokens one forward pass may carry (decode tokens first, then prompt chunks).
    #[arg(long, env = "WICK_STEP_TOKENS", default_value_t = 512)]
    step_tokens: usize,
    /// Context length limit (default: the model's).
    #[arg(long, env = "WICK_CTX_SIZE")]
    ctx_size: Option<usize>,
    /// Compute backend: candle (CPU) or mlx (GPU when the MLX runtime has one; needs a
    /// build with `--features mlx`).
    #[arg(long, env = "WICK_BACKEND", default_value = "candle", value_parser = ["candle", "mlx"])]
    backend: String,
    /// Tool-call format (hermes, qwen-xml, glm, minicpm, gemma4, llama3, mistral); detected from the chat template when absent.
    #[arg(long, env = "WICK_TOOL_PARSER")]
    tool_parser: Option<String>,
    /// A Jinja chat template file that replaces the model's.
    #[arg(long, env = "WICK_CHAT_TEMPLATE")]
    chat_template: Option<PathBuf>,
    /// The model id /v1/models lists and responses echo (default: the model's name).
    #[arg(long, env = "WICK_MODEL_ID")]
    model_id: Option<String>,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, env = "WICK_MAX_BODY_BYTES", default_value_t = wick_server::config::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Seconds in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, env = "WICK_SHUTDOWN_GRACE", default_value_t = 10.0)]
    shutdown_grace: f64,
}

/// Everything checked before the (slow) model load.
struct Checked {
    config: ServerConfig,
    engine: EngineConfig,
}

fn check(args: &ServeArgs, model_path: &std::path::Path) -> anyhow::Result<Checked> {
    let positive = |name: &str, v: usize| {
        anyhow::ensure!(v > 0, "--{name} must be at least 1");
        Ok(())
    };
    positive("max-batch", args.max_batch)?;
    positive("step-tokens", args.step_tokens)?;
    if let Some(n) = args.max_tokens {
        positive("max-tokens", n)?;
    }
    if let Some(n) = args.ctx_size {
        positive("ctx-size", n)?;
    }
    anyhow::ensure!(
        args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0,
        "--shutdown-grace must be a number of seconds >= 0"
    );
    let tool_format = args
        .tool_parser
        .as_deref()
        .map(ToolFormat::from_name)
        .transpose()?;
    let chat_template = match &args.chat_template {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --chat-template {}", path.display()))?;
            Some((path.display().to_string(), text))
        }
        None => None,
    };
    let model_id = args
        .model_id
        .clone()
        .unwrap_or_else(|| model_name(args, model_path));
    let mut config = ServerConfig::new(model_id);
    config.defaults = SamplingDefaults {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
    };
    config.api_key = args.api_key.clone().filter(|k| !k.is_empty());
    config.tool_format = tool_format;
    config.chat_template = chat_template;
    config.max_body_bytes = args.max_body_bytes;
    config.shutdown_grace = Duration::from_secs_f64(args.shutdown_grace);
    Ok(Checked {
        config,
        engine: EngineConfig {
            max_batch: args.max_batch,
            max_queue: args.max_queue,
            step_token_budget: args.step_tokens,
            ..EngineConfig::default()
        },
    })
}

/// The served id: the store name the user typed (or the default model's), else the file or
/// directory name.
fn model_name(args: &ServeArgs, path: &std::path::Path) -> String {
    let typed = args
        .model
        .clone()
        .unwrap_or_else(|| wick_hub::catalog::DEFAULT_MODEL.to_string());
    let is_path =
        typed.contains(std::path::MAIN_SEPARATOR) || std::path::Path::new(&typed).exists();
    if !is_path {
        return typed;
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or(typed)
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let path = crate::model_arg::resolve(args.model.as_deref())?;
    let checked = check(&args, &path)?;
    // Bind before loading the model: a busy port fails at once.
    let listener = wick_server::bind(&args.host, args.port)?;
    let model = Model::load(
        &path,
        &LoadOptions {
            context_length: args.ctx_size,
            backend: args.backend.parse()?,
        },
    )
    .with_context(|| format!("loading {}", path.display()))?;
    let model = Arc::new(model);
    let engine = Engine::start(model, checked.engine)?;
    let state = AppState::new(engine, checked.config)?;
    let model_id = state.config().model_id.clone();
    let context = state.model().info().context_length;
    let tool_format = state.tool_format();
    wick_server::run(listener, state, |addr| {
        let ready_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            model = %model_id,
            %addr,
            context,
            tool_format = %tool_format,
            ready_ms,
            "ready"
        );
        eprintln!("wick: serving {model_id} at http://{addr}/v1 (ready in {ready_ms:.0} ms)");
    })?;
    eprintln!("wick: stopped");
    Ok(())
}
