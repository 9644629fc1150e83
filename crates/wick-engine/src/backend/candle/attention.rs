//! Causal (optionally sliding-window) grouped-query attention over paged host KV caches:
//! keys and values are read block by block through each sequence's block table.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use wick_kernels::{Isa, ThreadPool};

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::block_pool::{Avx2, Avx512};
use super::block_pool::{KvBlock, KvDtype, KvNumber, Portable, Simd, BLOCK_TOKENS};
use super::exp::exp_in_place;
use super::kv::CpuKvLayer;
use super::prefill_attention;
use super::prefill_bf16::Bf16Products;
use crate::backend::AttentionParams;

/// `out += w * v`
#[inline]
fn axpy<E: KvNumber>(out: &mut [f32], w: f32, v: &[E]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += w * x.to_f32();
    }
}

/// Blocks whose loads are started ahead of the one being computed.
const PREFETCH_AHEAD: usize = 4;

/// Calls `f(block, first_slot, n)` for each run of consecutive positions `from..to` that
/// lie in one block, and `warm(block)` on each block [`PREFETCH_AHEAD`] runs before `f`
/// reaches it (the first ones up front).
#[inline(always)]
fn for_each_run(
    cache: &CpuKvLayer,
    from: usize,
    to: usize,
    warm: impl Fn(&KvBlock),
    mut f: impl FnMut(&KvBlock, usize, usize),
) {
    // Runs after the first start on block boundaries.
    let run_start = |i: usize| (from - from % BLOCK_TOKENS) + i * BLOCK_TOKENS;
    for i in 0..PREFETCH_AHEAD {
        let pos = run_start(i).max(from);
        if pos < to {
            warm(cache.locate(pos).0);
        }
    }
    let mut pos = from;
    let mut i = 0;
    while pos < to {
        let ahead = run_start(i + PREFETCH_AHEAD);
        if ahead < to {
            warm(cache.locate(ahead).0);
        }
        let (block, slot) = cache.locate(pos);
        let n = (BLOCK_TOKENS - slot).min(to - pos);
        f(block, slot, n);
        pos += n;
        i += 1;
    }
}

/// Sixteen-wide lanes of the position-wise reductions (maximum, softmax sum).
const LANES: usize = 16;

/// Partial sums per score: dimension `d` goes to partial `d % PARTS`, and a score is
/// `(p0 + p1) + (p2 + p3)` plus the dimensions past the last multiple of `PARTS`, added
/// in order. Four partials are enough independent additions per head to keep the vector
/// adders busy while every key row is still loaded once, in memory order. Every path
/// (decode, prompt chunks, any batch) sums in this order, so a sequence gets the same
/// bits alone or batched.
const PARTS: usize = 4;

/// Query heads handled together: each key and value row is loaded once for all of them,
/// and their independent sums keep the vector units busy (four heads' accumulators still
/// fit the registers).
const MAX_GROUP: usize = 4;

/// `q · k` of `G` query heads (`qs`, `[G][hd]`) against every slot of a block's transposed
/// keys of one KV head (`kt`, `[hd][slot]`): sixteen-wide products across the slots, no
/// horizontal sums, in the [`PARTS`] order.
#[inline(always)]
fn block_scores<const G: usize, E: KvNumber, S: Simd>(
    simd: S,
    qs: &[f32],
    kt: &[E],
    hd: usize,
) -> [[f32; BLOCK_TOKENS]; G] {
    const { assert!(BLOCK_TOKENS == 16, "a key row is one sixteen-number load") };
    let main = hd - hd % PARTS;
    let q: [&[f32]; G] = std::array::from_fn(|g| &qs[g * hd..(g + 1) * hd]);
    let mut part = [[[0f32; BLOCK_TOKENS]; PARTS]; G];
    for (c, rows) in kt[..main * BLOCK_TOKENS]
        .chunks_exact(PARTS * BLOCK_TOKENS)
        .enumerate()
    {
        for (j, row) in rows.chunks_exact(BLOCK_TOKENS).enumerate() {
            let k = E::load16(simd, row);
            for (part, q) in part.iter_mut().zip(&q) {
                let qd = q[c * PARTS + j];
                for (a, &k) in part[j].iter_mut().zip(&k) {
                    *a += qd * k;
                }
            }
        }
    }
    let mut sum = [[0f32; BLOCK_TOKENS]; G];
    for ((sum, part), q) in sum.iter_mut().zip(&part).zip(&q) {
        for (i, s) in sum.iter_mut().enumerate() {
            *s = (part[0][i] + part[1][i]) + (part[2][i] + part[3][i]);
        }
        for d in main..hd {
            let k = E::load16(simd, &kt[d * BLOCK_TOKENS..]);
            for (s, &k) in sum.iter_mut().zip(&k) {
                *s += q[d] * k;
            }
        }
    }
    sum
}

/// Scaled (and soft-capped) scores of the `G` query heads `qs` for positions `lo .. hi`
/// into `scores` (`[G][n]`).
#[inline(always)]
fn group_scores<const G: usize, E: KvNumber, S: Simd>(
    simd: S,
    qs: &[f32],
    src: &RowSource<'_>,
    (lo, hi): (usize, usize),
    kvh: usize,
    p: &AttentionParams,
    scores: &mut [f32],
) {
    let hd = p.head_dim;
    let n = hi - lo;
    let mut t = 0;
    // The values follow the keys into the caches, so the value pass after the softmax
    // finds them there.
    let warm = |b: &KvBlock| {
        b.prefetch_head_keys(kvh, hd);
        b.prefetch_head_values(kvh, hd);
    };
    for_each_run(src.cache, lo, hi, warm, |block, slot, len| {
        let sums = block_scores::<G, E, S>(simd, qs, block.head_keys(kvh, hd), hd);
        for (g, sum) in sums.iter().enumerate() {
            let out = &mut scores[g * n + t..g * n + t + len];
            for (o, &a) in out.iter_mut().zip(&sum[slot..slot + len]) {
                let mut s = a * p.scale;
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                *o = s;
            }
        }
        t += len;
    });
}

