//! Picking the next token from a logits row, with mlx-lm's semantics.
//!
//! A [`Sampler`] belongs to one request. Each [`Sampler::sample`] call takes the model's
//! logits for the next position (a plain `&mut [f32]` row) and the token history, and:
//!
//! 1. runs the logits processors in mlx-lm's order: `logit_bias` → repetition penalty →
//!    presence penalty → frequency penalty ([`processors`]);
//! 2. when log-probabilities are asked for, takes them as `logits − logsumexp` over the
//!    whole processed row, before any truncation;
//! 3. with `temperature == 0` returns the argmax (the first one on ties), without touching
//!    `exp` unless log-probabilities were asked for;
//! 4. otherwise truncates in mlx-lm's order: top-p → min-p → XTC (end-of-sequence and
//!    newline tokens exempt) → top-k, all on the untempered distribution, and draws from
//!    `softmax(logits / temperature)` over what is left.
//!
//! # Reproducibility
//! The random numbers of step `n` come from `(seed, n)` alone ([`StepRng`]), so a seed
//! gives the same tokens however requests are batched. The step counts `sample` calls
//! (see [`Sampler::set_step`]). A request without a seed should get [`fresh_seed`].
//!
//! # Speed
//! Nothing sorts the vocabulary: the truncations keep a ranked prefix found in one pass
//! ([`candidates`]), whole-row passes are vectorized loops ([`reduce`]), and the buffers
//! are reused from step to step.
//!
//! ```
//! use wick_engine::sampler::{Sampler, SamplerTokens, SamplingParams};
//!
//! let params = SamplingParams { temperature: 0.7, top_k: 2, seed: 7, ..Default::default() };
//! let mut sampler = Sampler::new(params, SamplerTokens::default()).expect("valid params");
//! let mut logits = vec![0.0, 3.0, 2.5, -1.0];
//! let picked = sampler.sample(&mut logits, &[]);
//! assert!(picked.id == 1 || picked.id == 2);
//! ```
mod candidates;
mod error;
mod nucleus;
mod params;
mod processors;
mod reduce;
mod rng;
mod xtc;

pub use error::SamplingError;
pub use params::{SamplingParams, DEFAULT_PENALTY_CONTEXT, MAX_TOP_LOGPROBS};
pub use rng::{fresh_seed, RngStream, StepRng};

use crate::speculative::{accept_one_hot, accept_sampled};
use candidates::{gather, keep_best, rank, Candidate, Mass, Prefix};
use processors::TokenMarks;

/// Tokens the sampler treats specially: XTC never removes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SamplerTokens {
    /// End-of-sequence ids (the model's whole EOS set).
    pub eos_ids: Vec<u32>,
    /// The id of the `"\n"` token, when the vocabulary has one.
    pub newline_id: Option<u32>,
}

/// The outcome of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token.
    pub id: u32,
    /// Its log-probability in the full processed distribution (before truncation and
    /// temperature); NaN unless [`SamplingParams::logprobs`] is set.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (higher id
    /// later on ties); as many as [`SamplingParams::logprobs`] asks for, fewer only when
    /// fewer tokens have a finite logit.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One request's sampler: parameters, step counter and reused buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Tokens XTC never removes.
    xtc_exempt: Vec<u32>,
    /// Number of the next step.
    step: u64,
    marks: TokenMarks,
    candidates: Vec<Candidate>,
    top: Vec<Candidate>,
    probs: Vec<f32>,
    weights: Vec<f32>,
    block_sums: Vec<f64>,
}

/// Which truncations are on for a row of a given size.
#[derive(Debug, Clone, Copy)]
struct Stages {
    top_p: bool,
    min_p: bool,
    top_k: bool,
    /// XTC is on and its coin says remove this step.
    xtc: bool,
}

