//! Elementwise and row-wise ops of a transformer layer, written into caller buffers:
//! RMS normalization, the gated activations `silu(g)·u` / `gelu_tanh(g)·u`, residual
//! adds, scaling and soft-capping.
//!
//! Each op is plain Rust compiled three times — for AVX-512, for AVX2 and portably — and
//! chosen at run time, so the loops (including [`exp`]) vectorize without intrinsics.
//! Large inputs are split over a [`ThreadPool`] by rows.
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Isa, KernelError, Result, ThreadPool};

/// Gated-MLP activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluActivation {
    /// `silu(g) · u`.
    Silu,
    /// `gelu_tanh(g) · u` (the tanh approximation of GELU).
    GeluTanh,
}

/// Elements under which an op stays on the calling thread.
const SERIAL: usize = 1 << 15;

/// Compiles `$body` (a closure-like block over the listed arguments) once per ISA and
/// calls the version for `$isa`.
macro_rules! multiversion {
    ($isa:expr, ($($arg:ident : $ty:ty),*) $body:block) => {{
        #[inline(always)]
        fn generic($($arg: $ty),*) $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
        unsafe fn v512($($arg: $ty),*) { generic($($arg),*) }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn v256($($arg: $ty),*) { generic($($arg),*) }
        match $isa.vector() {
            // SAFETY: the ISA was detected at run time.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => unsafe { v512($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { v256($($arg),*) },
            _ => generic($($arg),*),
        }
    }};
}

/// `e^x` for `x` in f32 range, relative error below 2·10⁻⁷, written to vectorize:
/// `2^n · p(r)` with `x = n·ln2 + r`, `|r| ≤ ln2/2`, `p` a degree-7 Taylor polynomial.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n without a float→int conversion (which would not vectorize): n + 127 lands in
    // the low mantissa bits of `n + 127 + 2^23`, and shifting them into the exponent
    // field drops everything above.
    let scale = f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23);
    p * scale
}

/// `tanh(x)` through [`exp`] (absolute error below 10⁻⁷).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (1.0 + exp(2.0 * x))
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + tanh(C * (x + 0.044_715 * x * x * x)))
}

fn same_len(op: &'static str, what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(KernelError::Shape {
            op,
            what,
            expected,
            found,
        });
    }
    Ok(())
}

/// Runs `f(range)` over `0..rows` split in chunks across the pool when `elements` is
/// large, else on the caller.
fn by_rows(pool: &ThreadPool, rows: usize, elements: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    if elements < SERIAL || rows < 2 {
        return f(0, rows);
    }
    let chunk = rows.div_ceil(pool.threads() * 4).max(1);
    let next = AtomicUsize::new(0);
    pool.run(&|_| loop {
        let r0 = next.fetch_add(chunk, Ordering::Relaxed);
        if r0 >= rows {
            break;
        }
        f(r0, (r0 + chunk).min(rows));
    });
}

/// Shares a mutable output between threads that write disjoint ranges.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: users write disjoint ranges (see `by_rows`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `start..end` must be inside the buffer and written by no other thread.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, end: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(start), end - start)
    }
}

/// RMS-normalizes every `weight.len()`-long row of `x` into `out`:
/// `out = x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<()> {
    let dim = weight.len();
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return Err(KernelError::Shape {
            op: "rms_norm",
            what: "input (whole rows)",
            expected: x.len().div_ceil(dim.max(1)) * dim,
            found: x.len(),
        });
    }
    same_len("rms_norm", "output", x.len(), out.len())?;
    let o = SharedOut(out.as_mut_ptr());
    by_rows(pool, x.len() / dim, x.len(), &|r0, r1| {
        // SAFETY: rows r0..r1 are this chunk's alone.
        let out = unsafe { o.slice(r0 * dim, r1 * dim) };
        rms_rows(isa, &x[r0 * dim..r1 * dim], weight, eps, out);
    });
    Ok(())
}

fn rms_rows(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    multiversion!(isa, (x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let dim = weight.len();
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let mut acc = [0f32; 16];
            let mut chunks = xr.chunks_exact(16);
            for c in &mut chunks {
                for i in 0..16 {
                    acc[i] += c[i] * c[i];
                }
            }
            let mut sum: f32 = acc.iter().sum();
            for &v in chunks.remainder() {
                sum += v * v;
            }
            let m = (sum / dim as f32 + eps).sqrt();
            for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                *o = v / m * w;
            }
        }
    })
}

