//! `wick serve [MODEL]`: the OpenAI-compatible HTTP server. The flags (each also read from a
//! `WICK_*` environment variable) become one checked `ServerConfig` and `EngineConfig`.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use wick_chat::tool_call::ToolFormat;
use wick_engine::scheduler::{Engine, EngineConfig, KvBudget};
use wick_engine::speculative::SpeculativeConfig;
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
    /// Require `Authorization: Bearer <KEY>` on every route but /health (an empty key is refused).
    #[arg(long, env = "WICK_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Serve GET /get_load without the API key, for routers whose load polls carry none
    /// (vllm-router's power_of_two); it reveals only queue counts and KV use.
    #[arg(long, env = "WICK_PUBLIC_LOAD")]
    public_load: bool,
    /// Host names `Host` headers may carry besides localhost, IP addresses and --host
    /// (DNS-rebinding protection); comma-separated; `*` allows any.
    #[arg(
        long,
        env = "WICK_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "HOSTS"
    )]
    allowed_hosts: Vec<String>,
    /// Let image and audio URLs in requests reach loopback, private, link-local and other
    /// non-public addresses (off: such URLs are refused, so clients cannot probe the
    /// server's network).
    #[arg(long, env = "WICK_ALLOW_PRIVATE_MEDIA")]
    allow_private_media: bool,
    /// Most images and audio clips one request may carry.
    #[arg(long, env = "WICK_MAX_MEDIA_ITEMS", default_value_t = wick_server::media::DEFAULT_MAX_MEDIA_ITEMS)]
    max_media_items: usize,
    /// A web page origin (`http://localhost:3000`) allowed to call the API from a browser;
    /// comma-separated for several. Without it, cross-origin requests are refused.
    #[arg(
        long,
        env = "WICK_CORS_ORIGIN",
        value_delimiter = ',',
        value_name = "ORIGIN"
    )]
    cors_origin: Vec<String>,
    /// Seconds a connection has to send a request's headers, from its opening or its
    /// previous answer (so also the keep-alive idle timeout).
    #[arg(
        long,
        env = "WICK_HEADER_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 10.0
    )]
    header_timeout: f64,
    /// Seconds a request body may take before --min-body-rate applies.
    #[arg(
        long,
        env = "WICK_BODY_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 10.0
    )]
    body_timeout: f64,
    /// Bytes per second a request body must average after --body-timeout (K, M suffixes; 0 = no minimum).
    #[arg(long, env = "WICK_MIN_BODY_RATE", value_parser = parse_bytes, default_value = "64K")]
    min_body_rate: u64,
    /// Open connections at most; past it the longest-idle one is closed for a new one.
    #[arg(long, env = "WICK_MAX_CONNECTIONS", default_value_t = wick_server::config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Requests that may wait for a batch slot before new ones get 429.
    #[arg(long, env = "WICK_MAX_QUEUE", default_value_t = 64)]
    max_queue: usize,
    /// Sequences decoded together at most.
    #[arg(long, env = "WICK_MAX_BATCH", default_value_t = 8)]
    max_batch: usize,
    /// Tokens one forward pass may carry (decode tokens first, then prompt chunks).
    #[arg(long, env = "WICK_STEP_TOKENS", default_value_t = 512)]
    step_tokens: usize,
    /// Tokens a step carries when it holds prompt chunks only (no stream decoding): a
    /// lone long prompt goes through in few large chunks. Default: 8192 on CUDA, 2048 on
    /// MLX and the CPU (never under --step-tokens).
    #[arg(long, env = "WICK_PROMPT_STEP_TOKENS")]
    prompt_step_tokens: Option<usize>,
    /// While a prompt arrives, the streams already decoding wait at most this many times
    /// their usual inter-token gap: its chunks are sized from measured step costs. 0 turns
    /// pacing off (chunks of --step-tokens). Default: 2 on CUDA and MLX, off on the CPU.
    #[arg(long, env = "WICK_ITL_FACTOR")]
    itl_factor: Option<f64>,
    /// Speculative decoding: `ngram` drafts the next tokens by prompt lookup (what followed
    /// the last few tokens earlier in the prompt or output), `draft` with a smaller model
    /// of the same vocabulary (--draft-model); the drafts are verified in one forward
    /// pass; greedy output is unchanged. Off by default.
    #[arg(long, env = "WICK_SPEC", value_enum)]
    spec: Option<SpecMethod>,
    /// The draft model of `--spec draft` (implies it): a .gguf path, a model directory or
    /// a name in the store, with the served model's tokenizer.
    #[arg(long, env = "WICK_DRAFT_MODEL", value_name = "MODEL")]
    draft_model: Option<String>,
    /// Shortest suffix prompt lookup matches (with --spec ngram).
    #[arg(long, env = "WICK_NGRAM_MIN", default_value_t = SpeculativeConfig::default().ngram_min)]
    ngram_min: usize,
    /// Longest suffix prompt lookup matches, tried first (with --spec ngram).
    #[arg(long, env = "WICK_NGRAM_MAX", default_value_t = SpeculativeConfig::default().ngram_max)]
    ngram_max: usize,
    /// Most tokens drafted per step; the length adapts below it to what is accepted.
    #[arg(long, env = "WICK_NUM_DRAFT_TOKENS", default_value_t = SpeculativeConfig::default().num_draft_tokens)]
    num_draft_tokens: usize,
    /// `on`: each step verifies only the drafts worth their rows, by the recorded time of
    /// decode steps of each size (a compute-bound batch drafts little); `off`: every draft.
    #[arg(long, env = "WICK_DRAFT_BUDGET", value_parser = ["on", "off"], default_value = "on")]
    draft_budget: String,
    /// Where greedy structured-output rows get their token: `backend` takes the backend's
    /// argmax of the logits under the grammar's mask (computed on the host while the pass
    /// runs), `host` samples the logits on the host and masks only a token the grammar
    /// refuses; `auto`: backend on a GPU, host on the CPU. The tokens are the same.
    #[arg(long, env = "WICK_STRUCTURED_MASKS", value_parser = ["auto", "backend", "host"], default_value = "auto")]
    structured_masks: String,
    /// Context length limit (default: the model's).
    #[arg(long, env = "WICK_CTX_SIZE")]
    ctx_size: Option<usize>,
    /// Memory the model may use, in decimal GB, for the fit check before loading (default:
    /// 75 % of RAM; see `wick fit`).
    #[arg(long, env = "WICK_MEMORY_BUDGET")]
    memory_budget: Option<f64>,
    /// Compute backend: cpu (wick's own kernels; `candle` is an old name for it), mlx (GPU
    /// when the MLX runtime has one; needs a build with `--features mlx`) or cuda (wick's own
    /// NVIDIA backend; needs a build with `--features cuda`).
    #[arg(long, env = "WICK_BACKEND", default_value = "cpu", value_parser = ["cpu", "candle", "mlx", "cuda"])]
    backend: String,
    /// How the CPU KV cache stores keys and values: f16 (halves the memory batched decode
    /// reads; llama.cpp's default) or f32. Default: f16 for GGUF files, f32 for Hugging
    /// Face directories.
    #[arg(long, env = "WICK_KV_TYPE", value_parser = ["f16", "f32"])]
    kv_type: Option<String>,
    /// Tool-call format (hermes, qwen-xml, glm, minicpm, gemma4, llama3, mistral); detected from the chat template when absent.
    #[arg(long, env = "WICK_TOOL_PARSER")]
    tool_parser: Option<String>,
    /// A Jinja chat template file that replaces the model's.
    #[arg(long, env = "WICK_CHAT_TEMPLATE")]
    chat_template: Option<PathBuf>,
    /// A LoRA adapter to mount at startup (PEFT or mlx-lm directory, or a llama.cpp GGUF
    /// adapter), under its folder name; repeatable. The first is the default of requests
    /// that name no `adapter`.
    #[arg(long = "adapter", alias = "adapter-path", value_name = "DIR")]
    adapters: Vec<PathBuf>,
    /// How mounted adapters keep their LoRA factors in memory: f16 (half the bytes decode
    /// reads per step), f32, or auto: f16 on a quantized or half-precision base, and on an
    /// f32 base the narrowest of f16, bf16 and f32 that holds every value exactly.
    #[arg(long, env = "WICK_ADAPTER_DTYPE", value_parser = ["auto", "f32", "f16"], default_value = "auto")]
    adapter_dtype: String,
    /// The model id /v1/models lists and responses echo (default: the model's name).
    #[arg(long, env = "WICK_MODEL_ID")]
    model_id: Option<String>,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, env = "WICK_MAX_BODY_BYTES", default_value_t = wick_server::config::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Memory for the KV cache block pool, in bytes; K, M, G, T suffixes are powers of 1024
    /// (`512M`, `2G`). Requests that could never fit get 400, the rest wait for room.
    #[arg(long, env = "WICK_KV_MEMORY", value_parser = parse_bytes, conflicts_with = "gpu_memory_utilization")]
    kv_memory: Option<u64>,
    /// Size the KV block pool as this fraction of the memory free once the weights are
    /// loaded (on the CPU backend: available RAM). Default when --kv-memory is absent: 0.9.
    #[arg(long, env = "WICK_GPU_MEMORY_UTILIZATION")]
    gpu_memory_utilization: Option<f64>,
    /// Seconds in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, env = "WICK_SHUTDOWN_GRACE", default_value_t = 10.0)]
    shutdown_grace: f64,
    /// RAM prompt cache size in GiB (reuses the longest cached prefix of each prompt; 0 = off).
    #[arg(long, env = "WICK_PROMPT_CACHE", value_name = "GIB", default_value_t = DEFAULT_PROMPT_CACHE_GIB)]
    prompt_cache: f64,
    /// Directory of the SSD prompt-cache tier (entries survive restarts; needs --prompt-cache > 0).
    #[arg(long, env = "WICK_SSD_CACHE", value_name = "DIR")]
    ssd_cache: Option<PathBuf>,
    /// Byte cap of the SSD tier in GiB (0 = unlimited); oldest entries go first.
    #[arg(long, env = "WICK_SSD_CACHE_MAX", value_name = "GIB")]
    ssd_cache_max: Option<f64>,
    /// Hash-check every SSD cache file's payload at start-up (restores are always checked).
    #[arg(long, env = "WICK_SSD_CACHE_VERIFY", value_parser = clap::builder::FalseyValueParser::new())]
    ssd_cache_verify: bool,
    /// Longest a pending SSD snapshot waits for the engine to go idle, in seconds (replicas
    /// sharing one --ssd-cache directory want it short: 1–2).
    #[arg(
        long,
        env = "WICK_SSD_WRITE_MAX_DEFER",
        value_name = "SECONDS",
        default_value_t = 60.0
    )]
    ssd_write_max_defer: f64,
    /// Save an in-flight generation every N generated tokens so the identical request resumes after a crash (needs --ssd-cache; 0 = off).
    #[arg(long, env = "WICK_GENERATION_CHECKPOINT", value_name = "N")]
    generation_checkpoint: Option<usize>,
    /// Seconds a prompt-cache flush may take (POST /admin/cache/flush, and at shutdown).
    #[arg(
        long,
        env = "WICK_CACHE_FLUSH_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 120.0
    )]
    cache_flush_timeout: f64,
    /// Serve the model as an embedding model: only /v1/embeddings (automatic for encoders such as BERT).
    #[arg(long, env = "WICK_EMBEDDING", value_parser = clap::builder::FalseyValueParser::new())]
    embedding: bool,
}

