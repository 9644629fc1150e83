//! The engine thread: admit, plan one batched step under a token budget, run it, hand
//! out tokens, retire finished sequences — repeat.
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::cache::{CacheTracking, Started};
use super::handle::{Pending, Shared};
use super::{Completion, EngineEvent};
use crate::generation::{Sequence, SequenceStep};
use crate::model::{Model, Step};

/// A sequence in the running batch and the request it serves.
struct Active {
    seq: Sequence,
    req: Pending,
    cache: Option<CacheTracking>,
}

impl Active {
    fn gone(&self) -> bool {
        self.req.cancel.load(Ordering::Relaxed) || self.req.events.is_closed()
    }
}

pub(crate) fn run(model: &Model, shared: &Shared) {
    let mut running: Vec<Active> = Vec::new();
    let c = &shared.counters;
    loop {
        if !admit(model, shared, &mut running) {
            break;
        }
        if shared.abort.load(Ordering::Relaxed) {
            for a in running.drain(..) {
                let _ = a.req.events.send(EngineEvent::Failed(
                    "cancelled: the server is shutting down".into(),
                ));
            }
            break;
        }
        running.retain(|a| {
            let keep = !a.gone();
            if !keep {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(request = a.req.id, "client gone, request cancelled");
            }
            keep
        });
        if running.is_empty() {
            c.running.store(0, Ordering::Relaxed);
            continue;
        }
        step(model, shared, &mut running);
        c.running.store(running.len(), Ordering::Relaxed);
        c.kv_bytes.store(
            running.iter().map(|a| a.seq.cache_bytes() as u64).sum(),
            Ordering::Relaxed,
        );
    }
    c.running.store(0, Ordering::Relaxed);
    if let Some(cache) = &shared.cache {
        cache.tiers.set_busy(false);
    }
}

/// Moves waiting requests into the batch; sleeps when there is nothing to do (telling
/// the cache's writer the engine is idle). Returns false when the engine should exit.
/// Cache lookups (which may read the SSD) run with the queue unlocked, so `submit`
/// never waits on them.
fn admit(model: &Model, shared: &Shared, running: &mut Vec<Active>) -> bool {
    let c = &shared.counters;
    loop {
        let taken: Vec<Pending> = {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let mut taken = Vec::new();
                while running.len() + taken.len() < shared.config.max_batch {
                    let Some(p) = q.waiting.pop_front() else {
                        break;
                    };
                    if p.cancel.load(Ordering::Relaxed) || p.events.is_closed() {
                        c.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    taken.push(p);
                }
                c.queued.store(q.waiting.len(), Ordering::Relaxed);
                if !taken.is_empty() || !running.is_empty() {
                    break taken;
                }
                if q.shutting_down || shared.abort.load(Ordering::Relaxed) {
                    return false;
                }
                if let Some(cache) = &shared.cache {
                    cache.tiers.set_busy(false);
                }
                q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        if taken.is_empty() {
            return true;
        }
        if let Some(cache) = &shared.cache {
            cache.tiers.set_busy(true);
        }
        for p in taken {
            start(model, shared, p, running);
        }
        if !running.is_empty() {
            return true;
        }
    }
}

/// Builds a request's sequence (from the cache when it can) and adds it to the batch.
fn start(model: &Model, shared: &Shared, p: Pending, running: &mut Vec<Active>) {
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
            seq,
            replay,
            tracking,
        }) => {
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
            };
            if a.seq.is_finished() {
                // A checkpoint replay that already reached the end.
                complete(model, shared, a);
            } else {
                running.push(a);
            }
        }
        Err(e) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            let _ = p.events.send(EngineEvent::Failed(e.to_string()));
        }
    }
}

