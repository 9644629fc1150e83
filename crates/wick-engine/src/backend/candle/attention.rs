//! Causal (optionally sliding-window) grouped-query attention over paged host KV caches:
//! keys and values are read block by block through each sequence's block table.
use rayon::prelude::*;

use super::block_pool::BLOCK_TOKENS;
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

/// Calls `f(keys, values, n)` for each run of consecutive positions `from..to` that lie
/// in one block: the slices start at the run's first token, `n` tokens long.
#[inline]
fn for_each_run(
    cache: &CpuKvLayer,
    from: usize,
    to: usize,
    mut f: impl FnMut(&[f32], &[f32], usize),
) {
    let row = cache.row();
    let mut pos = from;
    while pos < to {
        let (block, slot) = cache.locate(pos);
        let n = (BLOCK_TOKENS - slot).min(to - pos);
        f(
            &block.keys[slot * row..(slot + n) * row],
            &block.values[slot * row..(slot + n) * row],
            n,
        );
        pos += n;
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
            let row = src.cache.row();
            let hi = src.pos;
            let lo = match p.window {
                Some(w) => (hi + 1).saturating_sub(w),
                None => 0,
            }
            .max(src.cache.start);
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for_each_run(src.cache, lo, hi + 1, |keys, _, n| {
                for t in 0..n {
                    let at = t * row + kvh * hd;
                    let mut s = dot(qv, &keys[at..at + hd]) * p.scale;
                    if let Some(cap) = p.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    max = max.max(s);
                    scores.push(s);
                }
            });
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            let mut weights = scores.iter();
            for_each_run(src.cache, lo, hi + 1, |_, values, n| {
                for t in 0..n {
                    let at = t * row + kvh * hd;
                    let w = weights.next().copied().unwrap_or(0.0);
                    axpy(o, w * inv, &values[at..at + hd]);
                }
            });
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::candle::{CandleBackend, HostTensor};
    use crate::backend::{AttentionSegment, Backend, KvLayer};

    /// Deterministic values in `[-1, 1)`.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Plain attention over contiguous `[token][kv_head][hd]` keys and values of one
    /// sequence, for the query of position `pos`.
    fn reference(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        pos: usize,
        p: &AttentionParams,
    ) -> Vec<f32> {
        let hd = p.head_dim;
        let row = p.kv_heads * hd;
        let mut out = vec![0f32; p.heads * hd];
        for h in 0..p.heads {
            let kvh = h / (p.heads / p.kv_heads);
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let scores: Vec<f64> = (lo..=pos)
                .map(|j| {
                    let k = &keys[j * row + kvh * hd..][..hd];
                    let mut s: f64 = (0..hd).map(|d| (q[h * hd + d] * k[d]) as f64).sum();
                    s *= p.scale as f64;
                    if let Some(cap) = p.softcap {
                        s = cap as f64 * (s / cap as f64).tanh();
                    }
                    s
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            for (j, s) in (lo..=pos).zip(&scores) {
                let w = (s - max).exp() / sum;
                let v = &values[j * row + kvh * hd..][..hd];
                for d in 0..hd {
                    out[h * hd + d] += (w * v[d] as f64) as f32;
                }
            }
        }
        out
    }

    /// Three sequences of different lengths, fed in uneven chunks in shared batches,
    /// through the block tables (one sequence a copy-on-write clone of another), match
    /// the contiguous reference at every position.
    #[test]
    fn block_table_attention_matches_contiguous_reference() {
        let be = CandleBackend::cpu();
        for (window, softcap) in [(None, None), (Some(37), None), (Some(20), Some(30.0))] {
            let p = AttentionParams {
                heads: 6,
                kv_heads: 2,
                head_dim: 32,
                scale: 1.0 / (32f32).sqrt(),
                window,
                softcap,
            };
            let (q_w, kv_w) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
            let lens = [70usize, 45, 101];
            let data: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = lens
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    let seed = 10 * s as u64;
                    (
                        noise(seed + 1, n * q_w),
                        noise(seed + 2, n * kv_w),
                        noise(seed + 3, n * kv_w),
                    )
                })
                .collect();
            let mut caches: Vec<CpuKvLayer> = lens
                .iter()
                .map(|_| be.new_kv_layer(p.kv_heads, p.head_dim, window))
                .collect();
            let chunks = [1usize, 17, 5, 16, 1, 33, 2, 64];
            let mut fed = [0usize; 3];
            let mut worst = 0f32;
            let mut kept = None;
            for (step, &chunk) in chunks.iter().cycle().enumerate() {
                if fed.iter().zip(&lens).all(|(f, l)| f == l) {
                    break;
                }
                if step == 3 {
                    // Sequence 1 goes on writing while a clone shares its blocks.
                    kept = Some((caches[1].clone(), fed[1]));
                }
                let mut q = Vec::new();
                let mut k = Vec::new();
                let mut v = Vec::new();
                let mut rows = Vec::new();
                let mut plan = Vec::new();
                for s in 0..3 {
                    let n = (chunk + s).min(lens[s] - fed[s]);
                    if n == 0 {
                        continue;
                    }
                    let (qs, ks, vs) = &data[s];
                    let at = q.len() / q_w;
                    q.extend_from_slice(&qs[fed[s] * q_w..(fed[s] + n) * q_w]);
                    k.extend_from_slice(&ks[fed[s] * kv_w..(fed[s] + n) * kv_w]);
                    v.extend_from_slice(&vs[fed[s] * kv_w..(fed[s] + n) * kv_w]);
                    rows.push(at..at + n);
                    plan.push((s, n));
                }
                let total = q.len() / q_w;
                let q = HostTensor::from_vec(q, total, q_w).unwrap();
                let k = HostTensor::from_vec(k, total, kv_w).unwrap();
                let v = HostTensor::from_vec(v, total, kv_w).unwrap();
                let out = {
                    let mut segments: Vec<AttentionSegment<'_, CpuKvLayer>> = Vec::new();
                    for (s, cache) in caches.iter_mut().enumerate() {
                        if let Some(i) = plan.iter().position(|&(p, _)| p == s) {
                            segments.push(AttentionSegment {
                                rows: rows[i].clone(),
                                cache,
                            });
                        }
                    }
                    be.attention(&q, &k, &v, &mut segments, &p).unwrap()
                };
                let out = out.data();
                for (&(s, n), r) in plan.iter().zip(&rows) {
                    let (qs, ks, vs) = &data[s];
                    for i in 0..n {
                        let pos = fed[s] + i;
                        let want = reference(&qs[pos * q_w..(pos + 1) * q_w], ks, vs, pos, &p);
                        let got = &out[(r.start + i) * q_w..(r.start + i + 1) * q_w];
                        for (a, b) in got.iter().zip(&want) {
                            worst = worst.max((a - b).abs());
                        }
                    }
                    fed[s] += n;
                }
            }
            assert!(
                worst <= 1e-5,
                "window {window:?}: max difference {worst} from the contiguous reference"
            );
            let (clone, at) = kept.unwrap();
            let start = clone.start;
            assert_eq!(
                clone.snapshot().keys,
                data[1].1[start * kv_w..at * kv_w],
                "writes through the original changed its clone"
            );
            if let Some(w) = window {
                assert!(
                    caches[2].block_count() <= CpuKvLayer::peak_blocks(101, Some(w), 64),
                    "the window layer kept {} blocks",
                    caches[2].block_count()
                );
                assert!(caches[2].start > 0, "nothing fell out of the window");
            }
        }
    }
}
