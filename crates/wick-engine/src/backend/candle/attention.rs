//! Causal (optionally sliding-window) grouped-query attention over host KV caches.
use rayon::prelude::*;

use super::kv::CpuKvLayer;
use crate::backend::AttentionParams;

/// `Σ a_i b_i` with independent accumulators so the compiler vectorizes it.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (
            &a[c * LANES..(c + 1) * LANES],
            &b[c * LANES..(c + 1) * LANES],
        );
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * LANES..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// `out += w * v`
#[inline]
fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// Where one row of the batch reads from: its cache and its position.
pub(crate) struct RowSource<'a> {
    pub cache: &'a CpuKvLayer,
    pub pos: usize,
}

/// Attention for every (row, head); `q` is `[rows][heads][head_dim]`, the result too.
pub(crate) fn attend(q: &[f32], rows: &[RowSource<'_>], p: &AttentionParams) -> Vec<f32> {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let mut out = vec![0f32; q.len()];
    out.par_chunks_mut(hd)
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
            let (r, h) = (i / p.heads, i % p.heads);
            let src = &rows[r];
            let qv = &q[i * hd..(i + 1) * hd];
            let kvh = h / group;
            let hi = src.pos;
            let lo = match p.window {
                Some(w) => (hi + 1).saturating_sub(w),
                None => 0,
            }
            .max(src.cache.start);
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in lo..=hi {
                let mut s = dot(qv, src.cache.key(j, kvh)) * p.scale;
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            for (j, &w) in (lo..=hi).zip(scores.iter()) {
                axpy(o, w * inv, src.cache.value(j, kvh));
            }
        });
    out
}
