//! Causal (optionally sliding-window) grouped-query attention over paged host KV caches:
//! keys and values are read block by block through each sequence's block table.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use wick_kernels::ThreadPool;

use super::block_pool::{KvBlock, BLOCK_TOKENS};
use super::kv::CpuKvLayer;
use crate::backend::AttentionParams;

/// `out += w * v`
#[inline]
fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// Calls `f(block, first_slot, n)` for each run of consecutive positions `from..to` that
/// lie in one block.
#[inline]
fn for_each_run(
    cache: &CpuKvLayer,
    from: usize,
    to: usize,
    mut f: impl FnMut(&KvBlock, usize, usize),
) {
    let mut pos = from;
    while pos < to {
        let (block, slot) = cache.locate(pos);
        let n = (BLOCK_TOKENS - slot).min(to - pos);
        f(block, slot, n);
        pos += n;
    }
}

/// Partial sums per score: dimension `d` goes to accumulator `d % LANES`, the
/// accumulators are added in order at the end and a tail past the last multiple of
/// `LANES` after that — the summation order of a sixteen-lane dot product, so scores
/// come out bit for bit as a plain `q · k` loop computes them (models whose activations
/// are re-quantized between layers amplify even last-bit differences).
const LANES: usize = 16;

/// `q · k` of one query head (`q`, `hd` values) against every slot of a block's
/// transposed keys of one KV head (`kt`, `[hd][slot]`): sixteen-wide products across the
/// slots, no horizontal sums.
#[inline]
fn block_scores(q: &[f32], kt: &[f32], hd: usize) -> [f32; BLOCK_TOKENS] {
    let main = hd - hd % LANES;
    let mut sum = [0f32; BLOCK_TOKENS];
    if main > 0 {
        for lane in 0..LANES {
            // Accumulator `lane` over dimensions lane, lane + 16, …: two live vectors, so
            // the compiler keeps everything in registers.
            let mut acc = [0f32; BLOCK_TOKENS];
            for d in (lane..main).step_by(LANES) {
                let qd = q[d];
                for (a, &k) in acc
                    .iter_mut()
                    .zip(&kt[d * BLOCK_TOKENS..(d + 1) * BLOCK_TOKENS])
                {
                    *a += qd * k;
                }
            }
            for (s, &a) in sum.iter_mut().zip(&acc) {
                *s += a;
            }
        }
    }
    for d in main..hd {
        let qd = q[d];
        for (s, &k) in sum
            .iter_mut()
            .zip(&kt[d * BLOCK_TOKENS..(d + 1) * BLOCK_TOKENS])
        {
            *s += qd * k;
        }
    }
    sum
}

/// Writes the scores of query heads `qs` (`[heads][hd]`) for slots `slot .. slot + n` of
/// `block` into column `t ..` of `scores` (`[head][position]`, `stride` positions a row).
#[allow(clippy::too_many_arguments)]
fn score_run(
    qs: &[f32],
    block: &KvBlock,
    kvh: usize,
    slot: usize,
    n: usize,
    p: &AttentionParams,
    scores: &mut [f32],
    (t, stride): (usize, usize),
) {
    let hd = p.head_dim;
    let kt = block.head_keys(kvh, hd);
    let mut put = |g: usize, acc: &[f32; BLOCK_TOKENS]| {
        let out = &mut scores[g * stride + t..g * stride + t + n];
        for (o, &a) in out.iter_mut().zip(&acc[slot..slot + n]) {
            let mut s = a * p.scale;
            if let Some(cap) = p.softcap {
                s = cap * (s / cap).tanh();
            }
            *o = s;
        }
    };
    for (g, q) in qs.chunks_exact(hd).enumerate() {
        put(g, &block_scores(q, kt, hd));
    }
}

/// Where one row of the batch reads from: its cache and its position.
pub(crate) struct RowSource<'a> {
    pub cache: &'a CpuKvLayer,
    pub pos: usize,
}

/// Multiply-adds under which attention stays on the calling thread.
const SERIAL_WORK: usize = 1 << 15;

/// Reused buffers of one thread's attention work.
#[derive(Default)]
struct Scratch {
    /// `[head][position]` scores, then weights.
    scores: Vec<f32>,
    /// Per head: running max, then `1 / Σ exp`.
    max: Vec<f32>,
}

