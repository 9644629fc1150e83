//! What to keep of a draft: the rejection rule for a deterministic draft (prompt lookup)
//! and for a draft sampled from a draft model's distribution, and how many tokens to
//! draft next given how many were kept.

/// The speculative-sampling rule for a one-hot draft `draft` under the target
/// distribution `probs` (normalized, after every processor and truncation): keep the
/// draft with probability `probs[draft]` (`u_accept < probs[draft]`); otherwise draw
/// from `probs` with `draft` removed and renormalized, with `u_resample` in `[0, 1)`.
/// Returns the token and whether it is the draft. The token is distributed exactly as
/// a plain draw from `probs`: `P(d) = p(d)`, and for `t ≠ d`,
/// `P(t) = (1 − p(d)) · p(t) / (1 − p(d)) = p(t)`.
pub fn accept_one_hot(probs: &[f32], draft: u32, u_accept: f64, u_resample: f64) -> (u32, bool) {
    let p_draft = probs.get(draft as usize).map_or(0.0, |&p| f64::from(p));
    if u_accept < p_draft {
        return (draft, true);
    }
    let rest: f64 = probs
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != draft as usize)
        .map(|(_, &p)| f64::from(p))
        .sum();
    let target = u_resample * rest;
    let mut running = 0.0;
    let mut last = None;
    for (i, &p) in probs.iter().enumerate() {
        if i == draft as usize || p <= 0.0 {
            continue;
        }
        running += f64::from(p);
        last = Some(i as u32);
        if running > target {
            return (i as u32, false);
        }
    }
    // Rounding left `target` past the sum, or the draft held all the mass.
    (last.unwrap_or(draft), last.is_none())
}

/// The speculative-sampling rule (Leviathan et al., Chen et al., 2023) for a draft
/// `draft` drawn from the draft model's distribution `q`, under the target distribution
/// `probs`: keep it with probability `min(1, p(d) / q(d))`
/// (`u_accept · q(d) < p(d)`); otherwise draw from the residual `max(0, p − q)`,
/// renormalized, with `u_resample` in `[0, 1)`. `probs` and `q` are indexed alike (both
/// the whole row, or both a candidate list); `q_draft` is `q(d)`, which may lie outside
/// that index space (a draft the target's truncation removed). Returns the index and
/// whether it is the draft (`at`, the draft's index in `probs`, `u32::MAX` when absent).
///
/// The token is distributed as `p`: `P(t) = min(p(t), q(t)) + (1 − Σ min(p, q)) ·
/// max(0, p(t) − q(t)) / Σ max(0, p − q)`, and `Σ max(0, p − q) = 1 − Σ min(p, q)`,
/// so `P(t) = min(p, q) + max(0, p − q) = p(t)`.
pub fn accept_sampled(
    probs: &[f32],
    q: &[f32],
    at: u32,
    q_draft: f32,
    u_accept: f64,
    u_resample: f64,
) -> (u32, bool) {
    let p_draft = probs.get(at as usize).map_or(0.0, |&p| f64::from(p));
    if p_draft > 0.0 && u_accept * f64::from(q_draft) < p_draft {
        return (at, true);
    }
    let residual = |i: usize| {
        let p = f64::from(probs[i]);
        let q = q.get(i).map_or(0.0, |&q| f64::from(q));
        (p - q).max(0.0)
    };
    let rest: f64 = (0..probs.len()).map(residual).sum();
    if rest <= 0.0 || !rest.is_finite() {
        // p ≤ q everywhere up to rounding: p = q, so a draw from p is the residual's limit.
        return accept_one_hot(probs, u32::MAX, u_resample, u_resample);
    }
    let target = u_resample * rest;
    let mut running = 0.0;
    let mut last = None;
    for i in 0..probs.len() {
        let r = residual(i);
        if r <= 0.0 {
            continue;
        }
        running += r;
        last = Some(i as u32);
        if running > target {
            return (i as u32, i as u32 == at);
        }
    }
    let last = last.unwrap_or(at);
    (last, last == at)
}

/// Steps decoded plainly after the draft length fell to nothing, before drafting one
/// token again to probe whether the text turned repetitive.
pub const PROBE_AFTER_STEPS: usize = 16;

