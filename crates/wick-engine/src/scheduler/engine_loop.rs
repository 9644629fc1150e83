//! The engine thread: admit, plan one batched step under a token budget and the KV block
//! pool (preempting the newest sequence when a decode finds no block), run it, hand out
//! tokens, retire finished sequences — repeat.
use std::any::Any;
use std::collections::VecDeque;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::cache::{CacheTracking, Started};
use super::pacer::PromptPacer;
use super::queue::{Pending, Shared};
use super::{Completion, EngineConfig, EngineEvent};
use crate::constraint::{ConstraintError, RowConstraint};
use crate::generation::{DraftOutput, Sequence, SequenceStep, TokenEvent};
use crate::model::{Model, StepPlan, StepRow};
use crate::models::decoder::{LogitsRequest, RowOutput, StepMasks, Want};
use crate::speculative::DraftBudget;

/// A sequence in the running batch and the request it serves.
struct Active {
    seq: Sequence,
    req: Pending,
    cache: Option<CacheTracking>,
    /// Admission order (preemption takes the newest).
    order: u64,
}

impl Active {
    fn gone(&self) -> bool {
        self.req.is_gone()
    }
}

/// What the engine thread owns besides the model.
#[derive(Default)]
struct Batch {
    /// Running sequences, oldest first.
    running: Vec<Active>,
    /// Preempted sequences waiting for blocks, oldest first; they go back before any new
    /// request is admitted.
    preempted: VecDeque<Active>,
    /// Admission counter: a higher `order` is a newer sequence.
    next_order: u64,
    /// The decode steps' cost, which decides how many drafts a step verifies.
    drafts: DraftBudget,
    /// The steps' measured costs, which size prompt chunks beside decoding rows.
    pacer: PromptPacer,
    /// When the last step began, with its decode rows and prompt tokens: the time to the
    /// next step's beginning is what its rows waited (a step's pass runs on a GPU while
    /// the host already plans the next one, so the pass's own call returns early).
    last_step: Option<(Instant, usize, usize)>,
}

impl Batch {
    /// Puts a sequence back in the running batch at its place by age.
    fn resume(&mut self, a: Active) {
        let at = self
            .running
            .iter()
            .position(|r| r.order > a.order)
            .unwrap_or(self.running.len());
        self.running.insert(at, a);
    }
}

/// The engine thread's body. A panic anywhere in it (a bug in a forward pass, a kernel,
/// the sampler) halts the engine: every request in flight and waiting fails with the
/// reason, later submits are refused, and [`Shared::halted`] tells the server, which stops
/// reporting healthy and exits (`docs/reliability.md` says why it does not restart).
pub(crate) fn run(model: &Model, shared: &Shared) {
    let mut b = Batch::default();
    let served = panic::catch_unwind(AssertUnwindSafe(|| serve(model, shared, &mut b)));
    if let Err(payload) = served {
        halt(shared, &mut b, &panic_message(payload.as_ref()));
    }
    b.running.clear();
    b.preempted.clear();
    publish(shared, &b);
    if let Some(cache) = &shared.cache {
        cache.set_busy(false);
    }
}

/// The text a panic was raised with.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// After a panic on the engine thread: marks the engine halted (under the queue lock, so
/// no submit slips in behind the drain), then fails the running, preempted and waiting
/// requests with the reason. The model's and the batch's state are not trusted any more:
/// nothing goes back to the prompt cache.
fn halt(shared: &Shared, b: &mut Batch, panic: &str) {
    let c = &shared.counters;
    let reason = format!(
        "the engine stopped after an internal error ({panic}); the server must be restarted"
    );
    tracing::error!(panic, "engine thread panicked: failing every request");
    let waiting: Vec<Pending> = {
        let mut q = shared.lock_queue();
        shared.halt(reason.clone());
        c.queued.store(0, Ordering::Relaxed);
        q.waiting.drain(..).collect()
    };
    let running: Vec<Pending> = b.running.drain(..).map(|a| a.req).collect();
    let preempted: Vec<Pending> = b.preempted.drain(..).map(|a| a.req).collect();
    // The gauges say nothing runs before any client hears of the failure.
    publish(shared, b);
    for p in running.into_iter().chain(preempted).chain(waiting) {
        c.failed.fetch_add(1, Ordering::Relaxed);
        let _ = p.events.send(EngineEvent::Failed(reason.clone()));
    }
}

