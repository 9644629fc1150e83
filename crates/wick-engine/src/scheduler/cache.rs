//! The engine loop's use of the prompt cache: what happens at admission (resume from a
//! generation checkpoint, else reuse the longest cached prefix), after each step
//! (prompt-boundary entry, periodic checkpoints) and when a sequence ends (put its KV
//! back, drop its checkpoints).
use std::sync::Arc;
use std::time::{Duration, Instant};

use wick_cache::{
    CacheValue, CheckpointKey, KeyBuilder, PromptCache, PromptCacheConfig, SsdConfig,
};

use super::EngineConfig;
use crate::generation::{CachePoint, GenerationRequest, Sequence, SequenceStep, TokenEvent};
use crate::media::cache_key_tokens;
use crate::model::{KvCache, Model};
use crate::{EngineError, Result};

/// The prompt cache as the engine uses it.
pub(crate) struct EngineCache {
    /// The tiers.
    pub tiers: PromptCache<KvCache>,
    /// The draft model's entries, under the same keys: a request whose prompt the served
    /// model finds cached finds the draft's KV of it too, so the draft does not prefill
    /// it again before it can draft. With an SSD directory they spill to
    /// `<dir>/draft-<fingerprint of the draft>/`, so they outlive a restart as well.
    draft: Option<PromptCache<KvCache>>,
    fingerprint: String,
    checkpoint_every: usize,
    /// Prefill length that earns a prompt-boundary entry (`None`: the model has no
    /// sliding-window layer, so a longer entry can always be trimmed and none is needed).
    boundary_min: Option<usize>,
    /// Prompt tokens between periodic entries of a long prefill, on models whose caches
    /// cannot be cut back (0: none).
    prompt_checkpoint_every: usize,
}

/// What the cache tracks about a running sequence.
pub(crate) struct CacheTracking {
    ns: Arc<str>,
    checkpoint: Option<CheckpointKey>,
    boundary_pending: bool,
    /// Generated tokens at the last checkpoint (a speculative step emits several, so
    /// the next one is due once `checkpoint_every` more were made, not at a multiple).
    checkpointed: usize,
    /// The request's media: their positions are cached under ids of their digests.
    media: Vec<crate::media::MediaSpan>,
    /// Prompt positions whose KV is still to be kept as an entry, in order.
    points: Vec<CachePoint>,
}

/// A sequence ready to run, and the tokens to replay to the client first.
pub(crate) struct Started {
    pub seq: Sequence,
    pub replay: Vec<TokenEvent>,
    pub tracking: Option<CacheTracking>,
}

impl EngineCache {
    /// The cache for `config`, or `None` when it is off. With a draft model the RAM cap
    /// (and the SSD cap, when set) is split by `share` (the served model's part of the KV
    /// bytes per token): the served model's entries get that part, the draft's the rest.
    pub fn new(model: &Model, config: &EngineConfig, share: f64) -> Result<Option<EngineCache>> {
        if config.ssd_cache_dir.is_some() && config.prompt_cache_bytes == 0 {
            return Err(EngineError::InvalidInput(
                "the SSD cache needs the RAM prompt cache (prompt_cache_bytes is 0)".into(),
            ));
        }
        if config.generation_checkpoint_tokens > 0 && config.ssd_cache_dir.is_none() {
            return Err(EngineError::InvalidInput(
                "generation checkpoints need the SSD cache (ssd_cache_dir is not set)".into(),
            ));
        }
        if config.prompt_cache_bytes == 0 {
            return Ok(None);
        }
        let fingerprint = model.fingerprint();
        let ram = usize::try_from(config.prompt_cache_bytes).unwrap_or(usize::MAX);
        let share = share.clamp(0.0, 1.0);
        let draft_ram = match &config.draft_model {
            Some(_) => (ram as f64 * (1.0 - share)) as usize,
            None => 0,
        };
        let (ssd_max, draft_ssd_max) = match &config.draft_model {
            Some(_) => split_cap(config.ssd_cache_max_bytes, share),
            None => (config.ssd_cache_max_bytes, 0),
        };
        let tiers_config = |ram_bytes: usize, ssd: Option<SsdConfig>| PromptCacheConfig {
            ram_bytes,
            ssd,
            write_behind: config.ssd_write_behind,
            timing: wick_cache::durability::dirty::Timing {
                max_defer: config.ssd_write_max_defer,
                ..Default::default()
            },
            ..PromptCacheConfig::default()
        };
        let draft = match &config.draft_model {
            Some(d) if draft_ram > 0 => {
                let ssd = config.ssd_cache_dir.as_ref().map(|dir| SsdConfig {
                    root: dir.clone(),
                    // Its own directory, even for a model drafting for itself: the two
                    // tiers keep their own indexes and caps.
                    fingerprint: format!("draft-{}", d.0.fingerprint()),
                    model: d.0.info().name.clone(),
                    max_bytes: draft_ssd_max,
                    verify: config.ssd_cache_verify,
                });
                Some(PromptCache::new(tiers_config(draft_ram, ssd))?)
            }
            _ => None,
        };
        let tiers = PromptCache::new(tiers_config(
            ram - draft_ram,
            config.ssd_cache_dir.as_ref().map(|dir| SsdConfig {
                root: dir.clone(),
                fingerprint: fingerprint.clone(),
                model: model.info().name.clone(),
                max_bytes: ssd_max,
                verify: config.ssd_cache_verify,
            }),
        ))?;
        let windowed = !model.caches_can_be_cut_back();
        Ok(Some(EngineCache {
            tiers,
            draft,
            fingerprint,
            checkpoint_every: config.generation_checkpoint_tokens,
            boundary_min: windowed.then_some(config.prompt_boundary_min_tokens),
            prompt_checkpoint_every: if windowed {
                config.prompt_checkpoint_tokens
            } else {
                0
            },
        }))
    }