/// `out = act(gate) · up`, elementwise.
pub fn glu(
    pool: &ThreadPool,
    isa: Isa,
    act: GluActivation,
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
) -> Result<()> {
    same_len("glu", "up", gate.len(), up.len())?;
    same_len("glu", "output", gate.len(), out.len())?;
    const ROW: usize = 4096;
    let n = gate.len();
    let o = SharedOut(out.as_mut_ptr());
    by_rows(pool, n.div_ceil(ROW), n, &|r0, r1| {
        let (a, b) = (r0 * ROW, (r1 * ROW).min(n));
        // SAFETY: elements a..b are this chunk's alone.
        let out = unsafe { o.slice(a, b) };
        glu_span(isa, act, &gate[a..b], &up[a..b], out);
    });
    Ok(())
}

fn glu_span(isa: Isa, act: GluActivation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match act {
        GluActivation::Silu => {
            multiversion!(isa, (gate: &[f32], up: &[f32], out: &mut [f32]) {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = silu(g) * u;
                }
            })
        }
        GluActivation::GeluTanh => {
            multiversion!(isa, (gate: &[f32], up: &[f32], out: &mut [f32]) {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = gelu_tanh(g) * u;
                }
            })
        }
    }
}

/// `out = a + b`, elementwise.
pub fn add(isa: Isa, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    same_len("add", "b", a.len(), b.len())?;
    same_len("add", "output", a.len(), out.len())?;
    multiversion!(isa, (a: &[f32], b: &[f32], out: &mut [f32]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
    });
    Ok(())
}

/// `a += b`, elementwise.
pub fn add_assign(isa: Isa, a: &mut [f32], b: &[f32]) -> Result<()> {
    same_len("add_assign", "b", a.len(), b.len())?;
    multiversion!(isa, (a: &mut [f32], b: &[f32]) {
        for (x, &y) in a.iter_mut().zip(b) {
            *x += y;
        }
    });
    Ok(())
}

/// `out = x · s`, elementwise.
pub fn scale(isa: Isa, x: &[f32], s: f32, out: &mut [f32]) -> Result<()> {
    same_len("scale", "output", x.len(), out.len())?;
    multiversion!(isa, (x: &[f32], s: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v * s;
        }
    });
    Ok(())
}

/// `out = cap · tanh(x / cap)`, elementwise.
pub fn softcap(isa: Isa, x: &[f32], cap: f32, out: &mut [f32]) -> Result<()> {
    same_len("softcap", "output", x.len(), out.len())?;
    multiversion!(isa, (x: &[f32], cap: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = cap * tanh(v / cap);
        }
    });
    Ok(())
}

/// `x = silu(x) = x / (1 + e^-x)`, elementwise, in place.
pub fn silu_in_place(isa: Isa, x: &mut [f32]) {
    multiversion!(isa, (x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = silu(*v);
        }
    });
}