/// Admits, steps and retires sequences until shutdown.
fn serve(model: &Model, shared: &Shared, b: &mut Batch) {
    let c = &shared.counters;
    loop {
        if !admit(model, shared, b) {
            break;
        }
        if shared.abort.load(Ordering::Relaxed) {
            for a in b.running.drain(..).chain(b.preempted.drain(..)) {
                let _ = a.req.events.send(EngineEvent::Failed(
                    "cancelled: the server is shutting down".into(),
                ));
            }
            break;
        }
        let mut cancelled = 0;
        let mut gone = |a: &Active| {
            let gone = a.gone();
            if gone {
                cancelled += 1;
                tracing::debug!(request = a.req.id, "client gone, request cancelled");
            }
            !gone
        };
        b.running.retain(&mut gone);
        b.preempted.retain(&mut gone);
        // The batch's figures are published before the cancellations are counted, so a
        // caller that sees its request cancelled also sees the memory it held freed (also
        // when it was the last one running).
        publish(shared, b);
        c.cancelled.fetch_add(cancelled, Ordering::Relaxed);
        if b.running.is_empty() {
            // An idle wait is nobody's step time.
            b.last_step = None;
        } else {
            step(model, shared, b);
            publish(shared, b);
        }
    }
}

/// Stores the batch's size, the preempted count and the KV bytes the running sequences
/// hold (0 once the last one is gone).
fn publish(shared: &Shared, b: &Batch) {
    let c = &shared.counters;
    c.running.store(b.running.len(), Ordering::Relaxed);
    c.preempted_waiting
        .store(b.preempted.len(), Ordering::Relaxed);
    c.kv_bytes.store(
        b.running.iter().map(|a| a.seq.cache_bytes() as u64).sum(),
        Ordering::Relaxed,
    );
}

/// Moves preempted sequences, then waiting requests, into the batch while the batch has
/// places and the KV pool has room for their prompts (the oldest first, so nobody
/// starves; a lone sequence is always let in, since any accepted request fits the whole
/// pool). Sleeps when there is nothing to do (telling the cache's writer the engine is
/// idle). Returns false when the engine should exit. Cache lookups (which may read the
/// SSD) run with the queue unlocked, so `submit` never waits on them.
fn admit(model: &Model, shared: &Shared, b: &mut Batch) -> bool {
    let c = &shared.counters;
    let pool = &shared.admission.pool;
    let max_batch = shared.config.max_batch;
    loop {
        let mut free = pool.free();
        while b.running.len() < max_batch {
            let Some(front) = b.preempted.front() else {
                break;
            };
            let need = shared
                .admission
                .blocks_to_start(front.seq.remaining_prompt() + 1);
            if need > free && !b.running.is_empty() {
                break;
            }
            free = free.saturating_sub(need);
            let Some(mut a) = b.preempted.pop_front() else {
                break;
            };
            a.seq.cache_mut().attach(pool);
            resume_draft(shared, &mut a);
            tracing::debug!(
                request = a.req.id,
                recompute = a.seq.remaining_prompt(),
                "preempted sequence resumes"
            );
            b.resume(a);
        }
        c.preempted_waiting
            .store(b.preempted.len(), Ordering::Relaxed);
        let taken: Vec<Pending> = {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let mut taken = Vec::new();
                while b.preempted.is_empty() && b.running.len() + taken.len() < max_batch {
                    let Some(p) = q.waiting.front() else {
                        break;
                    };
                    if p.is_gone() {
                        q.waiting.pop_front();
                        c.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let need = shared.admission.blocks_to_start(p.request.prompt.len() + 1);
                    let alone = b.running.is_empty() && taken.is_empty();
                    if need > free && !alone {
                        break;
                    }
                    free = free.saturating_sub(need);
                    taken.extend(q.waiting.pop_front());
                }
                c.queued.store(q.waiting.len(), Ordering::Relaxed);
                if !taken.is_empty() || !b.running.is_empty() {
                    break taken;
                }
                if q.shutting_down || shared.abort.load(Ordering::Relaxed) {
                    return false;
                }
                if let Some(cache) = &shared.cache {
                    cache.set_busy(false);
                }
                q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                free = pool.free();
            }
        };
        if taken.is_empty() {
            return true;
        }
        if let Some(cache) = &shared.cache {
            cache.set_busy(true);
        }
        for p in taken {
            start(model, shared, p, b);
        }
        if !b.running.is_empty() {
            return true;
        }
    }
}

