//! Memory admission: how big the KV block pool is, whether a request could ever fit it,
//! and how many blocks a sequence needs before it may start or take a step.
use std::sync::Arc;

use crate::generation::GenerationRequest;
use crate::kv_pool::{BlockPool, BLOCK_TOKENS};
use crate::model::{Model, PeakBlocks};
use crate::{EngineError, Result};

/// How much memory the KV block pool may use.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum KvBudget {
    /// No budget: sequences take blocks as they need them (the batch size and the
    /// context bound memory). The library default.
    #[default]
    Unbounded,
    /// This many bytes (`--kv-memory 2G`).
    Bytes(u64),
    /// This fraction of the memory available once the weights are loaded
    /// (`--gpu-memory-utilization 0.9`): the GPU's free memory when the model runs on one,
    /// else available RAM.
    Fraction(f64),
}

/// The pool and the figures admission decisions use.
#[derive(Debug)]
pub(crate) struct KvAdmission {
    pub pool: Arc<BlockPool>,
    pub bounded: bool,
    /// Bytes of one block of one layer.
    pub block_bytes: usize,
    /// Prompt tokens one step may feed a sequence (the window layers' peak depends on it).
    chunk: usize,
    /// The model's sliding windows, one per layer.
    windows: Vec<Option<usize>>,
    /// Most blocks a layer holds, as the model's backend stores KV.
    peak: PeakBlocks,
    /// Longest sequence the whole pool can hold, capped at the context.
    pub max_sequence_tokens: usize,
}

/// Memory the OS could give this process now (Linux `MemAvailable`).
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl KvAdmission {
    /// Sizes the pool for `model` under `budget`. A fractional budget leaves out
    /// `reserved_bytes` (the RAM prompt cache's cap), which shares the same memory.
    /// `share` (≤ 1) is the part of the budget the model's own caches get: with a draft
    /// model every sequence keeps the draft's cache of the same tokens in the rest
    /// ([`crate::speculative::DraftModel::target_share`]), so each block charged stands
    /// for its tokens in both caches.
    pub fn new(
        model: &Model,
        budget: KvBudget,
        chunk: usize,
        reserved_bytes: u64,
        share: f64,
    ) -> Result<Self> {
        let block_bytes = model.kv_block_bytes().max(1);
        let bytes = match budget {
            KvBudget::Unbounded => None,
            KvBudget::Bytes(b) => Some(b),
            KvBudget::Fraction(f) => {
                if !(f > 0.0 && f <= 1.0) {
                    return Err(EngineError::InvalidInput(format!(
                        "the KV memory fraction must be in (0, 1], got {f}"
                    )));
                }
                let available = match model.device_memory() {
                    Some(gpu) => {
                        tracing::info!(
                            free = gpu.free,
                            total = gpu.total,
                            "KV pool sized from the GPU's free memory"
                        );
                        Some(gpu.free)
                    }
                    None => available_memory(),
                };
                match available {
                    Some(avail) => {
                        let share = (avail as f64 * f) as u64;
                        // Never below a tenth of the share: a huge prompt-cache cap must
                        // not leave running sequences without room.
                        let pool = share.saturating_sub(reserved_bytes).max(share / 10);
                        if pool < share {
                            tracing::info!(
                                share,
                                reserved_bytes,
                                pool,
                                "KV pool leaves room for the RAM prompt cache"
                            );
                        }
                        Some(pool)
                    }
                    None => {
                        tracing::warn!(
                            "cannot read the available memory; the KV pool has no budget"
                        );
                        None
                    }
                }
            }
        };
        let share = share.clamp(0.0, 1.0);
        if share < 1.0 {
            if let Some(b) = bytes {
                tracing::info!(
                    draft_bytes = (b as f64 * (1.0 - share)) as u64,
                    "the draft model's caches take their share of the KV budget"
                );
            }
        }
        let bytes = bytes.map(|b| (b as f64 * share) as u64);
        let capacity = match bytes {
            Some(b) => usize::try_from(b / block_bytes as u64).unwrap_or(usize::MAX),
            None => usize::MAX,
        };
        let mut admission = KvAdmission {
            pool: BlockPool::new(capacity),
            bounded: bytes.is_some(),
            block_bytes,
            chunk: chunk.max(1),
            windows: model.config().cache_windows(),
            peak: model.kv_peak_blocks(),
            max_sequence_tokens: 0,
        };
        let context = model.info().context_length;
        admission.max_sequence_tokens = admission.longest_fitting(context);
        if admission.max_sequence_tokens == 0 {
            return Err(EngineError::InvalidInput(format!(
                "a KV memory budget of {} bytes holds {capacity} blocks of {block_bytes} bytes, \
                 fewer than one sequence of one token needs ({}); raise it",
                bytes.unwrap_or(0),
                admission.blocks_for(1)
            )));
        }
        Ok(admission)
    }

    /// Most blocks a sequence of `tokens` tokens holds at once, all layers together.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.windows
            .iter()
            .map(|&w| (self.peak)(tokens, w, self.chunk))
            .sum()
    }

    /// The longest sequence (≤ `context`) whose blocks fit the whole pool.
    fn longest_fitting(&self, context: usize) -> usize {
        let cap = self.pool.capacity();
        if self.blocks_for(context) <= cap {
            return context;
        }
        let (mut lo, mut hi) = (0usize, context);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.blocks_for(mid) <= cap {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Refuses, before any work, a request that could never fit the pool even alone.
    pub fn check(&self, request: &GenerationRequest) -> Result<()> {
        let needed = request.prompt.len() + request.max_tokens;
        if needed > self.max_sequence_tokens {
            return Err(EngineError::KvCapacity {
                prompt: request.prompt.len(),
                max_tokens: request.max_tokens,
                needed,
                limit: self.max_sequence_tokens,
            });
        }
        Ok(())
    }

    /// Blocks a sequence that will hold `tokens` tokens after its first step needs
    /// free before it is admitted.
    pub fn blocks_to_start(&self, tokens: usize) -> usize {
        self.blocks_for(tokens.min(self.max_sequence_tokens).max(1))
    }

    /// One line for the start-up log.
    pub fn describe(&self, model: &Model) -> String {
        let layers = model.config().cache_windows().len().max(1);
        if !self.bounded {
            return format!(
                "KV pool without a budget: blocks of {BLOCK_TOKENS} tokens × {layers} layers, \
                 {} bytes each",
                self.block_bytes
            );
        }
        let cap = self.pool.capacity();
        format!(
            "KV pool: {cap} blocks of {BLOCK_TOKENS} tokens ({:.1} MiB, {} bytes a block of one \
             layer, {layers} layers): {} tokens at full attention, {} tokens per sequence at most",
            (cap * self.block_bytes) as f64 / (1 << 20) as f64,
            self.block_bytes,
            cap * BLOCK_TOKENS / layers,
            self.max_sequence_tokens,
        )
    }
}
