//! The loss rows' log-probabilities straight from the final hidden states, in chunks of
//! rows: per chunk the output head's product, the log-softmax, each row's
//! `log p(label)` and, for the backward, its gradient with respect to the row's hidden
//! state (`(onehot − softmax)·W` through the multiplier and soft cap). A pass never holds
//! the `[rows, vocab]` logits: SmolLM2's 49k vocabulary at 4 × 256 rows made them a
//! 200 MB buffer mapped and zeroed afresh every step, then read three times.
//!
//! Each row's gradient does not depend on the loss: any loss of the log-probabilities
//! (SFT, DPO, ORPO) scales row `i` by `∂L/∂log pᵢ` in the backward.
use rayon::prelude::*;

use super::products::{gemm, Layout};

/// Logits held at once per worker, in values: 30 MiB, below the mmap threshold `wick`
/// sets (32 MiB), so the buffer is reused from the heap rather than mapped and zeroed
/// each time, and as few chunks as that allows, since each chunk's products read (and
/// pack) the whole head matrix again.
const CHUNK_VALUES: usize = 30 << 18;

/// The head applied to the hidden states: `softcap(multiplier · (x·Wᵀ + bias))`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Head<'a> {
    /// `W`, `[vocab, hidden]`.
    pub(super) w: &'a [f32],
    pub(super) vocab: usize,
    pub(super) hidden: usize,
    pub(super) bias: Option<&'a [f32]>,
    pub(super) multiplier: Option<f32>,
    pub(super) softcap: Option<f32>,
}

/// `log p(labels[i])` of every row of `x` (`[n, hidden]`) and, with `grad`, the gradient
/// of each with respect to its row of `x` (`[n, hidden]`).
pub(super) fn label_log_probs(
    head: Head<'_>,
    x: &[f32],
    labels: &[u32],
    grad: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let chunk = (CHUNK_VALUES / head.vocab.max(1)).max(1);
    in_chunks(head, x, labels, grad, chunk)
}

/// [`label_log_probs`] over chunks of `chunk` rows, each chunk's logits in a buffer
/// that its worker reuses.
fn in_chunks(
    head: Head<'_>,
    x: &[f32],
    labels: &[u32],
    grad: bool,
    chunk: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let (vocab, hidden) = (head.vocab, head.hidden);
    let n = labels.len();
    let mut logp = vec![0.0f32; n];
    let mut dx = vec![0.0f32; if grad { n * hidden } else { 0 }];
    let run = |scratch: &mut Scratch, i: usize, lp: &mut [f32], labels: &[u32], dx: &mut [f32]| {
        let rows = labels.len();
        let xs = &x[i * chunk * hidden..][..rows * hidden];
        scratch.z.resize(rows * vocab, 0.0);
        let z = &mut scratch.z[..rows * vocab];
        gemm(
            rows,
            vocab,
            hidden,
            xs,
            Layout::Plain,
            head.w,
            Layout::Transposed,
            z,
            false,
            1.0,
            false,
        );
        if grad && head.softcap.is_some() {
            scratch.capped.resize(vocab, 0.0);
        }
        for ((row, &label), lp) in z.chunks_exact_mut(vocab).zip(labels).zip(lp.iter_mut()) {
            *lp = row_log_prob(head, row, label as usize, grad, &mut scratch.capped);
        }
        if grad {
            // dx = dz·W: [rows, vocab] × [vocab, hidden].
            gemm(
                rows,
                hidden,
                vocab,
                z,
                Layout::Plain,
                head.w,
                Layout::Plain,
                dx,
                false,
                1.0,
                false,
            );
        }
    };
    let parts = logp
        .par_chunks_mut(chunk)
        .zip(labels.par_chunks(chunk))
        .enumerate();
    if grad {
        parts
            .zip(dx.par_chunks_mut(chunk * hidden))
            .for_each_init(Scratch::default, |s, ((i, (lp, l)), d)| run(s, i, lp, l, d));
    } else {
        parts.for_each_init(Scratch::default, |s, (i, (lp, l))| {
            run(s, i, lp, l, &mut [])
        });
    }
    (logp, grad.then_some(dx))
}

/// A worker's buffers: one chunk's logits, and a row of capped logits.
#[derive(Default)]
struct Scratch {
    z: Vec<f32>,
    capped: Vec<f32>,
}