/// Builds a request's sequence (from the cache when it can) and adds it to the batch.
fn start(model: &Model, shared: &Shared, p: Pending, b: &mut Batch) {
    let c = &shared.counters;
    let started = match &shared.cache {
        Some(cache) => cache.start(model, &p.request),
        None => Sequence::new(model, &p.request, model.new_cache()).map(|seq| Started {
            seq,
            replay: Vec::new(),
            tracking: None,
        }),
    };
    match started {
        Ok(Started {
            mut seq,
            replay,
            tracking,
        }) => {
            seq.cache_mut().attach(&shared.admission.pool);
            // Room for the whole prompt now, charged and allocated once: on a backend whose
            // KV grows by copying into larger buffers (CUDA), a long prompt fed in short
            // paced chunks would otherwise leave the device allocator a buffer of every
            // size it passed through (tens of GB for an 18k-token prompt of an 8B model).
            // `WICK_KV_PREALLOCATE=0` turns this off (to measure what it saves).
            let left = seq.remaining_prompt();
            if left > 1
                && seq.cache().grows_by_copying()
                && preallocate_prompts()
                && seq.cache_mut().reserve(left)
            {
                if let Err(e) = seq.cache_mut().preallocate(left) {
                    tracing::debug!(request = p.id, "KV preallocation failed: {e}");
                }
            }
            if let Some(spec) = shared.config.speculative {
                if p.request.speculative && model.can_speculate() {
                    // A draft model would read an image's or clip's soft tokens as text
                    // (it has no tower): such requests draft by prompt lookup instead.
                    // The draft's KV of the prompt comes from the prompt cache too.
                    let draft = shared
                        .config
                        .draft_model
                        .as_ref()
                        .filter(|_| p.request.media.is_empty())
                        .map(|d| match &shared.cache {
                            Some(cache) => cache.draft_start(&d.0, &p.request),
                            None => (d.0.new_cache(), Vec::new()),
                        });
                    if let Some((_, fed)) = &draft {
                        c.spec_draft_cached
                            .fetch_add(fed.len() as u64, Ordering::Relaxed);
                    }
                    seq.enable_speculation(spec, draft, model.vocab_size());
                }
            }
            tracing::debug!(
                request = p.id,
                waited_ms = p.submitted.elapsed().as_millis() as u64,
                cached = seq.usage().cached_tokens,
                replayed = replay.len(),
                "admitted"
            );
            for event in replay {
                let _ = p.events.send(EngineEvent::Token(event));
            }
            let a = Active {
                seq,
                req: p,
                cache: tracking,
                order: b.next_order,
            };
            b.next_order += 1;
            if a.seq.is_finished() {
                // A checkpoint replay that already reached the end.
                complete(shared, a);
            } else {
                b.running.push(a);
            }
        }
        Err(e) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            let _ = p.events.send(EngineEvent::Failed(e.to_string()));
        }
    }
}

/// Hands a finished sequence's KV to the cache and its result to the client.
fn complete(shared: &Shared, mut a: Active) {
    let c = &shared.counters;
    let draft = a.seq.take_draft_cache();
    let out = a.seq.finish();
    let cancelled = out.finish_reason == crate::generation::FinishReason::Cancelled;
    let mut kv = out.cache;
    if let (Some(cache), Some(t)) = (&shared.cache, &a.cache) {
        if let Some((draft_kv, fed)) = draft {
            cache.draft_finish(t, &fed, draft_kv);
        }
        let mut tokens = a.req.request.prompt.clone();
        tokens.extend_from_slice(&out.tokens);
        tokens.truncate(kv.len());
        // The entry leaves the block pool; the prompt cache accounts for it from now on.
        kv.detach();
        cache.finish(t, &tokens, kv, !cancelled);
    } else {
        // Back to the pool before the client hears it is done, so a caller that reads
        // the stats after its last event sees the blocks free.
        drop(kv);
    }
    if cancelled {
        c.cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    c.completed.fetch_add(1, Ordering::Relaxed);
    a.req.release();
    let _ = a.req.events.send(EngineEvent::Done(Completion {
        finish_reason: out.finish_reason,
        usage: out.usage,
        // Scores travel on the first token; a reply without one gets them here.
        prompt_logprobs: if out.tokens.is_empty() {
            out.prompt_logprobs
        } else {
            Vec::new()
        },
        tokens: out.tokens,
        text: out.text,
    }));
}

/// Frees the blocks of running sequence `i` and queues it for recomputation. Its draft
/// model's KV goes to the prompt cache's draft entries (when the cache is on), to come
/// back when it resumes.
fn preempt(model: &Model, shared: &Shared, b: &mut Batch, i: usize) {
    let mut a = b.running.remove(i);
    if let (Some(cache), Some(t), Some(d)) = (&shared.cache, &a.cache, &shared.config.draft_model) {
        if let Some((kv, fed)) = a.seq.park_draft_cache(d.0.new_cache()) {
            cache.draft_finish(t, &fed, kv);
        }
    }
    a.seq.preempt(model.new_cache());
    shared.counters.preemptions.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        request = a.req.id,
        generated = a.seq.generated().len(),
        times = a.seq.preemptions(),
        "KV pool full: sequence preempted, it will be recomputed"
    );
    let at = b
        .preempted
        .iter()
        .position(|p| p.order > a.order)
        .unwrap_or(b.preempted.len());
    b.preempted.insert(at, a);
}

