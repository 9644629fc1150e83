//! The engine loop: one thread owns the model and runs every admitted request in one
//! batched forward pass per step (continuous batching); callers talk to it through a
//! cloneable [`EngineHandle`] and get each request's tokens back on its own channel.
//!
//! Every sequence's KV cache lives in fixed-size blocks charged to one pool
//! ([`EngineConfig::kv_budget`]): requests are admitted while the pool has room for their
//! prompt, and a sequence that cannot get a block for its next token preempts the newest
//! running one, whose blocks are freed and whose tokens are recomputed once room returns
//! (its client only sees a pause). See `admission.rs` and `engine_loop.rs`.
//!
//! With the prompt cache on ([`EngineConfig::prompt_cache_bytes`]), admission reuses the
//! longest cached prefix of each prompt (RAM, or the SSD tier after a restart), finished
//! sequences put their KV back, and generation checkpoints let an identical request
//! resume after a crash; see `cache.rs`.
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
mod admission;
mod cache;
mod engine_loop;
mod handle;
mod pacer;
mod queue;
mod stats;

pub use admission::{available_memory, KvBudget};
pub use handle::{Engine, EngineHandle, RequestHandle, SubmitError};
pub use stats::{
    EngineStats, HistogramSnapshot, KvPoolStats, SpeculationStats, StepSeconds, BATCH_SIZE_BUCKETS,
    STEP_TOKEN_BUCKETS,
};
pub use wick_cache::{CacheStats, FlushReport, ScanReport, SsdStats};

use std::path::PathBuf;

use crate::generation::{FinishReason, PromptLogprob, TokenEvent, Usage};

/// How the engine loop schedules work and caches prompts.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests accepted beyond the batch's places before `submit` answers
    /// [`SubmitError::QueueFull`]: at most `max_batch + max_queue` requests are accepted
    /// and not finished at once (waiting, running or preempted), so a burst never gets
    /// refused while batch places are free.
    pub max_queue: usize,
    /// Tokens one forward pass may carry: decode tokens first, the rest goes to
    /// prompt chunks, so a long prompt never stalls the others' decoding for long.
    pub step_token_budget: usize,
    /// Tokens a step of prompt chunks alone may carry (no sequence decoding): a lone
    /// prompt on a GPU goes through in a few long chunks. `None`: the backend's
    /// preference ([`crate::backend::Capabilities::lone_prompt_tokens`], at least the
    /// step budget).
    pub prompt_step_tokens: Option<usize>,
    /// Bound on the decoding rows' inter-token gap while a prompt arrives, as a multiple
    /// of a decode-only step: prompt chunks beside decoding rows are sized from measured
    /// step costs so a step takes at most this long (`scheduler/pacer.rs`). `Some(0.0)`
    /// turns pacing off (chunks of the step budget); `None`: the backend's preference
    /// ([`crate::backend::Capabilities::itl_factor`]).
    pub itl_factor: Option<f64>,
    /// RAM prompt cache byte cap (`--prompt-cache` GiB × 2³⁰); 0 turns the cache off.
    pub prompt_cache_bytes: u64,
    /// SSD cold tier directory (`--ssd-cache DIR`); needs the RAM cache.
    pub ssd_cache_dir: Option<PathBuf>,
    /// SSD tier byte cap (`--ssd-cache-max` GiB × 2³⁰); 0 = unlimited.
    pub ssd_cache_max_bytes: u64,
    /// Hash-check every SSD payload at start-up (`--ssd-cache-verify`); payloads are
    /// always checked when restored.
    pub ssd_cache_verify: bool,
    /// Snapshot RAM cache entries to the SSD after each put (debounced, while idle).
    pub ssd_write_behind: bool,
    /// The longest a due write-behind snapshot waits for the engine to go idle
    /// (`--ssd-write-max-defer`); replicas sharing one SSD directory want it short, so a
    /// replica killed under load leaves its prefixes on disk.
    pub ssd_write_max_defer: std::time::Duration,
    /// Save a generation checkpoint every this many generated tokens
    /// (`--generation-checkpoint N`, needs the SSD tier); 0 = off.
    pub generation_checkpoint_tokens: usize,
    /// On models with sliding-window layers, a prefill that computed at least this many
    /// tokens also stores a prompt-only entry, which stays reusable when the
    /// prompt+generation entry cannot be trimmed (a wrapped window ring).
    pub prompt_boundary_min_tokens: usize,
    /// On models whose caches cannot be cut back (sliding windows, recurrent layers), a
    /// long prefill also keeps an entry every this many prompt tokens, so a conversation
    /// that parts from a cached prompt anywhere resumes at most this many tokens back;
    /// 0 = off.
    pub prompt_checkpoint_tokens: usize,
    /// Memory for the KV block pool shared by the running sequences. A request that
    /// could never fit it is refused at `submit`; when it is momentarily full, new
    /// requests wait, and a running sequence that cannot get a block preempts the
    /// newest one (which is recomputed later).
    pub kv_budget: KvBudget,
    /// Prompt-lookup speculative decoding (`--spec ngram`); `None` decodes one token per
    /// step. See [`crate::speculative`] for the rows that decode plainly regardless.
    pub speculative: Option<crate::speculative::SpeculativeConfig>,
    /// Greedy rows under a structured-output grammar take the backend's argmax of their
    /// masked logits (the host computes the masks while the backend runs the pass)
    /// instead of sampling their logits on the host. `None`: when the model prefers it
    /// ([`crate::Model::prefers_backend_masks`]: device backends).
    pub masked_argmax: Option<bool>,
    /// With [`EngineConfig::speculative`]: a draft model drafts instead of prompt lookup
    /// (`--draft-model`), checked at [`Engine::start`] to share the model's vocabulary.
    /// Each sequence keeps the draft's KV of its history; the KV pool and the RAM prompt
    /// cache leave the draft's caches their share of the budget
    /// ([`crate::speculative::DraftModel::target_share`]), and the prompt cache keeps the
    /// draft's KV of a prompt beside the served model's (on the SSD tier too, in a
    /// directory of its own; the SSD cap is split like the RAM one). A preempted
    /// sequence's draft KV waits there and comes back when it resumes.
    pub draft_model: Option<crate::speculative::DraftModel>,
    /// Testing only: the engine thread panics before running this step (counted from 0),
    /// standing for a bug in a forward pass, so that tests can check what a panic does to
    /// the requests and the server (`wick serve` sets it from `WICK_TEST_PANIC_AT_STEP`).
    #[doc(hidden)]
    pub panic_at_step: Option<u64>,
}

/// Default RAM prompt-cache cap: 8 GiB.
pub const DEFAULT_PROMPT_CACHE_BYTES: u64 = 8 << 30;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 8,
            max_queue: 64,
            step_token_budget: 512,
            prompt_step_tokens: None,
            itl_factor: None,
            prompt_cache_bytes: DEFAULT_PROMPT_CACHE_BYTES,
            ssd_cache_dir: None,
            ssd_cache_max_bytes: 0,
            ssd_cache_verify: false,
            ssd_write_behind: true,
            ssd_write_max_defer: wick_cache::durability::dirty::Timing::default().max_defer,
            generation_checkpoint_tokens: 0,
            prompt_boundary_min_tokens: 256,
            prompt_checkpoint_tokens: 4096,
            kv_budget: KvBudget::Unbounded,
            speculative: None,
            masked_argmax: None,
            draft_model: None,
            panic_at_step: None,
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
    /// The prompt's scores of a request that asked for them and generated no token (else
    /// the first token carried them).
    pub prompt_logprobs: Vec<PromptLogprob>,
}
