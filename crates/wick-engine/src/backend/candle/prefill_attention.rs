//! Attention of long prompt chunks as matrix products: the keys and values a chunk sees
//! are converted to f32 once per call, and blocks of query rows (every query head of one
//! KV head stacked) meet tiles of keys in `gemm` products with an online softmax, so each
//! key and value is reused by a whole block of rows instead of streamed once per row.
//! Where the CPU has AVX-512 BF16 (and the model no soft-capping), the two products run
//! in bf16 with centred keys and values ([`super::prefill_bf16`]), the softmax between them
//! with a polynomial exponential: about 1.2× faster on an 8k prompt, with deviations from
//! the f32 products of the size an f16 KV cache makes (docs/lab/cpu-kernels.md, "Chunked like
//! the server, bf16 attention products").
//! `WICK_PROMPT_ATTENTION=f32` keeps the f32 products.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use half::f16;
use wick_kernels::{LineBuf, ThreadPool};

use super::attention::{lane_sum, max_of, Kernel, RowSource};
use super::block_pool::{KvDtype, KvNumber, BLOCK_TOKENS};
use super::exp::exp_in_place;
use super::kv::CpuKvLayer;
use super::prefill_bf16::{self, Bf16Products, PackedKv, PackedPiece};
use crate::backend::AttentionParams;

/// Fewest consecutive rows of one sequence's prompt chunk that go through the products;
/// shorter runs (decode, small chunks, speculative verification) stay with the per-row
/// kernel, which is faster there.
pub(crate) const MIN_ROWS: usize = 48;

/// Fewest keys the last row of a run must see for the run to go through the products.
///
/// The products sum in another order than the per-row kernel, so a row's bits depend on
/// the path it took. Below this length every row takes the per-row path, whose result
/// depends only on the row: a sequence gets the same bits alone or batched, chunked in
/// any way, or recomputed after preemption. Past it, where the products pay (attention
/// grows with the context, the per-row kernel streams every key once per row), a prompt
/// row's bits depend on whether its chunk was long enough: equal within f32 rounding,
/// not bit for bit, so sampled outputs of long prompts may differ between such runs.
pub(crate) const MIN_KEYS: usize = 1024;

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

/// The runs of at least [`MIN_ROWS`] causal rows of one sequence in `rows` whose last row
/// sees at least [`MIN_KEYS`] keys. A row that sees past its own position (a
/// bidirectional image span) ends a run.
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
        if len >= MIN_ROWS && rows[at + len - 1].end >= MIN_KEYS {
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

/// One KV head's keys and values as the products of a unit read them.
enum Tiles {
    F32(HeadKv),
    /// Centred and packed for the bf16 products.
    Bf16(PackedKv, Bf16Products),
}

/// Keys and values of KV head `kvh` at positions `from .. to` of `cache`, converted into
/// `keys` and `values` (`[position][hd]`, `to − from` positions each).
fn gather_into(
    cache: &CpuKvLayer,
    kvh: usize,
    hd: usize,
    (from, to): (usize, usize),
    keys: &mut [f32],
    values: &mut [f32],
) {
    match cache.dtype {
        KvDtype::F32 => gather_as::<f32>(cache, kvh, hd, (from, to), keys, values),
        KvDtype::F16 => gather_as::<f16>(cache, kvh, hd, (from, to), keys, values),
    }
}

fn gather_as<E: KvNumber>(
    cache: &CpuKvLayer,
    kvh: usize,
    hd: usize,
    (from, to): (usize, usize),
    keys: &mut [f32],
    values: &mut [f32],
) {
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
        let out = &mut values[(pos - from) * hd..(pos - from + len) * hd];
        for (o, x) in out.iter_mut().zip(v) {
            *o = x.to_f32();
        }
        pos += len;
    }
}

/// Positions one conversion unit handles: each run's keys and values are converted (and
/// packed) in pieces over all threads, not one KV head per thread.
const PIECE: usize = 1024;

/// A gathering unit: (job, piece) and the key and value rows it fills.
type GatherUnit<'a> = (usize, usize, Mutex<(&'a mut [f32], &'a mut [f32])>);