/// How much of the acceptance estimate's evidence a new verified step leaves standing
/// (a memory of a few steps: copying turns into writing and back within a reply).
const ACCEPTANCE_DECAY: f64 = 0.75;

/// The acceptance estimate before any evidence, and the evidence it counts as (in
/// drafted positions): optimistic, so a new row drafts and finds out.
const ACCEPTANCE_PRIOR: (f64, f64) = (0.8, 2.0);

/// A sequence's draft length, adapted to what the model accepts: all of a draft kept
/// grows it by one (up to the configured most), a partly kept draft sets it to one past
/// what was kept, nothing kept halves it, and from one a rejection turns drafting off
/// for [`PROBE_AFTER_STEPS`] steps. It also estimates how likely a draft token is kept
/// ([`DraftLength::acceptance`]), which the step's [`crate::speculative::DraftBudget`]
/// weighs against what a verified row costs.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    current: usize,
    resting: usize,
    /// Recent drafted positions kept and rejected, decayed by [`ACCEPTANCE_DECAY`] a step.
    kept: f64,
    rejected: f64,
    /// Steps in a row the budget verified none of this sequence's drafts.
    withheld: usize,
}

impl DraftLength {
    /// Starting at the most, `max`.
    pub fn new(max: usize) -> Self {
        DraftLength {
            max,
            current: max,
            resting: 0,
            kept: 0.0,
            rejected: 0.0,
            withheld: 0,
        }
    }

    /// Probability that a drafted token is kept when the one before it was: recent kept
    /// positions over recent verified ones, starting from [`ACCEPTANCE_PRIOR`].
    pub fn acceptance(&self) -> f64 {
        let (p, n) = ACCEPTANCE_PRIOR;
        (self.kept + p * n) / (self.kept + self.rejected + n)
    }

    /// Records that the step's budget verified none of the drafts: after
    /// [`PROBE_AFTER_STEPS`] such steps the estimate forgets its evidence, so the
    /// sequence gets to show whether the text turned repetitive.
    pub fn withheld(&mut self) {
        self.withheld += 1;
        if self.withheld > PROBE_AFTER_STEPS {
            self.withheld = 0;
            self.kept = 0.0;
            self.rejected = 0.0;
        }
    }

    /// Tokens to draft this step (0: decode plainly); counts a resting step.
    pub fn next_length(&mut self) -> usize {
        if self.resting > 0 {
            self.resting -= 1;
            return 0;
        }
        self.current
    }