/// Width of the value accumulators of one head: four vector registers.
const VALUE_TILE: usize = 64;

/// The first [`VALUE_TILE`] numbers of `v` as f32, sixteen per load.
#[inline(always)]
fn value_tile<E: KvNumber, S: Simd>(simd: S, v: &[E]) -> [f32; VALUE_TILE] {
    let mut tile = [0f32; VALUE_TILE];
    for (c, part) in tile.chunks_exact_mut(16).enumerate() {
        part.copy_from_slice(&E::load16(simd, &v[c * 16..]));
    }
    tile
}

/// `out[g] = Σ_t weights[g][t] · v_t` for the `G` heads, over positions `lo .. hi` of KV
/// head `kvh`; each value row is loaded once for all heads. Every output sums its terms in
/// position order from zero, as a plain loop would.
#[inline(always)]
fn group_values<const G: usize, E: KvNumber, S: Simd>(
    simd: S,
    weights: &[f32],
    src: &RowSource<'_>,
    (lo, hi): (usize, usize),
    kvh: usize,
    hd: usize,
    out: &mut [f32],
) {
    let n = hi - lo;
    let tiles = hd / VALUE_TILE;
    let mut t = 0;
    let warm = |b: &KvBlock| b.prefetch_head_values(kvh, hd);
    for_each_run(src.cache, lo, hi, warm, |block, slot, len| {
        let values: &[E] = block.head_values(kvh, hd, slot..slot + len);
        for tile in 0..tiles {
            let d0 = tile * VALUE_TILE;
            let mut acc: [[f32; VALUE_TILE]; G] = std::array::from_fn(|g| {
                out[g * hd + d0..g * hd + d0 + VALUE_TILE]
                    .try_into()
                    .expect("one value tile")
            });
            for (i, v) in values.chunks_exact(hd).enumerate() {
                let v = value_tile(simd, &v[d0..]);
                for (g, acc) in acc.iter_mut().enumerate() {
                    let wt = weights[g * n + t + i];
                    for (a, &x) in acc.iter_mut().zip(&v) {
                        *a += wt * x;
                    }
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                out[g * hd + d0..g * hd + d0 + VALUE_TILE].copy_from_slice(acc);
            }
        }
        let d0 = tiles * VALUE_TILE;
        if d0 < hd {
            for (i, v) in values.chunks_exact(hd).enumerate() {
                for g in 0..G {
                    let wt = weights[g * n + t + i];
                    axpy(&mut out[g * hd + d0..(g + 1) * hd], wt, &v[d0..]);
                }
            }
        }
        t += len;
    });
}

/// Divides one head's weights by their sum — multiplies by its inverse. The sum is taken
/// in [`LANES`] lanes (position `t` into lane `t % LANES`, up to the last multiple of
/// `LANES`), the lanes added in order, then the tail in order.
#[inline(always)]
fn normalize(weights: &mut [f32]) {
    let inv = 1.0 / lane_sum(weights);
    for w in weights {
        *w *= inv;
    }
}

/// The sum of `xs` in the [`normalize`] order.
#[inline(always)]
pub(super) fn lane_sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    let sum = lanes.iter().fold(0f32, |s, &l| s + l);
    chunks.remainder().iter().fold(sum, |s, &x| s + x)
}

/// The heads `0 .. heads` in runs of at most [`MAX_GROUP`], the runs that share loads.
fn head_groups(heads: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..heads)
        .step_by(MAX_GROUP)
        .map(move |h| h..(h + MAX_GROUP).min(heads))
}

/// Calls `$f::<G, $t, $s>(…)` with `G` the length (1 to [`MAX_GROUP`]) of the head run `$r`.
macro_rules! by_group {
    ($r:expr, $f:ident::<$t:ty, $s:ty>($($arg:expr),* $(,)?)) => {
        match $r.len() {
            4 => $f::<4, $t, $s>($($arg),*),
            3 => $f::<3, $t, $s>($($arg),*),
            2 => $f::<2, $t, $s>($($arg),*),
            _ => $f::<1, $t, $s>($($arg),*),
        }
    };
}

/// The largest of `xs` (−∞ when empty), sixteen lanes at a time: a maximum does not
/// depend on the order it is taken in.
#[inline(always)]
pub(super) fn max_of(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    lanes.iter().fold(tail, |m, &x| m.max(x))
}

/// Where one row of the batch reads from: its cache and its position.
pub(crate) struct RowSource<'a> {
    pub cache: &'a CpuKvLayer,
    pub pos: usize,
    /// The end (exclusive) of the keys the row sees: `pos + 1` for causal attention,
    /// further for a row inside a bidirectional block.
    pub end: usize,
}

/// Multiply-adds under which attention stays on the calling thread.
const SERIAL_WORK: usize = 1 << 15;

/// The instruction set attention runs on, chosen once per call of [`attend`]. Every set
/// computes the same operations in the same order (no fused multiply-adds, no reordered
/// sums), so all give the same bits; they differ only in vector width.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
}