/// How `--spec` drafts tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SpecMethod {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the last
    /// `--ngram-max` … `--ngram-min` tokens.
    Ngram,
    /// A draft model (`--draft-model`) proposes the tokens, batched over the rows.
    Draft,
}

/// `--spec` and its knobs, checked.
fn check_speculative(args: &ServeArgs) -> anyhow::Result<Option<SpeculativeConfig>> {
    match (args.spec, &args.draft_model) {
        (None, None) => return Ok(None),
        (Some(SpecMethod::Draft), None) => {
            anyhow::bail!("--spec draft needs --draft-model MODEL")
        }
        (Some(SpecMethod::Ngram), Some(_)) => {
            anyhow::bail!("--draft-model drafts with a model: use it with --spec draft (or alone), not --spec ngram")
        }
        _ => {}
    }
    anyhow::ensure!(
        args.ngram_min >= 1 && args.ngram_min <= args.ngram_max,
        "--ngram-min must be at least 1 and at most --ngram-max ({}), got {}",
        args.ngram_max,
        args.ngram_min
    );
    anyhow::ensure!(
        (1..=16).contains(&args.num_draft_tokens),
        "--num-draft-tokens must be 1 to 16, got {}",
        args.num_draft_tokens
    );
    Ok(Some(SpeculativeConfig {
        ngram_min: args.ngram_min,
        ngram_max: args.ngram_max,
        num_draft_tokens: args.num_draft_tokens,
        budget: args.draft_budget == "on",
    }))
}

