//! How many drafted tokens a batched step verifies: each costs a row of the forward
//! pass, and a row is worth its cost only while the pass is not yet compute-bound or
//! the draft is likely enough to be kept.
//!
//! The engine records what its decode steps cost by the tokens they feed
//! ([`DraftBudget::observe`]). At batch 1 on a CPU a step reads every weight once
//! whatever it feeds, and five tokens cost little more than one; at batch 8 the same
//! CPU is compute-bound and a step's time grows with every row, so a draft pays only
//! when it is nearly sure to be kept. [`DraftBudget::allot`] picks, from the drafts
//! proposed, the most likely ones up to the count that gives the most expected tokens
//! per second by that record. No shape is assumed: a CPU, a GPU and a loaded machine
//! each get their own curve.

/// Most tokens of a step recorded apart; larger steps share the last entry.
const SIZES: usize = 128;

/// Weight of a new observation in a size's running mean (about the last ten steps of
/// that size, so the record follows the machine's load).
const SMOOTHING: f64 = 0.1;

/// Observations of a size before its mean is trusted.
const MIN_SEEN: u32 = 2;

/// Every this many allotments one verifies every draft, so sizes judged too dear get
/// measured again (the load may have changed).
const EXPLORE_EVERY: u64 = 64;

/// The decode steps' cost by size and the allotment of drafts it implies.
#[derive(Debug, Clone)]
pub struct DraftBudget {
    /// Per step size (tokens fed, from 1): running mean seconds and observations.
    cost: Vec<(f64, u32)>,
    allotments: u64,
}

impl Default for DraftBudget {
    fn default() -> Self {
        DraftBudget {
            cost: vec![(0.0, 0); SIZES],
            allotments: 0,
        }
    }
}

/// One decoding row's part in [`DraftBudget::allot`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDrafts {
    /// Tokens drafted for the row (the most it may verify).
    pub drafted: usize,
    /// Probability that one drafted token is kept given the one before it was
    /// ([`crate::speculative::DraftLength::acceptance`]).
    pub acceptance: f64,
}

