//! Counters the engine loop keeps for `/stats` and `/metrics`.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Live engine counters (cheap atomics, read at any time).
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub(crate) queued: AtomicUsize,
    pub(crate) running: AtomicUsize,
    pub(crate) steps: AtomicU64,
    pub(crate) last_batch: AtomicUsize,
    pub(crate) last_step_tokens: AtomicUsize,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generated_tokens: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) kv_bytes: AtomicU64,
    /// Recent decode rate × 1000 (exponential moving average over steps).
    pub(crate) decode_tps_milli: AtomicU64,
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EngineStats {
    /// Requests waiting to start.
    pub queued: usize,
    /// Sequences in the running batch.
    pub running: usize,
    /// Forward passes run.
    pub steps: u64,
    /// Sequences in the last forward pass.
    pub last_batch_size: usize,
    /// Tokens in the last forward pass.
    pub last_step_tokens: usize,
    /// Prompt tokens computed, all time.
    pub prompt_tokens_total: u64,
    /// Tokens generated, all time.
    pub generated_tokens_total: u64,
    /// Requests finished normally.
    pub completed: u64,
    /// Requests cancelled (client gone).
    pub cancelled: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Bytes of KV cache held by running sequences.
    pub kv_bytes: u64,
    /// Recent aggregate decode rate, tokens per second.
    pub decode_tokens_per_second: f64,
    /// The prompt cache (RAM tier; `ssd` holds the SSD tier's counters).
    pub prompt_cache: wick_cache::CacheStats,
}

impl EngineCounters {
    pub(crate) fn snapshot(&self) -> EngineStats {
        let o = Ordering::Relaxed;
        EngineStats {
            queued: self.queued.load(o),
            running: self.running.load(o),
            steps: self.steps.load(o),
            last_batch_size: self.last_batch.load(o),
            last_step_tokens: self.last_step_tokens.load(o),
            prompt_tokens_total: self.prompt_tokens.load(o),
            generated_tokens_total: self.generated_tokens.load(o),
            completed: self.completed.load(o),
            cancelled: self.cancelled.load(o),
            failed: self.failed.load(o),
            kv_bytes: self.kv_bytes.load(o),
            decode_tokens_per_second: self.decode_tps_milli.load(o) as f64 / 1000.0,
            prompt_cache: wick_cache::CacheStats::default(),
        }
    }
}