/// How long `serve` waits for the SSD tier's start-up scan before it starts answering.
const SSD_SCAN_WAIT: Duration = Duration::from_secs(3);

/// `--prompt-cache` default: the engine's cap, in GiB.
const DEFAULT_PROMPT_CACHE_GIB: f64 =
    wick_engine::scheduler::DEFAULT_PROMPT_CACHE_BYTES as f64 / GIB;

const GIB: f64 = (1u64 << 30) as f64;

/// The prompt-cache part of the engine's settings, checked.
struct CacheFlags {
    prompt_cache_bytes: u64,
    ssd_cache_dir: Option<PathBuf>,
    ssd_cache_max_bytes: u64,
    ssd_cache_verify: bool,
    ssd_write_max_defer: Duration,
    generation_checkpoint_tokens: usize,
}

/// GiB → bytes, refusing negative, non-finite and absurd values.
fn gib_to_bytes(flag: &str, gib: f64) -> anyhow::Result<u64> {
    anyhow::ensure!(
        gib.is_finite() && gib >= 0.0,
        "--{flag} must be a size in GiB >= 0 (0 = off), got {gib}"
    );
    let bytes = gib * GIB;
    anyhow::ensure!(bytes < u64::MAX as f64, "--{flag} {gib} GiB is too large");
    Ok(bytes as u64)
}