impl DraftBudget {
    /// Records a decode step (no prompt chunk) that fed `tokens` and took `seconds`.
    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let (mean, seen) = &mut self.cost[tokens.min(SIZES) - 1];
        *mean = if *seen == 0 {
            seconds
        } else {
            *mean + SMOOTHING * (seconds - *mean)
        };
        *seen = seen.saturating_add(1);
    }

    /// The expected seconds of a step feeding `tokens`: its recorded mean, else a
    /// straight line between the nearest recorded sizes; past the largest recorded size,
    /// that size's (an optimistic guess, so the size gets tried and recorded). `None`
    /// before anything of at most `tokens` was recorded.
    pub fn seconds(&self, tokens: usize) -> Option<f64> {
        let at = tokens.clamp(1, SIZES) - 1;
        let known = |i: usize| {
            let (mean, seen) = self.cost[i];
            (seen >= MIN_SEEN).then_some(mean)
        };
        if let Some(s) = known(at) {
            return Some(s);
        }
        let (lo, lo_s) = (0..at).rev().find_map(|i| Some((i, known(i)?)))?;
        match (at + 1..SIZES).find_map(|i| Some((i, known(i)?))) {
            Some((hi, hi_s)) => {
                let f = (at - lo) as f64 / (hi - lo) as f64;
                Some(lo_s + f * (hi_s - lo_s))
            }
            None => Some(lo_s),
        }
    }

    /// How many of each row's drafts to verify this step, for `plain` decoding rows that
    /// draft nothing besides `rows`. Every row feeds its last token and emits at least
    /// one; the `j`-th draft of a row (from 1) is kept with probability `acceptance^j`.
    /// Drafts are ranked most likely first, and the step verifies the count of them
    /// that maximizes expected tokens over [`DraftBudget::seconds`]. None is verified
    /// while nothing the step's plain size or smaller has a record (so it gets one),
    /// and every draft every [`EXPLORE_EVERY`]th call.
    pub fn allot(&mut self, plain: usize, rows: &[RowDrafts]) -> Vec<usize> {
        self.allotments += 1;
        let fed = plain + rows.len();
        let Some(base) = self.seconds(fed) else {
            return vec![0; rows.len()];
        };
        if self.allotments.is_multiple_of(EXPLORE_EVERY) {
            return rows.iter().map(|r| r.drafted).collect();
        }
        // Drafts, most likely first (each row's in order, as their odds only fall).
        let mut ranked: Vec<(usize, f64)> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let a = r.acceptance.clamp(0.0, 1.0);
                (1..=r.drafted).map(move |j| (i, a.powi(j as i32)))
            })
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        let (mut best, mut best_rate) = (0, fed as f64 / base);
        let mut emitted = fed as f64;
        for (d, &(_, p)) in ranked.iter().enumerate() {
            emitted += p;
            let Some(s) = self.seconds(fed + d + 1) else {
                break;
            };
            if emitted / s > best_rate {
                (best, best_rate) = (d + 1, emitted / s);
            }
        }
        let mut taken = vec![0; rows.len()];
        for &(i, _) in &ranked[..best] {
            taken[i] += 1;
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget that saw steps of every size up to 48 cost `seconds(size)`.
    fn recorded(seconds: impl Fn(usize) -> f64) -> DraftBudget {
        let mut b = DraftBudget::default();
        for _ in 0..MIN_SEEN {
            for n in 1..=48 {
                b.observe(n, seconds(n));
            }
        }
        b
    }

    fn row(drafted: usize, acceptance: f64) -> RowDrafts {
        RowDrafts {
            drafted,
            acceptance,
        }
    }

    #[test]
    fn unrecorded_sizes_are_interpolated_or_guessed_optimistically() {
        let mut b = DraftBudget::default();
        assert_eq!(b.seconds(8), None);
        for _ in 0..MIN_SEEN {
            b.observe(8, 0.08);
            b.observe(16, 0.16);
        }
        assert_eq!(b.seconds(8), Some(0.08));
        assert!((b.seconds(12).unwrap() - 0.12).abs() < 1e-12);
        assert_eq!(b.seconds(40), Some(0.16));
        assert_eq!(b.seconds(4), None);
        // One observation is not yet a record.
        b.observe(4, 0.01);
        assert_eq!(b.seconds(4), None);
    }

    #[test]
    fn a_plain_step_is_recorded_first_then_drafts_are_tried() {
        let mut b = DraftBudget::default();
        let rows = [row(4, 0.5), row(2, 0.9)];
        assert_eq!(b.allot(3, &rows), vec![0, 0]);
        for _ in 0..MIN_SEEN {
            b.observe(5, 0.05);
        }
        // Larger steps are guessed to cost what the plain one does, until recorded.
        assert_eq!(b.allot(3, &rows), vec![4, 2]);
    }

    #[test]
    fn a_memory_bound_step_verifies_every_plausible_draft() {
        // Batch 1 on a CPU: reading the weights costs ten rows' arithmetic.
        let mut b = recorded(|n| 0.040 + 0.004 * n as f64);
        assert_eq!(b.allot(0, &[row(4, 0.9)]), vec![4]);
        assert_eq!(b.allot(0, &[row(4, 0.5)]), vec![2]);
        assert_eq!(b.allot(0, &[row(4, 0.05)]), vec![0]);
    }

    #[test]
    fn a_compute_bound_batch_verifies_only_likely_drafts() {
        // Batch 8 where a row costs nearly a plain step's share of a token.
        let mut b = recorded(|n| 0.034 + 0.0094 * n as f64);
        let rows = [row(4, 0.95), row(4, 0.6), row(4, 0.3)];
        let taken = b.allot(5, &rows);
        assert!(taken[0] >= 2, "{taken:?}");
        assert_eq!(&taken[1..], &[0, 0]);
        // Time in proportion to rows: no draft raises tokens per second.
        let mut b = recorded(|n| 0.007 * n as f64);
        assert_eq!(b.allot(5, &rows), vec![0, 0, 0]);
    }

    #[test]
    fn a_knee_in_the_cost_is_found() {
        // Free up to 12 tokens (the weights' read time), then compute-bound.
        let mut b = recorded(|n| 0.06_f64.max(0.005 * n as f64));
        let rows = [row(4, 0.5); 8];
        let taken = b.allot(0, &rows);
        assert_eq!(taken.iter().sum::<usize>(), 4, "{taken:?}");
    }

    #[test]
    fn every_draft_is_verified_now_and_then() {
        let mut b = recorded(|n| 0.007 * n as f64);
        let rows = [row(4, 0.5)];
        let all = (0..EXPLORE_EVERY)
            .filter(|_| b.allot(7, &rows) == vec![4])
            .count();
        assert_eq!(all, 1);
    }
}
