//! The state of one generating sequence, stepped by whoever owns the forward passes
//! (the single-sequence loop in `generation/mod.rs` or the batching scheduler).
use std::time::Duration;

use super::request::{
    FinishReason, GenerationOutput, GenerationRequest, PromptLogprob, TokenEvent, Usage,
    PROMPT_SCORE_CHUNK,
};
use super::text::TextStream;
use crate::constraint::RowConstraint;
use crate::model::{KvCache, Model};
use crate::models::decoder::{Logits, LogitsRequest};
use crate::sampler::{row_logprobs, RngStream, Sampler, SamplerTokens, StepRng};
use crate::speculative::{
    draft, draft_model, DraftLength, RowDrafts, SpeculationUsage, SpeculativeConfig,
};
use crate::Result;

/// What the next forward pass of a sequence feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceStep {
    /// Prompt tokens to feed (`0` for a decode step, which feeds the last sampled token).
    pub prefill: usize,
    /// Drafted tokens a decode step feeds after the last sampled one, to verify
    /// ([`crate::speculative`]); such a step asks for [`LogitsRequest::All`].
    pub drafts: usize,
    /// Which logits the step needs.
    pub logits: LogitsRequest,
}

impl SequenceStep {
    /// Tokens this step feeds.
    pub fn tokens(&self) -> usize {
        if self.prefill > 0 {
            self.prefill
        } else {
            1 + self.drafts
        }
    }
}

/// One sequence from prompt to finish.
pub struct Sequence {
    prompt: Vec<u32>,
    /// Tokens of `history` fed while (re)filling the cache.
    fed: usize,
    /// Tokens of `history` the cache must hold before decoding: the prompt, or after a
    /// preemption everything but the last sampled token.
    target: usize,
    preemptions: usize,
    cached: usize,
    cache: KvCache,
    sampler: Sampler,
    /// The grammar state of a structured-output request.
    constraint: Option<RowConstraint>,
    text: TextStream,
    generated: Vec<u32>,
    pending: u32,
    history: Vec<u32>,
    max_tokens: usize,
    eos: Vec<u32>,
    ignore_eos: bool,
    finish: Option<FinishReason>,
    prefill_time: Duration,
    decode_time: Duration,
    /// Alternatives per scored prompt position, when the prompt is scored.
    score_top: Option<usize>,
    /// Scores of prompt tokens `1..=scores.len()`.
    scores: Vec<PromptLogprob>,
    /// Whether a token event carried the scores.
    scores_sent: bool,
    /// Prompt lookup, when this sequence decodes speculatively.
    speculation: Option<Speculation>,
    /// Prompt positions a prefill chunk ends at, so the prompt cache can keep the KV
    /// there (see [`GenerationRequest::cache_points`]); sorted.
    cache_points: Vec<usize>,
}

/// A speculatively decoding sequence's drafter settings, draft length and counts.
struct Speculation {
    config: SpeculativeConfig,
    length: DraftLength,
    /// The drafts the planned step verifies.
    drafts: Vec<u32>,
    /// For a sampled row drafting with a draft model: the draft model's distribution each
    /// draft was drawn from (the rejection rule needs it); empty otherwise.
    q: Vec<Vec<f32>>,
    usage: SpeculationUsage,
    /// The draft model's state, when a draft model drafts (else prompt lookup does).
    model: Option<ModelDraft>,
}

/// One sequence's side of a draft model: its KV and what it holds.
struct ModelDraft {
    /// The draft model's KV for this sequence (the KV pool's budget leaves room for it:
    /// [`crate::speculative::DraftModel::target_share`]).
    cache: KvCache,
    /// The tokens `cache` holds, in order: a prefix of the history, then drafts.
    fed: Vec<u32>,
    /// Tokens the served model knows: a draft past them is not proposed.
    vocab: usize,
    /// Tokens to draft this step.
    rounds: usize,
}

/// `cache` (holding `fed`) cut back to the part of `history` it shares, with those
/// tokens; `None` when it cannot be cut back.
fn cut_to_history(
    mut cache: KvCache,
    mut fed: Vec<u32>,
    history: &[u32],
) -> Option<(KvCache, Vec<u32>)> {
    let shared = fed.iter().zip(history).take_while(|(a, b)| a == b).count();
    if shared < fed.len() {
        cache.trim(shared).ok()?;
        fed.truncate(shared);
    }
    (cache.len() == fed.len()).then_some((cache, fed))
}

