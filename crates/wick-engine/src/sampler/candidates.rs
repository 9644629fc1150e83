//! The most likely tokens of a logits row, found without sorting the whole vocabulary.
//!
//! top-k, top-p and min-p each keep a prefix of the vocabulary ranked by logit (higher
//! first, lower id on ties), so together they keep one prefix too. [`gather`] finds it in
//! one pass: tokens above a running bound go into a buffer; when the buffer fills, it is
//! cut back to what the rules can still keep (which raises the bound), or it grows. A token
//! is dropped only when enough tokens already rank above it (`count`) or they already carry
//! the nucleus mass (`mass`), so the result is exactly the set a full sort would give.
//!
//! Cuts never sort: the count rule is a quickselect, the mass rule a quickselect that
//! halves the range by mass ([`nucleus_len`]). The mass rule without a count goes to
//! [`gather_nucleus`], which needs no buffer cuts at all, so a nucleus of 100k tokens
//! costs linear time. The kept set comes back in no particular (but deterministic) order; [`rank`]
//! sorts it when the order matters.
use std::cmp::Ordering;

use super::nucleus::{gather_nucleus, nucleus_len};
#[cfg(test)]
use super::reduce;

/// A token and its (processed) logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    /// Token id.
    pub(crate) id: u32,
    /// Its logit.
    pub(crate) logit: f32,
}

/// Ranking order: higher logit first, then lower id (the argmax tie rule).
pub(crate) fn rank_order(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// The nucleus rule: keep tokens while the probability ranked above them is below `top_p`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mass {
    /// The nucleus mass, in (0, 1).
    pub(crate) top_p: f64,
    /// Log-sum-exp of the whole row, to turn logits into probabilities.
    pub(crate) logsumexp: f32,
}

/// Which prefix of the ranked row to keep; every rule set must hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prefix {
    /// Keep only logits `>= floor` (`-inf` keeps every finite logit; `-inf` and NaN logits
    /// are never kept).
    pub(crate) floor: f32,
    /// Keep at most this many.
    pub(crate) count: Option<usize>,
    /// Keep the nucleus.
    pub(crate) mass: Option<Mass>,
}

impl Prefix {
    /// Every finite logit, ranked.
    pub(crate) fn all() -> Self {
        Self {
            floor: f32::NEG_INFINITY,
            count: None,
            mass: None,
        }
    }

    /// The `count` best.
    pub(crate) fn top(count: usize) -> Self {
        Self {
            count: Some(count),
            ..Self::all()
        }
    }
}

/// The next `f32` below `x` (for turning `>= floor` into `> bound`).
fn next_down(x: f32) -> f32 {
    if x.is_nan() || x == f32::NEG_INFINITY {
        x
    } else if x == 0.0 {
        -f32::from_bits(1)
    } else if x > 0.0 {
        f32::from_bits(x.to_bits() - 1)
    } else {
        f32::from_bits(x.to_bits() + 1)
    }
}

/// Smallest buffer [`gather`] starts with.
const MIN_BUFFER: usize = 256;

/// Fills `out` with the kept prefix of `logits`, in no particular order.
pub(crate) fn gather(logits: &[f32], prefix: &Prefix, out: &mut Vec<Candidate>) {
    out.clear();
    if prefix.count == Some(0) || prefix.floor.is_nan() {
        return;
    }
    let mut bound = next_down(prefix.floor);
    if let (None, Some(mass)) = (prefix.count, prefix.mass) {
        // A nucleus may hold most of the row: find it by mass histogram instead.
        gather_nucleus(logits, bound, mass, out);
        return;
    }
    let prunable = prefix.count.is_some() || prefix.mass.is_some();
    let mut capacity = prefix
        .count
        .map_or(MIN_BUFFER, |c| c.saturating_mul(2).max(MIN_BUFFER));
    for (id, &logit) in logits.iter().enumerate() {
        if logit > bound {
            out.push(Candidate {
                id: id as u32,
                logit,
            });
            if out.len() >= capacity {
                let before = out.len();
                if prunable {
                    cut(out, prefix);
                }
                if out.len() < before {
                    // The rules are saturated: only a token ranking above the last kept one
                    // can still get in. Later tokens with its logit have higher ids, so they
                    // rank below it: the bound is strict.
                    if let Some(last) = out.iter().max_by(|a, b| rank_order(a, b)) {
                        bound = bound.max(last.logit);
                    }
                }
                if out.len() * 2 > capacity {
                    capacity *= 2;
                }
            }
        }
    }
    cut(out, prefix);
}

