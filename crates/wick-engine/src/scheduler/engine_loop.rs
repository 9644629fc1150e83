//! The engine thread: admit, plan one batched step under a token budget, run it, hand
//! out tokens, retire finished sequences — repeat.
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::handle::{Pending, Shared};
use super::{Completion, EngineEvent};
use crate::generation::{Sequence, SequenceStep};
use crate::model::{Model, Step};

/// A sequence in the running batch and the request it serves.
struct Active {
    seq: Sequence,
    req: Pending,
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
}

/// Moves waiting requests into the batch; sleeps when there is nothing to do. Returns
/// false when the engine should exit.
fn admit(model: &Model, shared: &Shared, running: &mut Vec<Active>) -> bool {
    let c = &shared.counters;
    let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        while running.len() < shared.config.max_batch {
            let Some(p) = q.waiting.pop_front() else {
                break;
            };
            if p.cancel.load(Ordering::Relaxed) || p.events.is_closed() {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            match Sequence::new(model, &p.request, model.new_cache()) {
                Ok(seq) => {
                    tracing::debug!(
                        request = p.id,
                        waited_ms = p.submitted.elapsed().as_millis() as u64,
                        "admitted"
                    );
                    running.push(Active { seq, req: p });
                }
                Err(e) => {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                    let _ = p.events.send(EngineEvent::Failed(e.to_string()));
                }
            }
        }
        c.queued.store(q.waiting.len(), Ordering::Relaxed);
        if !running.is_empty() {
            return true;
        }
        if q.shutting_down || shared.abort.load(Ordering::Relaxed) {
            return false;
        }
        q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
    }
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
    for (i, ok) in finished.into_iter().rev() {
        let a = running.swap_remove(i);
        if !ok {
            continue;
        }
        let out = a.seq.finish(model);
        if out.finish_reason == crate::generation::FinishReason::Cancelled {
            c.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        c.completed.fetch_add(1, Ordering::Relaxed);
        let _ = a.req.events.send(EngineEvent::Done(Completion {
            finish_reason: out.finish_reason,
            usage: out.usage,
            tokens: out.tokens,
            text: out.text,
        }));
    }
}