/// Every run's keys and values, per KV head (`[run][kv head]`), converted for the
/// products: gathered as f32 in pieces of [`PIECE`] positions over the pool, and with
/// `bf16`, centred on their means (summed piece by piece, in order) and packed, again in
/// pieces.
fn convert(
    pool: &ThreadPool,
    bf16: Option<Bf16Products>,
    rows: &[RowSource<'_>],
    runs: &[ChunkRun],
    p: &AttentionParams,
) -> Vec<Tiles> {
    let hd = p.head_dim;
    // One job per (run, KV head): its cache, head and positions.
    let jobs: Vec<(&CpuKvLayer, usize, usize, usize)> = runs
        .iter()
        .flat_map(|run| {
            let (first, last) = (&rows[run.first], &rows[run.first + run.len - 1]);
            let from = first_key(first.pos, first.cache, p);
            (0..p.kv_heads).map(move |kvh| (first.cache, kvh, from, last.pos + 1))
        })
        .collect();
    let mut heads: Vec<HeadKv> = jobs
        .iter()
        .map(|&(_, _, from, to)| HeadKv {
            base: from,
            keys: vec![0f32; (to - from) * hd],
            values: vec![0f32; (to - from) * hd],
        })
        .collect();
    // (job, piece, destination) of each gathering unit, and the column sums it finds.
    let mut sums: Vec<Mutex<(Vec<f64>, Vec<f64>)>> = Vec::new();
    {
        let units: Vec<GatherUnit<'_>> = heads
            .iter_mut()
            .enumerate()
            .flat_map(|(j, h)| {
                h.keys
                    .chunks_mut(PIECE * hd)
                    .zip(h.values.chunks_mut(PIECE * hd))
                    .enumerate()
                    .map(move |(i, kv)| (j, i, Mutex::new(kv)))
            })
            .collect();
        sums.resize_with(units.len(), Default::default);
        let next = AtomicUsize::new(0);
        pool.run(&|_| loop {
            let u = next.fetch_add(1, Ordering::Relaxed);
            let Some((j, i, dst)) = units.get(u) else {
                break;
            };
            let (cache, kvh, from, to) = jobs[*j];
            let at = from + i * PIECE;
            let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
            let (keys, values) = &mut *dst;
            gather_into(cache, kvh, hd, (at, (at + PIECE).min(to)), keys, values);
            if bf16.is_some() {
                *sums[u].lock().unwrap_or_else(|e| e.into_inner()) = (
                    prefill_bf16::column_sum(keys, hd),
                    prefill_bf16::column_sum(values, hd),
                );
            }
        });
    }
    let Some(bf) = bf16 else {
        return heads.into_iter().map(Tiles::F32).collect();
    };
    let mut sums = sums
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()));
    let mut packed: Vec<PackedKv> = heads
        .iter()
        .map(|h| {
            let n = h.keys.len() / hd;
            let (k, v): (Vec<_>, Vec<_>) = sums.by_ref().take(n.div_ceil(PIECE)).unzip();
            let (key_mean, value_mean) =
                (prefill_bf16::mean_of(&k, n), prefill_bf16::mean_of(&v, n));
            PackedKv::zeroed(h.base, n, hd, key_mean, value_mean)
        })
        .collect();
    {
        let units: Vec<(usize, usize, Mutex<PackedPiece<'_>>)> = packed
            .iter_mut()
            .enumerate()
            .flat_map(|(j, kv)| {
                kv.pieces(PIECE)
                    .into_iter()
                    .enumerate()
                    .map(move |(i, piece)| (j, i, Mutex::new(piece)))
            })
            .collect();
        let next = AtomicUsize::new(0);
        pool.run(&|_| loop {
            let u = next.fetch_add(1, Ordering::Relaxed);
            let Some((j, i, piece)) = units.get(u) else {
                break;
            };
            let h = &heads[*j];
            let span = i * PIECE * hd..((i + 1) * PIECE * hd).min(h.keys.len());
            piece.lock().unwrap_or_else(|e| e.into_inner()).pack(
                bf,
                &h.keys[span.clone()],
                &h.values[span],
            );
        });
    }
    packed.into_iter().map(|kv| Tiles::Bf16(kv, bf)).collect()
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

thread_local! {
    /// This thread's [`Scratch`], kept across units and calls (the score tiles are large
    /// enough that a fresh allocation per call costs page faults).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Scratch of one thread, kept across its units. The tile products' operands and
/// results start on cache lines ([`LineBuf`]).
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    /// The queries and a tile's probabilities as bf16 pairs (bf16 products only).
    q_pairs: LineBuf<u32>,
    p_pairs: LineBuf<u32>,
    scores: LineBuf<f32>,
    /// Each 16-row band's columns of the current tile (AMX only).
    bands: Vec<(usize, usize)>,
    acc: LineBuf<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// One unit's work: rows `rows` (consecutive positions of one sequence) against KV
/// head `kvh`'s keys and values `kv`, for the query heads of that KV head; `q` holds the
/// rows' queries (`[row][heads][hd]`), and each row's heads go to its slice of `out`
/// (`[group][hd]`).
struct Block<'a, 'b, 'c> {
    q: &'a [f32],
    rows: &'a [RowSource<'b>],
    kv: &'a Tiles,
    kvh: usize,
    out: &'a mut [&'c mut [f32]],
}