/// Sorts candidates by rank, best first.
pub(crate) fn rank(candidates: &mut [Candidate]) {
    candidates.sort_unstable_by(rank_order);
}

/// Keeps the `count` best of `candidates` (in no particular order).
pub(crate) fn keep_best(candidates: &mut Vec<Candidate>, count: usize) {
    if count == 0 {
        candidates.clear();
    } else if count < candidates.len() {
        candidates.select_nth_unstable_by(count - 1, rank_order);
        candidates.truncate(count);
    }
}

/// Drops from `out` what the rules cannot keep.
fn cut(out: &mut Vec<Candidate>, prefix: &Prefix) {
    if let Some(count) = prefix.count {
        keep_best(out, count);
    }
    if let Some(mass) = prefix.mass {
        let keep = nucleus_len(out, mass);
        out.truncate(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slow reference: rank everything, then apply the rules.
    fn by_full_sort(logits: &[f32], prefix: &Prefix) -> Vec<Candidate> {
        let mut all: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .filter(|(_, &x)| x > f32::NEG_INFINITY && x >= prefix.floor)
            .map(|(id, &logit)| Candidate {
                id: id as u32,
                logit,
            })
            .collect();
        all.sort_by(rank_order);
        let mut keep = all.len();
        if let Some(count) = prefix.count {
            keep = keep.min(count);
        }
        if let Some(mass) = prefix.mass {
            let mut below = 0.0f64;
            for (index, c) in all[..keep].iter().enumerate() {
                below += f64::from(reduce::exp(c.logit - mass.logsumexp));
                if below >= mass.top_p {
                    keep = index + 1;
                    break;
                }
            }
        }
        all.truncate(keep);
        all
    }

    fn rows() -> Vec<Vec<f32>> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let peaked: Vec<f32> = (0..5000)
            .map(|_| next() * 4.0 - 20.0 * next().powi(8))
            .collect();
        let flat: Vec<f32> = (0..3000).map(|_| next() * 0.01).collect();
        let ties: Vec<f32> = (0..2000).map(|i| (i % 7) as f32).collect();
        let mut masked: Vec<f32> = (0..1000).map(|_| next() * 10.0).collect();
        for (i, x) in masked.iter_mut().enumerate() {
            if i % 3 == 0 {
                *x = f32::NEG_INFINITY;
            }
            if i % 11 == 0 {
                *x = f32::NAN;
            }
        }
        let ascending: Vec<f32> = (0..4000).map(|i| i as f32 * 0.01).collect();
        vec![peaked, flat, ties, masked, ascending, vec![], vec![1.0]]
    }

    #[test]
    fn gather_equals_a_full_sort() {
        let mut out = Vec::new();
        for row in rows() {
            let max = reduce::max(&row);
            let lse = reduce::logsumexp(&row, max);
            for count in [None, Some(1), Some(5), Some(40), Some(300), Some(10_000)] {
                for top_p in [None, Some(0.1), Some(0.5), Some(0.9), Some(0.999)] {
                    for floor in [f32::NEG_INFINITY, max - 2.0, max - 0.5, max] {
                        let prefix = Prefix {
                            floor,
                            count,
                            mass: top_p.map(|top_p| Mass {
                                top_p,
                                logsumexp: lse,
                            }),
                        };
                        gather(&row, &prefix, &mut out);
                        rank(&mut out);
                        assert_eq!(out, by_full_sort(&row, &prefix), "{prefix:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn nucleus_keeps_the_token_that_crosses_top_p() {
        let probs = [0.5f32, 0.25, 0.15, 0.07, 0.03];
        let row: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let mut out = Vec::new();
        for (top_p, kept) in [
            (0.3, 1),
            (0.45, 1),
            (0.6, 2),
            (0.8, 3),
            (0.93, 4),
            (0.99, 5),
        ] {
            let prefix = Prefix {
                mass: Some(Mass {
                    top_p,
                    logsumexp: 0.0,
                }),
                ..Prefix::all()
            };
            gather(&row, &prefix, &mut out);
            rank(&mut out);
            let ids: Vec<u32> = out.iter().map(|c| c.id).collect();
            assert_eq!(ids, (0..kept).collect::<Vec<u32>>(), "top_p {top_p}");
        }
    }
}