/// What a draft model's forward pass gave one drafting sequence.
pub enum DraftOutput<'a> {
    /// Nothing (the pass only fed tokens).
    None,
    /// The argmax, picked on the backend.
    Id(u32),
    /// The logits of the last fed position.
    Logits(&'a [f32]),
}

impl Sequence {
    /// Validates `request` against the model and prepares to run it on `cache`, which
    /// may already hold a prefix of the prompt (at least one prompt token is always
    /// recomputed, so the first sampled token has fresh logits).
    pub fn new(model: &Model, request: &GenerationRequest, mut cache: KvCache) -> Result<Self> {
        model.check_request(request)?;
        if request.prompt_logprobs.is_some() && !cache.is_empty() {
            // A cached position has no logits: scoring computes the whole prompt.
            cache = model.new_cache();
        }
        let mut cached = cache.len();
        if cached >= request.prompt.len() {
            cached = request.prompt.len() - 1;
            cache.trim(cached)?;
        }
        // A cached prefix that ends inside an image is cut back to before it (the image's
        // soft tokens must be computed in one pass).
        if let Some(span) = request
            .media
            .iter()
            .find(|s| s.start < cached && cached < s.start + s.len)
        {
            if cache.can_trim_to(span.start) {
                cache.trim(span.start)?;
                cached = span.start;
            } else {
                cache = model.new_cache();
                cached = 0;
            }
        }
        // Always set: a cached prefix may carry another request's images.
        model.attach_media(&mut cache, &request.media)?;
        let sampler = Sampler::new(
            request.sampling.clone(),
            SamplerTokens {
                eos_ids: model.eos_ids().to_vec(),
                newline_id: model
                    .tokenizer()
                    .token_id("\n")
                    .or_else(|| model.tokenizer().token_id("Ċ")),
            },
        )?;
        Ok(Sequence {
            prompt: request.prompt.clone(),
            fed: cached,
            target: request.prompt.len(),
            preemptions: 0,
            cached,
            cache,
            constraint: request
                .sampling
                .constraint
                .as_ref()
                .map(|c| c.start(&request.prompt)),
            sampler,
            text: TextStream::new(model.tokenizer(), &request.stop, request.keep_special_text),
            generated: Vec::new(),
            pending: 0,
            history: request.prompt.clone(),
            max_tokens: request.max_tokens,
            eos: model.eos_ids().to_vec(),
            ignore_eos: request.ignore_eos,
            finish: if request.max_tokens == 0 && request.prompt_logprobs.is_none() {
                Some(FinishReason::Length)
            } else {
                None
            },
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            score_top: request.prompt_logprobs,
            scores: Vec::new(),
            scores_sent: false,
            speculation: None,
            cache_points: Vec::new(),
        }
        .with_cache_points(request.cache_points.iter().map(|p| p.at)))
    }

    /// Also ends a prefill chunk at each of `points` that lies in the part of the prompt
    /// still to compute, so the prompt cache can keep the KV there.
    pub fn with_cache_points(mut self, points: impl IntoIterator<Item = usize>) -> Self {
        let (from, to) = (self.fed, self.prompt.len());
        self.cache_points
            .extend(points.into_iter().filter(|&p| p > from && p < to));
        self.cache_points.sort_unstable();
        self.cache_points.dedup();
        self
    }

    /// Decodes speculatively with prompt lookup from now on. Under a structured-output
    /// constraint the drafts are cut where the grammar stops accepting them, and each
    /// verified position is sampled under the grammar's mask as plain decoding would.
    ///
    /// With `draft_cache` (a cache of the draft model and the prompt tokens it holds,
    /// from the prompt cache or none) a draft model drafts instead of prompt lookup: the
    /// engine loop runs it ([`Sequence::begin_model_draft`],
    /// [`Sequence::record_model_draft`]); `vocab` is the served model's vocabulary size.
    pub fn enable_speculation(
        &mut self,
        config: SpeculativeConfig,
        draft_cache: Option<(KvCache, Vec<u32>)>,
        vocab: usize,
    ) {
        self.speculation = Some(Speculation {
            config,
            length: DraftLength::new(config.num_draft_tokens),
            drafts: Vec::new(),
            q: Vec::new(),
            usage: SpeculationUsage::default(),
            model: draft_cache.map(|(cache, fed)| ModelDraft {
                cache,
                fed,
                vocab,
                rounds: 0,
            }),
        });
    }