/// Hands a finished sequence's KV to the cache and its result to the client.
fn complete(model: &Model, shared: &Shared, a: Active) {
    let c = &shared.counters;
    let out = a.seq.finish(model);
    let cancelled = out.finish_reason == crate::generation::FinishReason::Cancelled;
    if let (Some(cache), Some(t)) = (&shared.cache, &a.cache) {
        let mut tokens = a.req.request.prompt.clone();
        tokens.extend_from_slice(&out.tokens);
        tokens.truncate(out.cache.len());
        cache.finish(t, &tokens, out.cache, !cancelled);
    }
    if cancelled {
        c.cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    c.completed.fetch_add(1, Ordering::Relaxed);
    let _ = a.req.events.send(EngineEvent::Done(Completion {
        finish_reason: out.finish_reason,
        usage: out.usage,
        tokens: out.tokens,
        text: out.text,
    }));
}

/// Plans and runs one forward pass over the batch.
fn step(model: &Model, shared: &Shared, running: &mut Vec<Active>) {
    let c = &shared.counters;
    // Decoding sequences take one token each; prompt chunks share what is left.
    let decoding = running.iter().filter(|a| a.seq.is_decoding()).count();
    let mut budget = shared
        .config
        .step_token_budget
        .saturating_sub(decoding)
        .max(1);
    let plans: Vec<Option<SequenceStep>> = running
        .iter()
        .map(|a| {
            if a.seq.is_decoding() {
                Some(a.seq.next_step(1))
            } else if budget > 0 {
                let s = a.seq.next_step(budget);
                budget -= s.tokens();
                Some(s)
            } else {
                None
            }
        })
        .collect();
    let inputs: Vec<Option<Vec<u32>>> = running
        .iter()
        .zip(&plans)
        .map(|(a, p)| p.as_ref().map(|p| a.seq.input_tokens(p)))
        .collect();
    let started = Instant::now();
    let result = {
        let mut steps: Vec<Step<'_>> = running
            .iter_mut()
            .zip(&plans)
            .zip(&inputs)
            .filter_map(|((a, p), t)| {
                Some(Step {
                    tokens: t.as_deref()?,
                    cache: a.seq.cache_mut(),
                    logits: p.as_ref()?.logits,
                })
            })
            .collect();
        model.forward(&mut steps)
    };
    let took = started.elapsed();
    let outputs = match result {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "forward pass failed; failing the batch");
            for a in running.drain(..) {
                c.failed.fetch_add(1, Ordering::Relaxed);
                let _ = a
                    .req
                    .events
                    .send(EngineEvent::Failed(format!("generation failed: {e}")));
            }
            return;
        }
    };
    let step_tokens: usize = plans.iter().flatten().map(|p| p.tokens()).sum();
    c.steps.fetch_add(1, Ordering::Relaxed);
    c.last_batch.store(outputs.len(), Ordering::Relaxed);
    c.last_step_tokens.store(step_tokens, Ordering::Relaxed);
    let prefill: usize = plans.iter().flatten().map(|p| p.prefill).sum();
    c.prompt_tokens.fetch_add(prefill as u64, Ordering::Relaxed);

    let mut outputs = outputs.into_iter();
    let mut sampled = 0u64;
    let mut finished = Vec::new();
    for (i, (a, plan)) in running.iter_mut().zip(&plans).enumerate() {
        let Some(plan) = plan else { continue };
        let logits = outputs.next().flatten();
        match a.seq.advance(model, plan, logits.as_ref(), took) {
            Ok(Some(event)) => {
                sampled += 1;
                if a.req.events.send(EngineEvent::Token(event)).is_err() {
                    a.seq.cancel();
                }
            }
            Ok(None) => {}
            Err(e) => {
                let _ = a
                    .req
                    .events
                    .send(EngineEvent::Failed(format!("generation failed: {e}")));
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
    if decoding > 0 {
        let tps = decoding as f64 / took.as_secs_f64().max(1e-9);
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
        let a = running.swap_remove(i);
        if !ok {
            continue;
        }
        complete(model, shared, a);
    }
}