impl Kernel {
    /// The kernel for the family `isa`, or the best smaller one this CPU has.
    pub(super) fn for_isa(isa: Isa) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if isa >= Isa::Avx512Vnni {
                if let Some(s) = Avx512::detect() {
                    return Kernel::Avx512(s);
                }
            }
            if isa >= Isa::Avx2 {
                if let Some(s) = Avx2::detect() {
                    return Kernel::Avx2(s);
                }
            }
        }
        let _ = isa;
        Kernel::Portable
    }
}

/// One job of the per-row kernel: the query heads `qs` (`[head][hd]`) of one row, all
/// reading KV head `kvh`, over the keys `span` (`lo .. hi`).
struct HeadsJob<'a, 'b> {
    qs: &'a [f32],
    src: &'a RowSource<'b>,
    kvh: usize,
    span: (usize, usize),
    /// For a piece of a split row: where each head's softmax maximum and sum go, the
    /// output left unnormalized for [`merge_pieces`]. `None`: the whole row, normalized.
    stats: Option<&'a mut [(f32, f32)]>,
}

/// Attention of one [`HeadsJob`], up to [`MAX_GROUP`] heads at a time sharing every key
/// and value load; `scores` is reused scratch. The body is compiled once per [`Kernel`],
/// each copy with its instruction set enabled, so the sixteen-wide loops become that
/// set's vector code whatever CPU the build targets.
fn attend_heads(
    kernel: Kernel,
    job: HeadsJob<'_, '_>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    match kernel {
        Kernel::Portable => attend_heads_on(Portable, job, p, scores, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx2` proves the CPU has AVX2, FMA and F16C.
        Kernel::Avx2(s) => unsafe { attend_heads_avx2(s, job, p, scores, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx512` proves the CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C.
        Kernel::Avx512(s) => unsafe { attend_heads_avx512(s, job, p, scores, out) },
    }
}

/// [`attend_heads`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_heads_avx2(
    simd: Avx2,
    job: HeadsJob<'_, '_>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_heads_on(simd, job, p, scores, out)
}

/// [`attend_heads`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn attend_heads_avx512(
    simd: Avx512,
    job: HeadsJob<'_, '_>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_heads_on(simd, job, p, scores, out)
}

/// [`attend_heads`] with the instructions of `simd`, inlined into its caller.
#[inline(always)]
fn attend_heads_on<S: Simd>(
    simd: S,
    job: HeadsJob<'_, '_>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    match job.src.cache.dtype {
        KvDtype::F32 => attend_heads_as::<f32, S>(simd, job, p, scores, out),
        KvDtype::F16 => attend_heads_as::<f16, S>(simd, job, p, scores, out),
    }
}

/// [`attend_heads`] over a cache storing numbers of type `E`.
#[inline(always)]
fn attend_heads_as<E: KvNumber, S: Simd>(
    simd: S,
    job: HeadsJob<'_, '_>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let HeadsJob {
        qs,
        src,
        kvh,
        span,
        mut stats,
    } = job;
    let hd = p.head_dim;
    let heads = qs.len() / hd;
    let n = span.1 - span.0;
    scores.clear();
    scores.resize(heads * n, 0.0);
    for r in head_groups(heads) {
        let (q, s) = (
            &qs[r.start * hd..r.end * hd],
            &mut scores[r.start * n..r.end * n],
        );
        by_group!(r, group_scores::<E, S>(simd, q, src, span, kvh, p, s));
    }
    for (h, weights) in scores.chunks_exact_mut(n).enumerate() {
        let max = max_of(weights);
        for s in weights.iter_mut() {
            *s -= max;
        }
        exp_in_place(weights);
        match stats.as_deref_mut() {
            Some(stats) => stats[h] = (max, lane_sum(weights)),
            None => normalize(weights),
        }
    }
    for r in head_groups(heads) {
        let (w, o) = (
            &scores[r.start * n..r.end * n],
            &mut out[r.start * hd..r.end * hd],
        );
        by_group!(r, group_values::<E, S>(simd, w, src, span, kvh, hd, o));
    }
}

/// The keys a row sees: from its window's start (or the cache's) to its end.
fn row_span(src: &RowSource<'_>, p: &AttentionParams) -> (usize, usize) {
    let lo = match p.window {
        Some(w) => (src.pos + 1).saturating_sub(w),
        None => 0,
    }
    .max(src.cache.start);
    (lo, src.end)
}

/// Rows that see at least this many keys are split over the threads in pieces.
const SPLIT_KEYS: usize = 1024;

/// Keys of one piece of a split row; pieces start at multiples of this position, so how
/// a row is split (and the bits of its result) depends only on the row, never on the
/// batch around it.
const PIECE_KEYS: usize = 512;

/// The pieces of `span`, cut at multiples of [`PIECE_KEYS`].
fn pieces((lo, hi): (usize, usize)) -> impl Iterator<Item = (usize, usize)> {
    let first = lo - lo % PIECE_KEYS;
    (first..hi)
        .step_by(PIECE_KEYS)
        .map(move |at| (at.max(lo), (at + PIECE_KEYS).min(hi)))
}

/// What one piece of a split row leaves for the merge: per head of its group the softmax
/// maximum and sum over the piece, and the unnormalized weighted values `[head][hd]`.
#[derive(Default)]
struct Partial {
    stats: Vec<(f32, f32)>,
    acc: Vec<f32>,
}

/// Combines the pieces of one split row's KV-head group, in position order, into `out`
/// (`[head][hd]`): each piece's values and sum scaled by `exp(its max − overall max)`.
fn merge_pieces(parts: &[Partial], hd: usize, out: &mut [f32]) {
    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
        let max = parts
            .iter()
            .fold(f32::NEG_INFINITY, |m, part| m.max(part.stats[h].0));
        o.fill(0.0);
        let mut total = 0f32;
        for part in parts {
            let (m, sum) = part.stats[h];
            let w = (m - max).exp();
            total += w * sum;
            axpy(o, w, &part.acc[h * hd..(h + 1) * hd]);
        }
        let inv = 1.0 / total;
        for x in o.iter_mut() {
            *x *= inv;
        }
    }
}

