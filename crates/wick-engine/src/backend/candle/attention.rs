//! Causal (optionally sliding-window) grouped-query attention over paged host KV caches,
//! flash-style: keys and values are read block by block through each sequence's block
//! table, and a softmax kept online (running maximum, running sum, rescaled accumulators)
//! folds them in without ever holding a row's scores.
//!
//! A prompt chunk is cut into tiles of [`TILE_ROWS`] consecutive query rows; every query
//! head of a tile that reads one KV head shares each block of keys and values, converted to
//! f32 once for all of them, and blocks no row of the tile may see (the causal triangle,
//! the part outside a sliding window) are never read. A decode row has one query row to
//! share loads with, so its history is split into [`SPLIT_TOKENS`]-position pieces computed
//! on different threads, then merged.
//!
//! Every row, whatever path computes it, sums in the same order: the positions `lo ..= pos`
//! it sees are cut at multiples of [`SPLIT_TOKENS`] into splits and at block boundaries into
//! runs; each split starts a fresh online softmax, fed run by run in position order, and the
//! splits are merged left to right. So a row's bits depend on its position and its cache
//! only, never on the batch, the tile it lands in, the chunking of its prompt or the thread
//! count — Gemma 3 and Qwen 2.5 re-quantize activations between layers and amplify last-bit
//! differences. Products and sums are separate operations (no fused multiply-adds, which
//! LLVM does not vectorize from these loops), so the AVX-512, AVX2 and portable bodies
//! give the same bits.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use wick_kernels::{Isa, ThreadPool};

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::block_pool::{Avx2, Avx512};
use super::block_pool::{KvBlock, KvDtype, KvNumber, Portable, Simd, BLOCK_TOKENS};
use super::exp::exp_in_place;
use super::kv::CpuKvLayer;
use crate::backend::AttentionParams;

/// Blocks whose loads are started ahead of the one being computed (blocks are separate
/// allocations, so the hardware prefetcher stops at each one's end).
const PREFETCH_AHEAD: usize = 4;

/// Positions of one split: the online softmax restarts at every multiple, so a decode row's
/// history can be computed a split per thread and merged, in the order prompt tiles merge
/// theirs. 256 keeps a merge (two exponentials and a pass over the accumulators) under 1%
/// of a split's work and gives 32 pieces per KV head to share out at 8k tokens.
const SPLIT_TOKENS: usize = 256;
const _: () = assert!(
    SPLIT_TOKENS.is_multiple_of(BLOCK_TOKENS),
    "a block lies in one split"
);

/// Query rows of one prompt tile: each key and value block is converted and loaded once for
/// `TILE_ROWS ×` (query heads per KV head) query vectors, whose running states (a few tens
/// of KiB) stay in the core's L2 cache.
const TILE_ROWS: usize = 32;

/// Partial sums per score: dimension `d` goes to partial `d % PARTS`, and a score is
/// `(p0 + p1) + (p2 + p3)` plus the dimensions past the last multiple of `PARTS`, added
/// in order. With [`MAX_GROUP`] query vectors that makes sixteen independent chains of
/// additions, enough to keep the vector adders busy.
const PARTS: usize = 4;

/// Query vectors scored together against a block: each key row is loaded once for all of
/// them (their partials fill sixteen vector registers).
const MAX_GROUP: usize = 4;

/// Width of the value accumulators of one query vector: four vector registers.
const VALUE_TILE: usize = 64;