/// A preempted sequence resumes: its draft model's KV comes back from the prompt cache.
fn resume_draft(shared: &Shared, a: &mut Active) {
    let (Some(cache), Some(t), Some(d)) = (&shared.cache, &a.cache, &shared.config.draft_model)
    else {
        return;
    };
    if !a.seq.drafts_with_model() {
        return;
    }
    if let Some((kv, fed)) = cache.draft_resume(&d.0, t, a.seq.history()) {
        let restored = fed.len() as u64;
        if a.seq.restore_draft_cache(kv, fed) {
            shared
                .counters
                .spec_draft_cached
                .fetch_add(restored, Ordering::Relaxed);
        }
    }
}

/// What the widest decoding row stores after this step, per layer: on a backend that
/// decodes the batch in one buffer per layer, every row is that wide.
fn widest_decode_rows(b: &Batch) -> Vec<usize> {
    b.running
        .iter()
        .filter(|a| a.seq.is_decoding())
        .map(|a| a.seq.cache().stored_after_step())
        .reduce(|w, s| w.iter().zip(&s).map(|(a, b)| *a.max(b)).collect())
        .unwrap_or_default()
}

/// Decides what each running sequence feeds this step and reserves the KV blocks for it:
/// decoding sequences first, oldest first, each preempting the newest running sequence
/// while the pool has no block for it; then prompt chunks under the step's token budget,
/// shrunk to what the pool can give. `None` for a sequence that sits this step out.
fn plan(model: &Model, shared: &Shared, b: &mut Batch) -> Vec<Option<SequenceStep>> {
    let decoding = b.running.iter().filter(|a| a.seq.is_decoding()).count();
    if model.speculates_in_batches() || decoding <= 1 {
        if let Some(draft) = &shared.config.draft_model {
            draft_with_model(&draft.0, shared, b);
        }
        budget_drafts(shared, b);
    } else {
        b.running.iter_mut().for_each(|a| a.seq.clear_drafts());
    }
    let mut i = 0;
    let mut widest = widest_decode_rows(b);
    while i < b.running.len() {
        let seq = &mut b.running[i].seq;
        if !seq.is_decoding() {
            i += 1;
            continue;
        }
        // Drafts need room for themselves too; without it the row decodes plainly.
        let drafts = seq.draft_count();
        if drafts > 0 && seq.cache_mut().reserve(1 + drafts) {
            i += 1;
            continue;
        }
        seq.clear_drafts();
        if seq.cache_mut().reserve_decode_step(&widest) {
            i += 1;
            continue;
        }
        let newest = b.running.len() - 1;
        preempt(model, shared, b, newest);
        widest = widest_decode_rows(b);
    }
    loop {
        let decoding: usize = b
            .running
            .iter()
            .filter(|a| a.seq.is_decoding())
            .map(|a| a.seq.next_step(1).tokens())
            .sum();
        let mut budget = b
            .pacer
            .step_tokens(
                &shared.config,
                lone_prompt_tokens(model, &shared.config),
                itl_factor(model, &shared.config),
                decoding,
            )
            .saturating_sub(decoding)
            .max(1);
        let plans: Vec<Option<SequenceStep>> = b
            .running
            .iter_mut()
            .map(|a| {
                if a.seq.is_decoding() {
                    return Some(a.seq.next_step(1));
                }
                let mut n = budget.min(a.seq.remaining_prompt());
                while n > 0 && !a.seq.cache_mut().reserve(n) {
                    n /= 2;
                }
                if n == 0 {
                    return None;
                }
                // A chunk that starts at an image takes the whole image (never cut).
                let s = a.seq.next_step(n);
                if s.tokens() > n && !a.seq.cache_mut().reserve(s.tokens()) {
                    return None;
                }
                budget = budget.saturating_sub(s.tokens());
                Some(s)
            })
            .collect();
        if plans.iter().any(Option::is_some) || b.running.is_empty() {
            return plans;
        }
        // Only prompts left and not one block for any of them: the newest makes room.
        let newest = b.running.len() - 1;
        preempt(model, shared, b, newest);
    }
}

