//! Greedy decoding of a batch of prompts in lockstep, with the argmax on the backend and
//! the host out of the device's way: step `n + 1` is built from step `n`'s ids while the
//! device still computes them, queued, and only then are step `n`'s ids read — the one
//! wait per step is for the sampled ids themselves.
use std::time::{Duration, Instant};

use super::decoder::{BatchItem, Decoder, Input, RowOutput, SequenceCache, Want};
use crate::backend::Backend;
use crate::Result;

/// What [`crate::Model::generate_greedy`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyRun {
    /// Generated ids per prompt (`max_tokens` each).
    pub tokens: Vec<Vec<u32>>,
    /// Prompt tokens fed.
    pub prompt_tokens: usize,
    /// From the start until the first generated ids were on the host.
    pub prefill_time: Duration,
    /// From then until the last ids were on the host.
    pub decode_time: Duration,
    /// Of `decode_time`, the host's time building and queuing the decode steps.
    pub decode_build_time: Duration,
    /// Of `decode_time`, the time spent waiting for ids the device had not finished.
    pub decode_wait_time: Duration,
}

impl GreedyRun {
    /// Prompt tokens per second.
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first, over the whole batch.
    pub fn decode_tps(&self) -> f64 {
        let steps: usize = self.tokens.iter().map(|t| t.len().saturating_sub(1)).sum();
        steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Runs the prompts (each non-empty, lengths checked by the caller) on fresh caches.
pub(crate) fn run<B: Backend>(
    d: &Decoder<B>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    chunk: usize,
) -> Result<GreedyRun> {
    let chunk = chunk.max(1);
    let be = d.backend();
    let mut caches: Vec<SequenceCache<B>> = prompts.iter().map(|_| d.new_cache()).collect();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::with_capacity(max_tokens); prompts.len()];
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    let started = Instant::now();
    if prompts.is_empty() || max_tokens == 0 {
        return Ok(GreedyRun {
            tokens,
            prompt_tokens: 0,
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            decode_build_time: Duration::ZERO,
            decode_wait_time: Duration::ZERO,
        });
    }
    // Everything but each prompt's last chunk, one sequence at a time.
    for (p, cache) in prompts.iter().zip(caches.iter_mut()) {
        let head = (p.len() - 1) / chunk * chunk;
        for part in p[..head].chunks(chunk) {
            d.execute(
                &mut [BatchItem {
                    tokens: part,
                    cache,
                    want: Want::Nothing,
                    adapters: Vec::new(),
                }],
                None,
            )?;
        }
    }
    // The last chunks together; their argmax is the first generated token.
    let mut items: Vec<BatchItem<'_, B>> = prompts
        .iter()
        .zip(caches.iter_mut())
        .map(|(p, cache)| BatchItem {
            tokens: &p[(p.len() - 1) / chunk * chunk..],
            cache,
            want: Want::Token,
            adapters: Vec::new(),
        })
        .collect();
    for (t, out) in tokens.iter_mut().zip(d.execute(&mut items, None)?) {
        if let RowOutput::Token(id) = out {
            t.push(id);
        }
    }
    drop(items);
    let first: Vec<u32> = tokens.iter().filter_map(|t| t.last().copied()).collect();
    let prefill_time = started.elapsed();
    let decoding = Instant::now();
    let (mut build, mut wait) = (Duration::ZERO, Duration::ZERO);
    let mut refs: Vec<&mut SequenceCache<B>> = caches.iter_mut().collect();
    let mut read = |ids: &B::Ids, tokens: &mut Vec<Vec<u32>>| -> Result<()> {
        let t = Instant::now();
        let host = be.ids_to_host(ids)?;
        wait += t.elapsed();
        for (t, id) in tokens.iter_mut().zip(host) {
            t.push(id);
        }
        Ok(())
    };
    let mut current: Option<B::Ids> = None;
    for _ in 1..max_tokens {
        let t = Instant::now();
        let input = match &current {
            None => Input::Host(&first),
            Some(ids) => Input::Backend(ids),
        };
        let next = d.decode_ids(input, &mut refs)?;
        build += t.elapsed();
        if let Some(ids) = &current {
            read(ids, &mut tokens)?;
        }
        current = Some(next);
    }
    if let Some(ids) = &current {
        read(ids, &mut tokens)?;
    }
    Ok(GreedyRun {
        tokens,
        prompt_tokens,
        prefill_time,
        decode_time: decoding.elapsed(),
        decode_build_time: build,
        decode_wait_time: wait,
    })
}
