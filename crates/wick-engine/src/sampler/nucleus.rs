//! The top-p nucleus: the fewest best-ranked tokens whose probability reaches `top_p`.
//!
//! mlx-lm keeps a token when the probability of the tokens ranked above it is below
//! `top_p` (so the token that crosses `top_p` stays). A nucleus can hold most of a
//! 262k-entry row when the model is unsure, so nothing here sorts more than a sliver:
//! - [`gather_nucleus`] bins every token by its distance below the log-sum-exp, adds up the
//!   probability per bin, walks the bins from the top to the one where the mass crosses
//!   `top_p`, keeps every token of the bins above it, and resolves only that boundary bin
//!   token by token;
//! - [`nucleus_len`] resolves a set token by token: a quickselect that halves the range by
//!   mass.
use super::candidates::{rank, rank_order, Candidate, Mass};
use super::reduce;

/// Bins per unit of log-probability (a bin spans a probability ratio of e^(1/32) ≈ 1.03).
const BINS_PER_UNIT: f32 = 32.0;
/// Number of bins; the last one also takes every token further down (log-probability
/// below −64, probability under 2e-28).
const BINS: usize = 64 * BINS_PER_UNIT as usize;
/// Tokens per block of the first pass.
const BLOCK: usize = 1024;

/// The bin of a token with log-probability `-distance`.
#[inline(always)]
fn bin_of(distance: f32) -> usize {
    // Saturating float-to-int cast: a huge distance lands past the end, then clamps.
    ((distance * BINS_PER_UNIT) as usize).min(BINS - 1)
}

/// Fills `out` with the nucleus of the tokens whose logit is above `bound`, in no
/// particular order. `mass.logsumexp` is the whole row's.
pub(crate) fn gather_nucleus(logits: &[f32], bound: f32, mass: Mass, out: &mut Vec<Candidate>) {
    out.clear();
    let lse = mass.logsumexp;
    // Pass 1: probability per bin. Probabilities and bins of a block are computed in plain
    // map loops (vectorized); only the scatter into the bins is scalar.
    let mut bins = vec![0.0f64; BINS];
    let mut probs = [0.0f32; BLOCK];
    let mut slots = [0u16; BLOCK];
    for xs in logits.chunks(BLOCK) {
        let probs = &mut probs[..xs.len()];
        let slots = &mut slots[..xs.len()];
        for ((p, slot), &x) in probs.iter_mut().zip(slots.iter_mut()).zip(xs) {
            let kept = x > bound;
            *p = if kept { reduce::exp(x - lse) } else { 0.0 };
            *slot = bin_of(lse - x) as u16;
        }
        for (&p, &slot) in probs.iter().zip(slots.iter()) {
            bins[usize::from(slot)] += f64::from(p);
        }
    }
    // The bin where the running mass reaches top_p, and the mass of the bins above it.
    let mut above = 0.0f64;
    let mut boundary = BINS;
    for (bin, &bin_mass) in bins.iter().enumerate() {
        if above + bin_mass >= mass.top_p {
            boundary = bin;
            break;
        }
        above += bin_mass;
    }
    // Pass 2: keep the bins above the boundary, resolve the boundary bin by rank.
    let mut edge = Vec::new();
    for (id, &x) in logits.iter().enumerate() {
        if x > bound {
            let bin = bin_of(lse - x);
            if bin < boundary {
                out.push(Candidate {
                    id: id as u32,
                    logit: x,
                });
            } else if bin == boundary {
                edge.push(Candidate {
                    id: id as u32,
                    logit: x,
                });
            }
        }
    }
    let rest = Mass {
        top_p: mass.top_p - above,
        logsumexp: lse,
    };
    let keep = nucleus_len(&mut edge, rest);
    out.extend_from_slice(&edge[..keep]);
}

/// Ranges at most this long are sorted and walked instead of split further.
const SMALL_RANGE: usize = 32;

/// Reorders `candidates` so the first `n` are the nucleus (unordered) and returns `n`: the
/// fewest best-ranked tokens whose probability reaches `mass.top_p`, or all of them.
///
/// A quickselect by mass: split the open range at its middle rank; if the upper half
/// (with what is already known to rank above it) reaches the mass, the end of the nucleus
/// lies in it, else past the middle. Expected linear time.
pub(crate) fn nucleus_len(candidates: &mut [Candidate], mass: Mass) -> usize {
    let prob = |c: &Candidate| f64::from(reduce::exp(c.logit - mass.logsumexp));
    let (mut lo, mut hi) = (0, candidates.len());
    // Probability of candidates[..lo], all of which rank above candidates[lo..].
    let mut above = 0.0f64;
    while hi - lo > SMALL_RANGE {
        let mid = (hi - lo) / 2;
        candidates[lo..hi].select_nth_unstable_by(mid, rank_order);
        let upper: f64 = candidates[lo..lo + mid].iter().map(prob).sum();
        if above + upper >= mass.top_p {
            hi = lo + mid;
        } else {
            above += upper + prob(&candidates[lo + mid]);
            lo += mid + 1;
            if above >= mass.top_p {
                return lo;
            }
        }
    }
    rank(&mut candidates[lo..hi]);
    for (index, candidate) in candidates[lo..hi].iter().enumerate() {
        above += prob(candidate);
        if above >= mass.top_p {
            return lo + index + 1;
        }
    }
    // Only rounding between the split sums and this walk lands here, or the whole set is
    // short of the mass: keep the range.
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nucleus by full sort, as ids in rank order.
    fn by_full_sort(row: &[f32], mass: Mass) -> Vec<u32> {
        let mut all: Vec<Candidate> = row
            .iter()
            .enumerate()
            .filter(|(_, &x)| x > f32::NEG_INFINITY)
            .map(|(id, &logit)| Candidate {
                id: id as u32,
                logit,
            })
            .collect();
        all.sort_by(rank_order);
        let mut below = 0.0;
        let mut ids = Vec::new();
        for c in all {
            if below >= mass.top_p {
                break;
            }
            below += f64::from(reduce::exp(c.logit - mass.logsumexp));
            ids.push(c.id);
        }
        ids
    }

    fn check(row: &[f32], top_p: f64) -> usize {
        let mass = Mass {
            top_p,
            logsumexp: reduce::logsumexp(row, reduce::max(row)),
        };
        let mut out = Vec::new();
        gather_nucleus(row, f32::NEG_INFINITY, mass, &mut out);
        rank(&mut out);
        let ids: Vec<u32> = out.iter().map(|c| c.id).collect();
        assert_eq!(ids, by_full_sort(row, mass), "top_p {top_p}");
        ids.len()
    }

    #[test]
    fn large_nuclei_match_a_full_sort() {
        // All equal: one boundary bin holding the whole row, resolved by id.
        assert_eq!(check(&vec![1.5; 100_000], 0.25), 25_000);
        // A smooth spread over many bins.
        let spread: Vec<f32> = (0..100_000)
            .map(|i| ((i * 7919) % 100_000) as f32 * -1e-4)
            .collect();
        for top_p in [0.05, 0.5, 0.9, 0.99] {
            assert!(check(&spread, top_p) > 300);
        }
        // A few strong tokens over a long tail, with masked entries.
        let mut peaked: Vec<f32> = (0..50_000).map(|i| -((i % 977) as f32) * 0.05).collect();
        peaked[123] = 12.0;
        peaked[40_000] = 11.5;
        peaked[7] = f32::NEG_INFINITY;
        for top_p in [0.3, 0.8, 0.95, 0.999] {
            check(&peaked, top_p);
        }
    }
}