    /// Starts this step's drafting with the draft model: cuts the draft's cache back to
    /// the part of the history it still shares (a rejected draft is gone from the
    /// history) and returns the tokens to feed it first — the history it has not seen,
    /// at most `max_feed` — and how many tokens to draft (0 while the adaptive length
    /// rests or while the draft is still catching up on a long prompt). `None` for a
    /// sequence that does not draft with a model this step, or would pass `context`.
    pub fn begin_model_draft(
        &mut self,
        max_feed: usize,
        context: usize,
    ) -> Option<(Vec<u32>, usize)> {
        let decoding = self.is_decoding() && !self.generated.is_empty();
        let left = self.max_tokens.saturating_sub(self.generated.len());
        let s = self.speculation.as_mut()?;
        let m = s.model.as_mut()?;
        s.drafts.clear();
        s.q.clear();
        m.rounds = 0;
        if !decoding || left < 2 {
            return None;
        }
        let k = s.length.next_length().min(left - 1);
        if k == 0 || self.history.len() + k > context {
            return None;
        }
        // At least the last token is fed: its logits propose the first draft.
        let shared = m
            .fed
            .iter()
            .zip(&self.history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(self.history.len() - 1);
        if shared < m.fed.len() {
            if m.cache.trim(shared).is_err() {
                // Not expected (draft models are checked to be trimmable): start over.
                m.cache.trim(0).ok()?;
                m.fed.clear();
            } else {
                m.fed.truncate(shared);
            }
        }
        let from = m.fed.len();
        let missing = self.history.len() - from;
        if missing > max_feed.max(1) {
            return Some((self.history[from..from + max_feed.max(1)].to_vec(), 0));
        }
        m.rounds = k;
        Some((self.history[from..].to_vec(), k))
    }

    /// Takes the draft model's cache, cut back to the part of the history it holds, and
    /// those tokens (for the prompt cache, when the sequence ends). `None` when no draft
    /// model drafts for this sequence or its cache cannot be cut back.
    pub fn take_draft_cache(&mut self) -> Option<(KvCache, Vec<u32>)> {
        let m = self.speculation.as_mut()?.model.take()?;
        cut_to_history(m.cache, m.fed, &self.history)
    }

    /// Parks the draft model's cache before the sequence is preempted ([`Sequence::preempt`]
    /// clears the rest of the draft's state): returns it, cut back to the part of the
    /// history it holds, with those tokens (for the prompt cache's draft entries), and
    /// leaves `empty` in its place; the draft model keeps drafting for the sequence once
    /// it resumes. `None` when no draft model drafts for it (or its cache cannot be cut
    /// back).
    pub fn park_draft_cache(&mut self, empty: KvCache) -> Option<(KvCache, Vec<u32>)> {
        let m = self.speculation.as_mut()?.model.as_mut()?;
        let cache = std::mem::replace(&mut m.cache, empty);
        let fed = std::mem::take(&mut m.fed);
        cut_to_history(cache, fed, &self.history)
    }

    /// Gives a resumed sequence's draft model its KV of `fed`, a prefix of the history
    /// (found in the prompt cache's draft entries), when it holds nothing yet. Returns
    /// whether it was taken.
    pub fn restore_draft_cache(&mut self, cache: KvCache, fed: Vec<u32>) -> bool {
        let history = &self.history;
        let Some(m) = self.speculation.as_mut().and_then(|s| s.model.as_mut()) else {
            return false;
        };
        let fits = m.fed.is_empty()
            && m.cache.is_empty()
            && cache.len() == fed.len()
            && fed.len() < history.len()
            && history.starts_with(&fed);
        if fits {
            m.cache = cache;
            m.fed = fed;
        }
        fits
    }

    /// Whether a draft model drafts for this sequence.
    pub fn drafts_with_model(&self) -> bool {
        self.speculation.as_ref().is_some_and(|s| s.model.is_some())
    }

    /// The prompt and the tokens generated so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The draft model's cache, when a draft model drafts for this sequence.
    pub fn draft_cache_mut(&mut self) -> Option<&mut KvCache> {
        Some(&mut self.speculation.as_mut()?.model.as_mut()?.cache)
    }

    /// Whether the draft model proposes by argmax for this sequence (greedy sampling).
    pub fn drafts_greedily(&self) -> bool {
        self.sampler.params().is_greedy()
    }

    /// Records a draft-model pass that fed `input` into this sequence's draft cache and
    /// gave `out`: the next draft is the argmax (greedy rows) or a draw from the draft
    /// model's tempered distribution (sampled rows, keyed by the seed and the step the
    /// draft is for). Returns the next pass's input for this sequence (the new draft),
    /// or `None` when it has drafted enough (or drafted the end of the sequence).
    pub fn record_model_draft(&mut self, input: &[u32], out: DraftOutput<'_>) -> Option<u32> {
        let greedy = self.sampler.params().is_greedy();
        let (seed, temperature) = (
            self.sampler.params().seed,
            self.sampler.params().temperature,
        );
        let step = self.sampler.step();
        let s = self.speculation.as_mut()?;
        let m = s.model.as_mut()?;
        m.fed.extend_from_slice(input);
        if s.drafts.len() >= m.rounds {
            return None;
        }
        let d = match out {
            DraftOutput::None => return None,
            DraftOutput::Id(id) => id,
            DraftOutput::Logits(row) if greedy => {
                let row = &row[..m.vocab.min(row.len())];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter().position(|&l| l == max).unwrap_or(0) as u32
            }
            DraftOutput::Logits(row) => {
                let q = draft_model::distribution(row, temperature, m.vocab);
                let at = step + s.drafts.len() as u64;
                let d = draft_model::pick(&q, StepRng::new(seed, at, RngStream::Draft).next_f64());
                s.q.push(q);
                d
            }
        };
        if d as usize >= m.vocab {
            return None;
        }
        s.drafts.push(d);
        let more = s.drafts.len() < m.rounds && !self.eos.contains(&d);
        more.then_some(d)
    }

    /// Forgets the draft model's state after its pass failed: the next step feeds it the
    /// whole history again.
    pub fn abandon_model_draft(&mut self) {
        if let Some(s) = self.speculation.as_mut() {
            s.drafts.clear();
            s.q.clear();
            if let Some(m) = s.model.as_mut() {
                if m.cache.trim(0).is_err() {
                    tracing::warn!("a draft cache could not be emptied");
                }
                m.fed.clear();
                m.rounds = 0;
            }
        }
    }

    /// Drafts the tokens the next decode step verifies (none for a sequence that does
    /// not speculate, is not decoding, found no match, or has one token left to make).
    /// Returns how many.
    pub fn propose_drafts(&mut self) -> usize {
        let decoding = self.is_decoding() && !self.generated.is_empty();
        let left = self.max_tokens.saturating_sub(self.generated.len());
        let Some(s) = self.speculation.as_mut() else {
            return 0;
        };
        // Drafted by the engine loop's draft-model passes this step, or looked up here.
        if s.model.is_none() {
            s.drafts.clear();
            if !decoding || left < 2 {
                return 0;
            }
            let k = s.length.next_length().min(left - 1);
            s.drafts = draft(&self.history, s.config.ngram_min, s.config.ngram_max, k);
        }
        if let Some(c) = self.constraint.as_mut() {
            // A draft the grammar refuses would only be rejected: not worth its row. A
            // failing check drafts nothing (the step then reports the grammar's error).
            let n = c.valid_prefix(&s.drafts).unwrap_or(0);
            s.drafts.truncate(n);
            s.q.truncate(n);
        }
        s.drafts.len()
    }

    /// The drafts proposed for the next step and how likely each is kept (see
    /// [`crate::speculative::DraftBudget::allot`]); `None` without drafts.
    pub fn draft_prospect(&self) -> Option<RowDrafts> {
        let s = self.speculation.as_ref().filter(|s| !s.drafts.is_empty())?;
        Some(RowDrafts {
            drafted: s.drafts.len(),
            acceptance: s.length.acceptance(),
        })
    }

    /// Keeps the first `n` of the drafts proposed for the next step (the step's budget
    /// verifies no more).
    pub fn limit_drafts(&mut self, n: usize) {
        let Some(s) = self.speculation.as_mut() else {
            return;
        };
        if n == 0 && !s.drafts.is_empty() {
            s.length.withheld();
        }
        s.drafts.truncate(n);
        s.q.truncate(n);
    }

    /// How many drafts the next step verifies.
    pub fn draft_count(&self) -> usize {
        self.drafts().len()
    }

    /// Drops the drafts proposed for the next step (the pool had no room for them).
    pub fn clear_drafts(&mut self) {
        if let Some(s) = self.speculation.as_mut() {
            s.drafts.clear();
            s.q.clear();
        }
    }

    /// Drafted and kept tokens so far, when the sequence decodes speculatively.
    pub fn speculation(&self) -> Option<SpeculationUsage> {
        self.speculation.as_ref().map(|s| s.usage)
    }

    fn drafts(&self) -> &[u32] {
        self.speculation.as_ref().map_or(&[], |s| &s.drafts)
    }

    /// Whether the prompt chunk starting at `fed` holds a position whose score is still
    /// missing (the row at position `p` scores prompt token `p + 1`).
    fn scores_from(&self, fed: usize) -> bool {
        let next = self.scores.len();
        self.score_top.is_some() && next + 1 < self.prompt.len() && fed <= next
    }

    /// Whether the sequence is done.
    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Whether the prompt (and, after a preemption, what had been generated) is fully in
    /// the cache.
    pub fn is_decoding(&self) -> bool {
        self.fed >= self.target
    }

    /// Prompt tokens (or, after a preemption, tokens to recompute) not yet in the cache.
    pub fn remaining_prompt(&self) -> usize {
        self.target - self.fed.min(self.target)
    }

    /// The next step, feeding at most `chunk` prompt tokens.
    pub fn next_step(&self, chunk: usize) -> SequenceStep {
        if self.fed < self.target {
            let scoring = self.scores_from(self.fed);
            let chunk = if scoring {
                chunk.min(PROMPT_SCORE_CHUNK)
            } else {
                chunk
            };
            let n = chunk.max(1).min(self.target - self.fed);
            let n = self.cache.chunk_end(self.fed, self.fed + n) - self.fed;
            // A chunk ends at the next cache point (an image keeps its pass whole).
            let n = match self.cache_points.iter().find(|&&p| p > self.fed) {
                Some(&p) if p < self.fed + n && self.cache.chunk_end(self.fed, p) == p => {
                    p - self.fed
                }
                _ => n,
            };
            // A recomputed sequence already sampled its next token: no logits needed.
            // With `max_tokens` 0 (a scored prompt) nothing is sampled.
            let last =
                self.fed + n == self.target && self.generated.is_empty() && self.max_tokens > 0;
            SequenceStep {
                prefill: n,
                drafts: 0,
                logits: if scoring {
                    LogitsRequest::All
                } else if last {
                    LogitsRequest::Last
                } else {
                    LogitsRequest::None
                },
            }
        } else {
            let drafts = self.drafts().len();
            SequenceStep {
                prefill: 0,
                drafts,
                logits: if drafts > 0 {
                    LogitsRequest::All
                } else {
                    LogitsRequest::Last
                },
            }
        }
    }

    /// The tokens `step` feeds.
    pub fn input_tokens(&self, step: &SequenceStep) -> Vec<u32> {
        if step.prefill > 0 {
            self.history[self.fed..self.fed + step.prefill].to_vec()
        } else {
            let mut t = vec![self.pending];
            t.extend_from_slice(&self.drafts()[..step.drafts]);
            t
        }
    }

    /// The sequence's cache.
    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// Bytes of KV cache the sequence holds.
    pub fn cache_bytes(&self) -> usize {
        self.cache.byte_size()
    }

    /// The tokens `step` feeds and the cache they go into.
    pub fn input_and_cache(&mut self, step: &SequenceStep) -> (Vec<u32>, &mut KvCache) {
        (self.input_tokens(step), &mut self.cache)
    }

    /// Records a forward pass of a decode step that verified `step.drafts` drafts:
    /// samples each position in turn from its processed logits (as plain decoding would,
    /// one step at a time), keeping drafts while the sampler accepts them (greedy: the
    /// draft is the argmax; sampled: the rejection rule of [`Sampler::sample_draft`]),
    /// and ends with the first token that is not the draft (or the one after the last
    /// draft). The cache is then cut back to what plain decoding would hold: everything
    /// but the last token. Returns the tokens' events, in order.
    pub fn advance_speculative(
        &mut self,
        step: &SequenceStep,
        logits: Option<Logits>,
        took: Duration,
    ) -> Result<Vec<TokenEvent>> {
        self.record(step, took);
        let Some(mut logits) = logits else {
            return Ok(Vec::new());
        };
        let (drafts, q) = self
            .speculation
            .as_mut()
            .map(|s| (std::mem::take(&mut s.drafts), std::mem::take(&mut s.q)))
            .unwrap_or_default();
        let mut events = Vec::with_capacity(step.drafts + 1);
        let mut accepted = 0;
        let greedy = self.sampler.params().is_greedy();
        for j in 0..logits.rows.min(step.drafts + 1) {
            let row = &mut logits.data[j * logits.vocab..(j + 1) * logits.vocab];
            // The grammar's state after the tokens kept so far (each is committed as it
            // is accepted), so every position is sampled as plain decoding would.
            let grammar = self.constraint.as_mut().filter(|c| c.is_active());
            let (sampled, kept) = match (drafts.get(j).filter(|_| j < step.drafts), grammar) {
                // Greedy under a grammar: the token plain decoding picks, kept if it is
                // the draft.
                (Some(&d), Some(c)) if greedy => {
                    let s = c.sample(&mut self.sampler, row, &self.history)?;
                    let kept = s.id == d;
                    (s, kept)
                }
                (Some(&d), grammar) => {
                    // Sampled: the rejection rule against the grammar's distribution.
                    if let Some(c) = grammar {
                        c.mask_logits(row)?;
                    }
                    match q.get(j) {
                        Some(q) => self.sampler.sample_draft_from(row, &self.history, d, q),
                        None => self.sampler.sample_draft(row, &self.history, d),
                    }
                }
                (None, Some(c)) => (c.sample(&mut self.sampler, row, &self.history)?, false),
                (None, None) => (self.sampler.sample(row, &self.history), false),
            };
            events.push(self.accept(sampled.id, sampled.logprob, sampled.top_logprobs)?);
            accepted += usize::from(kept);
            if !kept || self.finish.is_some() {
                break;
            }
        }
        self.observe_drafts(step.drafts, accepted);
        self.cache.trim(self.history.len() - 1)?;
        Ok(events)
    }

    /// [`Self::advance_speculative`] for a pass that returned each verified position's
    /// argmax instead of its logits (only when [`Self::takes_raw_argmax`]): the tokens the
    /// greedy sampler would have picked, drafts kept while they equal them.
    pub fn advance_speculative_to(
        &mut self,
        step: &SequenceStep,
        ids: &[u32],
        took: Duration,
    ) -> Result<Vec<TokenEvent>> {
        self.record(step, took);
        let drafts = self
            .speculation
            .as_mut()
            .map(|s| {
                s.q.clear();
                std::mem::take(&mut s.drafts)
            })
            .unwrap_or_default();
        let mut events = Vec::with_capacity(step.drafts + 1);
        let mut accepted = 0;
        for (j, &id) in ids.iter().enumerate().take(step.drafts + 1) {
            self.sampler.set_step(self.sampler.step() + 1);
            events.push(self.accept(id, f32::NAN, Vec::new())?);
            let kept = j < step.drafts && drafts.get(j) == Some(&id);
            accepted += usize::from(kept);
            if !kept || self.finish.is_some() {
                break;
            }
        }
        self.observe_drafts(step.drafts, accepted);
        self.cache.trim(self.history.len() - 1)?;
        Ok(events)
    }

    /// Counts a verified step's drafts and how many were kept, and adapts the draft
    /// length to it.
    fn observe_drafts(&mut self, drafted: usize, accepted: usize) {
        if let Some(s) = self.speculation.as_mut() {
            s.length.observe(drafted, accepted);
            s.usage.drafted += drafted;
            s.usage.accepted += accepted;
        }
    }

    /// Records a finished forward pass of `step`; samples when logits came back (in
    /// place: the sampler's processors rewrite the last row).
    pub fn advance(
        &mut self,
        step: &SequenceStep,
        logits: Option<Logits>,
        took: Duration,
    ) -> Result<Option<TokenEvent>> {
        self.record(step, took);
        if let (LogitsRequest::All, Some(rows)) = (step.logits, &logits) {
            self.score_rows(step, rows);
        }
        if self.scored_only() {
            return Ok(None);
        }
        let Some(mut logits) = logits else {
            return Ok(None);
        };
        // Of a scored chunk, only the prompt's last position samples.
        if step.logits == LogitsRequest::All && !(self.is_decoding() && self.generated.is_empty()) {
            return Ok(None);
        }
        let sampled = match self.constraint.as_mut().filter(|c| c.is_active()) {
            Some(c) => c.sample(&mut self.sampler, logits.last_mut(), &self.history)?,
            None => self.sampler.sample(logits.last_mut(), &self.history),
        };
        self.accept(sampled.id, sampled.logprob, sampled.top_logprobs)
            .map(Some)
    }

    /// Whether this sequence's next token is the argmax of the raw logits (see
    /// [`crate::sampler::SamplingParams::is_raw_argmax`]), so a forward pass may return just that.
    pub fn takes_raw_argmax(&self) -> bool {
        self.sampler.params().is_raw_argmax()
    }

    /// Whether this sequence's next token is the argmax of its logits under its
    /// structured-output grammar's mask, if it has one (see
    /// [`crate::sampler::SamplingParams::is_masked_argmax`]): a forward pass may then
    /// return just that, given [`Self::next_mask`].
    pub fn takes_masked_argmax(&self) -> bool {
        self.sampler.params().is_masked_argmax()
    }

    /// The cache and the grammar state, borrowed together: the mask of the next token can
    /// be computed while the cache is in a forward pass.
    pub fn cache_and_constraint(&mut self) -> (&mut KvCache, Option<&mut RowConstraint>) {
        (&mut self.cache, self.constraint.as_mut())
    }

    /// [`Self::advance`] for a pass that returned the argmax `id` instead of logits (only
    /// when [`Self::takes_raw_argmax`], or [`Self::takes_masked_argmax`] with the grammar's
    /// mask applied): the same token the sampler would have picked.
    pub fn advance_to(
        &mut self,
        step: &SequenceStep,
        id: Option<u32>,
        took: Duration,
    ) -> Result<Option<TokenEvent>> {
        self.record(step, took);
        if self.scored_only() {
            return Ok(None);
        }
        let Some(id) = id else {
            return Ok(None);
        };
        self.sampler.set_step(self.sampler.step() + 1);
        self.accept(id, f32::NAN, Vec::new()).map(Some)
    }

    /// Whether this is a request that only scores its prompt (`max_tokens` 0), which
    /// finishes once the prompt is in.
    fn scored_only(&mut self) -> bool {
        if self.max_tokens > 0 {
            return false;
        }
        if self.is_decoding() {
            self.finish = Some(FinishReason::Length);
        }
        true
    }

    /// Scores the prompt tokens the rows of prompt chunk `step` (just recorded) predict.
    fn score_rows(&mut self, step: &SequenceStep, logits: &Logits) {
        let Some(top) = self.score_top else { return };
        let start = self.fed - step.prefill;
        for j in 0..logits.rows.min(step.prefill) {
            let q = start + j + 1;
            if q >= self.prompt.len() || q != self.scores.len() + 1 {
                continue;
            }
            let (logprob, top_logprobs) = row_logprobs(logits.row(j), self.prompt[q], top);
            self.scores.push(PromptLogprob {
                logprob,
                top_logprobs,
            });
        }
    }

    /// Counts the tokens `step` fed and its time.
    fn record(&mut self, step: &SequenceStep, took: Duration) {
        if step.prefill > 0 {
            self.fed += step.prefill;
            self.prefill_time += took;
        } else {
            self.decode_time += took;
        }
    }

    /// Records a sampled token: history, text, stop strings, limits.
    fn accept(
        &mut self,
        id: u32,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    ) -> Result<TokenEvent> {
        self.generated.push(id);
        self.history.push(id);
        self.pending = id;
        let mut event = TokenEvent {
            id,
            text: String::new(),
            logprob,
            top_logprobs,
            last: false,
            cached_tokens: self.cached,
            prompt_logprobs: Vec::new(),
        };
        if self.score_top.is_some() && !self.scores_sent {
            self.scores_sent = true;
            event.prompt_logprobs = self.scores.clone();
        }
        let eos = !self.ignore_eos && self.eos.contains(&id);
        if let (Some(c), false) = (self.constraint.as_mut(), eos) {
            c.commit(id)?;
        }
        if eos {
            self.finish = Some(FinishReason::EndOfSequence);
        } else {
            let (text, stopped) = self.text.push(id)?;
            event.text = text;
            if let Some(stop) = stopped {
                self.finish = Some(FinishReason::StopString(stop));
            }
        }
        if self.finish.is_none() && self.constraint.as_ref().is_some_and(RowConstraint::is_done) {
            // The grammar is complete and allows nothing more.
            self.finish = Some(FinishReason::EndOfSequence);
        }
        if self.finish.is_none() && self.generated.len() >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
        }
        if let Some(reason) = &self.finish {
            event.last = true;
            if !matches!(reason, FinishReason::StopString(_)) {
                let (rest, stopped) = self.text.flush();
                event.text.push_str(&rest);
                if let Some(stop) = stopped {
                    self.finish = Some(FinishReason::StopString(stop));
                }
            }
        }
        Ok(event)
    }