fn check_cache(args: &ServeArgs) -> anyhow::Result<CacheFlags> {
    let prompt_cache_bytes = gib_to_bytes("prompt-cache", args.prompt_cache)?;
    let generation_checkpoint_tokens = args.generation_checkpoint.unwrap_or(0);
    let Some(dir) = &args.ssd_cache else {
        anyhow::ensure!(
            generation_checkpoint_tokens == 0,
            "--generation-checkpoint needs --ssd-cache DIR (checkpoints are written to the SSD tier)"
        );
        if args.ssd_cache_max.is_some() || args.ssd_cache_verify {
            tracing::warn!(
                "--ssd-cache-max and --ssd-cache-verify have no effect without --ssd-cache"
            );
        }
        return Ok(CacheFlags {
            prompt_cache_bytes,
            ssd_cache_dir: None,
            ssd_cache_max_bytes: 0,
            ssd_cache_verify: false,
            ssd_write_max_defer: Duration::from_secs(60),
            generation_checkpoint_tokens: 0,
        });
    };
    anyhow::ensure!(
        prompt_cache_bytes > 0,
        "--ssd-cache needs the RAM prompt cache, but --prompt-cache is 0"
    );
    anyhow::ensure!(
        !dir.as_os_str().is_empty(),
        "--ssd-cache needs a directory path"
    );
    if dir.exists() {
        anyhow::ensure!(
            dir.is_dir(),
            "--ssd-cache {} exists and is not a directory",
            dir.display()
        );
    } else {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the --ssd-cache directory {}", dir.display()))?;
    }
    let ssd_cache_max_bytes = gib_to_bytes("ssd-cache-max", args.ssd_cache_max.unwrap_or(0.0))?;
    anyhow::ensure!(
        args.ssd_write_max_defer.is_finite()
            && (0.0..=86_400.0).contains(&args.ssd_write_max_defer),
        "--ssd-write-max-defer must be 0 to 86400 seconds, got {}",
        args.ssd_write_max_defer
    );
    Ok(CacheFlags {
        prompt_cache_bytes,
        ssd_cache_dir: Some(dir.clone()),
        ssd_cache_max_bytes,
        ssd_cache_verify: args.ssd_cache_verify,
        ssd_write_max_defer: Duration::from_secs_f64(args.ssd_write_max_defer),
        generation_checkpoint_tokens,
    })
}

/// Everything checked before the (slow) model load.
struct Checked {
    config: ServerConfig,
    engine: EngineConfig,
}