/// A causal depthwise convolution followed by SiLU, over `channels`-wide rows:
/// `out[t][c] = silu(Σⱼ taps[j][c] · e[t + j][c])`, where `e` is the `kernel − 1` rows of
/// `history` (oldest first) followed by the rows of `x`, and `taps` is tap-major
/// (`[kernel][channels]`). `out` has as many rows as `x`. Each output row is one chain of
/// multiply-adds in tap order, so splitting the rows between callers changes nothing.
pub fn causal_conv1d_silu(
    isa: Isa,
    history: &[f32],
    x: &[f32],
    channels: usize,
    taps: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let op = "causal_conv1d_silu";
    if channels == 0 || taps.is_empty() || !taps.len().is_multiple_of(channels) {
        return Err(KernelError::Shape {
            op,
            what: "taps",
            expected: channels.max(1),
            found: taps.len(),
        });
    }
    let kernel = taps.len() / channels;
    same_len(op, "history", (kernel - 1) * channels, history.len())?;
    same_len(op, "output", x.len(), out.len())?;
    if !x.len().is_multiple_of(channels) {
        return Err(KernelError::Shape {
            op,
            what: "input",
            expected: x.len().div_ceil(channels) * channels,
            found: x.len(),
        });
    }
    multiversion!(isa, (history: &[f32], x: &[f32], channels: usize, taps: &[f32], out: &mut [f32]) {
        let hist = history.len() / channels;
        for (t, o) in out.chunks_exact_mut(channels).enumerate() {
            for (j, w) in taps.chunks_exact(channels).enumerate() {
                let e = t + j;
                let row = if e < hist {
                    &history[e * channels..(e + 1) * channels]
                } else {
                    &x[(e - hist) * channels..(e - hist + 1) * channels]
                };
                if j == 0 {
                    for ((y, &w), &r) in o.iter_mut().zip(w).zip(row) {
                        *y = w * r;
                    }
                } else {
                    for ((y, &w), &r) in o.iter_mut().zip(w).zip(row) {
                        *y = w.mul_add(r, *y);
                    }
                }
            }
            for y in o.iter_mut() {
                *y = silu(*y);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<f32> {
        let mut s = 0x9E37_79B9u32;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32 - 0.5) * 12.0
            })
            .collect()
    }

    #[test]
    fn exp_is_accurate_over_the_f32_range() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.013;
        }
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn tanh_is_accurate() {
        let mut x = -20.0f32;
        while x < 20.0 {
            assert!(
                (tanh(x) as f64 - (x as f64).tanh()).abs() < 2e-7,
                "tanh({x})"
            );
            x += 0.0071;
        }
    }

    #[test]
    fn every_isa_matches_the_f64_definitions() {
        let pool = ThreadPool::new(2);
        let dim = 96;
        let x = sample(dim * 700);
        let w = sample(dim);
        let up = sample(x.len());
        for isa in Isa::available() {
            let mut out = vec![0f32; x.len()];
            rms_norm(&pool, isa, &x, &w, 1e-6, &mut out).unwrap();
            for (r, row) in x.chunks(dim).enumerate() {
                let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                let m = (ms + 1e-6).sqrt();
                for c in 0..dim {
                    let want = row[c] as f64 / m * w[c] as f64;
                    let got = out[r * dim + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "{isa:?} rms"
                    );
                }
            }
            for act in [GluActivation::Silu, GluActivation::GeluTanh] {
                glu(&pool, isa, act, &x, &up, &mut out).unwrap();
                for i in 0..x.len() {
                    let g = x[i] as f64;
                    let a = match act {
                        GluActivation::Silu => g / (1.0 + (-g).exp()),
                        GluActivation::GeluTanh => {
                            let c = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
                        }
                    };
                    let want = a * up[i] as f64;
                    let got = out[i] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "{isa:?} {act:?}"
                    );
                }
            }
            let mut sum = vec![0f32; x.len()];
            add(isa, &x, &up, &mut sum).unwrap();
            let mut acc = x.clone();
            add_assign(isa, &mut acc, &up).unwrap();
            assert_eq!(sum, acc);
            assert!(sum.iter().zip(&x).zip(&up).all(|((s, a), b)| *s == a + b));
            softcap(isa, &x, 3.0, &mut out).unwrap();
            for i in 0..x.len() {
                let want = 3.0 * (x[i] as f64 / 3.0).tanh();
                assert!((out[i] as f64 - want).abs() < 1e-6, "{isa:?} softcap");
            }
        }
    }

    #[test]
    fn shape_mistakes_are_errors() {
        let pool = ThreadPool::new(1);
        let mut out = vec![0f32; 5];
        assert!(rms_norm(&pool, Isa::Scalar, &[1.0; 5], &[1.0; 2], 1e-6, &mut out).is_err());
        assert!(glu(
            &pool,
            Isa::Scalar,
            GluActivation::Silu,
            &[1.0; 5],
            &[1.0; 4],
            &mut out
        )
        .is_err());
    }

    #[test]
    fn causal_conv_silu_matches_the_f64_definition_on_every_isa() {
        let (channels, kernel, rows) = (37, 4, 9);
        let history = sample((kernel - 1) * channels);
        let x = sample(rows * channels);
        let taps: Vec<f32> = sample(kernel * channels).iter().map(|v| v / 6.0).collect();
        let extended: Vec<f32> = history.iter().chain(&x).copied().collect();
        for isa in Isa::available() {
            let mut out = vec![0f32; x.len()];
            causal_conv1d_silu(isa, &history, &x, channels, &taps, &mut out).unwrap();
            for t in 0..rows {
                for c in 0..channels {
                    let s: f64 = (0..kernel)
                        .map(|j| {
                            taps[j * channels + c] as f64 * extended[(t + j) * channels + c] as f64
                        })
                        .sum();
                    let want = s / (1.0 + (-s).exp());
                    let got = out[t * channels + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "{isa:?} t={t} c={c}"
                    );
                }
            }
            let mut y = x.clone();
            silu_in_place(isa, &mut y);
            for (&got, &v) in y.iter().zip(&x) {
                let want = v as f64 / (1.0 + (-(v as f64)).exp());
                assert!(
                    (got as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{isa:?} silu"
                );
            }
        }
        let mut out = vec![0f32; x.len()];
        assert!(
            causal_conv1d_silu(Isa::Scalar, &history[1..], &x, channels, &taps, &mut out).is_err()
        );
        assert!(
            causal_conv1d_silu(Isa::Scalar, &history, &x, channels, &taps[1..], &mut out).is_err()
        );
    }
}