    /// Continues a generation from a checkpoint: `cache` holds the prompt and all of
    /// `generated` but the last token, which was sampled and not yet fed. The generated
    /// tokens are replayed through the text stream (their events, to send to the client,
    /// come back with the sequence) and the sampler continues at the step after them, so
    /// a seeded or greedy request continues exactly as it would have.
    pub fn resume(
        model: &Model,
        request: &GenerationRequest,
        cache: KvCache,
        generated: &[u32],
    ) -> Result<(Self, Vec<TokenEvent>)> {
        let prompt = request.prompt.len();
        if generated.is_empty() || cache.len() + 1 != prompt + generated.len() {
            return Err(crate::EngineError::Cache(format!(
                "a checkpoint of {} cached tokens cannot continue {} prompt and {} generated tokens",
                cache.len(),
                prompt,
                generated.len()
            )));
        }
        let mut seq = Sequence::new(model, request, model.new_cache())?;
        seq.cache = cache;
        seq.fed = prompt;
        seq.cached = prompt;
        let mut events = Vec::with_capacity(generated.len());
        for &id in generated {
            if seq.finish.is_some() {
                break;
            }
            events.push(seq.accept(id, f32::NAN, Vec::new())?);
        }
        seq.sampler.set_step(generated.len() as u64);
        Ok((seq, events))
    }