/// `--api-key`: an empty (or blank) key is refused, not read as "no authentication".
/// `env` is `WICK_API_KEY` as set (clap reads an empty variable as absent).
fn check_api_key(
    flag: Option<&str>,
    env: Option<std::ffi::OsString>,
) -> anyhow::Result<Option<String>> {
    let given = match flag {
        Some(key) => Some(key.to_string()),
        None => env.map(|v| v.to_string_lossy().into_owned()),
    };
    match given {
        Some(key) if key.trim().is_empty() => anyhow::bail!(
            "--api-key (or WICK_API_KEY) is empty: give a non-empty key, or unset it to serve \
             without authentication"
        ),
        Some(key) if key.trim() != key => anyhow::bail!(
            "--api-key (or WICK_API_KEY) starts or ends with whitespace: clients cannot send it"
        ),
        other => Ok(other),
    }
}

/// A `--cors-origin`: `scheme://host[:port]`, as browsers send it in `Origin`.
fn check_origin(origin: &str) -> anyhow::Result<String> {
    let origin = origin.trim().trim_end_matches('/');
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    let valid = rest.is_some_and(|r| !r.is_empty() && !r.contains(['/', '?', '#', '*', ' ', '@']));
    anyhow::ensure!(
        valid,
        "--cors-origin '{origin}' is not an origin like http://localhost:3000 (scheme, host \
         and port, no path; `*` is not accepted)"
    );
    Ok(origin.to_string())
}

/// Checks the flags; the model id is set once the model argument is resolved.
fn check(args: &ServeArgs) -> anyhow::Result<Checked> {
    let positive = |name: &str, v: usize| {
        anyhow::ensure!(v > 0, "--{name} must be at least 1");
        Ok(())
    };
    positive("max-batch", args.max_batch)?;
    positive("step-tokens", args.step_tokens)?;
    if let Some(n) = args.prompt_step_tokens {
        positive("prompt-step-tokens", n)?;
    }
    if let Some(f) = args.itl_factor {
        anyhow::ensure!(
            f == 0.0 || (f.is_finite() && f > 1.0),
            "--itl-factor must be 0 (off) or a number above 1, got {f}"
        );
    }
    if let Some(n) = args.max_tokens {
        positive("max-tokens", n)?;
    }
    if let Some(n) = args.ctx_size {
        positive("ctx-size", n)?;
    }
    let kv_budget = match (args.kv_memory, args.gpu_memory_utilization) {
        (Some(0), _) => anyhow::bail!("--kv-memory must be more than 0 bytes"),
        (Some(bytes), _) => KvBudget::Bytes(bytes),
        (None, Some(f)) if !(f > 0.0 && f <= 1.0) => {
            anyhow::bail!("--gpu-memory-utilization must be in (0, 1], got {f}")
        }
        (None, f) => KvBudget::Fraction(f.unwrap_or(DEFAULT_MEMORY_UTILIZATION)),
    };
    anyhow::ensure!(
        args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0,
        "--shutdown-grace must be a number of seconds >= 0"
    );
    anyhow::ensure!(
        args.cache_flush_timeout.is_finite() && args.cache_flush_timeout >= 0.0,
        "--cache-flush-timeout must be a number of seconds >= 0"
    );
    let cache = check_cache(args)?;
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
    let api_key = check_api_key(args.api_key.as_deref(), std::env::var_os("WICK_API_KEY"))?;
    let seconds = |flag: &str, v: f64| {
        anyhow::ensure!(
            v.is_finite() && v > 0.0 && v < 1e9,
            "--{flag} must be a number of seconds > 0, got {v}"
        );
        Ok(Duration::from_secs_f64(v))
    };
    let header_timeout = seconds("header-timeout", args.header_timeout)?;
    let body_timeout = seconds("body-timeout", args.body_timeout)?;
    positive("max-connections", args.max_connections)?;
    let cors_origins = args
        .cors_origin
        .iter()
        .map(|o| check_origin(o))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut allowed_hosts: Vec<String> = args
        .allowed_hosts
        .iter()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect();
    allowed_hosts.push(args.host.trim_matches(['[', ']']).to_ascii_lowercase());
    let mut config = ServerConfig::new(String::new());
    config.allowed_hosts = allowed_hosts;
    config.cors_origins = cors_origins;
    config.header_timeout = header_timeout;
    config.body_timeout = body_timeout;
    config.min_body_rate = args.min_body_rate;
    config.max_connections = args.max_connections;
    config.defaults = SamplingDefaults {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
    };
    config.api_key = api_key;
    config.public_load = args.public_load;
    config.media.allow_private = args.allow_private_media;
    config.media.max_items = args.max_media_items;
    config.tool_format = tool_format;
    config.chat_template = chat_template;
    config.adapters = args.adapters.clone();
    config.max_body_bytes = args.max_body_bytes;
    config.shutdown_grace = Duration::from_secs_f64(args.shutdown_grace);
    config.cache_flush_timeout = Duration::from_secs_f64(args.cache_flush_timeout);
    config.jobs = jobs_config();
    Ok(Checked {
        config,
        engine: EngineConfig {
            max_batch: args.max_batch,
            max_queue: args.max_queue,
            step_token_budget: args.step_tokens,
            prompt_step_tokens: args.prompt_step_tokens,
            itl_factor: args.itl_factor,
            prompt_cache_bytes: cache.prompt_cache_bytes,
            ssd_cache_dir: cache.ssd_cache_dir,
            ssd_cache_max_bytes: cache.ssd_cache_max_bytes,
            ssd_cache_verify: cache.ssd_cache_verify,
            ssd_write_max_defer: cache.ssd_write_max_defer,
            generation_checkpoint_tokens: cache.generation_checkpoint_tokens,
            kv_budget,
            speculative: check_speculative(args)?,
            masked_argmax: match args.structured_masks.as_str() {
                "backend" => Some(true),
                "host" => Some(false),
                _ => None,
            },
            // The test suite's way to make the engine thread panic (never set otherwise).
            panic_at_step: std::env::var("WICK_TEST_PANIC_AT_STEP")
                .ok()
                .and_then(|v| v.parse().ok()),
            ..EngineConfig::default()
        },
    })
}