/// One row of logits `z` (the bare product `x·Wᵀ`, in place): its `log p(label)`, and
/// with `grad` the row replaced by `∂log p(label)/∂(x·Wᵀ)`. `capped` is scratch of
/// `vocab` values where a soft cap needs the capped logits for its derivative.
fn row_log_prob(
    head: Head<'_>,
    z: &mut [f32],
    label: usize,
    grad: bool,
    capped: &mut [f32],
) -> f32 {
    if let Some(b) = head.bias {
        z.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
    if let Some(m) = head.multiplier {
        z.iter_mut().for_each(|v| *v *= m);
    }
    if let Some(cap) = head.softcap {
        z.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        if grad {
            capped.copy_from_slice(z);
        }
    }
    let logit = z[label];
    let (max, sum) = exp_shifted(z);
    let logp = logit - (max + sum.ln() as f32);
    if grad {
        // ∂log p(label)/∂z = onehot(label) − softmax(z), then back through the cap
        // (1 − (y/cap)²) and the multiplier.
        let inv = (1.0 / sum) as f32;
        z.iter_mut().for_each(|v| *v *= -inv);
        z[label] += 1.0;
        if let Some(cap) = head.softcap {
            z.iter_mut().zip(capped.iter()).for_each(|(d, &y)| {
                let t = y / cap;
                *d *= 1.0 - t * t;
            });
        }
        if let Some(m) = head.multiplier {
            z.iter_mut().for_each(|v| *v *= m);
        }
    }
    logp
}

/// Replaces `z` by `exp(z − max z)` and returns `(max z, Σ exp(z − max z))`, the sum in
/// f64: one exponential per logit, vectorized where the CPU has AVX-512.
fn exp_shifted(z: &mut [f32]) -> (f32, f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the features were detected at run time.
            return unsafe { exp_shifted_avx512(z) };
        }
    }
    exp_shifted_generic(z)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn exp_shifted_avx512(z: &mut [f32]) -> (f32, f64) {
    exp_shifted_generic(z)
}

/// Lanes the max and the sum are kept in, so the loops vectorize (a single running sum
/// is a chain of dependent adds).
const LANES: usize = 16;

#[inline(always)]
fn exp_shifted_generic(z: &mut [f32]) -> (f32, f64) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut parts = z.chunks_exact(LANES);
    for c in &mut parts {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = parts
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let mut sums = [0.0f64; LANES];
    let mut parts = z.chunks_exact_mut(LANES);
    for c in &mut parts {
        for (s, v) in sums.iter_mut().zip(c.iter_mut()) {
            *v = wick_kernels::elementwise::exp(*v - max);
            *s += f64::from(*v);
        }
    }
    let mut sum: f64 = 0.0;
    for v in parts.into_remainder() {
        *v = wick_kernels::elementwise::exp(*v - max);
        sum += f64::from(*v);
    }
    (max, sum + sums.iter().sum::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked result against the whole logits computed directly, with a bias, a
    /// multiplier and a soft cap, over more rows than one chunk holds.
    #[test]
    fn matches_the_whole_logits_and_their_gradient() {
        let (vocab, hidden, n, chunk) = (50, 4, 7, 3); // chunks of 3, 3 and 1 rows
        let mut s = 0x2545_f491u32;
        let mut rand = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32 - 0.5
        };
        let w: Vec<f32> = (0..vocab * hidden).map(|_| rand()).collect();
        let x: Vec<f32> = (0..n * hidden).map(|_| 4.0 * rand()).collect();
        let mut bias = vec![0.0f32; vocab];
        bias[vocab - 3..].fill(f32::NEG_INFINITY);
        let labels: Vec<u32> = (0..n as u32).map(|i| i * 6 + 1).collect();
        for (multiplier, softcap) in [(None, None), (Some(0.5), Some(3.0))] {
            let head = Head {
                w: &w,
                vocab,
                hidden,
                bias: Some(&bias),
                multiplier,
                softcap,
            };
            let (logp, dx) = in_chunks(head, &x, &labels, true, chunk);
            let (logp_only, none) = in_chunks(head, &x, &labels, false, chunk);
            assert!(none.is_none());
            assert_eq!(logp, logp_only);
            let dx = dx.unwrap();
            let m = multiplier.unwrap_or(1.0) as f64;
            for i in 0..n {
                let xr = &x[i * hidden..][..hidden];
                // y_v = softcap(m·(x·w_v + b_v)), in f64.
                let ys: Vec<f64> = (0..vocab)
                    .map(|v| {
                        let dot: f64 = (0..hidden)
                            .map(|k| xr[k] as f64 * w[v * hidden + k] as f64)
                            .sum();
                        let y = m * (dot + bias[v] as f64);
                        softcap.map_or(y, |c| c as f64 * (y / c as f64).tanh())
                    })
                    .collect();
                let max = ys.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = ys.iter().map(|y| (y - max).exp()).sum();
                let want = ys[labels[i] as usize] - max - sum.ln();
                assert!(
                    (logp[i] as f64 - want).abs() < 1e-5,
                    "row {i}: {} vs {want}",
                    logp[i]
                );
                for k in 0..hidden {
                    let want: f64 = (0..vocab)
                        .map(|v| {
                            let p = (ys[v] - max).exp() / sum;
                            let onehot = if v == labels[i] as usize { 1.0 } else { 0.0 };
                            let dcap = softcap.map_or(1.0, |c| {
                                let t = ys[v] / c as f64;
                                1.0 - t * t
                            });
                            (onehot - p) * dcap * m * w[v * hidden + k] as f64
                        })
                        .sum();
                    let got = dx[i * hidden + k] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "row {i} col {k}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