    /// The prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The sequence's cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Gives up the cache to free its memory (the scheduler needs the blocks for an older
    /// sequence) and continues on `empty`: the next steps recompute the prompt and the
    /// tokens generated so far (without sampling), then decoding goes on where it
    /// stopped, with the same sampler state, so the output is what it would have been.
    pub fn preempt(&mut self, mut empty: KvCache) {
        self.target = if self.generated.is_empty() {
            self.prompt.len()
        } else {
            // Everything but the last sampled token, which the next decode step feeds.
            self.history.len() - 1
        };
        self.fed = 0;
        // The images' rows stay: the recompute places them again.
        empty.adopt_media(&self.cache);
        self.cache = empty;
        // What the draft model still holds goes too (with the prompt cache on, the engine
        // loop parked it there first: `park_draft_cache`); it catches up once decoding.
        self.abandon_model_draft();
        self.preemptions += 1;
    }

    /// Times the sequence was preempted.
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    /// Stops the sequence at the caller's request.
    pub fn cancel(&mut self) {
        if self.finish.is_none() {
            self.finish = Some(FinishReason::Cancelled);
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Counts and timings so far.
    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated.len(),
            prefill_time: self.prefill_time,
            decode_time: self.decode_time,
            speculation: self
                .speculation
                .as_ref()
                .map(|s| s.usage)
                .filter(|u| u.drafted > 0),
        }
    }

    /// Ends the sequence and hands back what it produced.
    pub fn finish(mut self) -> GenerationOutput {
        let usage = self.usage();
        if !matches!(self.finish, Some(FinishReason::StopString(_))) {
            self.text.flush();
        }
        GenerationOutput {
            tokens: self.generated,
            text: self.text.text().to_string(),
            finish_reason: self.finish.unwrap_or(FinishReason::Cancelled),
            usage,
            cache: self.cache,
            prompt_logprobs: self.scores,
        }
    }
}
