//! Passes over a whole logits row: max, argmax, log-sum-exp and softmax weights.
//!
//! These run over the full vocabulary (150k–260k entries) every step, so they are written
//! as branch-free loops over fixed-width lanes that the compiler vectorizes, with an `exp`
//! of our own ([`exp`]) instead of the scalar libm call. NaN logits count as `-inf`
//! everywhere: they never win the max and get weight 0.
//!
//! Sums are taken in `f32` lanes over blocks of [`BLOCK`] entries and added up in `f64`,
//! which keeps the relative error near 1e-6 for any vocabulary size.

/// Lanes of the vectorized loops.
const LANES: usize = 8;

/// Entries per block of a blocked sum.
pub(crate) const BLOCK: usize = 1024;

/// Below this, `exp` returns exactly 0 (the result would be subnormal).
const EXP_LOW: f32 = -87.0;
/// Above this, `exp` would overflow.
const EXP_HIGH: f32 = 88.0;

/// `e^x` for `f32`, within 2 ulp of the true value on `[-87, 88]`; 0 below (and for NaN),
/// `e^88` above.
///
/// Range reduction `x = n ln2 + r` with `|r| <= ln2/2` (ln2 split in two parts so `r` is
/// exact), a degree-6 polynomial for `e^r` (Cephes `expf` coefficients) and `2^n` built in
/// the exponent bits. Round-to-nearest of `x / ln2` uses the 1.5 * 2^23 trick, which also
/// leaves `n` in the low bits, so no float-to-int conversion is needed.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let finite = x >= EXP_LOW; // false for NaN and -inf
    let x = x.clamp(EXP_LOW, EXP_HIGH);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if finite {
        e_r * scale
    } else {
        0.0
    }
}

/// The largest logit, ignoring NaN; `-inf` for an empty row or one without numbers.
pub(crate) fn max(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(tail) {
        if x > best {
            best = x;
        }
    }
    best
}

/// The first index holding the largest logit (mlx's tie rule), or 0 when there is none.
pub(crate) fn argmax(logits: &[f32]) -> usize {
    first_index_of(logits, max(logits)).unwrap_or(0)
}

/// The first index holding `value`, looking at whole lanes first.
pub(crate) fn first_index_of(logits: &[f32], value: f32) -> Option<usize> {
    let chunks = logits.chunks_exact(LANES);
    let tail_start = logits.len() - chunks.remainder().len();
    for (index, chunk) in chunks.enumerate() {
        if chunk.iter().fold(false, |hit, &x| hit | (x == value)) {
            return chunk
                .iter()
                .position(|&x| x == value)
                .map(|at| index * LANES + at);
        }
    }
    logits[tail_start..]
        .iter()
        .position(|&x| x == value)
        .map(|at| tail_start + at)
}

/// Sum of a slice in `f32` lanes.
fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum(e^((x - shift) * scale))` over the row, in `f64`.
pub(crate) fn sum_exp(logits: &[f32], shift: f32, scale: f32) -> f64 {
    // exp into a stack block first: a plain map loop vectorizes where an exp inside the
    // lane accumulation does not.
    let mut block = [0.0f32; BLOCK];
    logits
        .chunks(BLOCK)
        .map(|xs| {
            let out = &mut block[..xs.len()];
            for (w, &x) in out.iter_mut().zip(xs) {
                *w = exp((x - shift) * scale);
            }
            f64::from(lane_sum(out))
        })
        .sum()
}

/// `log(sum(e^x))` over the row, given its max; `-inf` when every logit is `-inf`/NaN.
pub(crate) fn logsumexp(logits: &[f32], max: f32) -> f32 {
    if !max.is_finite() {
        return max;
    }
    max + sum_exp(logits, max, 1.0).ln() as f32
}

/// Writes `w = e^((x - shift) * scale)` for every logit into `weights` and the sum of each
/// block of [`BLOCK`] weights into `block_sums`.
pub(crate) fn exp_weights(
    logits: &[f32],
    shift: f32,
    scale: f32,
    weights: &mut Vec<f32>,
    block_sums: &mut Vec<f64>,
) {
    weights.clear();
    weights.resize(logits.len(), 0.0);
    block_sums.clear();
    for (block, out) in logits.chunks(BLOCK).zip(weights.chunks_mut(BLOCK)) {
        for (w, &x) in out.iter_mut().zip(block) {
            *w = exp((x - shift) * scale);
        }
        block_sums.push(f64::from(lane_sum(out)));
    }
}

/// The index where the running sum of `weights` first passes `target`, found through the
/// block sums from [`exp_weights`]; the last positive weight when rounding leaves `target`
/// beyond the total; `None` when all weights are 0.
pub(crate) fn pick_weighted(weights: &[f32], block_sums: &[f64], target: f64) -> Option<usize> {
    let mut before = 0.0;
    for (block, &sum) in block_sums.iter().enumerate() {
        if before + sum > target {
            let start = block * BLOCK;
            let end = (start + BLOCK).min(weights.len());
            let mut running = before;
            for (offset, &w) in weights[start..end].iter().enumerate() {
                running += f64::from(w);
                if running > target && w > 0.0 {
                    return Some(start + offset);
                }
            }
        }
        before += sum;
    }
    weights.iter().rposition(|&w| w > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::NAN), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn max_and_argmax_ignore_nan_and_take_the_first_tie() {
        let row = [
            1.0,
            f32::NAN,
            3.0,
            -2.0,
            3.0,
            0.5,
            2.9,
            3.0,
            1.0,
            0.0,
            f32::NAN,
        ];
        assert_eq!(max(&row), 3.0);
        assert_eq!(argmax(&row), 2);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(max(&[f32::NAN; 3]), f32::NEG_INFINITY);
        assert_eq!(argmax(&[f32::NAN; 3]), 0);
    }

    #[test]
    fn logsumexp_matches_f64() {
        let row: Vec<f32> = (0..5000)
            .map(|i| ((i * 37 % 101) as f32) * 0.1 - 3.0)
            .collect();
        let want = row.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let got = logsumexp(&row, max(&row));
        assert!((f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
        assert_eq!(
            logsumexp(&[f32::NEG_INFINITY; 4], f32::NEG_INFINITY),
            f32::NEG_INFINITY
        );
    }

    #[test]
    fn weighted_pick_walks_the_cumulative_sum() {
        let row: Vec<f32> = (0..3000)
            .map(|i| {
                if i % 1024 == 7 {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let (mut weights, mut sums) = (Vec::new(), Vec::new());
        exp_weights(&row, 0.0, 1.0, &mut weights, &mut sums);
        assert_eq!(sums, vec![1.0, 1.0, 1.0]);
        assert_eq!(pick_weighted(&weights, &sums, 0.0), Some(7));
        assert_eq!(pick_weighted(&weights, &sums, 1.5), Some(1031));
        assert_eq!(pick_weighted(&weights, &sums, 2.999), Some(2055));
        assert_eq!(pick_weighted(&weights, &sums, 3.5), Some(2055));
        exp_weights(&[f32::NEG_INFINITY; 3], 0.0, 1.0, &mut weights, &mut sums);
        assert_eq!(pick_weighted(&weights, &sums, 0.0), None);
    }
}