/// Drafts the next tokens of every decoding row, then keeps of them what the step's
/// [`DraftBudget`] finds worth a row of the forward pass (when it is on).
fn budget_drafts(shared: &Shared, b: &mut Batch) {
    let budget = shared.config.speculative.is_some_and(|s| s.budget);
    let mut plain = 0;
    let mut rows = Vec::new();
    for a in b.running.iter_mut().filter(|a| a.seq.is_decoding()) {
        a.seq.propose_drafts();
        match a.seq.draft_prospect() {
            Some(r) => rows.push(r),
            None => plain += 1,
        }
    }
    if rows.is_empty() || !budget {
        return;
    }
    let mut allotted = b.drafts.allot(plain, &rows).into_iter();
    for a in b.running.iter_mut().filter(|a| a.seq.is_decoding()) {
        if a.seq.draft_prospect().is_some() {
            a.seq.limit_drafts(allotted.next().unwrap_or(0));
        }
    }
}

/// Drafts the next tokens of every row that drafts with the draft model: one batched
/// forward pass of the draft model per draft position, over all those rows together.
/// The first pass feeds each row what its draft cache has not seen yet (the tokens
/// accepted last step, or a prompt chunk while it catches up); each later pass feeds the
/// row's previous draft. Greedy rows draft the argmax, sampled rows draw from the
/// draft's distribution (kept for the rejection rule).
fn draft_with_model(draft: &Model, shared: &Shared, b: &mut Batch) {
    let context = draft.info().context_length;
    let budget = shared.config.step_token_budget;
    // Each row's input this pass and whether it drafts (else it only catches up).
    let mut inputs: Vec<Option<(Vec<u32>, bool)>> = b
        .running
        .iter_mut()
        .map(|a| {
            let (feed, rounds) = a.seq.begin_model_draft(budget, context)?;
            Some((feed, rounds > 0))
        })
        .collect();
    while inputs.iter().any(Option::is_some) {
        let greedy = b
            .running
            .iter()
            .zip(&inputs)
            .all(|(a, t)| t.is_none() || a.seq.drafts_greedily());
        let result = {
            let rows: Vec<StepRow<'_>> = b
                .running
                .iter_mut()
                .zip(&inputs)
                .filter_map(|(a, t)| {
                    let (tokens, drafts) = t.as_ref()?;
                    Some(StepRow {
                        tokens,
                        cache: a.seq.draft_cache_mut()?,
                        want: match (drafts, greedy) {
                            (false, _) => Want::Nothing,
                            (true, true) => Want::Token,
                            (true, false) => Want::Logits,
                        },
                        adapters: None,
                    })
                })
                .collect();
            draft.execute(StepPlan::new(rows))
        };
        let outputs = match result {
            Ok(o) => {
                let fed: usize = inputs.iter().flatten().map(|(t, _)| t.len()).sum();
                shared
                    .counters
                    .spec_draft_computed
                    .fetch_add(fed as u64, Ordering::Relaxed);
                o
            }
            Err(e) => {
                tracing::warn!(error = %e, "draft model pass failed; these rows decode plainly");
                for (a, t) in b.running.iter_mut().zip(&inputs) {
                    if t.is_some() {
                        a.seq.abandon_model_draft();
                    }
                }
                return;
            }
        };
        let mut outputs = outputs.into_iter();
        for (a, t) in b.running.iter_mut().zip(inputs.iter_mut()) {
            let Some((input, _)) = t.take() else {
                continue;
            };
            let out = outputs.next();
            let next = match &out {
                Some(RowOutput::Token(id)) => {
                    a.seq.record_model_draft(&input, DraftOutput::Id(*id))
                }
                Some(RowOutput::Logits(l)) => a
                    .seq
                    .record_model_draft(&input, DraftOutput::Logits(l.last())),
                _ => a.seq.record_model_draft(&input, DraftOutput::None),
            };
            *t = next.map(|d| (vec![d], true));
        }
    }
}