/// A work unit of [`attend`].
enum Unit {
    /// Query heads `h0 ..` (one [`attend`] slice's worth) of a whole row.
    Heads { row: usize, h0: usize },
    /// A piece of a split row: the query heads of KV head `kvh` over `span`, into partial
    /// `slot`.
    Piece {
        row: usize,
        kvh: usize,
        span: (usize, usize),
        slot: usize,
    },
}

/// Attention for every (row, head) on `pool`, with the kernels of the family `isa` (or
/// the best smaller one the CPU has); `q` is `[rows][heads][head_dim]`, the result too.
///
/// Runs of at least [`prefill_attention::MIN_ROWS`] prompt rows of one sequence go
/// through [`prefill_attention`]'s matrix products. Every other row is a work unit of
/// its query heads of one KV head (the group shares every key load), or a single head
/// when that leaves too few units for the threads; a row that sees [`SPLIT_KEYS`] keys
/// or more is cut into pieces per KV head, computed apart and merged, so a long decode
/// row keeps every thread busy.
pub(crate) fn attend(
    pool: &ThreadPool,
    isa: Isa,
    bf16_prompt: bool,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
) -> Vec<f32> {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let kernel = Kernel::for_isa(isa);
    // A recycled buffer: a fresh one would fault in (and the kernel zero) about 2 MB of
    // pages per layer of a 512-row prompt chunk. The heads accumulate into it.
    let mut out = super::tensor::buffer(q.len());
    out.fill(0.0);
    // Long runs of one sequence's prompt rows go through the matrix products.
    let runs = prefill_attention::chunk_runs(rows);
    let mut in_run = vec![false; rows.len()];
    for run in &runs {
        in_run[run.first..run.first + run.len].fill(true);
    }
    let single = in_run.iter().filter(|&&r| !r).count();
    let per_unit = if single * p.kv_heads >= 2 * pool.threads() {
        group
    } else {
        1
    };
    let mut units = Vec::new();
    let mut splits = Vec::new();
    let mut slots = 0;
    let mut work_size = 0;
    for (r, src) in rows.iter().enumerate() {
        if in_run[r] {
            continue;
        }
        let span = row_span(src, p);
        work_size += (span.1 - span.0) * p.heads * hd * 2;
        if span.1 - span.0 >= SPLIT_KEYS {
            for kvh in 0..p.kv_heads {
                let first = slots;
                for span in pieces(span) {
                    units.push(Unit::Piece {
                        row: r,
                        kvh,
                        span,
                        slot: slots,
                    });
                    slots += 1;
                }
                splits.push((r, kvh, first..slots));
            }
        } else {
            units.extend(
                (0..p.heads)
                    .step_by(per_unit)
                    .map(|h0| Unit::Heads { row: r, h0 }),
            );
        }
    }
    let partials: Vec<Mutex<Partial>> = (0..slots).map(|_| Mutex::default()).collect();
    let slices: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per_unit * hd).map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    let work = |_thread: usize| {
        let mut scores = Vec::new();
        loop {
            let u = next.fetch_add(1, Ordering::Relaxed);
            match units.get(u) {
                None => break,
                Some(&Unit::Heads { row, h0 }) => {
                    let qs = &q[(row * p.heads + h0) * hd..(row * p.heads + h0 + per_unit) * hd];
                    let src = &rows[row];
                    let job = HeadsJob {
                        qs,
                        src,
                        kvh: h0 / group,
                        span: row_span(src, p),
                        stats: None,
                    };
                    let mut o = slices[(row * p.heads + h0) / per_unit]
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    attend_heads(kernel, job, p, &mut scores, &mut o);
                }
                Some(&Unit::Piece {
                    row,
                    kvh,
                    span,
                    slot,
                }) => {
                    let h0 = kvh * group;
                    let mut part = Partial {
                        stats: vec![(0.0, 0.0); group],
                        acc: vec![0.0; group * hd],
                    };
                    let job = HeadsJob {
                        qs: &q[(row * p.heads + h0) * hd..(row * p.heads + h0 + group) * hd],
                        src: &rows[row],
                        kvh,
                        span,
                        stats: Some(&mut part.stats),
                    };
                    attend_heads(kernel, job, p, &mut scores, &mut part.acc);
                    *partials[slot].lock().unwrap_or_else(|e| e.into_inner()) = part;
                }
            }
        }
    };
    if units.is_empty() {
        // Every row is in a run.
    } else if work_size < SERIAL_WORK {
        work(0);
    } else {
        pool.run(&work);
    }
    drop(slices);
    let partials: Vec<Partial> = partials
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect();
    for (r, kvh, slots) in splits {
        let at = (r * p.heads + kvh * group) * hd;
        merge_pieces(&partials[slots], hd, &mut out[at..at + group * hd]);
    }
    if !runs.is_empty() {
        // bf16 products only beside the AVX-512 kernels (a backend asked for a smaller
        // family keeps that family's arithmetic).
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bf16_prompt;
        let bf16 = match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512(_) if bf16_prompt => Bf16Products::detect(isa),
            _ => None,
        };
        prefill_attention::attend_runs(pool, (kernel, bf16), q, rows, &runs, p, &mut out);
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backend::candle::{CandleBackend, HostTensor, KvDtype};
    use crate::backend::{AttentionSegment, Backend, KvLayer};

    /// Attention parameters with the usual `1/√head_dim` scale.
    fn params(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        softcap: Option<f32>,
    ) -> AttentionParams {
        AttentionParams {
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window,
            softcap,
        }
    }

    /// Deterministic values in `[-1, 1)`.
    pub(in crate::backend::candle) fn noise(seed: u64, n: usize) -> Vec<f32> {
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

    /// One head's attention at position `pos` of contiguous `[token][kv_head][hd]` keys and
    /// values in the order the kernels promise: each score's dimensions summed in four
    /// partials (dimension `d` into partial `d % 4`) combined as `(p0 + p1) + (p2 + p3)`,
    /// then the tail; the softmax sum in sixteen lanes (position `t` into lane `t % 16`)
    /// added in order, then its tail; values summed position by position from zero.
    fn ordered_reference(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        pos: usize,
        p: &AttentionParams,
    ) -> Vec<f32> {
        let hd = p.head_dim;
        let row = p.kv_heads * hd;
        let main = hd - hd % 4;
        let mut out = vec![0f32; p.heads * hd];
        for h in 0..p.heads {
            let kvh = h / (p.heads / p.kv_heads);
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let q = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f32> = (lo..=pos)
                .map(|j| {
                    let k = &keys[j * row + kvh * hd..][..hd];
                    let mut part = [0f32; 4];
                    for d in 0..main {
                        part[d % 4] += q[d] * k[d];
                    }
                    let mut sum = (part[0] + part[1]) + (part[2] + part[3]);
                    for d in main..hd {
                        sum += q[d] * k[d];
                    }
                    let mut s = sum * p.scale;
                    if let Some(cap) = p.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    s
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let main = weights.len() - weights.len() % 16;
            let mut lanes = [0f32; 16];
            for (t, w) in weights[..main].iter().enumerate() {
                lanes[t % 16] += w;
            }
            let total = weights[main..]
                .iter()
                .fold(lanes.iter().sum::<f32>(), |s, w| s + w);
            let inv = 1.0 / total;
            for (j, w) in (lo..=pos).zip(&weights) {
                let w = w * inv;
                let v = &values[j * row + kvh * hd..][..hd];
                for d in 0..hd {
                    out[h * hd + d] += w * v[d];
                }
            }
        }
        out
    }

    /// Grouped heads (one to four sharing each load, seven split four and three), head
    /// sizes with and without a tail past the four partials or a 64-wide value tile: every
    /// output is bit for bit the ordered reference's, for decode rows of several sequences
    /// and for a prompt chunk, on every instruction set this CPU has. (The chunks are
    /// shorter than [`prefill_attention::MIN_KEYS`], so they stay on the per-row kernel;
    /// the matrix products have their own test below.)
    #[test]
    fn grouped_heads_keep_the_promised_summation_order() {
        for isa in Isa::available() {
            for dtype in [KvDtype::F32, KvDtype::F16] {
                grouped_heads_in_order(isa, dtype);
            }
        }
    }

    fn grouped_heads_in_order(isa: Isa, dtype: KvDtype) {
        let be = CandleBackend::cpu().with_isa(isa).with_kv_dtype(dtype);
        // What the cache keeps of a number.
        let stored = |x: f32| match dtype {
            KvDtype::F32 => x,
            KvDtype::F16 => half::f16::from_f32(x).to_f32(),
        };
        for (heads, kv_heads, head_dim, window, softcap) in [
            (9, 3, 64, None, None),
            (14, 2, 64, None, None),
            (4, 1, 256, Some(40), Some(30.0)),
            (6, 6, 80, None, None),
            (8, 2, 24, None, None),
            (2, 1, 128, None, None),
            (3, 1, 18, None, None),
        ] {
            let p = params(heads, kv_heads, head_dim, window, softcap);
            let (q_w, kv_w) = (heads * head_dim, kv_heads * head_dim);
            let lens = [75usize, 33, 130];
            let data: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..lens.len())
                .map(|s| {
                    let n = lens[s];
                    let seed = 100 + 10 * s as u64;
                    (
                        noise(seed, n * q_w).iter().map(|x| 3.0 * x).collect(),
                        noise(seed + 1, n * kv_w).iter().map(|x| 3.0 * x).collect(),
                        noise(seed + 2, n * kv_w),
                    )
                })
                .collect();
            // The reference sees the keys and values as the cache stores them.
            let kept: Vec<(Vec<f32>, Vec<f32>)> = data
                .iter()
                .map(|(_, k, v)| {
                    (
                        k.iter().map(|&x| stored(x)).collect(),
                        v.iter().map(|&x| stored(x)).collect(),
                    )
                })
                .collect();
            let mut caches: Vec<CpuKvLayer> = lens
                .iter()
                .map(|_| be.new_kv_layer(kv_heads, head_dim, window))
                .collect();
            // A prompt chunk of all but the last token of each, then one decode row each.
            for last in [false, true] {
                let (mut q, mut k, mut v, mut rows) = (vec![], vec![], vec![], vec![]);
                for (s, &n) in lens.iter().enumerate() {
                    let span = if last { n - 1..n } else { 0..n - 1 };
                    let at = q.len() / q_w;
                    q.extend_from_slice(&data[s].0[span.start * q_w..span.end * q_w]);
                    k.extend_from_slice(&data[s].1[span.start * kv_w..span.end * kv_w]);
                    v.extend_from_slice(&data[s].2[span.start * kv_w..span.end * kv_w]);
                    rows.push((at..at + span.len(), span));
                }
                let total = q.len() / q_w;
                let out = {
                    let q = HostTensor::from_vec(q, total, q_w).unwrap();
                    let k = HostTensor::from_vec(k, total, kv_w).unwrap();
                    let v = HostTensor::from_vec(v, total, kv_w).unwrap();
                    let mut segments: Vec<AttentionSegment<'_, CpuKvLayer>> = caches
                        .iter_mut()
                        .zip(&rows)
                        .map(|(cache, (r, _))| AttentionSegment {
                            rows: r.clone(),
                            cache,
                        })
                        .collect();
                    be.attention(&q, &k, &v, &mut segments, &p).unwrap()
                };
                for (s, (r, span)) in rows.iter().enumerate() {
                    let (qs, (ks, vs)) = (&data[s].0, &kept[s]);
                    for (i, pos) in span.clone().enumerate() {
                        let want =
                            ordered_reference(&qs[pos * q_w..(pos + 1) * q_w], ks, vs, pos, &p);
                        let got = &out.data()[(r.start + i) * q_w..(r.start + i + 1) * q_w];
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} {dtype:?}: {heads}/{kv_heads} heads of {head_dim}, sequence {s} position {pos}"
                        );
                    }
                }
            }
        }
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
            let p = params(heads, kv_heads, head_dim, window, softcap);
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

    /// Prompt chunks long enough for the matrix products — a first chunk, then one after a
    /// prefix, with and without a sliding window and soft-capping, f32 and f16 caches, beside
    /// a decode row of another sequence in the same batch — match the f64 reference, and the
    /// per-row kernel (the same rows fed one at a time) within f32 rounding; with the bf16
    /// products (where the CPU has them), within bf16 rounding.
    #[test]
    fn long_prompt_chunks_match_the_reference_and_the_per_row_kernel() {
        let n = prefill_attention::MIN_KEYS + 2 * prefill_attention::MIN_ROWS + 30;
        let bf16 = super::Bf16Products::detect(Isa::best()).is_some();
        for (dtype, bf16) in [
            (KvDtype::F32, false),
            (KvDtype::F16, false),
            (KvDtype::F16, bf16),
        ] {
            // Operands rounded to 8 significant bits move these peaked softmaxes' outputs
            // (values in [−1, 1]) by about 1e-2.
            let bound = if bf16 { 3e-2 } else { 1e-5 };
            let be = CandleBackend::cpu()
                .with_kv_dtype(dtype)
                .with_bf16_prompt_attention(bf16);
            let stored = |x: f32| match dtype {
                KvDtype::F32 => x,
                KvDtype::F16 => half::f16::from_f32(x).to_f32(),
            };
            for (heads, kv_heads, head_dim, window, softcap) in [
                (14, 2, 64, None, None),
                (4, 1, 256, Some(150), Some(30.0)),
                (6, 3, 80, Some(40), None),
            ] {
                let p = params(heads, kv_heads, head_dim, window, softcap);
                let (q_w, kv_w) = (heads * head_dim, kv_heads * head_dim);
                let q: Vec<f32> = noise(7, n * q_w).iter().map(|x| 3.0 * x).collect();
                let k: Vec<f32> = noise(8, n * kv_w).iter().map(|x| 3.0 * x).collect();
                let v = noise(9, n * kv_w);
                let (k_kept, v_kept): (Vec<f32>, Vec<f32>) = (
                    k.iter().map(|&x| stored(x)).collect(),
                    v.iter().map(|&x| stored(x)).collect(),
                );
                // The other sequence: one earlier token, then a decode row.
                let other: Vec<f32> = noise(10, 2 * kv_w);
                let tensor =
                    |x: &[f32], w: usize| HostTensor::from_vec(x.to_vec(), x.len() / w, w).unwrap();
                let mut whole = be.new_kv_layer(kv_heads, head_dim, window);
                let mut rowwise = be.new_kv_layer(kv_heads, head_dim, window);
                let mut side = be.new_kv_layer(kv_heads, head_dim, window);
                be.attention(
                    &tensor(&noise(11, q_w), q_w),
                    &tensor(&other[..kv_w], kv_w),
                    &tensor(&other[..kv_w], kv_w),
                    &mut [AttentionSegment {
                        rows: 0..1,
                        cache: &mut side,
                    }],
                    &p,
                )
                .unwrap();
                let split = n - prefill_attention::MIN_ROWS - 7;
                let mut worst_ref = 0f32;
                let mut worst_row = 0f32;
                for span in [0..split, split..n] {
                    // The chunk, then the other sequence's decode row, in one batch.
                    let rows = span.len();
                    let mut qb = q[span.start * q_w..span.end * q_w].to_vec();
                    let mut kb = k[span.start * kv_w..span.end * kv_w].to_vec();
                    let mut vb = v[span.start * kv_w..span.end * kv_w].to_vec();
                    qb.extend(std::iter::repeat_n(0.5, q_w));
                    kb.extend_from_slice(&other[kv_w..]);
                    vb.extend_from_slice(&other[kv_w..]);
                    let out = be
                        .attention(
                            &tensor(&qb, q_w),
                            &tensor(&kb, kv_w),
                            &tensor(&vb, kv_w),
                            &mut [
                                AttentionSegment {
                                    rows: 0..rows,
                                    cache: &mut whole,
                                },
                                AttentionSegment {
                                    rows: rows..rows + 1,
                                    cache: &mut side,
                                },
                            ],
                            &p,
                        )
                        .unwrap();
                    for (i, pos) in span.clone().enumerate() {
                        let one = be
                            .attention(
                                &tensor(&q[pos * q_w..(pos + 1) * q_w], q_w),
                                &tensor(&k[pos * kv_w..(pos + 1) * kv_w], kv_w),
                                &tensor(&v[pos * kv_w..(pos + 1) * kv_w], kv_w),
                                &mut [AttentionSegment {
                                    rows: 0..1,
                                    cache: &mut rowwise,
                                }],
                                &p,
                            )
                            .unwrap();
                        let want =
                            reference(&q[pos * q_w..(pos + 1) * q_w], &k_kept, &v_kept, pos, &p);
                        let got = &out.data()[i * q_w..(i + 1) * q_w];
                        for ((a, b), c) in got.iter().zip(&want).zip(one.data()) {
                            worst_ref = worst_ref.max((a - b).abs());
                            worst_row = worst_row.max((a - c).abs());
                        }
                    }
                }
                assert!(
                    worst_ref <= bound && worst_row <= bound,
                    "{dtype:?} (bf16 {bf16}) {heads}/{kv_heads} heads of {head_dim}, window \
                     {window:?}: {worst_ref} from the reference, {worst_row} from the per-row \
                     kernel"
                );
                if bf16 && softcap.is_none() && head_dim % 64 == 0 {
                    // The bf16 products ran: they are not f32-exact.
                    assert!(worst_ref > 1e-5, "the bf16 products did not run");
                }
            }
        }
    }

    /// The bf16 products' attention (on AMX tiles where the CPU has them, and on AVX-512
    /// BF16 alone) with its fused softmax — masking, exponential, sum and rounding in one
    /// pass, masked blocks skipped, a row's shift raised only when a score passes it by
    /// far — against a plain f64 softmax over the same rounded operands: queries scaled
    /// and rounded to bf16, keys and values centred on their mean over the call's
    /// positions and rounded. Only the probabilities' own rounding to bf16 (at most 2⁻⁸ of
    /// each) is left, so no output may be further off than 2⁻⁸ of the largest centred
    /// value, plus f32 sums. Shapes: grouped query heads of 64 and 128 dimensions, sliding
    /// windows that begin inside the key tiles and the bands of rows, a first chunk and
    /// one after it, and keys whose scores pass every earlier row maximum by far (the
    /// last shape). Soft-capped models keep the f32 products (the test above covers them).
    #[test]
    fn long_prompt_bf16_softmax_matches_the_rounded_reference() {
        let mut families = vec![Isa::Avx512Vnni];
        if wick_kernels::amx::support().is_ok() {
            families.push(Isa::Amx);
        } else {
            eprintln!("AMX tile products skipped: the CPU cannot run tiles");
        }
        if super::Bf16Products::detect(Isa::Avx512Vnni).is_none() {
            eprintln!("skipped: the CPU has no AVX-512 BF16");
            return;
        }
        let bf = |x: f32| f64::from(half::bf16::from_f32(x).to_f32());
        let split = prefill_attention::MIN_KEYS;
        let n = split + 2 * prefill_attention::MIN_ROWS + 5;
        for isa in families {
            let be = CandleBackend::cpu()
                .with_isa(isa)
                .with_kv_dtype(KvDtype::F32)
                .with_bf16_prompt_attention(true);
            for (heads, kv_heads, hd, window, loud) in [
                (14, 2, 64, None, false),
                (8, 2, 128, Some(300), false),
                (4, 4, 64, Some(1001), true),
            ] {
                let p = params(heads, kv_heads, hd, window, None);
                let group = heads / kv_heads;
                let (q_w, kv_w) = (heads * hd, kv_heads * hd);
                // Queries share a part on their first 8 dimensions, which the loud keys
                // meet with a large one: their scores pass the others by about 120, past
                // where `exp` of the difference overflows f32.
                let q: Vec<f32> = noise(17, n * q_w)
                    .iter()
                    .enumerate()
                    .map(|(i, x)| 1.5 * x + if loud && i % hd < 8 { 1.0 } else { 0.0 })
                    .collect();
                // A bias on some dimensions, as models with biased key projections have.
                let k: Vec<f32> = noise(18, n * kv_w)
                    .iter()
                    .enumerate()
                    .map(|(i, x)| {
                        let (t, d) = (i / kv_w, i % hd);
                        let bias = if d < 4 { 20.0 } else { 0.0 };
                        let shout = if loud && d < 8 && t % 509 == 7 {
                            120.0
                        } else {
                            0.0
                        };
                        3.0 * x + bias + shout
                    })
                    .collect();
                let v = noise(19, n * kv_w);
                let tensor =
                    |x: &[f32], w: usize| HostTensor::from_vec(x.to_vec(), x.len() / w, w).unwrap();
                let mut cache = be.new_kv_layer(kv_heads, hd, window);
                let (mut worst, mut bound) = (0f64, 0f64);
                for span in [0..split, split..n] {
                    let out = be
                        .attention(
                            &tensor(&q[span.start * q_w..span.end * q_w], q_w),
                            &tensor(&k[span.start * kv_w..span.end * kv_w], kv_w),
                            &tensor(&v[span.start * kv_w..span.end * kv_w], kv_w),
                            &mut [AttentionSegment {
                                rows: 0..span.len(),
                                cache: &mut cache,
                            }],
                            &p,
                        )
                        .unwrap();
                    // The call's keys: from the first row's first one.
                    let first = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let from = first(span.start);
                    for kvh in 0..kv_heads {
                        // Centred on the mean over the call's keys, rounded: `[t − from][d]`.
                        let centred = |x: &[f32]| -> (Vec<f64>, Vec<f32>) {
                            let at = |t: usize, d: usize| x[t * kv_w + kvh * hd + d];
                            let mean: Vec<f32> = (0..hd)
                                .map(|d| {
                                    let s: f64 =
                                        (from..span.end).map(|t| f64::from(at(t, d))).sum();
                                    (s / (span.end - from) as f64) as f32
                                })
                                .collect();
                            let c = (from..span.end)
                                .flat_map(|t| (0..hd).map(move |d| (t, d)))
                                .map(|(t, d)| bf(at(t, d) - mean[d]))
                                .collect();
                            (c, mean)
                        };
                        let ((kc, _), (vc, vm)) = (centred(&k), centred(&v));
                        let largest = vc.iter().fold(0f64, |m, x| m.max(x.abs()));
                        bound = bound.max(largest / 256.0 + 1e-4);
                        for (i, pos) in span.clone().enumerate() {
                            for h in kvh * group..(kvh + 1) * group {
                                let qr: Vec<f64> = q[pos * q_w + h * hd..][..hd]
                                    .iter()
                                    .map(|&x| bf(x * p.scale))
                                    .collect();
                                let keys = first(pos) - from..pos + 1 - from;
                                let scores: Vec<f64> = keys
                                    .clone()
                                    .map(|t| qr.iter().zip(&kc[t * hd..]).map(|(a, b)| a * b).sum())
                                    .collect();
                                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                                let mut acc = vec![0f64; hd];
                                let mut sum = 0f64;
                                for (t, s) in keys.zip(&scores) {
                                    let w = (s - max).exp();
                                    sum += w;
                                    for (a, x) in acc.iter_mut().zip(&vc[t * hd..(t + 1) * hd]) {
                                        *a += w * x;
                                    }
                                }
                                for d in 0..hd {
                                    let want = acc[d] / sum + f64::from(vm[d]);
                                    let got = f64::from(out.data()[i * q_w + h * hd + d]);
                                    let off = (got - want).abs();
                                    // (NaN included.)
                                    if off.is_nan() || off > worst {
                                        worst = off;
                                    }
                                }
                            }
                        }
                    }
                }
                assert!(
                    worst <= bound,
                    "{isa:?} {heads}/{kv_heads} heads of {hd}, window {window:?}: {worst} from \
                     the rounded reference (bound {bound})"
                );
                eprintln!("{isa:?} {heads}/{kv_heads}x{hd} window {window:?}: {worst:.2e} (bound {bound:.2e})");
            }
        }
    }

    /// Decode rows that see more than [`SPLIT_KEYS`] keys are cut into pieces and merged:
    /// they match the f64 reference (with and without a window whose start falls inside a
    /// piece), and a row gives the same bits alone and beside another sequence's row.
    #[test]
    fn split_decode_rows_match_the_reference_alone_or_batched() {
        let n = SPLIT_KEYS + PIECE_KEYS + 37;
        for window in [None, Some(SPLIT_KEYS + 100)] {
            let be = CandleBackend::cpu().with_kv_dtype(KvDtype::F32);
            let p = AttentionParams {
                heads: 14,
                kv_heads: 2,
                head_dim: 64,
                scale: 0.125,
                window,
                softcap: None,
            };
            let (q_w, kv_w) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
            let q: Vec<f32> = noise(21, n * q_w).iter().map(|x| 3.0 * x).collect();
            let k: Vec<f32> = noise(22, n * kv_w).iter().map(|x| 3.0 * x).collect();
            let v = noise(23, n * kv_w);
            let tensor =
                |x: &[f32], w: usize| HostTensor::from_vec(x.to_vec(), x.len() / w, w).unwrap();
            let mut alone = be.new_kv_layer(p.kv_heads, p.head_dim, window);
            let mut batched = be.new_kv_layer(p.kv_heads, p.head_dim, window);
            let mut other = be.new_kv_layer(p.kv_heads, p.head_dim, window);
            let prompt = n - 3;
            for cache in [&mut alone, &mut batched] {
                be.attention(
                    &tensor(&q[..prompt * q_w], q_w),
                    &tensor(&k[..prompt * kv_w], kv_w),
                    &tensor(&v[..prompt * kv_w], kv_w),
                    &mut [AttentionSegment {
                        rows: 0..prompt,
                        cache,
                    }],
                    &p,
                )
                .unwrap();
            }
            let mut worst = 0f32;
            for pos in prompt..n {
                let (qr, kr, vr) = (
                    &q[pos * q_w..(pos + 1) * q_w],
                    &k[pos * kv_w..(pos + 1) * kv_w],
                    &v[pos * kv_w..(pos + 1) * kv_w],
                );
                let one = be
                    .attention(
                        &tensor(qr, q_w),
                        &tensor(kr, kv_w),
                        &tensor(vr, kv_w),
                        &mut [AttentionSegment {
                            rows: 0..1,
                            cache: &mut alone,
                        }],
                        &p,
                    )
                    .unwrap();
                let two = be
                    .attention(
                        &tensor(&[qr, qr].concat(), q_w),
                        &tensor(&[kr, kr].concat(), kv_w),
                        &tensor(&[vr, vr].concat(), kv_w),
                        &mut [
                            AttentionSegment {
                                rows: 0..1,
                                cache: &mut other,
                            },
                            AttentionSegment {
                                rows: 1..2,
                                cache: &mut batched,
                            },
                        ],
                        &p,
                    )
                    .unwrap();
                assert_eq!(
                    one.data(),
                    &two.data()[q_w..],
                    "alone and batched differ at {pos}"
                );
                let want = reference(qr, &k, &v, pos, &p);
                for (a, b) in one.data().iter().zip(&want) {
                    worst = worst.max((a - b).abs());
                }
            }
            assert!(
                worst <= 1e-5,
                "window {window:?}: {worst} from the reference"
            );
        }
    }
}
