//! Counters the engine loop keeps for `/stats` and `/metrics`.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::kv_pool::PoolUsage;

/// Upper bounds of the batch-size histogram (sequences per forward pass).
pub const BATCH_SIZE_BUCKETS: &[u64] = &[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128];

/// Upper bounds of the tokens-per-step histogram.
pub const STEP_TOKEN_BUCKETS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];

/// A histogram of counts kept with atomics.
#[derive(Debug)]
pub(crate) struct CountHistogram {
    bounds: &'static [u64],
    counts: Vec<AtomicU64>,
    sum: AtomicU64,
}

impl CountHistogram {
    pub(crate) fn new(bounds: &'static [u64]) -> Self {
        CountHistogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
        }
    }

    pub(crate) fn observe(&self, value: u64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        HistogramSnapshot {
            bounds: self.bounds.to_vec(),
            count: counts.iter().sum(),
            counts,
            sum: self.sum.load(Ordering::Relaxed),
        }
    }
}

/// A histogram's figures at one moment.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct HistogramSnapshot {
    /// Upper bounds of the buckets.
    pub bounds: Vec<u64>,
    /// Observations per bucket, not cumulative; one more than `bounds` (the last is
    /// above every bound).
    pub counts: Vec<u64>,
    /// Sum of the observed values.
    pub sum: u64,
    /// Observations.
    pub count: u64,
}

impl HistogramSnapshot {
    /// Mean of the observed values (0 without observations).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }
}

/// The KV block pool as `/stats` shows it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct KvPoolStats {
    /// Tokens per block (each layer has its own blocks).
    pub block_tokens: usize,
    /// Blocks the budget allows (`None`: no budget was set).
    pub total_blocks: Option<usize>,
    /// Blocks charged to running sequences.
    pub used_blocks: usize,
    /// Blocks left (`None` without a budget).
    pub free_blocks: Option<usize>,
    /// Most blocks charged at once.
    pub peak_blocks: usize,
    /// Bytes of one block (keys and values of one layer).
    pub block_bytes: usize,
    /// The budget in bytes (`None` without one).
    pub budget_bytes: Option<u64>,
    /// Longest sequence (prompt + generation) the whole pool can hold.
    pub max_sequence_tokens: usize,
}

impl KvPoolStats {
    pub(crate) fn from_usage(
        u: PoolUsage,
        bounded: bool,
        block_bytes: usize,
        max_seq: usize,
    ) -> Self {
        KvPoolStats {
            block_tokens: u.block_tokens,
            total_blocks: bounded.then_some(u.total_blocks),
            used_blocks: u.used_blocks,
            free_blocks: bounded.then(|| u.free_blocks()),
            peak_blocks: u.peak_blocks,
            block_bytes,
            budget_bytes: bounded.then(|| (u.total_blocks * block_bytes) as u64),
            max_sequence_tokens: max_seq,
        }
    }
}

/// Live engine counters (cheap atomics, read at any time).
#[derive(Debug)]
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
    /// Running sequences preempted for lack of KV blocks.
    pub(crate) preemptions: AtomicU64,
    /// Preempted sequences waiting to be recomputed.
    pub(crate) preempted_waiting: AtomicUsize,
    /// Steps that verified drafts, tokens drafted, and drafted tokens kept.
    pub(crate) spec_steps: AtomicU64,
    pub(crate) spec_drafted: AtomicU64,
    pub(crate) spec_accepted: AtomicU64,
    /// Tokens the draft model computed, and history tokens it restored from the prompt
    /// cache instead.
    pub(crate) spec_draft_computed: AtomicU64,
    pub(crate) spec_draft_cached: AtomicU64,
    /// Sequences per forward pass.
    pub(crate) batch_sizes: CountHistogram,
    /// Tokens per forward pass.
    pub(crate) step_tokens: CountHistogram,
    /// Time in steps, nanoseconds: all of it, the forward passes, and sampling and
    /// sending the tokens.
    pub(crate) step_nanos: AtomicU64,
    pub(crate) forward_nanos: AtomicU64,
    pub(crate) sampling_nanos: AtomicU64,
}

impl Default for EngineCounters {
    fn default() -> Self {
        EngineCounters {
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            steps: AtomicU64::new(0),
            last_batch: AtomicUsize::new(0),
            last_step_tokens: AtomicUsize::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            kv_bytes: AtomicU64::new(0),
            decode_tps_milli: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            preempted_waiting: AtomicUsize::new(0),
            spec_steps: AtomicU64::new(0),
            spec_drafted: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            spec_draft_computed: AtomicU64::new(0),
            spec_draft_cached: AtomicU64::new(0),
            batch_sizes: CountHistogram::new(BATCH_SIZE_BUCKETS),
            step_tokens: CountHistogram::new(STEP_TOKEN_BUCKETS),
            step_nanos: AtomicU64::new(0),
            forward_nanos: AtomicU64::new(0),
            sampling_nanos: AtomicU64::new(0),
        }
    }
}

/// Where the engine loop's time went, all time, in seconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepSeconds {
    /// Whole steps: planning, the forward pass, sampling, the prompt cache, finishing.
    pub total: f64,
    /// Forward passes, logits on the host included.
    pub forward: f64,
    /// Sampling the tokens and handing them to the requests.
    pub sampling: f64,
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
    /// Running sequences preempted (blocks freed, recomputed later) for lack of KV blocks.
    pub preemptions: u64,
    /// Preempted sequences waiting to be recomputed (also counted in `queued`).
    pub preempted_waiting: usize,
    /// The KV block pool.
    pub kv_pool: KvPoolStats,
    /// Sequences per forward pass.
    pub batch_size: HistogramSnapshot,
    /// Tokens per forward pass.
    pub step_tokens: HistogramSnapshot,
    /// Where the steps' time went.
    pub step_seconds: StepSeconds,
    /// Speculative decoding, all time.
    pub speculation: SpeculationStats,
}

/// Speculative decoding's counters (all zero when it is off).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpeculationStats {
    /// Forward passes that verified drafts.
    pub steps: u64,
    /// Tokens drafted and scored.
    pub drafted: u64,
    /// Drafted tokens the model agreed with.
    pub accepted: u64,
    /// Tokens the draft model computed (`--draft-model`): histories it caught up on and
    /// the drafts it fed itself.
    pub draft_model_tokens: u64,
    /// Tokens the draft model restored from the prompt cache instead of computing: prompts
    /// at admission, histories of preempted sequences that resume.
    pub draft_model_cached_tokens: u64,
}

impl EngineCounters {
    pub(crate) fn snapshot(&self) -> EngineStats {
        let o = Ordering::Relaxed;
        EngineStats {
            queued: self.queued.load(o) + self.preempted_waiting.load(o),
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
            preemptions: self.preemptions.load(o),
            preempted_waiting: self.preempted_waiting.load(o),
            kv_pool: KvPoolStats::default(),
            batch_size: self.batch_sizes.snapshot(),
            step_tokens: self.step_tokens.snapshot(),
            step_seconds: StepSeconds {
                total: self.step_nanos.load(o) as f64 / 1e9,
                forward: self.forward_nanos.load(o) as f64 / 1e9,
                sampling: self.sampling_nanos.load(o) as f64 / 1e9,
            },
            speculation: SpeculationStats {
                steps: self.spec_steps.load(o),
                drafted: self.spec_drafted.load(o),
                accepted: self.spec_accepted.load(o),
                draft_model_tokens: self.spec_draft_computed.load(o),
                draft_model_cached_tokens: self.spec_draft_cached.load(o),
            },
        }
    }
}