/// What a forward pass gave one sequence.
enum StepOutput {
    /// What the model returned for its row.
    Row(RowOutput),
    /// The grammar allowed no token: the sequence fails.
    Failed(ConstraintError),
}

/// Hands each planned sequence its share of a forward pass (sampling, detokenizing),
/// spread over the cores: those are per sequence. Returns each one's index in `running`
/// and its token event, if it sampled one.
fn advance_all(
    running: &mut [Active],
    plans: &[Option<SequenceStep>],
    outputs: Vec<StepOutput>,
    took: Duration,
) -> Vec<(usize, crate::Result<Vec<TokenEvent>>)> {
    let mut outputs = outputs.into_iter();
    let work: Vec<(usize, &mut Active, &SequenceStep, Option<StepOutput>)> = running
        .iter_mut()
        .zip(plans)
        .enumerate()
        .filter_map(|(i, (a, p))| Some((i, a, p.as_ref()?)))
        .map(|(i, a, p)| (i, a, p, outputs.next()))
        .collect();
    work.into_par_iter()
        .map(|(i, a, plan, output)| {
            let event = match output {
                Some(StepOutput::Row(RowOutput::Logits(logits))) if plan.drafts > 0 => {
                    a.seq.advance_speculative(plan, Some(logits), took)
                }
                Some(StepOutput::Row(RowOutput::Logits(logits))) => {
                    a.seq.advance(plan, Some(logits), took).map(Vec::from_iter)
                }
                Some(StepOutput::Row(RowOutput::Token(id))) => {
                    a.seq.advance_to(plan, Some(id), took).map(Vec::from_iter)
                }
                Some(StepOutput::Row(RowOutput::Tokens(ids))) => {
                    a.seq.advance_speculative_to(plan, &ids, took)
                }
                Some(StepOutput::Failed(e)) => Err(e.into()),
                Some(StepOutput::Row(RowOutput::Nothing | RowOutput::Hidden(_))) | None => {
                    a.seq.advance(plan, None, took).map(Vec::from_iter)
                }
            };
            (i, event)
        })
        .collect()
}

/// Drafted tokens the running sequences kept so far, all together.
fn kept_drafts(running: &[Active]) -> usize {
    running
        .iter()
        .filter_map(|a| a.seq.speculation())
        .map(|u| u.accepted)
        .sum()
}

/// Tokens a step of prompt chunks alone carries: as configured, else the backend's
/// preference (never under the step budget), else the step budget.
fn lone_prompt_tokens(model: &Model, config: &EngineConfig) -> usize {
    config
        .prompt_step_tokens
        .unwrap_or_else(|| model.lone_prompt_tokens(config.step_token_budget))
}

/// The bound on decoding rows' inter-token gap while prompts arrive: as configured (0 is
/// off), else the backend's preference.
fn itl_factor(model: &Model, config: &EngineConfig) -> Option<f64> {
    match config.itl_factor {
        Some(f) if f > 0.0 => Some(f),
        Some(_) => None,
        None => model.itl_factor(),
    }
}

/// Plans and runs one forward pass over the batch.
fn step(model: &Model, shared: &Shared, b: &mut Batch) {
    let c = &shared.counters;
    if shared.config.panic_at_step == Some(c.steps.load(Ordering::Relaxed)) {
        panic!(
            "a panic injected at step {} (EngineConfig::panic_at_step)",
            c.steps.load(Ordering::Relaxed)
        );
    }
    let started = Instant::now();
    run_step(model, shared, b);
    let nanos = started.elapsed().as_nanos() as u64;
    shared
        .counters
        .step_nanos
        .fetch_add(nanos, Ordering::Relaxed);
}

