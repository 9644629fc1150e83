//! Attention of long prompt chunks as matrix products: the keys and values a chunk sees
//! are converted to f32 once per call, and blocks of query rows (every query head of one
//! KV head stacked) meet tiles of keys in `gemm` products with an online softmax, so each
//! key and value is reused by a whole block of rows instead of streamed once per row.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use half::f16;
use wick_kernels::ThreadPool;

use super::attention::RowSource;
use super::block_pool::{KvDtype, KvNumber, BLOCK_TOKENS};
use super::exp::exp_in_place;
use super::kv::CpuKvLayer;
use crate::backend::AttentionParams;

/// Fewest consecutive rows of one sequence's prompt chunk that go through the products;
/// shorter runs (decode, small chunks) stay with the per-row kernel, which is faster there.
pub(crate) const MIN_ROWS: usize = 48;

/// Query rows of one work unit: with the query heads of a KV head stacked, the left
/// matrix has `QUERY_ROWS × group` rows.
const QUERY_ROWS: usize = 64;

/// Key positions of one tile: the scores of a unit's rows against one tile stay in the
/// core's second-level cache between the two products.
const KEY_TILE: usize = 256;

/// Rows `first .. first + len` of a batch: consecutive positions of one sequence, each
/// seeing the keys up to its own position (plain causal attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkRun {
    pub first: usize,
    pub len: usize,
}

/// The runs of at least [`MIN_ROWS`] causal rows of one sequence in `rows`. A row that
/// sees past its own position (a bidirectional image span) ends a run.
pub(crate) fn chunk_runs(rows: &[RowSource<'_>]) -> Vec<ChunkRun> {
    let mut runs = Vec::new();
    let mut at = 0;
    while at < rows.len() {
        let first = &rows[at];
        let mut len = 0;
        while let Some(r) = rows.get(at + len) {
            let next = std::ptr::eq(r.cache, first.cache)
                && r.pos == first.pos + len
                && r.end == r.pos + 1;
            if !next {
                break;
            }
            len += 1;
        }
        if len >= MIN_ROWS {
            runs.push(ChunkRun { first: at, len });
        }
        at += len.max(1);
    }
    runs
}

/// First key a row at `pos` sees.
fn first_key(pos: usize, cache: &CpuKvLayer, p: &AttentionParams) -> usize {
    match p.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    }
    .max(cache.start)
}

