//! Causal grouped-query attention over packed sequences, and its backward. Work is
//! spread over (sequence, head) pairs; each keeps its `[T, T]` probabilities for the
//! backward.
use rayon::prelude::*;

use crate::linalg::{gemm, Layout};

/// The attention layer's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub scale: f32,
    /// Sliding window (`i − j < w`), `None` for full causal attention.
    pub window: Option<usize>,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
}

/// Columns `[col, col + hd)` of rows `rows` of a `[_, width]` buffer, contiguous.
fn gather(
    x: &[f32],
    width: usize,
    rows: std::ops::Range<usize>,
    col: usize,
    hd: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * hd);
    for r in rows {
        out.extend_from_slice(&x[r * width + col..r * width + col + hd]);
    }
    out
}

fn scatter_add(dst: &mut [f32], width: usize, start: usize, col: usize, hd: usize, src: &[f32]) {
    for (i, row) in src.chunks_exact(hd).enumerate() {
        let d = &mut dst[(start + i) * width + col..(start + i) * width + col + hd];
        for (a, b) in d.iter_mut().zip(row) {
            *a += b;
        }
    }
}

/// Row-wise causal softmax of `scores` `[t, t]` in place.
fn causal_softmax(p: &mut [f32], t: usize, window: Option<usize>) {
    for i in 0..t {
        let row = &mut p[i * t..(i + 1) * t];
        let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
        let max = row[lo..=i]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (j, v) in row.iter_mut().enumerate() {
            if j < lo || j > i {
                *v = 0.0;
            } else {
                *v = (*v - max).exp();
                sum += *v;
            }
        }
        let inv = 1.0 / sum;
        row[lo..=i].iter_mut().for_each(|v| *v *= inv);
    }
}

/// The attention output `[rows, heads·hd]` and, per sequence, the probabilities of each
/// head (`[heads][t][t]`).
pub(crate) fn forward(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    starts: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let rows = *starts.last().unwrap_or(&0);
    let jobs: Vec<(usize, usize)> = (0..starts.len() - 1)
        .flat_map(|seq| (0..s.heads).map(move |h| (seq, h)))
        .collect();
    let results: Vec<(Vec<f32>, Vec<f32>)> = jobs
        .par_iter()
        .map(|&(seq, h)| {
            let (a, b) = (starts[seq], starts[seq + 1]);
            let t = b - a;
            let g = h / s.group();
            let qh = gather(q, qw, a..b, h * s.hd, s.hd);
            let kh = gather(k, kw, a..b, g * s.hd, s.hd);
            let vh = gather(v, kw, a..b, g * s.hd, s.hd);
            let mut p = vec![0.0; t * t];
            gemm(
                t,
                t,
                s.hd,
                &qh,
                Layout::Plain,
                &kh,
                Layout::Transposed,
                &mut p,
                false,
                s.scale,
                false,
            );
            causal_softmax(&mut p, t, s.window);
            let mut o = vec![0.0; t * s.hd];
            gemm(
                t,
                s.hd,
                t,
                &p,
                Layout::Plain,
                &vh,
                Layout::Plain,
                &mut o,
                false,
                1.0,
                false,
            );
            (p, o)
        })
        .collect();
    let mut out = vec![0.0; rows * qw];
    let mut probs: Vec<Vec<f32>> = (0..starts.len() - 1)
        .map(|seq| {
            let t = starts[seq + 1] - starts[seq];
            Vec::with_capacity(s.heads * t * t)
        })
        .collect();
    for (&(seq, h), (p, o)) in jobs.iter().zip(results) {
        scatter_add(&mut out, qw, starts[seq], h * s.hd, s.hd, &o);
        probs[seq].extend_from_slice(&p);
    }
    (out, probs)
}

/// Gradients of `q`, `k`, `v` (after rotary) from the output gradient `dout`.
pub(crate) fn backward(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[Vec<f32>],
    dout: &[f32],
    starts: &[usize],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let rows = *starts.last().unwrap_or(&0);
    let jobs: Vec<(usize, usize)> = (0..starts.len() - 1)
        .flat_map(|seq| (0..s.kv_heads).map(move |g| (seq, g)))
        .collect();
    type Grads = (Vec<(usize, Vec<f32>)>, Vec<f32>, Vec<f32>);
    let results: Vec<Grads> = jobs
        .par_iter()
        .map(|&(seq, g)| {
            let (a, b) = (starts[seq], starts[seq + 1]);
            let t = b - a;
            let kh = gather(k, kw, a..b, g * s.hd, s.hd);
            let vh = gather(v, kw, a..b, g * s.hd, s.hd);
            let mut dk = vec![0.0; t * s.hd];
            let mut dv = vec![0.0; t * s.hd];
            let mut dqs = Vec::with_capacity(s.group());
            let mut dp = vec![0.0; t * t];
            for h in g * s.group()..(g + 1) * s.group() {
                let p = &probs[seq][h * t * t..(h + 1) * t * t];
                let qh = gather(q, qw, a..b, h * s.hd, s.hd);
                let doh = gather(dout, qw, a..b, h * s.hd, s.hd);
                // dV += Pᵀ dO; dP = dO Vᵀ.
                gemm(
                    t,
                    s.hd,
                    t,
                    p,
                    Layout::Transposed,
                    &doh,
                    Layout::Plain,
                    &mut dv,
                    true,
                    1.0,
                    false,
                );
                gemm(
                    t,
                    t,
                    s.hd,
                    &doh,
                    Layout::Plain,
                    &vh,
                    Layout::Transposed,
                    &mut dp,
                    false,
                    1.0,
                    false,
                );
                // dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale.
                for i in 0..t {
                    let pr = &p[i * t..(i + 1) * t];
                    let dr = &mut dp[i * t..(i + 1) * t];
                    let dot: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    for (d, &pv) in dr.iter_mut().zip(pr) {
                        *d = pv * (*d - dot) * s.scale;
                    }
                }
                let mut dq = vec![0.0; t * s.hd];
                gemm(
                    t,
                    s.hd,
                    t,
                    &dp,
                    Layout::Plain,
                    &kh,
                    Layout::Plain,
                    &mut dq,
                    false,
                    1.0,
                    false,
                );
                gemm(
                    t,
                    s.hd,
                    t,
                    &dp,
                    Layout::Transposed,
                    &qh,
                    Layout::Plain,
                    &mut dk,
                    true,
                    1.0,
                    false,
                );
                dqs.push((h, dq));
            }
            (dqs, dk, dv)
        })
        .collect();
    let mut dq = vec![0.0; rows * qw];
    let mut dk = vec![0.0; rows * kw];
    let mut dv = vec![0.0; rows * kw];
    for (&(seq, g), (dqs, dkh, dvh)) in jobs.iter().zip(results) {
        let a = starts[seq];
        for (h, d) in dqs {
            scatter_add(&mut dq, qw, a, h * s.hd, s.hd, &d);
        }
        scatter_add(&mut dk, kw, a, g * s.hd, s.hd, &dkh);
        scatter_add(&mut dv, kw, a, g * s.hd, s.hd, &dvh);
    }
    (dq, dk, dv)
}