/// What a planned sequence wants of the step: the backend's argmax where its token is the
/// raw argmax (or, on a backend that masks, the argmax under its grammar), else logits;
/// a greedy row verifying drafts wants every position's argmax.
fn want(seq: &Sequence, plan: &SequenceStep, backend_masks: bool) -> Want {
    match plan.logits {
        LogitsRequest::None => Want::Nothing,
        LogitsRequest::Last if seq.takes_raw_argmax() => Want::Token,
        LogitsRequest::Last if backend_masks && seq.takes_masked_argmax() => Want::MaskedToken,
        LogitsRequest::Last => Want::Logits,
        LogitsRequest::All if plan.drafts > 0 && seq.takes_raw_argmax() => Want::Tokens,
        LogitsRequest::All => Want::AllLogits,
    }
}

/// Runs the planned sequences' step as one [`Model::execute`]: each row with its tokens,
/// want and adapters (held by the step, so an adapter unmounted meanwhile stays until its
/// requests end). When rows pick their token under a grammar's mask, the masks are
/// computed on another thread while this one builds and starts the pass; a row whose
/// grammar allowed nothing fails.
fn execute(
    model: &Model,
    shared: &Shared,
    running: &mut [Active],
    plans: &[Option<SequenceStep>],
) -> crate::Result<Vec<StepOutput>> {
    let backend_masks = shared
        .config
        .masked_argmax
        .unwrap_or_else(|| model.prefers_backend_masks());
    let inputs: Vec<Option<Vec<u32>>> = running
        .iter()
        .zip(plans)
        .map(|(a, p)| p.as_ref().map(|p| a.seq.input_tokens(p)))
        .collect();
    let stacks: Vec<crate::adapters::AdapterStack> = running
        .iter()
        .zip(plans)
        .filter(|(_, p)| p.is_some())
        .map(|(a, _)| a.req.request.adapters.clone())
        .collect();
    let mut rows = Vec::new();
    let mut grammars: Vec<Option<&mut RowConstraint>> = Vec::new();
    for ((a, p), t) in running.iter_mut().zip(plans).zip(&inputs) {
        let (Some(p), Some(tokens)) = (p, t) else {
            continue;
        };
        let want = want(&a.seq, p, backend_masks);
        let (cache, grammar) = a.seq.cache_and_constraint();
        grammars.push(grammar.filter(|_| want == Want::MaskedToken));
        rows.push(StepRow {
            tokens,
            cache,
            want,
            adapters: None,
        });
    }
    for (row, stack) in rows.iter_mut().zip(&stacks) {
        row.adapters = Some(stack);
    }
    let wants: Vec<Want> = rows.iter().map(|r| r.want).collect();
    let mut failures: Vec<Option<ConstraintError>> = Vec::new();
    let outputs = if Want::picks_under_masks(&wants) {
        let failures = &mut failures;
        std::thread::scope(|scope| {
            let count = grammars.len();
            let worker = scope.spawn(move || {
                grammars
                    .into_par_iter()
                    .map(|g| g.map_or(Ok(None), RowConstraint::next_mask))
                    .collect::<Vec<_>>()
            });
            let masks: StepMasks<'_> = Box::new(move || {
                let masks = worker.join().unwrap_or_else(|_| {
                    (0..count)
                        .map(|_| Err(ConstraintError::Failed("token mask failed".into())))
                        .collect()
                });
                masks
                    .into_iter()
                    .map(|m| match m {
                        Ok(m) => {
                            failures.push(None);
                            m
                        }
                        Err(e) => {
                            failures.push(Some(e));
                            None
                        }
                    })
                    .collect()
            });
            model.execute(StepPlan::new(rows).with_masks(masks))
        })
    } else {
        drop(grammars);
        model.execute(StepPlan::new(rows))
    }?;
    let mut failures = failures.into_iter();
    Ok(outputs
        .into_iter()
        .map(|o| match failures.next().flatten() {
            Some(e) => StepOutput::Failed(e),
            None => StepOutput::Row(o),
        })
        .collect())
}