    /// Records that `accepted` of `drafted` (> 0) tokens were kept.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.withheld = 0;
        self.kept = ACCEPTANCE_DECAY * self.kept + accepted.min(drafted) as f64;
        self.rejected = ACCEPTANCE_DECAY * self.rejected + f64::from(u8::from(accepted < drafted));
        if accepted >= drafted {
            self.current = (self.current + 1).min(self.max);
        } else if accepted > 0 {
            self.current = (accepted + 1).min(self.max);
        } else if self.current <= 1 {
            self.current = 1;
            self.resting = PROBE_AFTER_STEPS;
        } else {
            self.current /= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{RngStream, StepRng};

    /// The rejection rule's output frequencies match the target distribution, whichever
    /// token is drafted (a likely one, an unlikely one, one with no mass).
    #[test]
    fn the_rule_leaves_the_distribution_unchanged() {
        let probs = [0.5f32, 0.25, 0.15, 0.1, 0.0];
        let n = 200_000;
        for draft in 0..probs.len() as u32 {
            let mut counts = [0usize; 5];
            let mut kept = 0usize;
            for step in 0..n {
                let u1 =
                    StepRng::new(7 + u64::from(draft), step, RngStream::Categorical).next_f64();
                let u2 = StepRng::new(7 + u64::from(draft), step, RngStream::Xtc).next_f64();
                let (t, accepted) = accept_one_hot(&probs, draft, u1, u2);
                counts[t as usize] += 1;
                kept += accepted as usize;
            }
            for (i, &p) in probs.iter().enumerate() {
                let f = counts[i] as f64 / n as f64;
                // 5 standard deviations of a binomial frequency at n draws.
                let tol = 5.0 * (f64::from(p) * (1.0 - f64::from(p)) / n as f64).sqrt() + 1e-9;
                assert!(
                    (f - f64::from(p)).abs() <= tol,
                    "draft {draft}: token {i} drawn {f}, want {p} ± {tol}"
                );
            }
            let want = f64::from(probs[draft as usize]);
            let rate = kept as f64 / n as f64;
            assert!(
                (rate - want).abs() < 0.01,
                "draft {draft} kept {rate}, want {want}"
            );
        }
    }

    /// Through the sampler: a sampled step given a draft draws each token as often as a
    /// plain step does, with and without truncations, whatever the draft.
    #[test]
    fn a_sampled_step_with_a_draft_draws_what_a_plain_step_draws() {
        use crate::sampler::{Sampler, SamplerTokens, SamplingParams};
        let logits = [1.0f32, 0.5, 0.0, -0.5, -3.0];
        let n = 60_000;
        for (top_k, top_p) in [(0, 1.0), (3, 1.0), (0, 0.8)] {
            let params = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                seed: 11,
                ..Default::default()
            };
            let new = || Sampler::new(params.clone(), SamplerTokens::default()).unwrap();
            let mut plain_counts = [0usize; 5];
            let mut plain = new();
            for _ in 0..n {
                plain_counts[plain.sample(&mut logits.clone(), &[]).id as usize] += 1;
            }
            for draft in [0u32, 2, 4] {
                let mut spec = new();
                let mut counts = [0usize; 5];
                for _ in 0..n {
                    let (s, kept) = spec.sample_draft(&mut logits.clone(), &[], draft);
                    assert_eq!(kept, s.id == draft);
                    counts[s.id as usize] += 1;
                }
                for i in 0..5 {
                    let (a, b) = (
                        plain_counts[i] as f64 / n as f64,
                        counts[i] as f64 / n as f64,
                    );
                    let tol = 5.0 * (2.0 * a.max(1e-4) * (1.0 - a) / n as f64).sqrt();
                    assert!(
                        (a - b).abs() <= tol,
                        "top_k {top_k} top_p {top_p} draft {draft}: token {i} {b} vs plain {a}"
                    );
                }
            }
        }
    }

    /// A draw from the cumulative sum of `q` at `u` in `[0, 1)`.
    fn draw(q: &[f32], u: f64) -> u32 {
        let mut running = 0.0;
        for (i, &w) in q.iter().enumerate() {
            running += f64::from(w);
            if running > u && w > 0.0 {
                return i as u32;
            }
        }
        q.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }

    /// A draft drawn from a draft distribution `q` and judged by the rule leaves each
    /// token as often as the target gives it, and the draft is kept at the rate
    /// `Σ min(p, q)`, for a uniform `q`, one far from the target and one equal to it.
    #[test]
    fn the_rule_for_sampled_drafts_leaves_the_distribution_unchanged() {
        let probs = [0.5f32, 0.25, 0.15, 0.1, 0.0];
        let qs: [[f32; 5]; 4] = [
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.0, 0.0, 0.1, 0.4, 0.5],
            [0.5, 0.25, 0.15, 0.1, 0.0],
            [0.05, 0.05, 0.0, 0.0, 0.9],
        ];
        let n = 200_000;
        for (k, q) in qs.iter().enumerate() {
            let mut counts = [0usize; 5];
            let mut kept = 0usize;
            for step in 0..n {
                let seed = 40 + k as u64;
                let d = draw(q, StepRng::new(seed, step, RngStream::Draft).next_f64());
                let u1 = StepRng::new(seed, step, RngStream::Categorical).next_f64();
                let u2 = StepRng::new(seed, step, RngStream::Resample).next_f64();
                let (t, accepted) = accept_sampled(&probs, q, d, q[d as usize], u1, u2);
                assert_eq!(accepted, t == d, "q {k}: kept flag");
                counts[t as usize] += 1;
                kept += accepted as usize;
            }
            for (i, &p) in probs.iter().enumerate() {
                let f = counts[i] as f64 / n as f64;
                let tol = 5.0 * (f64::from(p) * (1.0 - f64::from(p)) / n as f64).sqrt() + 1e-9;
                assert!(
                    (f - f64::from(p)).abs() <= tol,
                    "q {k}: token {i} drawn {f}, want {p} ± {tol}"
                );
            }
            let want: f64 = probs
                .iter()
                .zip(q)
                .map(|(&p, &q)| f64::from(p.min(q)))
                .sum();
            let rate = kept as f64 / n as f64;
            assert!((rate - want).abs() < 0.01, "q {k} kept {rate}, want {want}");
        }
    }

    /// Through the sampler, with truncations: a draft drawn from a draft model's
    /// distribution (other logits than the target's) leaves a sampled step drawing each
    /// token as often as a plain step.
    #[test]
    fn a_sampled_step_with_a_drawn_draft_draws_what_a_plain_step_draws() {
        use crate::sampler::{Sampler, SamplerTokens, SamplingParams};
        let logits = [1.0f32, 0.5, 0.0, -0.5, -3.0];
        let draft_logits = [-1.0f32, 0.0, 0.8, 0.3, 1.0];
        let q = crate::speculative::draft_model::distribution(&draft_logits, 0.8, 5);
        let n = 60_000;
        for (top_k, top_p) in [(0, 1.0), (3, 1.0), (0, 0.8)] {
            let params = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                seed: 13,
                ..Default::default()
            };
            let new = || Sampler::new(params.clone(), SamplerTokens::default()).unwrap();
            let mut plain_counts = [0usize; 5];
            let mut plain = new();
            for _ in 0..n {
                plain_counts[plain.sample(&mut logits.clone(), &[]).id as usize] += 1;
            }
            let mut spec = new();
            let mut counts = [0usize; 5];
            for step in 0..n as u64 {
                let d = draw(&q, StepRng::new(99, step, RngStream::Draft).next_f64());
                let (s, kept) = spec.sample_draft_from(&mut logits.clone(), &[], d, &q);
                assert_eq!(kept, s.id == d);
                counts[s.id as usize] += 1;
            }
            for i in 0..5 {
                let (a, b) = (
                    plain_counts[i] as f64 / n as f64,
                    counts[i] as f64 / n as f64,
                );
                let tol = 5.0 * (2.0 * a.max(1e-4) * (1.0 - a) / n as f64).sqrt();
                assert!(
                    (a - b).abs() <= tol,
                    "top_k {top_k} top_p {top_p}: token {i} {b} vs plain {a}"
                );
            }
        }
    }

    #[test]
    fn a_certain_draft_is_always_kept() {
        let probs = [0.0f32, 1.0, 0.0];
        assert_eq!(accept_one_hot(&probs, 1, 0.999, 0.5), (1, true));
        assert_eq!(accept_one_hot(&probs, 0, 0.0, 0.5), (1, false));
    }

    #[test]
    fn the_length_follows_acceptance() {
        let mut k = DraftLength::new(4);
        assert_eq!(k.next_length(), 4);
        k.observe(4, 4);
        assert_eq!(k.next_length(), 4);
        k.observe(4, 1);
        assert_eq!(k.next_length(), 2);
        k.observe(2, 2);
        assert_eq!(k.next_length(), 3);
        k.observe(3, 0);
        assert_eq!(k.next_length(), 1);
        k.observe(1, 0);
        for _ in 0..PROBE_AFTER_STEPS {
            assert_eq!(k.next_length(), 0);
        }
        assert_eq!(k.next_length(), 1);
        k.observe(1, 1);
        assert_eq!(k.next_length(), 2);
    }

    #[test]
    fn the_acceptance_follows_recent_steps() {
        let mut k = DraftLength::new(4);
        assert!((k.acceptance() - 0.8).abs() < 1e-12);
        for _ in 0..20 {
            k.observe(4, 4);
        }
        assert!(k.acceptance() > 0.95, "{}", k.acceptance());
        for _ in 0..20 {
            k.observe(1, 0);
        }
        assert!(k.acceptance() < 0.4, "{}", k.acceptance());
        // Withheld long enough, the evidence is forgotten.
        for _ in 0..=PROBE_AFTER_STEPS {
            k.withheld();
        }
        assert!((k.acceptance() - 0.8).abs() < 1e-12);
    }
}