/// `q · k` of `G` query vectors (`qs`, `[G][hd]`) against every slot of a block's
/// transposed keys of one KV head (`kt`, `[hd][slot]`, as f32): sixteen-wide products
/// across the slots, no horizontal sums, in the [`PARTS`] order.
#[inline(always)]
fn block_scores<const G: usize>(qs: &[f32], kt: &[f32], hd: usize) -> [[f32; BLOCK_TOKENS]; G] {
    const { assert!(BLOCK_TOKENS == 16, "a key row is one sixteen-number load") };
    let main = hd - hd % PARTS;
    let q: [&[f32]; G] = std::array::from_fn(|g| &qs[g * hd..(g + 1) * hd]);
    let mut part = [[[0f32; BLOCK_TOKENS]; PARTS]; G];
    for (c, rows) in kt[..main * BLOCK_TOKENS]
        .chunks_exact(PARTS * BLOCK_TOKENS)
        .enumerate()
    {
        for (j, row) in rows.chunks_exact(BLOCK_TOKENS).enumerate() {
            let k: &[f32; BLOCK_TOKENS] = row.try_into().expect("one key row");
            for (part, q) in part.iter_mut().zip(&q) {
                let qd = q[c * PARTS + j];
                for (a, &k) in part[j].iter_mut().zip(k) {
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
            let k = &kt[d * BLOCK_TOKENS..(d + 1) * BLOCK_TOKENS];
            for (s, &k) in sum.iter_mut().zip(k) {
                *s += q[d] * k;
            }
        }
    }
    sum
}

/// The largest of `xs` (−∞ when empty): a maximum does not depend on the order it is
/// taken in.
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// Online-softmax states of some query vectors: running maximum `m`, running sum of
/// `exp(s − m)` `l`, and the accumulators `Σ exp(s − m) · v` (`[vector][hd]`).
#[derive(Default)]
struct State {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

impl State {
    /// `n` empty states of `hd` accumulators.
    fn reset(&mut self, n: usize, hd: usize) {
        self.m.clear();
        self.m.resize(n, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(n, 0.0);
        self.acc.clear();
        self.acc.resize(n * hd, 0.0);
    }

    /// Merges `part` into `self`, vector by vector: both are rescaled to the larger
    /// maximum. An empty side (maximum −∞) leaves the other's bits as they are.
    fn merge(&mut self, part: &State, hd: usize) {
        for v in 0..self.m.len() {
            let (m1, m2) = (self.m[v], part.m[v]);
            if m2 == f32::NEG_INFINITY {
                continue;
            }
            let m = m1.max(m2);
            let mut f = [m1 - m, m2 - m];
            exp_in_place(&mut f);
            self.m[v] = m;
            self.l[v] = self.l[v] * f[0] + part.l[v] * f[1];
            let acc = &mut self.acc[v * hd..(v + 1) * hd];
            for (a, &b) in acc.iter_mut().zip(&part.acc[v * hd..(v + 1) * hd]) {
                *a = *a * f[0] + b * f[1];
            }
        }
    }

    /// The attention outputs, `acc / l`, into `out` (`[vector][hd]`).
    fn finish(&self, hd: usize, out: &mut [f32]) {
        for (v, out) in out.chunks_exact_mut(hd).enumerate() {
            let inv = 1.0 / self.l[v];
            for (o, &a) in out.iter_mut().zip(&self.acc[v * hd..(v + 1) * hd]) {
                *o = a * inv;
            }
        }
    }
}

/// Folds one block into the states of `G` consecutive query vectors: `keys` (`[hd][slot]`)
/// and `values` (`[slot][hd]`) as f32, vector `g` seeing the slots `seen[g]` (a range within
/// `slots`, the union; slots outside a vector's range weigh exactly zero).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fold_block<const G: usize>(
    qs: &[f32],
    keys: &[f32],
    values: &[f32],
    slots: (usize, usize),
    seen: [(usize, usize); G],
    p: &AttentionParams,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let hd = p.head_dim;
    let sums = block_scores::<G>(qs, keys, hd);
    let mut w = [[f32::NEG_INFINITY; BLOCK_TOKENS]; G];
    let mut alpha = [0f32; G];
    for g in 0..G {
        let (a, b) = seen[g];
        for (o, &s) in w[g][a..b].iter_mut().zip(&sums[g][a..b]) {
            let mut s = s * p.scale;
            if let Some(cap) = p.softcap {
                s = cap * (s / cap).tanh();
            }
            *o = s;
        }
        let mn = m[g].max(max_of(&w[g][a..b]));
        alpha[g] = m[g] - mn;
        m[g] = mn;
        for s in &mut w[g] {
            *s -= mn;
        }
    }
    // Scores minus the new maximum (−∞ where unseen, giving 0), then the rescale factors.
    exp_in_place(w.as_flattened_mut());
    exp_in_place(&mut alpha);
    let (t0, t1) = slots;
    for g in 0..G {
        let s = w[g][t0..t1].iter().fold(0f32, |s, &x| s + x);
        l[g] = l[g] * alpha[g] + s;
    }
    let tiles = hd / VALUE_TILE;
    for tile in 0..tiles {
        let d0 = tile * VALUE_TILE;
        let mut a: [[f32; VALUE_TILE]; G] = std::array::from_fn(|g| {
            let mut a: [f32; VALUE_TILE] = acc[g * hd + d0..g * hd + d0 + VALUE_TILE]
                .try_into()
                .expect("one value tile");
            for x in &mut a {
                *x *= alpha[g];
            }
            a
        });
        for t in t0..t1 {
            let v: &[f32; VALUE_TILE] = values[t * hd + d0..t * hd + d0 + VALUE_TILE]
                .try_into()
                .expect("one value tile");
            for (a, w) in a.iter_mut().zip(&w) {
                let wt = w[t];
                for (x, &v) in a.iter_mut().zip(v) {
                    *x += wt * v;
                }
            }
        }
        for (g, a) in a.iter().enumerate() {
            acc[g * hd + d0..g * hd + d0 + VALUE_TILE].copy_from_slice(a);
        }
    }
    let d0 = tiles * VALUE_TILE;
    if d0 < hd {
        for g in 0..G {
            let a = &mut acc[g * hd + d0..(g + 1) * hd];
            for x in a.iter_mut() {
                *x *= alpha[g];
            }
            for t in t0..t1 {
                let wt = w[g][t];
                for (x, &v) in a.iter_mut().zip(&values[t * hd + d0..(t + 1) * hd]) {
                    *x += wt * v;
                }
            }
        }
    }
}

/// Where one row of the batch reads from: its cache and its position.
pub(crate) struct RowSource<'a> {
    pub cache: &'a CpuKvLayer,
    pub pos: usize,
}

/// The positions `lo .. hi` the row at `src` attends to.
fn span(src: &RowSource<'_>, p: &AttentionParams) -> (usize, usize) {
    let hi = src.pos + 1;
    let lo = match p.window {
        Some(w) => hi.saturating_sub(w),
        None => 0,
    }
    .max(src.cache.start);
    (lo, hi)
}

/// One piece of the work: the query heads of KV head `kvh` of rows `row .. row + rows`
/// (consecutive positions of one sequence), over every split of their history
/// (`split: None`, normalized outputs) or over split `split` only (an unnormalized state,
/// merged after the threads are done).
#[derive(Debug, Clone, Copy)]
struct Unit {
    row: usize,
    rows: usize,
    kvh: usize,
    split: Option<usize>,
    /// Keys × rows, to hand out the largest pieces first.
    work: usize,
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    split: State,
    total: State,
}

/// `src` as f32: borrowed when the cache stores f32, converted into `buf` otherwise.
#[inline(always)]
fn as_f32<'a, E: KvNumber, S: Simd>(simd: S, src: &'a [E], buf: &'a mut Vec<f32>) -> &'a [f32] {
    if let Some(x) = E::as_f32(src) {
        return x;
    }
    buf.resize(src.len(), 0.0);
    for (o, c) in buf.chunks_exact_mut(16).zip(src.chunks_exact(16)) {
        o.copy_from_slice(&E::load16(simd, c));
    }
    buf
}

/// Folds split `split` of the history into `state` for the query vectors of `rows`
/// (all reading one cache, at consecutive positions, `group` vectors a row from `q`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fold_split<E: KvNumber, S: Simd>(
    simd: S,
    rows: &[RowSource<'_>],
    kvh: usize,
    split: usize,
    p: &AttentionParams,
    q: &[f32],
    (keys_buf, values_buf): (&mut Vec<f32>, &mut Vec<f32>),
    state: &mut State,
) {
    let hd = p.head_dim;
    let group = q.len() / (rows.len() * hd);
    let spans: Vec<(usize, usize)> = rows.iter().map(|r| span(r, p)).collect();
    let cache = rows[0].cache;
    let (lo, hi) = (spans[0].0, spans[spans.len() - 1].1);
    let from = (split * SPLIT_TOKENS).max(lo - lo % BLOCK_TOKENS);
    let to = ((split + 1) * SPLIT_TOKENS).min(hi);
    let warm = |pos: usize| {
        if pos < hi {
            let b = cache.locate(pos).0;
            b.prefetch_head_keys(kvh, hd);
            b.prefetch_head_values(kvh, hd);
        }
    };
    for i in 0..PREFETCH_AHEAD {
        warm(from + i * BLOCK_TOKENS);
    }
    let mut b0 = from;
    while b0 < to {
        warm(b0 + PREFETCH_AHEAD * BLOCK_TOKENS);
        let b1 = (b0 + BLOCK_TOKENS).min(to);
        // What each row sees of this block, as slots; rows that see none are skipped.
        let seen = |i: usize| {
            let (a, b) = spans[i];
            (a.max(b0), b.min(b1))
        };
        let first = (0..rows.len()).find(|&i| seen(i).0 < seen(i).1);
        let Some(first) = first else {
            b0 += BLOCK_TOKENS;
            continue;
        };
        let last = (first..rows.len())
            .take_while(|&i| seen(i).0 < seen(i).1)
            .last()
            .unwrap_or(first);
        let block: &KvBlock = cache.locate(b0).0;
        let keys = as_f32(simd, block.head_keys::<E>(kvh, hd), keys_buf);
        let values = as_f32(
            simd,
            block.head_values::<E>(kvh, hd, 0..BLOCK_TOKENS),
            values_buf,
        );
        let slots = (seen(first).0 - b0, seen(last).1 - b0);
        let vectors = first * group..(last + 1) * group;
        for v0 in vectors.clone().step_by(MAX_GROUP) {
            let r = v0..(v0 + MAX_GROUP).min(vectors.end);
            let seen_of = |g: usize| {
                let (a, b) = seen((v0 + g) / group);
                (a - b0, b - b0)
            };
            let qs = &q[r.start * hd..r.end * hd];
            let (m, l) = (&mut state.m[r.clone()], &mut state.l[r.clone()]);
            let acc = &mut state.acc[r.start * hd..r.end * hd];
            macro_rules! fold {
                ($g:literal) => {
                    fold_block::<$g>(
                        qs,
                        keys,
                        values,
                        slots,
                        std::array::from_fn(seen_of),
                        p,
                        m,
                        l,
                        acc,
                    )
                };
            }
            match r.len() {
                4 => fold!(4),
                3 => fold!(3),
                2 => fold!(2),
                _ => fold!(1),
            }
        }
        b0 += BLOCK_TOKENS;
    }
}

/// Computes `unit` into `out`: normalized outputs `[row][head][hd]` of its heads, or the
/// split's state (`[vector][hd]` accumulators, then the maxima, then the sums).
#[inline(always)]
fn run_unit_as<E: KvNumber, S: Simd>(
    simd: S,
    unit: Unit,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [f32],
) {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let rows = &rows[unit.row..unit.row + unit.rows];
    s.q.clear();
    for i in 0..unit.rows {
        let at = ((unit.row + i) * p.heads + unit.kvh * group) * hd;
        s.q.extend_from_slice(&q[at..at + group * hd]);
    }
    let n = unit.rows * group;
    match unit.split {
        Some(split) => {
            s.split.reset(n, hd);
            let bufs = (&mut s.keys, &mut s.values);
            fold_split::<E, S>(simd, rows, unit.kvh, split, p, &s.q, bufs, &mut s.split);
            let (acc, rest) = out.split_at_mut(n * hd);
            acc.copy_from_slice(&s.split.acc);
            rest[..n].copy_from_slice(&s.split.m);
            rest[n..2 * n].copy_from_slice(&s.split.l);
        }
        None => {
            let (lo, hi) = (span(&rows[0], p).0, span(&rows[rows.len() - 1], p).1);
            s.total.reset(n, hd);
            for split in lo / SPLIT_TOKENS..hi.div_ceil(SPLIT_TOKENS) {
                s.split.reset(n, hd);
                let bufs = (&mut s.keys, &mut s.values);
                fold_split::<E, S>(simd, rows, unit.kvh, split, p, &s.q, bufs, &mut s.split);
                s.total.merge(&s.split, hd);
            }
            s.total.finish(hd, out);
        }
    }
}

/// [`run_unit`] with the instructions of `simd`, inlined into its caller.
#[inline(always)]
fn run_unit_on<S: Simd>(
    simd: S,
    unit: Unit,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [f32],
) {
    match rows[unit.row].cache.dtype {
        KvDtype::F32 => run_unit_as::<f32, S>(simd, unit, q, rows, p, s, out),
        KvDtype::F16 => run_unit_as::<f16, S>(simd, unit, q, rows, p, s, out),
    }
}

/// Multiply-adds under which attention stays on the calling thread.
const SERIAL_WORK: usize = 1 << 15;

/// The instruction set attention runs on, chosen once per call of [`attend`]. Every set
/// computes the same operations in the same order (no fused multiply-adds, no reordered
/// sums), so all give the same bits; they differ only in vector width.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
}

impl Kernel {
    /// The kernel for the family `isa`, or the best smaller one this CPU has.
    fn for_isa(isa: Isa) -> Kernel {
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

/// Computes one [`Unit`] into `out`. The body is compiled once per [`Kernel`], each copy
/// with its instruction set enabled, so the sixteen-wide loops become that set's vector
/// code whatever CPU the build targets.
fn run_unit(
    kernel: Kernel,
    unit: Unit,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [f32],
) {
    match kernel {
        Kernel::Portable => run_unit_on(Portable, unit, q, rows, p, s, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx2` proves the CPU has AVX2, FMA and F16C.
        Kernel::Avx2(simd) => unsafe { run_unit_avx2(simd, unit, q, rows, p, s, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx512` proves the CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C.
        Kernel::Avx512(simd) => unsafe { run_unit_avx512(simd, unit, q, rows, p, s, out) },
    }
}

/// [`run_unit`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_unit_avx2(
    simd: Avx2,
    unit: Unit,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [f32],
) {
    run_unit_on(simd, unit, q, rows, p, s, out)
}

/// [`run_unit`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn run_unit_avx512(
    simd: Avx512,
    unit: Unit,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [f32],
) {
    run_unit_on(simd, unit, q, rows, p, s, out)
}

/// The work units of a batch: each run of consecutive positions of one sequence is cut
/// into prompt tiles of up to [`TILE_ROWS`] rows; a lone row (a decode step) is cut into
/// its splits instead, so long histories spread over the threads. Largest first.
fn plan(rows: &[RowSource<'_>], p: &AttentionParams) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut r = 0;
    while r < rows.len() {
        let mut n = 1;
        while n < TILE_ROWS
            && r + n < rows.len()
            && std::ptr::eq(rows[r + n].cache, rows[r].cache)
            && rows[r + n].pos == rows[r].pos + n
        {
            n += 1;
        }
        let (lo, hi) = (span(&rows[r], p).0, span(&rows[r + n - 1], p).1);
        for kvh in 0..p.kv_heads {
            if n == 1 {
                for split in lo / SPLIT_TOKENS..hi.div_ceil(SPLIT_TOKENS) {
                    let keys = hi.min((split + 1) * SPLIT_TOKENS) - lo.max(split * SPLIT_TOKENS);
                    units.push(Unit {
                        row: r,
                        rows: 1,
                        kvh,
                        split: Some(split),
                        work: keys,
                    });
                }
            } else {
                units.push(Unit {
                    row: r,
                    rows: n,
                    kvh,
                    split: None,
                    work: (hi - lo) * n,
                });
            }
        }
        r += n;
    }
    units.sort_by_key(|u| std::cmp::Reverse(u.work));
    units
}

/// Numbers a unit writes: outputs of its heads, or a split's accumulators, maxima and sums.
fn unit_len(u: &Unit, p: &AttentionParams) -> usize {
    let n = u.rows * (p.heads / p.kv_heads);
    match u.split {
        Some(_) => n * (p.head_dim + 2),
        None => n * p.head_dim,
    }
}

/// Attention for every (row, head) on `pool`, with the kernels of the family `isa` (or
/// the best smaller one the CPU has); `q` is `[rows][heads][head_dim]`, the result too.
pub(crate) fn attend(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    rows: &[RowSource<'_>],
    p: &AttentionParams,
) -> Vec<f32> {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let kernel = Kernel::for_isa(isa);
    let units = plan(rows, p);
    let lens: Vec<usize> = units.iter().map(|u| unit_len(u, p)).collect();
    let mut results = vec![0f32; lens.iter().sum()];
    let work_size = units.iter().map(|u| u.work).sum::<usize>() * group * hd * 2;
    {
        let mut slots = Vec::with_capacity(units.len());
        let mut rest = results.as_mut_slice();
        for &len in &lens {
            let (slot, tail) = rest.split_at_mut(len);
            slots.push(Mutex::new(slot));
            rest = tail;
        }
        let next = AtomicUsize::new(0);
        let work = |_thread: usize| {
            let mut scratch = Scratch::default();
            loop {
                let u = next.fetch_add(1, Ordering::Relaxed);
                if u >= units.len() {
                    break;
                }
                let mut out = slots[u].lock().unwrap_or_else(|e| e.into_inner());
                run_unit(kernel, units[u], q, rows, p, &mut scratch, &mut out);
            }
        };
        if work_size < SERIAL_WORK {
            work(0);
        } else {
            pool.run(&work);
        }
    }
    // Scatter the tiles' outputs; merge each decode row's splits left to right.
    let mut out = vec![0f32; q.len()];
    let mut offsets = Vec::with_capacity(units.len());
    let mut at = 0;
    for &len in &lens {
        offsets.push(at);
        at += len;
    }
    let mut splits: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        let data = &results[offsets[i]..offsets[i] + lens[i]];
        match u.split {
            None => {
                for r in 0..u.rows {
                    let at = ((u.row + r) * p.heads + u.kvh * group) * hd;
                    out[at..at + group * hd]
                        .copy_from_slice(&data[r * group * hd..(r + 1) * group * hd]);
                }
            }
            Some(split) => splits.push((u.row, u.kvh, split, i)),
        }
    }
    splits.sort_unstable();
    let (mut total, mut part) = (State::default(), State::default());
    for run in splits.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
        let (row, kvh) = (run[0].0, run[0].1);
        total.reset(group, hd);
        for &(_, _, _, i) in run {
            let data = &results[offsets[i]..offsets[i] + lens[i]];
            let (acc, rest) = data.split_at(group * hd);
            part.acc.clear();
            part.acc.extend_from_slice(acc);
            part.m.clear();
            part.m.extend_from_slice(&rest[..group]);
            part.l.clear();
            part.l.extend_from_slice(&rest[group..]);
            total.merge(&part, hd);
        }
        let at = (row * p.heads + kvh * group) * hd;
        total.finish(hd, &mut out[at..at + group * hd]);
    }
    out
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::candle::{CandleBackend, HostTensor, KvDtype};
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

    /// One row's attention at position `pos` of contiguous `[token][kv_head][hd]` keys and
    /// values in the order the kernels promise, head by head: the positions `lo ..= pos`
    /// cut into splits of [`SPLIT_TOKENS`] and those into runs at block boundaries; each
    /// split an online softmax from scratch, fed run by run (scores with four partial sums,
    /// dimension `d` into partial `d % 4`, combined as `(p0 + p1) + (p2 + p3)`, then the
    /// tail; the run's maximum taken into the running one; sums and accumulators rescaled
    /// by `exp(old − new)`, then the run's weights added in position order, the sum from
    /// zero); splits merged left to right; the accumulators times `1 / sum` at the end.
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
        let exp = |x: f32| x.exp();
        let mut out = vec![0f32; p.heads * hd];
        for h in 0..p.heads {
            let kvh = h / (p.heads / p.kv_heads);
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let q = &q[h * hd..(h + 1) * hd];
            let score = |j: usize| {
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
            };
            let (mut tm, mut tl, mut ta) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
            for split in lo / SPLIT_TOKENS..=pos / SPLIT_TOKENS {
                let (from, to) = (
                    lo.max(split * SPLIT_TOKENS),
                    (pos + 1).min((split + 1) * SPLIT_TOKENS),
                );
                let (mut m, mut l, mut a) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
                let mut run = from;
                while run < to {
                    let end = (run - run % BLOCK_TOKENS + BLOCK_TOKENS).min(to);
                    let scores: Vec<f32> = (run..end).map(score).collect();
                    let mn = scores.iter().fold(m, |m, &s| m.max(s));
                    let alpha = exp(m - mn);
                    m = mn;
                    let w: Vec<f32> = scores.iter().map(|&s| exp(s - mn)).collect();
                    l = l * alpha + w.iter().fold(0f32, |s, &x| s + x);
                    for x in a.iter_mut() {
                        *x *= alpha;
                    }
                    for (j, &w) in (run..end).zip(&w) {
                        let v = &values[j * row + kvh * hd..][..hd];
                        for d in 0..hd {
                            a[d] += w * v[d];
                        }
                    }
                    run = end;
                }
                let mn = tm.max(m);
                let (f1, f2) = (exp(tm - mn), exp(m - mn));
                tm = mn;
                tl = tl * f1 + l * f2;
                for (x, &y) in ta.iter_mut().zip(&a) {
                    *x = *x * f1 + y * f2;
                }
            }
            let inv = 1.0 / tl;
            for d in 0..hd {
                out[h * hd + d] = ta[d] * inv;
            }
        }
        out
    }

    /// Grouped heads (one to four sharing each load, seven split four and three), head
    /// sizes with and without a tail past the four partials or a 64-wide value tile: every
    /// output is bit for bit the ordered reference's, for decode rows of several sequences
    /// and for a prompt chunk, on every instruction set this CPU has.
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
            let p = AttentionParams {
                heads,
                kv_heads,
                head_dim,
                scale: 1.0 / (head_dim as f32).sqrt(),
                window,
                softcap,
            };
            let (q_w, kv_w) = (heads * head_dim, kv_heads * head_dim);
            // The longest spans three splits.
            let lens = [75usize, 33, 530];
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