fn run_step(model: &Model, shared: &Shared, b: &mut Batch) {
    let c = &shared.counters;
    let plans = plan(model, shared, b);
    let began = Instant::now();
    let factor = itl_factor(model, &shared.config);
    if let Some((at, decode_rows, prompt_tokens)) = b.last_step.take() {
        let waited = began.duration_since(at).as_secs_f64();
        b.pacer.observe(factor, decode_rows, prompt_tokens, waited);
        tracing::debug!(decode_rows, prompt_tokens, seconds = waited, "step time");
    }
    let running = &mut b.running;
    if running.is_empty() {
        return;
    }
    let decoding = running
        .iter()
        .zip(&plans)
        .filter(|(a, p)| p.is_some() && a.seq.is_decoding())
        .count();
    let started = Instant::now();
    let result = execute(model, shared, running, &plans);
    let took = started.elapsed();
    c.forward_nanos
        .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    let outputs = match result {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "forward pass failed; failing the batch");
            for a in running.drain(..) {
                c.failed.fetch_add(1, Ordering::Relaxed);
                let _ = a.req.events.send(EngineEvent::Failed(e.to_string()));
            }
            return;
        }
    };
    let step_tokens: usize = plans.iter().flatten().map(|p| p.tokens()).sum();
    c.steps.fetch_add(1, Ordering::Relaxed);
    c.batch_sizes.observe(outputs.len() as u64);
    c.step_tokens.observe(step_tokens as u64);
    c.last_batch.store(outputs.len(), Ordering::Relaxed);
    c.last_step_tokens.store(step_tokens, Ordering::Relaxed);
    let prefill: usize = plans.iter().flatten().map(|p| p.prefill).sum();
    c.prompt_tokens.fetch_add(prefill as u64, Ordering::Relaxed);
    let sampling = Instant::now();
    let kept_before = kept_drafts(running);
    let advanced = advance_all(running, &plans, outputs, took);
    let mut sampled = 0u64;
    let mut finished = Vec::new();
    for (i, events) in advanced {
        let a = &mut running[i];
        match events {
            Ok(events) => {
                for event in events {
                    sampled += 1;
                    if a.req.events.send(EngineEvent::Token(event)).is_err() {
                        a.seq.cancel();
                        break;
                    }
                }
            }
            Err(e) => {
                let _ = a.req.events.send(EngineEvent::Failed(e.to_string()));
                c.failed.fetch_add(1, Ordering::Relaxed);
                a.seq.cancel();
                finished.push((i, false));
                continue;
            }
        }
        if a.seq.is_finished() {
            finished.push((i, true));
        }
    }
    c.generated_tokens.fetch_add(sampled, Ordering::Relaxed);
    let sampled_in = sampling.elapsed();
    c.sampling_nanos
        .fetch_add(sampled_in.as_nanos() as u64, Ordering::Relaxed);
    b.last_step = Some((began, decoding, prefill));
    if prefill == 0 && shared.config.speculative.is_some() {
        b.drafts
            .observe(step_tokens, (took + sampled_in).as_secs_f64());
        tracing::debug!(
            tokens = step_tokens,
            rows = decoding,
            seconds = (took + sampled_in).as_secs_f64(),
            "decode step recorded for the draft budget"
        );
    }
    let drafted: usize = plans.iter().flatten().map(|p| p.drafts).sum();
    let kept = kept_drafts(running) - kept_before;
    if drafted > 0 {
        c.spec_steps.fetch_add(1, Ordering::Relaxed);
        c.spec_drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        c.spec_accepted.fetch_add(kept as u64, Ordering::Relaxed);
    }
    if decoding > 0 {
        let tps = (decoding + kept) as f64 / took.as_secs_f64().max(1e-9);
        let old = c.decode_tps_milli.load(Ordering::Relaxed) as f64 / 1000.0;
        let ema = if old == 0.0 {
            tps
        } else {
            0.8 * old + 0.2 * tps
        };
        c.decode_tps_milli
            .store((ema * 1000.0) as u64, Ordering::Relaxed);
    }
    if let Some(cache) = &shared.cache {
        for (a, plan) in running.iter_mut().zip(&plans) {
            if let (Some(plan), Some(t)) = (plan, a.cache.as_mut()) {
                cache.after_step(t, &a.seq, plan);
            }
        }
    }
    for (i, ok) in finished.into_iter().rev() {
        let a = running.remove(i);
        if !ok {
            continue;
        }
        complete(shared, a);
    }
}

/// Whether a prompt's KV room is made at once on backends that grow it by copying (on unless
/// `WICK_KV_PREALLOCATE=0`, read once).
fn preallocate_prompts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WICK_KV_PREALLOCATE").map_or(true, |v| v != "0"))
}
