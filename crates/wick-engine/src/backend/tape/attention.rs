//! Causal grouped-query attention of whole sequences (each from an empty cache) and its
//! backward. Work is spread over (sequence, head) pairs; each keeps its `[t, t]`
//! probabilities for the backward.
use std::ops::Range;

use rayon::prelude::*;

use super::products::{gemm, Layout};
use crate::backend::AttentionParams;

/// The attention layer's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub scale: f32,
    /// Sliding window (`i − j < w`), `None` for full causal attention.
    pub window: Option<usize>,
    /// `cap · tanh(s / cap)` on the scaled scores.
    pub softcap: Option<f32>,
}

impl AttnShape {
    pub(crate) fn of(p: &AttentionParams) -> AttnShape {
        AttnShape {
            heads: p.heads,
            kv_heads: p.kv_heads,
            hd: p.head_dim,
            scale: p.scale,
            window: p.window,
            softcap: p.softcap,
        }
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
}

/// Columns `[col, col + hd)` of rows `rows` of a `[_, width]` buffer, contiguous.
fn gather(x: &[f32], width: usize, rows: Range<usize>, col: usize, hd: usize) -> Vec<f32> {
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

/// The scaled (and soft-capped) scores `q·kᵀ` of one head, `[t, t]`.
fn scores(s: AttnShape, qh: &[f32], kh: &[f32], t: usize) -> Vec<f32> {
    let mut p = vec![0.0; t * t];
    gemm(
        t,
        t,
        s.hd,
        qh,
        Layout::Plain,
        kh,
        Layout::Transposed,
        &mut p,
        false,
        s.scale,
        false,
    );
    if let Some(cap) = s.softcap {
        p.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }
    p
}

/// The first key row `i` sees.
fn first_key(i: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (i + 1).saturating_sub(w))
}

/// Row-wise causal softmax of `p` `[t, t]` in place.
fn causal_softmax(p: &mut [f32], t: usize, window: Option<usize>) {
    for i in 0..t {
        let row = &mut p[i * t..(i + 1) * t];
        let lo = first_key(i, window);
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

/// The attention output `[rows, heads·hd]` and, per segment, the probabilities of each
/// head (`[heads][t][t]`).
pub(crate) fn forward(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    segments: &[Range<usize>],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let rows = segments.iter().map(|r| r.end).max().unwrap_or(0);
    let jobs: Vec<(usize, usize)> = (0..segments.len())
        .flat_map(|seq| (0..s.heads).map(move |h| (seq, h)))
        .collect();
    let results: Vec<(Vec<f32>, Vec<f32>)> = jobs
        .par_iter()
        .map(|&(seq, h)| {
            let r = segments[seq].clone();
            let t = r.len();
            let g = h / s.group();
            let qh = gather(q, qw, r.clone(), h * s.hd, s.hd);
            let kh = gather(k, kw, r.clone(), g * s.hd, s.hd);
            let vh = gather(v, kw, r, g * s.hd, s.hd);
            let mut p = scores(s, &qh, &kh, t);
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
    let mut probs: Vec<Vec<f32>> = segments
        .iter()
        .map(|r| Vec::with_capacity(s.heads * r.len() * r.len()))
        .collect();
    for (&(seq, h), (p, o)) in jobs.iter().zip(results) {
        scatter_add(&mut out, qw, segments[seq].start, h * s.hd, s.hd, &o);
        probs[seq].extend_from_slice(&p);
    }
    (out, probs)
}

/// Gradients of `q`, `k`, `v` (as the attention read them) from the output gradient
/// `dout`, `[rows, heads·hd]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[Vec<f32>],
    dout: &[f32],
    segments: &[Range<usize>],
    rows: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qw, kw) = (s.heads * s.hd, s.kv_heads * s.hd);
    let jobs: Vec<(usize, usize)> = (0..segments.len())
        .flat_map(|seq| (0..s.kv_heads).map(move |g| (seq, g)))
        .collect();
    type Grads = (Vec<(usize, Vec<f32>)>, Vec<f32>, Vec<f32>);
    let results: Vec<Grads> = jobs
        .par_iter()
        .map(|&(seq, g)| {
            let r = segments[seq].clone();
            let t = r.len();
            let kh = gather(k, kw, r.clone(), g * s.hd, s.hd);
            let vh = gather(v, kw, r.clone(), g * s.hd, s.hd);
            let mut dk = vec![0.0; t * s.hd];
            let mut dv = vec![0.0; t * s.hd];
            let mut dqs = Vec::with_capacity(s.group());
            let mut dp = vec![0.0; t * t];
            for h in g * s.group()..(g + 1) * s.group() {
                let p = &probs[seq][h * t * t..(h + 1) * t * t];
                let qh = gather(q, qw, r.clone(), h * s.hd, s.hd);
                let doh = gather(dout, qw, r.clone(), h * s.hd, s.hd);
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
                // The capped scores again, for the cap's derivative 1 − tanh².
                let capped = s.softcap.map(|_| scores(s, &qh, &kh, t));
                // dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale (· (1 − tanh²) under a cap).
                for i in 0..t {
                    let pr = &p[i * t..(i + 1) * t];
                    let dr = &mut dp[i * t..(i + 1) * t];
                    let dot: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    for (j, (d, &pv)) in dr.iter_mut().zip(pr).enumerate() {
                        let mut ds = pv * (*d - dot) * s.scale;
                        if let (Some(c), Some(cap)) = (&capped, s.softcap) {
                            let th = c[i * t + j] / cap;
                            ds *= 1.0 - th * th;
                        }
                        *d = ds;
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
        let a = segments[seq].start;
        for (h, d) in dqs {
            scatter_add(&mut dq, qw, a, h * s.hd, s.hd, &d);
        }
        scatter_add(&mut dk, kw, a, g * s.hd, s.hd, &dkh);
        scatter_add(&mut dv, kw, a, g * s.hd, s.hd, &dvh);
    }
    (dq, dk, dv)
}