/// Training jobs over HTTP run this binary's `wick train` in `$WICK_HOME/jobs`; without a
/// home or a path to the binary the job routes say why they are off.
fn jobs_config() -> Option<wick_server::JobsConfig> {
    let root = match wick_hub::Store::from_env() {
        Ok(store) => store.root().to_path_buf(),
        Err(e) => {
            tracing::warn!(error = %e, "no wick home: training jobs are off");
            return None;
        }
    };
    let trainer = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            tracing::warn!(error = %e, "cannot find this binary: training jobs are off");
            return None;
        }
    };
    Some(wick_server::JobsConfig {
        dir: root.join("jobs"),
        adapters_dir: root.join("adapters"),
        trainer,
        cancel_grace: Duration::from_secs(60),
    })
}

/// Fraction of the free memory the KV pool takes when no flag says otherwise (vLLM's).
const DEFAULT_MEMORY_UTILIZATION: f64 = 0.9;

/// A byte count: digits (a fraction allowed) and an optional K/M/G/T suffix, powers of
/// 1024, with or without a trailing `B`/`iB` (`512M`, `2G`, `1.5GiB`, `1048576`).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits_end);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a byte count like 512M or 2G"))?;
    let unit = suffix.trim().to_ascii_uppercase();
    let unit = unit
        .strip_suffix("IB")
        .or_else(|| unit.strip_suffix('B'))
        .unwrap_or(&unit);
    let scale: u64 = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => {
            return Err(format!(
                "'{text}': unknown unit '{suffix}' (use K, M, G or T)"
            ))
        }
    };
    let bytes = number * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("'{text}' is too large"));
    }
    Ok(bytes as u64)
}

/// The model being served and the names it answers to.
struct ServedModel {
    path: PathBuf,
    /// `--model-id`, else the model's name (see [`model_name`]).
    id: String,
    /// What was typed and the file name, when they differ from `id`.
    aliases: Vec<String>,
}

/// The served id when no `--model-id` is given: a store or Hugging Face cache name (the
/// canonical one, not the substring typed), the Hugging Face repo of a cache snapshot path,
/// a GGUF's `general.name`, else the file or directory name.
fn model_name(resolved: &crate::model_arg::Resolved) -> String {
    if !resolved.is_path {
        return resolved.name.clone();
    }
    let path = std::fs::canonicalize(&resolved.path).unwrap_or_else(|_| resolved.path.clone());
    if let Some(repo) = hf_repo_of(&path) {
        return repo;
    }
    if let Some(name) = gguf_general_name(&path) {
        return name;
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| resolved.name.clone())
}