    /// The identity of a generation: everything that decides its tokens. The seed of a
    /// greedy request decides nothing and is left out.
    pub fn checkpoint_key(&self, request: &GenerationRequest) -> CheckpointKey {
        let mut sampling = request.sampling.clone();
        if sampling.is_greedy() {
            sampling.seed = 0;
        }
        let stop = serde_json::to_string(&request.stop).unwrap_or_default();
        KeyBuilder::default()
            .str("fingerprint", &self.fingerprint)
            .str("namespace", &request.effective_namespace())
            .tokens("prompt", &request.prompt)
            .u64("max_tokens", request.max_tokens as u64)
            .str("sampling", &format!("{sampling:?}"))
            .str("stop", &stop)
            .u64("ignore_eos", u64::from(request.ignore_eos))
            .u64("keep_special_text", u64::from(request.keep_special_text))
            .finish()
    }

    fn checkpoints_for(&self, request: &GenerationRequest) -> Option<CheckpointKey> {
        let eligible = self.checkpoint_every > 0
            && self.tiers.checkpoints_available()
            && request.sampling.logprobs.is_none()
            && request.prompt_logprobs.is_none()
            // A resumed generation would need its images again: not checkpointed.
            && request.media.is_empty();
        eligible.then(|| self.checkpoint_key(request))
    }