/// One KV head's keys and values of positions `base ..` as f32, `[position][dim]` each.
struct HeadKv {
    base: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Keys and values of KV head `kvh` at positions `from .. to` of `cache`, converted.
fn gather(cache: &CpuKvLayer, kvh: usize, hd: usize, from: usize, to: usize) -> HeadKv {
    match cache.dtype {
        KvDtype::F32 => gather_as::<f32>(cache, kvh, hd, from, to),
        KvDtype::F16 => gather_as::<f16>(cache, kvh, hd, from, to),
    }
}

fn gather_as<E: KvNumber>(
    cache: &CpuKvLayer,
    kvh: usize,
    hd: usize,
    from: usize,
    to: usize,
) -> HeadKv {
    let n = to - from;
    let mut keys = vec![0f32; n * hd];
    let mut values = Vec::with_capacity(n * hd);
    let mut pos = from;
    while pos < to {
        let (block, slot) = cache.locate(pos);
        let len = (BLOCK_TOKENS - slot).min(to - pos);
        // Keys are stored transposed, `[dim][slot]`.
        let kt: &[E] = block.head_keys(kvh, hd);
        let out = &mut keys[(pos - from) * hd..(pos - from + len) * hd];
        for (d, col) in kt.chunks_exact(BLOCK_TOKENS).enumerate() {
            for (s, &x) in col[slot..slot + len].iter().enumerate() {
                out[s * hd + d] = x.to_f32();
            }
        }
        let v: &[E] = block.head_values(kvh, hd, slot..slot + len);
        values.extend(v.iter().map(|x| x.to_f32()));
        pos += len;
    }
    HeadKv {
        base: from,
        keys,
        values,
    }
}

/// `c (m × n) = a (m × k) · b (k × n)`, or `c +=` when `accumulate`; each operand given as
/// (data, row stride, column stride).
#[allow(clippy::too_many_arguments)]
fn matmul(
    (m, n, k): (usize, usize, usize),
    c: &mut [f32],
    accumulate: bool,
    (a, a_rs, a_cs): (&[f32], usize, usize),
    (b, b_rs, b_cs): (&[f32], usize, usize),
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let last = |rs: usize, cs: usize, rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(
        c.len() >= m * n && a.len() > last(a_rs, a_cs, m, k) && b.len() > last(b_rs, b_cs, k, n),
        "matrix buffers smaller than their shapes"
    );
    // SAFETY: the assertion above keeps every addressed element inside its buffer; `c`
    // does not alias `a` or `b` (one `&mut` and two `&` borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Scratch of one thread, kept across its units.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// Attention of rows `rows` (indices into the batch, consecutive positions of one
/// sequence) for the query heads of KV head `kvh`; writes each row's heads into `out`
/// (one slice per row, `[group][hd]`).
fn attend_block(
    q: &[f32],
    rows: &[RowSource<'_>],
    kv: &HeadKv,
    kvh: usize,
    p: &AttentionParams,
    s: &mut Scratch,
    out: &mut [&mut [f32]],
) {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let m = rows.len() * group;
    let cache = rows[0].cache;
    let bounds: Vec<(usize, usize)> = rows
        .iter()
        .map(|r| (first_key(r.pos, cache, p), r.pos + 1))
        .collect();
    // Query heads of every row stacked: matrix row `i * group + g`.
    s.q.clear();
    s.q.resize(m * hd, 0.0);
    for (i, row) in q.chunks_exact(p.heads * hd).enumerate().take(rows.len()) {
        let at = kvh * group * hd;
        s.q[i * group * hd..(i + 1) * group * hd].copy_from_slice(&row[at..at + group * hd]);
    }
    s.acc.clear();
    s.acc.resize(m * hd, 0.0);
    s.max.clear();
    s.max.resize(m, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(m, 0.0);
    let lo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
    let hi = bounds.iter().map(|b| b.1).max().unwrap_or(0);
    let mut t0 = lo;
    while t0 < hi {
        let t1 = (t0 + KEY_TILE).min(hi);
        let n = t1 - t0;
        let keys = &kv.keys[(t0 - kv.base) * hd..(t1 - kv.base) * hd];
        let values = &kv.values[(t0 - kv.base) * hd..(t1 - kv.base) * hd];
        s.scores.clear();
        s.scores.resize(m * n, 0.0);
        // S = Q · Kᵀ: the keys `[position][dim]` read as a `dim × position` matrix.
        matmul(
            (m, n, hd),
            &mut s.scores,
            false,
            (&s.q, hd, 1),
            (keys, 1, hd),
        );
        for (i, &(from, to)) in bounds.iter().enumerate() {
            let (a, b) = (from.clamp(t0, t1) - t0, to.clamp(t0, t1) - t0);
            for g in 0..group {
                let mi = i * group + g;
                let row = &mut s.scores[mi * n..(mi + 1) * n];
                if a >= b {
                    row.fill(0.0);
                    continue;
                }
                let mut tile_max = f32::NEG_INFINITY;
                for x in &mut row[a..b] {
                    let mut v = *x * p.scale;
                    if let Some(cap) = p.softcap {
                        v = cap * (v / cap).tanh();
                    }
                    *x = v;
                    tile_max = tile_max.max(v);
                }
                let new_max = s.max[mi].max(tile_max);
                let carry = (s.max[mi] - new_max).exp();
                s.max[mi] = new_max;
                row[..a].fill(0.0);
                row[b..].fill(0.0);
                let live = &mut row[a..b];
                for x in live.iter_mut() {
                    *x -= new_max;
                }
                exp_in_place(live);
                let tile_sum: f32 = live.iter().sum();
                s.sum[mi] = s.sum[mi] * carry + tile_sum;
                if carry != 1.0 {
                    for x in &mut s.acc[mi * hd..(mi + 1) * hd] {
                        *x *= carry;
                    }
                }
            }
        }
        // O += P · V.
        matmul(
            (m, hd, n),
            &mut s.acc,
            true,
            (&s.scores, n, 1),
            (values, hd, 1),
        );
        t0 = t1;
    }
    for (i, o) in out.iter_mut().enumerate() {
        for g in 0..group {
            let mi = i * group + g;
            let inv = 1.0 / s.sum[mi];
            for (o, &a) in o[g * hd..(g + 1) * hd]
                .iter_mut()
                .zip(&s.acc[mi * hd..(mi + 1) * hd])
            {
                *o = a * inv;
            }
        }
    }
}

/// Attention of the rows of `runs` into `out` (`[rows][heads][head_dim]`, as `q`), on
/// `pool`: one unit per (run, KV head, block of [`QUERY_ROWS`] rows), the latest blocks
/// (which see the most keys) first.
pub(crate) fn attend_runs(
    pool: &ThreadPool,
    q: &[f32],
    rows: &[RowSource<'_>],
    runs: &[ChunkRun],
    p: &AttentionParams,
    out: &mut [f32],
) {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let row_width = p.heads * hd;
    // Every run's keys and values, per KV head, converted once.
    let jobs: Vec<(usize, usize)> = (0..runs.len())
        .flat_map(|r| (0..p.kv_heads).map(move |h| (r, h)))
        .collect();
    let converted: Vec<Mutex<Option<HeadKv>>> = jobs.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    pool.run(&|_| loop {
        let j = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(r, kvh)) = jobs.get(j) else { break };
        let run = &runs[r];
        let (first, last) = (&rows[run.first], &rows[run.first + run.len - 1]);
        let from = first_key(first.pos, first.cache, p);
        let kv = gather(first.cache, kvh, hd, from, last.pos + 1);
        *converted[j].lock().unwrap_or_else(|e| e.into_inner()) = Some(kv);
    });
    let converted: Vec<HeadKv> = converted
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every run and head converted")
        })
        .collect();
    // Units, latest blocks first.
    let mut units: Vec<(usize, usize, usize)> = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        for b in 0..run.len.div_ceil(QUERY_ROWS) {
            for kvh in 0..p.kv_heads {
                units.push((r, kvh, b * QUERY_ROWS));
            }
        }
    }
    units.sort_by_key(|&(r, _, b)| std::cmp::Reverse(rows[runs[r].first].pos + b));
    // One slice per (row, KV head): the group's heads of that row.
    let slices: Vec<Mutex<&mut [f32]>> = out.chunks_mut(group * hd).map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    pool.run(&|_| {
        let mut scratch = Scratch::default();
        loop {
            let u = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(r, kvh, b)) = units.get(u) else {
                break;
            };
            let run = &runs[r];
            let first = run.first + b;
            let last = (first + QUERY_ROWS).min(run.first + run.len);
            let mut guards: Vec<_> = (first..last)
                .map(|row| {
                    slices[row * p.kv_heads + kvh]
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                })
                .collect();
            let mut outs: Vec<&mut [f32]> = guards.iter_mut().map(|g| &mut ***g).collect();
            attend_block(
                &q[first * row_width..last * row_width],
                &rows[first..last],
                &converted[r * p.kv_heads + kvh],
                kvh,
                p,
                &mut scratch,
                &mut outs,
            );
        }
    });
}