/// `ORG/NAME` for a path inside a Hugging Face cache (`models--ORG--NAME/snapshots/<commit>`).
fn hf_repo_of(path: &std::path::Path) -> Option<String> {
    path.ancestors().find_map(|dir| {
        let name = dir.file_name()?.to_str()?;
        let repo = name.strip_prefix("models--")?;
        let (org, model) = repo.split_once("--")?;
        (!org.is_empty() && !model.is_empty()).then(|| format!("{org}/{model}"))
    })
}

/// A GGUF file's `general.name`, when it is a usable id (non-empty, one line, short).
fn gguf_general_name(path: &std::path::Path) -> Option<String> {
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !is_gguf {
        return None;
    }
    let file = wick_gguf::GgufFile::open(path).ok()?;
    let name = file.metadata().opt_str("general.name").ok()??.trim();
    let usable = !name.is_empty() && name.len() <= 128 && !name.chars().any(char::is_control);
    usable.then(|| name.to_string())
}

fn served_model(args: &ServeArgs) -> anyhow::Result<ServedModel> {
    let resolved = crate::model_arg::resolve_named(args.model.as_deref())?;
    let id = match &args.model_id {
        Some(id) => {
            anyhow::ensure!(!id.trim().is_empty(), "--model-id must not be empty");
            id.clone()
        }
        None => model_name(&resolved),
    };
    let mut aliases = Vec::new();
    let typed = args
        .model
        .as_deref()
        .unwrap_or(wick_hub::catalog::DEFAULT_MODEL);
    for alias in [typed.to_string(), resolved.name.clone()] {
        if alias != id && !alias.is_empty() && !aliases.contains(&alias) {
            aliases.push(alias);
        }
    }
    Ok(ServedModel {
        path: resolved.path,
        id,
        aliases,
    })
}