/// [`attend_block_on`] compiled for `kernel`'s instruction set, so the softmax loops
/// between the products become its vector code.
fn attend_block(kernel: Kernel, job: Block<'_, '_, '_>, p: &AttentionParams, s: &mut Scratch) {
    match kernel {
        Kernel::Portable => attend_block_on(job, p, s),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx2` kernel proves the CPU has AVX2, FMA and F16C.
        Kernel::Avx2(_) => unsafe { attend_block_avx2(job, p, s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Avx512` kernel proves the CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C.
        Kernel::Avx512(_) => unsafe { attend_block_avx512(job, p, s) },
    }
}

/// [`attend_block_on`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_block_avx2(job: Block<'_, '_, '_>, p: &AttentionParams, s: &mut Scratch) {
    attend_block_on(job, p, s)
}

/// [`attend_block_on`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn attend_block_avx512(job: Block<'_, '_, '_>, p: &AttentionParams, s: &mut Scratch) {
    attend_block_on(job, p, s)
}

/// The work of [`attend_block`]: the query heads stacked (matrix row `i * group + g`, the
/// scale folded in unless scores are soft-capped), then per tile of keys `S = Q·Kᵀ`, the
/// softmax of each row's scores within its keys ([`softmax_f32`], [`softmax_bf16`]) with
/// the running sum and the accumulator rescaled when the row's shift grows, and
/// `O += P·V`; finally each row divided by its sum.
#[inline(always)]
fn attend_block_on(job: Block<'_, '_, '_>, p: &AttentionParams, s: &mut Scratch) {
    let Block {
        q,
        rows,
        kv,
        kvh,
        out,
    } = job;
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let m = rows.len() * group;
    let cache = rows[0].cache;
    let bounds: Vec<(usize, usize)> = rows
        .iter()
        .map(|r| (first_key(r.pos, cache, p), r.pos + 1))
        .collect();
    let q_scale = if p.softcap.is_some() { 1.0 } else { p.scale };
    s.q.clear();
    for row in q.chunks_exact(p.heads * hd).take(rows.len()) {
        let at = kvh * group * hd;
        s.q.extend(row[at..at + group * hd].iter().map(|&x| x * q_scale));
    }
    s.acc.fill_zero(m * hd);
    s.max.clear();
    s.max.resize(m, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(m, 0.0);
    s.scores.grow(m * KEY_TILE);
    let lo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
    let hi = bounds.iter().map(|b| b.1).max().unwrap_or(0);
    // Tiles within `last_first .. first_end` are seen whole by every row.
    let last_first = bounds.iter().map(|b| b.0).max().unwrap_or(0);
    let first_end = bounds.iter().map(|b| b.1).min().unwrap_or(0);
    // Tiles from the last key back, so the diagonal tile ends where the rows' keys do
    // and the masked triangle it computes in vain is only as wide as the block (for the
    // bf16 products, tiles of whole packed groups, their padding masked like any key
    // outside a row's range).
    let (mut t1, lo) = match kv {
        Tiles::F32(_) => (hi, lo),
        Tiles::Bf16(packed, bf) => {
            let (base, align) = (packed.base, prefill_bf16::ALIGN);
            bf.pairs(&s.q, &mut s.q_pairs);
            (
                base + (hi - base).div_ceil(align) * align,
                base + (lo - base) / align * align,
            )
        }
    };
    while t1 > lo {
        let t0 = t1.saturating_sub(KEY_TILE).max(lo);
        let n = t1 - t0;
        let scores = &mut s.scores[..m * n];
        match kv {
            Tiles::F32(kv) => {
                // S = Q · Kᵀ: the keys `[position][dim]` read as a `dim × position` matrix.
                let keys = &kv.keys[(t0 - kv.base) * hd..(t1 - kv.base) * hd];
                matmul((m, n, hd), scores, false, (&s.q, hd, 1), (keys, 1, hd));
                softmax_f32(
                    &bounds,
                    group,
                    (t0, t1),
                    p,
                    Running {
                        max: &mut s.max,
                        sum: &mut s.sum,
                        acc: &mut s.acc,
                    },
                    scores,
                );
                let values = &kv.values[(t0 - kv.base) * hd..(t1 - kv.base) * hd];
                // O += P · V.
                matmul(
                    (m, hd, n),
                    &mut s.acc,
                    true,
                    (scores, n, 1),
                    (values, hd, 1),
                );
            }
            Tiles::Bf16(packed, bf) => {
                // Only the columns each band of 16 rows sees, on AMX: the causal triangle's
                // masked blocks (and those before a sliding window) are never computed.
                // (No bands: every row sees every column.)
                s.bands.clear();
                if bf.tiled() && !(last_first <= t0 && t1 <= first_end) {
                    s.bands
                        .extend((0..m / 16).map(|i| band_columns(&bounds, group, i, (t0, t1))));
                }
                bf.scores(&s.q_pairs, m, packed, (t0, t1), &s.bands, scores);
                s.p_pairs.grow(m * n / 2);
                let probs = &mut s.p_pairs[..m * n / 2];
                softmax_bf16(
                    *bf,
                    &bounds,
                    group,
                    (t0, t1),
                    Running {
                        max: &mut s.max,
                        sum: &mut s.sum,
                        acc: &mut s.acc,
                    },
                    scores,
                    probs,
                );
                bf.accumulate(probs, m, packed, (t0, t1), &s.bands, &mut s.acc);
            }
        }
        t1 = t0;
    }
    // Centred values: their mean comes back once per row (probabilities sum to one).
    let zeros = [0f32; 0];
    let mean: &[f32] = match kv {
        Tiles::F32(_) => &zeros,
        Tiles::Bf16(packed, _) => &packed.value_mean,
    };
    for (i, o) in out.iter_mut().enumerate() {
        for g in 0..group {
            let mi = i * group + g;
            let inv = 1.0 / s.sum[mi];
            let o = &mut o[g * hd..(g + 1) * hd];
            for (o, &a) in o.iter_mut().zip(&s.acc[mi * hd..(mi + 1) * hd]) {
                *o = a * inv;
            }
            for (o, &c) in o.iter_mut().zip(mean) {
                *o += c;
            }
        }
    }
}

/// Row `mi`'s keys within the tile `t0 .. t1`, relative to `t0` (empty where it sees
/// none of them).
fn live_keys(
    bounds: &[(usize, usize)],
    group: usize,
    mi: usize,
    (t0, t1): (usize, usize),
) -> (usize, usize) {
    let (from, to) = bounds[mi / group];
    let (a, b) = (from.clamp(t0, t1) - t0, to.clamp(t0, t1) - t0);
    (a, b.max(a))
}

/// The columns of the tile `t0 .. t1` that band `i` (rows `16 i .. 16 i + 16`) sees, out
/// to multiples of 32; `(0, 0)` when it sees none. A band's rows are consecutive
/// positions, whose keys overlap or touch, so the band sees one span.
fn band_columns(
    bounds: &[(usize, usize)],
    group: usize,
    i: usize,
    (t0, t1): (usize, usize),
) -> (usize, usize) {
    let (mut lo, mut hi) = (usize::MAX, 0);
    for mi in 16 * i..16 * (i + 1) {
        let (a, b) = live_keys(bounds, group, mi, (t0, t1));
        if a < b {
            lo = lo.min(a);
            hi = hi.max(b);
        }
    }
    if lo >= hi {
        return (0, 0);
    }
    (lo / 32 * 32, hi.next_multiple_of(32).min(t1 - t0))
}

/// A unit's running softmax state, borrowed from its [`Scratch`].
struct Running<'a> {
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
}