/// Attention of the query heads `h0 .. h0 + qs.len() / hd`, which all read KV head `kvh`,
/// for one row: every key is loaded once for all of them.
fn attend_heads(
    qs: &[f32],
    src: &RowSource<'_>,
    kvh: usize,
    p: &AttentionParams,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    let hd = p.head_dim;
    let heads = qs.len() / hd;
    let row = src.cache.row();
    let hi = src.pos;
    let lo = match p.window {
        Some(w) => (hi + 1).saturating_sub(w),
        None => 0,
    }
    .max(src.cache.start);
    let n = hi + 1 - lo;
    sc.scores.clear();
    sc.scores.resize(heads * n, 0.0);
    sc.max.clear();
    sc.max.resize(heads, f32::NEG_INFINITY);
    let mut t = 0;
    for_each_run(src.cache, lo, hi + 1, |block, slot, len| {
        score_run(qs, block, kvh, slot, len, p, &mut sc.scores, (t, n));
        t += len;
    });
    for g in 0..heads {
        sc.max[g] = sc.scores[g * n..(g + 1) * n]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    }
    for g in 0..heads {
        let max = sc.max[g];
        let weights = &mut sc.scores[g * n..(g + 1) * n];
        for s in weights.iter_mut() {
            *s = (*s - max).exp();
        }
        let sum: f32 = weights.iter().sum();
        sc.max[g] = 1.0 / sum;
    }
    for g in 0..heads {
        let inv = sc.max[g];
        for w in &mut sc.scores[g * n..(g + 1) * n] {
            *w *= inv;
        }
    }
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        let w = &sc.scores[g * n..(g + 1) * n];
        // 64 dimensions at a time in a register-sized accumulator, the rest one by one.
        let mut d0 = 0;
        while d0 + 64 <= hd {
            let mut acc = [0f32; 64];
            let mut t = 0;
            for_each_run(src.cache, lo, hi + 1, |block, slot, len| {
                let values = &block.values[slot * row..(slot + len) * row];
                for (v, &wt) in values.chunks_exact(row).zip(&w[t..t + len]) {
                    let v = &v[kvh * hd + d0..kvh * hd + d0 + 64];
                    for (a, &x) in acc.iter_mut().zip(v) {
                        *a += wt * x;
                    }
                }
                t += len;
            });
            o[d0..d0 + 64].copy_from_slice(&acc);
            d0 += 64;
        }
        if d0 < hd {
            let mut t = 0;
            for_each_run(src.cache, lo, hi + 1, |block, slot, len| {
                let values = &block.values[slot * row..(slot + len) * row];
                for (v, &wt) in values.chunks_exact(row).zip(&w[t..t + len]) {
                    axpy(&mut o[d0..], wt, &v[kvh * hd + d0..(kvh + 1) * hd]);
                }
                t += len;
            });
        }
    }
}

/// Attention for every (row, head) on `pool`; `q` is `[rows][heads][head_dim]`, the
/// result too. A work unit is one row's query heads of one KV head (the group shares
/// every key load), or a single head when that leaves too few units for the threads.
pub(crate) fn attend(
    pool: &ThreadPool,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
) -> Vec<f32> {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let mut out = vec![0f32; q.len()];
    let per_unit = if rows.len() * p.kv_heads >= 2 * pool.threads() {
        group
    } else {
        1
    };
    let units_per_row = p.heads / per_unit;
    let work_size: usize = rows
        .iter()
        .map(|r| (r.pos + 1 - r.cache.start.min(r.pos)).min(p.window.unwrap_or(usize::MAX)))
        .sum::<usize>()
        * p.heads
        * hd
        * 2;
    let units: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per_unit * hd).map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    let work = |_thread: usize| {
        let mut sc = Scratch::default();
        loop {
            let u = next.fetch_add(1, Ordering::Relaxed);
            if u >= units.len() {
                break;
            }
            let (r, h0) = (u / units_per_row, (u % units_per_row) * per_unit);
            let qs = &q[(r * p.heads + h0) * hd..(r * p.heads + h0 + per_unit) * hd];
            let mut o = units[u].lock().unwrap_or_else(|e| e.into_inner());
            attend_heads(qs, &rows[r], h0 / group, p, &mut sc, &mut o);
        }
    };
    if work_size < SERIAL_WORK {
        work(0);
    } else {
        pool.run(&work);
    }
    drop(units);
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
        const AMP: f32 = 1.0;
        let be = CandleBackend::cpu();
        for (window, softcap, heads, kv_heads, head_dim) in [
            (None, None, 6, 2, 32),
            (Some(37), None, 9, 3, 64),
            (Some(20), Some(30.0), 4, 1, 256),
            (None, None, 14, 2, 80),
        ] {
            let p = AttentionParams {
                heads,
                kv_heads,
                head_dim,
                scale: 1.0 / (head_dim as f32).sqrt(),
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
                        noise(seed + 1, n * q_w)
                            .into_iter()
                            .map(|x| x * AMP)
                            .collect(),
                        noise(seed + 2, n * kv_w)
                            .into_iter()
                            .map(|x| x * AMP)
                            .collect(),
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