impl Sampler {
    /// A sampler for validated `params`; the error names the first bad field.
    pub fn new(params: SamplingParams, special: SamplerTokens) -> Result<Self, SamplingError> {
        params.validate()?;
        let mut xtc_exempt = special.eos_ids;
        xtc_exempt.extend(special.newline_id);
        xtc_exempt.sort_unstable();
        xtc_exempt.dedup();
        Ok(Self {
            params,
            xtc_exempt,
            step: 0,
            marks: TokenMarks::default(),
            candidates: Vec::new(),
            top: Vec::new(),
            probs: Vec::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The number of the next step (how many tokens were sampled since the start).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Sets the number of the next step, e.g. to replay from a checkpoint or after a
    /// rejected speculative draft: step `n` always draws the same random numbers.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Picks the next token. `logits` is the model's row for the next position (it is
    /// modified: processors and truncations are applied in place); `history` is every token
    /// so far, prompt included, as the penalties see it.
    ///
    /// Never panics: an empty row gives token 0, a row without any finite logit the argmax
    /// rule's fallback (first index), ids outside the row in `history` or `logit_bias` are
    /// skipped.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Sampled {
        self.sample_against(logits, history, None, None).0
    }

    /// [`Sampler::sample`] for a position where `draft` was guessed (speculative
    /// decoding): greedy picks the argmax as ever; a sampled step keeps the draft with
    /// its probability under the final distribution and otherwise draws from that
    /// distribution with the draft removed ([`crate::speculative::accept_one_hot`]), so
    /// the token is distributed exactly as [`Sampler::sample`]'s. Returns the token and
    /// whether it is the draft.
    pub fn sample_draft(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        draft: u32,
    ) -> (Sampled, bool) {
        self.sample_against(logits, history, Some(draft), None)
    }

    /// [`Sampler::sample_draft`] for a draft drawn from `q`, the draft model's
    /// distribution over the vocabulary (normalized): a sampled step keeps the draft with
    /// probability `min(1, p(d) / q(d))` and otherwise draws from `max(0, p − q)`
    /// renormalized ([`crate::speculative::accept_sampled`]), so the token is distributed
    /// exactly as [`Sampler::sample`]'s; greedy picks the argmax as ever.
    pub fn sample_draft_from(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        draft: u32,
        q: &[f32],
    ) -> (Sampled, bool) {
        self.sample_against(logits, history, Some(draft), Some(q))
    }

    fn sample_against(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        draft: Option<u32>,
        q: Option<&[f32]>,
    ) -> (Sampled, bool) {
        let step = self.step;
        self.step = self.step.wrapping_add(1);
        if logits.is_empty() {
            let sampled = Sampled {
                id: 0,
                logprob: f32::NAN,
                top_logprobs: Vec::new(),
            };
            return (sampled, draft == Some(0));
        }
        self.process(logits, history);

        let params = &self.params;
        // `new` validated the temperature: finite and >= 0.
        let greedy = params.is_greedy();
        let stages = Stages {
            top_p: !greedy && params.top_p > 0.0 && params.top_p < 1.0,
            min_p: !greedy && params.min_p > 0.0,
            top_k: !greedy && params.top_k > 0 && params.top_k < logits.len(),
            xtc: !greedy
                && params.xtc_probability > 0.0
                && StepRng::new(params.seed, step, RngStream::Xtc).next_f64()
                    <= f64::from(params.xtc_probability),
        };
        let xtc_on_row = stages.xtc && !stages.top_p && !stages.min_p;
        let need_logsumexp = params.logprobs.is_some() || stages.top_p || xtc_on_row;
        let max = if greedy || need_logsumexp || stages.min_p {
            reduce::max(logits)
        } else {
            f32::NAN
        };
        let logsumexp = if need_logsumexp {
            reduce::logsumexp(logits, max)
        } else {
            f32::NAN
        };

        let top_logprobs = match params.logprobs {
            Some(count) if count > 0 => {
                gather(logits, &Prefix::top(count), &mut self.top);
                rank(&mut self.top);
                self.top
                    .iter()
                    .map(|c| (c.id, c.logit - logsumexp))
                    .collect()
            }
            _ => Vec::new(),
        };
        let want_logprobs = params.logprobs.is_some();
        let logprob_of = |logits: &[f32], id: usize| {
            if want_logprobs {
                logits[id] - logsumexp
            } else {
                f32::NAN
            }
        };

        if greedy {
            let id = reduce::first_index_of(logits, max).unwrap_or(0);
            let sampled = Sampled {
                id: id as u32,
                logprob: logprob_of(logits, id),
                top_logprobs,
            };
            return (sampled, draft == Some(id as u32));
        }
        // XTC on the whole row writes -inf over the tokens it removes, which are then never
        // drawn: the chosen token's logit is still the processed one.
        let (id, kept) = match draft {
            None => (self.draw(logits, step, stages, max, logsumexp), false),
            Some(d) => self.draw_against(logits, step, stages, max, logsumexp, d, q),
        };
        let sampled = Sampled {
            id: id as u32,
            logprob: logprob_of(logits, id),
            top_logprobs,
        };
        (sampled, kept)
    }

    /// Applies the logits processors in mlx-lm's order.
    fn process(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        processors::apply_logit_bias(logits, &p.logit_bias);
        processors::apply_repetition_penalty(
            logits,
            history,
            p.repetition_penalty,
            p.repetition_context_size,
            &mut self.marks,
        );
        processors::apply_presence_penalty(
            logits,
            history,
            p.presence_penalty,
            p.presence_context_size,
            &mut self.marks,
        );
        processors::apply_frequency_penalty(
            logits,
            history,
            p.frequency_penalty,
            p.frequency_context_size,
        );
    }

    /// The truncations and the categorical draw (temperature > 0).
    fn draw(
        &mut self,
        logits: &mut [f32],
        step: u64,
        stages: Stages,
        max: f32,
        logsumexp: f32,
    ) -> usize {
        let listed = self.truncate(logits, stages, max, logsumexp);
        let p = &self.params;
        let inverse_temperature = 1.0 / p.temperature;
        let uniform = StepRng::new(p.seed, step, RngStream::Categorical).next_f64();
        let picked = if listed {
            self.pick_candidate(inverse_temperature, uniform)
        } else {
            let shift = reduce::max(logits);
            reduce::exp_weights(
                logits,
                shift,
                inverse_temperature,
                &mut self.weights,
                &mut self.block_sums,
            );
            let total: f64 = self.block_sums.iter().sum();
            reduce::pick_weighted(&self.weights, &self.block_sums, uniform * total)
        };
        picked.unwrap_or_else(|| reduce::argmax(logits))
    }

    /// The truncations and the rejection rule for `draft` (temperature > 0), a one-hot
    /// draft or one drawn from `q`: the token and whether it is the draft.
    #[allow(clippy::too_many_arguments)]
    fn draw_against(
        &mut self,
        logits: &mut [f32],
        step: u64,
        stages: Stages,
        max: f32,
        logsumexp: f32,
        draft: u32,
        q: Option<&[f32]>,
    ) -> (usize, bool) {
        let listed = self.truncate(logits, stages, max, logsumexp);
        let p = &self.params;
        let inverse_temperature = 1.0 / p.temperature;
        let u_accept = StepRng::new(p.seed, step, RngStream::Categorical).next_f64();
        let u_resample = StepRng::new(p.seed, step, RngStream::Resample).next_f64();
        // The final distribution, normalized: over the candidates, or the whole row.
        let (ids, at): (Option<Vec<u32>>, u32) = if listed {
            self.candidate_weights(inverse_temperature);
            let at = self.candidates.iter().position(|c| c.id == draft);
            let ids = self.candidates.iter().map(|c| c.id).collect();
            (Some(ids), at.map_or(u32::MAX, |i| i as u32))
        } else {
            let shift = reduce::max(logits);
            reduce::exp_weights(
                logits,
                shift,
                inverse_temperature,
                &mut self.probs,
                &mut self.block_sums,
            );
            (None, draft)
        };
        let total: f64 = self.probs.iter().map(|&w| f64::from(w)).sum();
        if total.is_nan() || total <= 0.0 {
            return (reduce::argmax(logits), false);
        }
        let scale = (1.0 / total) as f32;
        self.probs.iter_mut().for_each(|w| *w *= scale);
        let (i, kept) = match q {
            None => accept_one_hot(&self.probs, at, u_accept, u_resample),
            Some(q) => {
                // `q` indexed as `probs`: by candidate, or the whole row.
                let q_draft = q.get(draft as usize).copied().unwrap_or(0.0);
                let aligned: std::borrow::Cow<'_, [f32]> = match &ids {
                    Some(ids) => ids
                        .iter()
                        .map(|&id| q.get(id as usize).copied().unwrap_or(0.0))
                        .collect(),
                    None => q.into(),
                };
                accept_sampled(&self.probs, &aligned, at, q_draft, u_accept, u_resample)
            }
        };
        let id = match &ids {
            Some(ids) => ids.get(i as usize).copied(),
            None => ((i as usize) < logits.len()).then_some(i),
        };
        match id {
            Some(id) => (id as usize, kept),
            None => (reduce::argmax(logits), false),
        }
    }

    /// The truncations (temperature > 0): returns whether they left a candidate list
    /// (else the whole row, with XTC's removals written as -inf, is the distribution).
    fn truncate(&mut self, logits: &mut [f32], stages: Stages, max: f32, logsumexp: f32) -> bool {
        let p = &self.params;
        // top-p, min-p and (unless XTC may reach past it) top-k keep one ranked prefix.
        let mut listed = false;
        if stages.top_p || stages.min_p || (stages.top_k && !stages.xtc) {
            let prefix = Prefix {
                floor: if stages.min_p {
                    max + p.min_p.ln()
                } else {
                    f32::NEG_INFINITY
                },
                count: (stages.top_k && !stages.xtc).then_some(p.top_k),
                mass: stages.top_p.then_some(Mass {
                    top_p: f64::from(p.top_p),
                    logsumexp,
                }),
            };
            gather(logits, &prefix, &mut self.candidates);
            listed = true;
        }
        if stages.xtc {
            if listed {
                xtc::apply_to_candidates(
                    &mut self.candidates,
                    p.xtc_threshold,
                    &self.xtc_exempt,
                    &mut self.probs,
                );
            } else {
                xtc::apply_to_row(
                    logits,
                    logsumexp,
                    p.xtc_threshold,
                    &self.xtc_exempt,
                    &mut self.candidates,
                );
            }
            if stages.top_k {
                if listed {
                    keep_best(&mut self.candidates, p.top_k);
                } else {
                    gather(logits, &Prefix::top(p.top_k), &mut self.candidates);
                    listed = true;
                }
            }
        }
        listed
    }

    /// Fills `probs` with the candidates' unnormalized `exp((logit − max) · inverse_temperature)`.
    fn candidate_weights(&mut self, inverse_temperature: f32) {
        let top = self
            .candidates
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        self.probs.clear();
        self.probs.extend(
            self.candidates
                .iter()
                .map(|c| reduce::exp((c.logit - top) * inverse_temperature)),
        );
    }

    /// Draws from `softmax(logit * inverse_temperature)` over the candidates (walked in
    /// their stored order, which is deterministic).
    fn pick_candidate(&mut self, inverse_temperature: f32, uniform: f64) -> Option<usize> {
        self.candidate_weights(inverse_temperature);
        let total: f64 = self.probs.iter().map(|&w| f64::from(w)).sum();
        let target = uniform * total;
        let mut running = 0.0;
        for (candidate, &w) in self.candidates.iter().zip(&self.probs) {
            running += f64::from(w);
            if running > target && w > 0.0 {
                return Some(candidate.id as usize);
            }
        }
        self.candidates
            .iter()
            .zip(&self.probs)
            .rev()
            .find(|(_, &w)| w > 0.0)
            .map(|(c, _)| c.id as usize)
    }
}

/// The log-probability of `id` under the raw distribution `logits` (no processors,
/// no temperature) and the `top` most likely tokens with theirs, most likely first, as
/// [`Sampler::sample`] reports them: a prompt token's score (`echo` with `logprobs`).
/// NaN for an `id` outside the row.
pub fn row_logprobs(logits: &[f32], id: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = reduce::max(logits);
    let logsumexp = reduce::logsumexp(logits, max);
    let logprob = logits
        .get(id as usize)
        .map_or(f32::NAN, |&logit| logit - logsumexp);
    if top == 0 {
        return (logprob, Vec::new());
    }
    let mut best = Vec::new();
    gather(logits, &Prefix::top(top), &mut best);
    rank(&mut best);
    let top = best.iter().map(|c| (c.id, c.logit - logsumexp)).collect();
    (logprob, top)
}

#[cfg(test)]
mod tests;
