//! XTC, "exclude top choices": when its coin comes up, every token more likely than the
//! threshold is removed except the least likely of them, so the model is pushed off its
//! most obvious continuation while the choice stays sensible.
//!
//! mlx-lm's rule, on the distribution left by the earlier truncations (renormalized): find
//! the tokens with probability above the threshold; if there are two or more, remove those
//! strictly more likely than the least likely of them. End-of-sequence tokens and the
//! newline token are never removed, so XTC cannot keep an answer from ending or a line from
//! breaking.
use super::candidates::{gather, Candidate, Prefix};
use super::reduce;

/// The probability of each token over `candidates`, in the same order.
fn probabilities(candidates: &[Candidate], out: &mut Vec<f32>) {
    out.clear();
    let top = candidates
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = candidates
        .iter()
        .map(|c| f64::from(reduce::exp(c.logit - top)))
        .sum();
    let logsumexp = top + total.ln() as f32;
    out.extend(candidates.iter().map(|c| reduce::exp(c.logit - logsumexp)));
}

/// The probability of the least likely token above `threshold`, when there are at least two
/// such tokens (otherwise XTC changes nothing).
fn removal_bound(probs: &[f32], threshold: f32) -> Option<f32> {
    let mut above = 0usize;
    let mut least = f32::INFINITY;
    for &p in probs.iter().filter(|&&p| p > threshold) {
        above += 1;
        least = least.min(p);
    }
    (above >= 2).then_some(least)
}

/// XTC over a truncated candidate list (the kept tokens of earlier stages).
pub(crate) fn apply_to_candidates(
    candidates: &mut Vec<Candidate>,
    threshold: f32,
    exempt: &[u32],
    probs: &mut Vec<f32>,
) {
    probabilities(candidates, probs);
    let Some(bound) = removal_bound(probs, threshold) else {
        return;
    };
    let mut index = 0;
    candidates.retain(|c| {
        let keep = probs[index] <= bound || exempt.contains(&c.id);
        index += 1;
        keep
    });
}

/// XTC over a whole row (no earlier truncation): removed tokens get a `-inf` logit.
/// `logsumexp` is the row's.
pub(crate) fn apply_to_row(
    logits: &mut [f32],
    logsumexp: f32,
    threshold: f32,
    exempt: &[u32],
    scratch: &mut Vec<Candidate>,
) {
    // Only tokens with logit above `logsumexp + ln(threshold)` can be above the threshold;
    // gather those (with a little slack for rounding) and test each exactly.
    let floor = if threshold > 0.0 {
        logsumexp + threshold.ln() - 1e-3
    } else {
        f32::NEG_INFINITY
    };
    gather(
        logits,
        &Prefix {
            floor,
            ..Prefix::all()
        },
        scratch,
    );
    let prob = |logit: f32| reduce::exp(logit - logsumexp);
    let mut above = 0usize;
    let mut least = f32::INFINITY;
    for c in scratch.iter().filter(|c| prob(c.logit) > threshold) {
        above += 1;
        least = least.min(prob(c.logit));
    }
    if above < 2 {
        return;
    }
    for c in scratch.iter() {
        if prob(c.logit) > least && !exempt.contains(&c.id) {
            logits[c.id as usize] = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ln_row(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn as_candidates(row: &[f32]) -> Vec<Candidate> {
        let mut out = Vec::new();
        gather(row, &Prefix::all(), &mut out);
        out
    }

    #[test]
    fn removes_all_above_threshold_but_the_least_likely() {
        let row = ln_row(&[0.5, 0.25, 0.15, 0.07, 0.03]);
        let mut list = as_candidates(&row);
        apply_to_candidates(&mut list, 0.1, &[], &mut Vec::new());
        let ids: Vec<u32> = list.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![2, 3, 4]);

        let mut whole = row.clone();
        apply_to_row(&mut whole, 0.0, 0.1, &[], &mut Vec::new());
        assert_eq!(whole[0], f32::NEG_INFINITY);
        assert_eq!(whole[1], f32::NEG_INFINITY);
        assert_eq!(&whole[2..], &row[2..]);
    }

    #[test]
    fn exempt_tokens_stay_and_one_token_above_changes_nothing() {
        let row = ln_row(&[0.5, 0.25, 0.15, 0.07, 0.03]);
        let mut list = as_candidates(&row);
        apply_to_candidates(&mut list, 0.1, &[0], &mut Vec::new());
        let ids: Vec<u32> = list.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![0, 2, 3, 4]);

        let mut whole = row.clone();
        apply_to_row(&mut whole, 0.0, 0.3, &[], &mut Vec::new());
        assert_eq!(whole, row);
        let mut list = as_candidates(&row);
        apply_to_candidates(&mut list, 0.3, &[], &mut Vec::new());
        assert_eq!(list.len(), 5);
    }

    #[test]
    fn candidates_are_renormalized_first() {
        // Among the kept {0.15, 0.07, 0.03} (sum 0.25) the probabilities are 0.6, 0.28,
        // 0.12: with threshold 0.2, token 2 goes and token 3 stays.
        let row = ln_row(&[0.5, 0.25, 0.15, 0.07, 0.03]);
        let mut list = as_candidates(&row);
        list.retain(|c| c.id >= 2);
        apply_to_candidates(&mut list, 0.2, &[], &mut Vec::new());
        let ids: Vec<u32> = list.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![3, 4]);
    }
}