impl Running<'_> {
    /// Row `mi`'s probabilities are now relative to `shift` (at least its old maximum):
    /// its sum and accumulator are rescaled, then `tile_sum` added.
    fn carry(&mut self, mi: usize, hd: usize, shift: f32, tile_sum: f32) {
        let old = self.max[mi];
        if shift != old {
            self.max[mi] = shift;
            // Nothing accumulated yet while the old maximum is −∞.
            if old != f32::NEG_INFINITY {
                let carry = (old - shift).exp();
                self.sum[mi] *= carry;
                for x in &mut self.acc[mi * hd..(mi + 1) * hd] {
                    *x *= carry;
                }
            }
        }
        self.sum[mi] += tile_sum;
    }
}

/// The f32 products' softmax of one tile: each row's scores outside its keys zeroed, the
/// rest (soft-capped where the model says) turned into `exp(s − running max)`.
#[inline(always)]
fn softmax_f32(
    bounds: &[(usize, usize)],
    group: usize,
    tile: (usize, usize),
    p: &AttentionParams,
    mut run: Running<'_>,
    scores: &mut [f32],
) {
    let n = tile.1 - tile.0;
    for (mi, row) in scores.chunks_exact_mut(n).enumerate() {
        let (a, b) = live_keys(bounds, group, mi, tile);
        row[..a].fill(0.0);
        row[b..].fill(0.0);
        if a == b {
            continue;
        }
        let live = &mut row[a..b];
        if let Some(cap) = p.softcap {
            for x in live.iter_mut() {
                *x = cap * (*x * p.scale / cap).tanh();
            }
        }
        let new_max = run.max[mi].max(max_of(live));
        for x in live.iter_mut() {
            *x -= new_max;
        }
        exp_in_place(live);
        run.carry(mi, p.head_dim, new_max, lane_sum(live));
    }
}