    /// Builds the sequence for `request`: resumed from its latest checkpoint when there
    /// is one, else on the longest cached prefix of its prompt.
    pub fn start(&self, model: &Model, request: &GenerationRequest) -> Result<Started> {
        let ns: Arc<str> = request.effective_namespace().into();
        let checkpoint = self.checkpoints_for(request);
        if let Some(key) = checkpoint {
            if let Some(r) = self.tiers.find_checkpoint(key, &ns, &request.prompt, model) {
                match Sequence::resume(model, request, r.value, &r.generated) {
                    Ok((seq, replay)) => {
                        tracing::info!(
                            replayed = replay.len(),
                            "resuming a generation from its checkpoint"
                        );
                        return Ok(Started {
                            seq,
                            replay,
                            tracking: Some(CacheTracking {
                                ns,
                                checkpoint,
                                boundary_pending: false,
                                checkpointed: r.generated.len(),
                                media: Vec::new(),
                                points: Vec::new(),
                            }),
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "checkpoint unusable; starting over"),
                }
            }
        }
        // A scored prompt is computed whole (cached positions have no logits), so it does
        // not look the cache up; its KV still goes back to the cache at the end.
        let keyed = cache_key_tokens(&request.prompt, &request.media);
        let (computed, value) = if request.prompt_logprobs.is_some() {
            (request.prompt.len(), None)
        } else {
            let hit = self.tiers.lookup(&ns, &keyed, model);
            (request.prompt.len() - hit.cached, hit.value)
        };
        let cached = request.prompt.len() - computed;
        // A reused breakpoint's pin lives on from this use (as Anthropic's cache does).
        for p in request.cache_points.iter().filter(|p| p.at <= cached) {
            if let Some(ttl) = p.pin {
                self.tiers.pin(&ns, &keyed[..p.at], Instant::now() + ttl);
            }
        }
        // Entries where the next turn may part from this prompt: the request's points on
        // a model whose caches cannot be cut back (else a longer entry serves any prefix),
        // its pinned breakpoints on any model, and periodic ones through a long prefill.
        let untrimmable = self.boundary_min.is_some();
        let mut points: Vec<CachePoint> = request
            .cache_points
            .iter()
            .filter(|p| untrimmable || p.pin.is_some())
            .copied()
            .collect();
        if self.prompt_checkpoint_every > 0 {
            let every = self.prompt_checkpoint_every;
            points.extend(
                (every..request.prompt.len())
                    .step_by(every)
                    .map(|at| CachePoint { at, pin: None }),
            );
        }
        // The next turn parts right after this prompt (a template that renders the reply as
        // it prompted for it): the prompt-boundary entry is that point, however short.
        let parts_at_end = request
            .cache_points
            .iter()
            .any(|p| p.at == request.prompt.len());
        points.retain(|p| p.at > cached && p.at < request.prompt.len());
        points.sort_by_key(|p| p.at);
        let seq = Sequence::new(model, request, value.unwrap_or_else(|| model.new_cache()))?
            .with_cache_points(points.iter().map(|p| p.at));
        Ok(Started {
            seq,
            replay: Vec::new(),
            tracking: Some(CacheTracking {
                ns,
                checkpoint,
                boundary_pending: computed > 0
                    && self
                        .boundary_min
                        .is_some_and(|min| computed >= min || parts_at_end),
                checkpointed: 0,
                media: request.media.clone(),
                points,
            }),
        })
    }

    /// An empty cache of the draft model for `request`, or the longest prefix of its
    /// prompt the draft's entries hold, with the tokens it holds.
    pub fn draft_start(&self, draft: &Model, request: &GenerationRequest) -> (KvCache, Vec<u32>) {
        self.draft_lookup(draft, &request.effective_namespace(), &request.prompt)
            .unwrap_or_else(|| (draft.new_cache(), Vec::new()))
    }

    /// A preempted sequence resumes: the draft model's KV of the longest prefix of its
    /// history that the draft's entries hold (put there when it was preempted).
    pub fn draft_resume(
        &self,
        draft: &Model,
        t: &CacheTracking,
        history: &[u32],
    ) -> Option<(KvCache, Vec<u32>)> {
        self.draft_lookup(draft, &t.ns, history)
    }

    fn draft_lookup(&self, draft: &Model, ns: &str, tokens: &[u32]) -> Option<(KvCache, Vec<u32>)> {
        let kv = self.draft.as_ref()?.lookup(ns, tokens, draft).value?;
        let fed = tokens.get(..kv.len())?.to_vec();
        Some((kv, fed))
    }

    /// A sequence ended or was preempted: the draft model's KV of `tokens` goes to its
    /// entries.
    pub fn draft_finish(&self, t: &CacheTracking, tokens: &[u32], kv: KvCache) {
        if let Some(tiers) = &self.draft {
            if tokens.len() == kv.len() && !kv.is_empty() {
                tiers.put(&t.ns, tokens, kv);
            }
        }
    }

    /// After a forward pass of `plan`: a prompt-boundary entry once the prompt is in,
    /// a checkpoint every N generated tokens.
    pub fn after_step(&self, t: &mut CacheTracking, seq: &Sequence, plan: &SequenceStep) {
        if plan.prefill > 0 {
            self.keep_points(t, seq);
        }
        if t.boundary_pending && plan.prefill > 0 && seq.is_decoding() {
            t.boundary_pending = false;
            let prompt = seq.prompt();
            match seq.cache().fork(prompt.len()) {
                Ok(kv) => self
                    .tiers
                    .put(&t.ns, &cache_key_tokens(prompt, &t.media), kv),
                Err(e) => tracing::warn!(error = %e, "prompt-boundary entry skipped"),
            }
        }
        let Some(key) = t.checkpoint else { return };
        if plan.logits == crate::models::decoder::LogitsRequest::None {
            // No token was sampled (a prompt chunk, or a preempted sequence's recompute).
            return;
        }
        let n = seq.generated().len();
        if n == 0 || seq.is_finished() || n < t.checkpointed + self.checkpoint_every {
            return;
        }
        t.checkpointed = n;
        match seq.cache().to_host() {
            Ok(host) => self
                .tiers
                .save_checkpoint(key, &t.ns, seq.prompt(), seq.generated(), host),
            Err(e) => tracing::warn!(error = %e, "generation checkpoint skipped"),
        }
    }

    /// Keeps an entry at each pending cache point the prefill has reached (a chunk ends
    /// at every point, so the cache holds exactly the point's tokens after it).
    fn keep_points(&self, t: &mut CacheTracking, seq: &Sequence) {
        let len = seq.cache().len();
        while let Some(p) = t.points.first().copied().filter(|p| p.at <= len) {
            t.points.remove(0);
            if p.at != len {
                continue;
            }
            let keyed = cache_key_tokens(&seq.prompt()[..p.at], &t.media);
            match seq.cache().fork(p.at) {
                Ok(kv) => {
                    self.tiers.put(&t.ns, &keyed, kv);
                    if let Some(ttl) = p.pin {
                        self.tiers.pin(&t.ns, &keyed, Instant::now() + ttl);
                    }
                }
                Err(e) => tracing::warn!(error = %e, at = p.at, "prompt cache point skipped"),
            }
        }
    }

    /// A sequence ended: its KV goes back to the cache; a completed generation's
    /// checkpoints are removed (a cancelled one keeps its latest).
    pub fn finish(&self, t: &CacheTracking, tokens: &[u32], kv: KvCache, completed: bool) {
        if tokens.len() == kv.len() && !kv.is_empty() {
            self.tiers
                .put(&t.ns, &cache_key_tokens(tokens, &t.media), kv);
        }
        if completed {
            if let Some(key) = t.checkpoint {
                self.tiers.remove_checkpoints(key);
            }
        }
    }

    /// Makes every cache entry durable within `timeout`. The report is the served
    /// model's tiers'; the draft's entries (which only save the draft a prefill) get
    /// what is left of the time.
    pub fn flush(&self, timeout: Duration) -> wick_cache::FlushReport {
        let start = std::time::Instant::now();
        let report = self.tiers.flush(timeout);
        if let Some(draft) = &self.draft {
            let d = draft.flush(timeout.saturating_sub(start.elapsed()));
            if !d.durable {
                tracing::debug!(
                    pending = d.pending_snapshots,
                    "draft cache entries not flushed"
                );
            }
        }
        report
    }

    /// Waits up to `timeout` for the SSD tiers' start-up scans (the draft's entries too);
    /// the served model's report, or `None` without an SSD tier or while a scan runs.
    pub fn wait_for_scan(&self, timeout: Duration) -> Option<wick_cache::ScanReport> {
        let start = std::time::Instant::now();
        let report = self.tiers.wait_for_scan(timeout)?;
        match &self.draft {
            Some(d) if d.ssd().is_some() => d
                .wait_for_scan(timeout.saturating_sub(start.elapsed()))
                .map(|_| report),
            _ => Some(report),
        }
    }

    /// Whether an SSD tier's start-up scan is still indexing entries.
    pub fn is_scanning(&self) -> bool {
        self.tiers.is_scanning() || self.draft.as_ref().is_some_and(|d| d.is_scanning())
    }

    /// Tells the cache writers whether the engine is computing.
    pub fn set_busy(&self, busy: bool) {
        self.tiers.set_busy(busy);
        if let Some(draft) = &self.draft {
            draft.set_busy(busy);
        }
    }
}

/// A byte cap split by `share`: the served model's part and the draft's. No cap (0) stays
/// none for both; a cap leaves each part at least one byte (0 would lift it).
fn split_cap(cap: u64, share: f64) -> (u64, u64) {
    if cap < 2 {
        return (cap, cap);
    }
    let draft = ((cap as f64 * (1.0 - share)) as u64).clamp(1, cap - 1);
    (cap - draft, draft)
}

#[cfg(test)]
mod tests {
    use super::split_cap;

    #[test]
    fn a_cap_splits_by_share_and_never_becomes_none() {
        assert_eq!(split_cap(0, 0.8), (0, 0));
        assert_eq!(split_cap(1000, 0.75), (750, 250));
        assert_eq!(split_cap(1000, 1.0), (999, 1));
        assert_eq!(split_cap(1000, 0.0), (1, 999));
        assert_eq!(split_cap(1, 0.5), (1, 1));
    }
}