/// Refuses, before loading, a model that cannot fit: the weights alone (no context at
/// all fits), or an explicit `--ctx-size` larger than what fits. A full default context
/// that does not fit only warns: the KV pool bounds what runs at once.
fn preflight_fit(path: &std::path::Path, args: &ServeArgs) -> anyhow::Result<()> {
    use crate::commands::fit;
    let kind = if path.is_dir() {
        wick_hub::ModelKind::HfDir
    } else {
        wick_hub::ModelKind::Gguf
    };
    let model = match wick_hub::fit::FitModel::read(path, kind) {
        Ok(m) => m,
        Err(e) => {
            // Loading reports what is wrong with the model itself.
            tracing::debug!("no fit check: {e}");
            return Ok(());
        }
    };
    let store = wick_hub::Store::from_env()?;
    let machine = wick_hub::fit::Machine::detect(fit::device(&args.backend), store.root());
    let ctx = args.ctx_size.unwrap_or(model.context_length);
    let kv = crate::model_arg::kv_dtype(args.kv_type.as_deref())?;
    let report = model.assess(
        Some(ctx),
        kv,
        &machine,
        fit::budget_bytes(args.memory_budget)?,
    );
    let name = path.display().to_string();
    if report.max_context == 0 || (args.ctx_size.is_some() && !report.fits) {
        anyhow::bail!(
            "the model does not fit this machine{}:\n{}",
            if report.max_context > 0 {
                format!(
                    " at --ctx-size {ctx} (try --ctx-size {})",
                    report.max_context
                )
            } else {
                String::new()
            },
            fit::report_text(&name, &model, &machine, &report)
        );
    }
    if !report.fits {
        tracing::warn!(
            context = ctx,
            max_context = report.max_context,
            "a sequence of the full context would not fit in memory; the KV pool limits what runs at once"
        );
    }
    Ok(())
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut checked = check(&args)?;
    let served = served_model(&args)?;
    let path = served.path;
    checked.config.model_id = served.id;
    checked.config.model_aliases = served.aliases;
    preflight_fit(&path, &args)?;
    // Bind before loading the model: a busy port fails at once.
    let listener = wick_server::bind(&args.host, args.port)?;
    if args.embedding || wick_engine::embedding::Embedder::is_encoder(&path) {
        let opts = LoadOptions {
            context_length: args.ctx_size,
            backend: args.backend.parse()?,
            kv_dtype: crate::model_arg::kv_dtype(args.kv_type.as_deref())?,
        };
        return super::embed::serve(&path, &opts, checked.config, listener, started);
    }
    let mut model = Model::load(
        &path,
        &LoadOptions {
            context_length: args.ctx_size,
            backend: args.backend.parse()?,
            kv_dtype: crate::model_arg::kv_dtype(args.kv_type.as_deref())?,
        },
    )
    .with_context(|| format!("loading {}", path.display()))?;
    model.set_adapter_dtype(args.adapter_dtype.parse()?);
    // A backend or family that cannot verify drafts refuses --spec rather than serving
    // plainly with speculation counters that never move.
    if checked.engine.speculative.is_some() {
        if let Err(e) = &model.support().speculation {
            anyhow::bail!("--spec: {e}");
        }
    }
    let model = Arc::new(model);
    if let Some(name) = &args.draft_model {
        let resolved = crate::model_arg::resolve_named(Some(name))?;
        let draft = Model::load(
            &resolved.path,
            &LoadOptions {
                context_length: args.ctx_size,
                backend: args.backend.parse()?,
                kv_dtype: crate::model_arg::kv_dtype(args.kv_type.as_deref())?,
            },
        )
        .with_context(|| format!("loading the draft model {}", resolved.path.display()))?;
        let draft = wick_engine::speculative::DraftModel::new(&model, Arc::new(draft))?;
        checked.engine.draft_model = Some(draft);
    }
    let engine = Engine::start(model, checked.engine).context("starting the engine")?;
    if let Some(dir) = engine.ssd_cache_path() {
        // A replica joining others on a shared directory should answer its first request with
        // what the directory holds: wait a little for the scan (thousands of headers take
        // well under this). A larger directory goes on scanning in the background: serving
        // starts, entries become restorable as they are indexed, and the tier logs "SSD cache
        // scanned" with its report when done.
        if engine.wait_for_cache_scan(SSD_SCAN_WAIT).is_none() {
            tracing::info!(dir = %dir.display(), "SSD prompt cache opened; scanning in the background");
        }
    }
    let state = AppState::new(engine, checked.config)?;
    // The grammar engine's token table takes up to a second or two to build: build it in the
    // background now, not on the first request that asks for structured output.
    let model = state.model().clone();
    std::thread::spawn(move || {
        if let Err(e) = model.grammars() {
            tracing::warn!("structured output is unavailable: {e}");
        }
    });
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

#[cfg(test)]
mod tests {
    use super::{check_api_key, check_origin, hf_repo_of, parse_bytes};
    use std::path::Path;

    #[test]
    fn empty_or_padded_api_keys_are_refused() {
        assert!(check_api_key(Some(""), None).is_err());
        assert!(check_api_key(Some("  "), None).is_err());
        assert!(check_api_key(None, Some("".into())).is_err());
        assert!(check_api_key(Some(" k"), None).is_err());
        assert_eq!(check_api_key(Some("k"), None).unwrap(), Some("k".into()));
        assert_eq!(
            check_api_key(None, Some("k".into())).unwrap(),
            Some("k".into())
        );
        assert_eq!(check_api_key(None, None).unwrap(), None);
    }

    #[test]
    fn cors_origins_are_exact_origins() {
        assert_eq!(
            check_origin("http://localhost:3000/").unwrap(),
            "http://localhost:3000"
        );
        assert!(check_origin("https://app.example").is_ok());
        for bad in [
            "*",
            "localhost:3000",
            "http://",
            "http://a/b",
            "ftp://x",
            "http://*.x",
        ] {
            assert!(check_origin(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hugging_face_cache_paths_name_their_repo() {
        let snapshot = Path::new("/c/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc123");
        assert_eq!(hf_repo_of(snapshot).as_deref(), Some("Qwen/Qwen2.5-0.5B"));
        assert_eq!(
            hf_repo_of(&snapshot.join("model.gguf")).as_deref(),
            Some("Qwen/Qwen2.5-0.5B")
        );
        assert_eq!(hf_repo_of(Path::new("/models/qwen/abc123")), None);
    }

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("64KB"), Ok(64 << 10));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5X").is_err());
        assert!(parse_bytes("").is_err());
    }
}