/// How far past a row's shift a tile's scores may go before the row is redone with a
/// larger one: probabilities up to `e^16` (sums of them stay far inside f32).
const SHIFT_SLACK: f32 = 16.0;

/// The bf16 products' softmax of one tile in one pass per row: masking, exponential, sum
/// and rounding to bf16 pairs (`probs`, `[row][n / 2]`) together
/// ([`Bf16Products::exp_pairs`]). A row's first tile shifts by its maximum; later tiles
/// keep the running shift unless a score passes it by more than [`SHIFT_SLACK`], so the
/// maximum costs no pass of its own (the rare row that passes is redone).
#[inline(always)]
fn softmax_bf16(
    bf: Bf16Products,
    bounds: &[(usize, usize)],
    group: usize,
    tile: (usize, usize),
    mut run: Running<'_>,
    scores: &[f32],
    probs: &mut [u32],
) {
    let n = tile.1 - tile.0;
    let hd = run.acc.len() / run.max.len();
    for (mi, (row, out)) in scores
        .chunks_exact(n)
        .zip(probs.chunks_exact_mut(n / 2))
        .enumerate()
    {
        let (a, b) = live_keys(bounds, group, mi, tile);
        if a == b {
            out.fill(0);
            continue;
        }
        let mut shift = run.max[mi];
        if shift == f32::NEG_INFINITY {
            shift = max_of(&row[a..b]);
        }
        let (mut sum, top) = bf.exp_pairs(row, (a, b), shift, out);
        if top > shift + SHIFT_SLACK {
            shift = top;
            sum = bf.exp_pairs(row, (a, b), shift, out).0;
        }
        run.carry(mi, hd, shift, sum);
    }
}

/// Attention of the rows of `runs` into `out` (`[rows][heads][head_dim]`, as `q`), on
/// `pool`: one unit per (run, KV head, block of [`QUERY_ROWS`] rows), the latest blocks
/// (which see the most keys) first.
pub(crate) fn attend_runs(
    pool: &ThreadPool,
    (kernel, bf16): (Kernel, Option<Bf16Products>),
    q: &[f32],
    rows: &[RowSource<'_>],
    runs: &[ChunkRun],
    p: &AttentionParams,
    out: &mut [f32],
) {
    let hd = p.head_dim;
    let group = p.heads / p.kv_heads;
    let row_width = p.heads * hd;
    let bf16 = bf16.filter(|_| p.softcap.is_none() && Bf16Products::fits(hd));
    let converted = convert(pool, bf16, rows, runs, p);
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
        SCRATCH.with_borrow_mut(|scratch| loop {
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
            let job = Block {
                q: &q[first * row_width..last * row_width],
                rows: &rows[first..last],
                kv: &converted[r * p.kv_heads + kvh],
                kvh,
                out: &mut outs,
            };
            attend_block(kernel, job, p, scratch);
        });
    });
}
