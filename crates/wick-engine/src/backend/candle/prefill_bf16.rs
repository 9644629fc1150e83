//! The two products of a long prompt chunk's attention in bf16 (AVX-512 BF16), at twice
//! the multiply-adds per instruction of f32 FMAs: `vdpbf16ps` multiplies pairs of bf16
//! numbers and adds both products to one f32 lane. Where the CPU has AMX (and the
//! backend's family is [`Isa::Amx`]), whole tiles of 16 rows run on the tile unit instead
//! (`tdpbf16ps`, [`wick_kernels::amx::bf16_product`]: the same bf16 operands, products
//! summed in f32 in the same order of pairs), the leftover rows on AVX-512.
//!
//! Operands are rounded to bf16 (8 significant bits), products summed in f32. To keep
//! that rounding small where keys or values share a large common part (a bias on the key
//! projection makes some dimensions nearly constant), each KV head's keys and values are
//! centred on their mean over the positions of the call before rounding: a row's scores
//! against centred keys differ from the true ones by one constant per row, which the
//! softmax ignores, and the value mean is added back to each output row. Soft-capped
//! scores are not shift-invariant, so those models keep the f32 products.
//!
//! Layouts (one `u32` = two bf16, the first in the low half):
//! - queries `[row][hd / 2]`: dimensions `2j, 2j + 1` of a row;
//! - keys in groups of [`KEYS`] positions, `[group][hd / 2][KEYS]`: one 512-bit load is
//!   the same two dimensions of sixteen positions;
//! - probabilities `[row][n / 2]`: positions `2i, 2i + 1` of a row;
//! - values `[position pair][hd]`: one 512-bit load is sixteen dimensions of two positions.
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::bf16;
use wick_kernels::amx::{self, Bf16Columns, Bf16Rows};
use wick_kernels::{Isa, LineBuf};

/// Key positions of one packed group (the lanes of a 512-bit register).
pub(crate) const KEYS: usize = 16;

/// Key tiles start and end on multiples of this many positions from the packed base, so
/// every tile is whole groups of [`GROUPS`] × [`KEYS`].
pub(crate) const ALIGN: usize = GROUPS * KEYS;

/// Query rows × key groups of one score micro-tile (24 accumulators).
const ROWS: usize = 6;
const GROUPS: usize = 4;

/// Output rows of one `P·V` micro-tile, each four 16-dimension vectors (24 accumulators).
const OUT_ROWS: usize = 6;
const OUT_VECS: usize = 4;

/// What a [`Bf16Products`] holds: nothing on x86-64, and no value at all elsewhere (so
/// none can be made there).
#[cfg(target_arch = "x86_64")]
type Proof = ();
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy)]
enum Proof {}

/// Proof that this CPU runs the bf16 products, and whether on tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bf16Products {
    // Only matched on (as an empty enum) where no products exist.
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    proof: Proof,
    tiles: bool,
}

impl Bf16Products {
    /// The products where this CPU has AVX-512 BF16, on AMX tiles when `isa` is
    /// [`Isa::Amx`].
    pub(crate) fn detect(isa: Isa) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let has = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16");
            has.then_some(Bf16Products {
                proof: (),
                tiles: isa == Isa::Amx && amx::support().is_ok(),
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = isa;
            None
        }
    }

    /// Whether a head of `head_dim` dimensions fits the layouts.
    pub(crate) fn fits(head_dim: usize) -> bool {
        head_dim > 0 && head_dim.is_multiple_of(KEYS * OUT_VECS)
    }
}

fn pair(a: f32, b: f32) -> u32 {
    u32::from(bf16::from_f32(a).to_bits()) | (u32::from(bf16::from_f32(b).to_bits()) << 16)
}

/// Sum of each dimension over the rows of `x` (`[row][hd]`), in f64.
pub(crate) fn column_sum(x: &[f32], hd: usize) -> Vec<f64> {
    let mut sum = vec![0f64; hd];
    for row in x.chunks_exact(hd) {
        for (s, &v) in sum.iter_mut().zip(row) {
            *s += f64::from(v);
        }
    }
    sum
}

/// Mean of each dimension over `rows` rows of `x` (`[row][hd]`).
#[cfg(test)]
fn column_mean(x: &[f32], hd: usize) -> Vec<f32> {
    mean_of(&[column_sum(x, hd)], x.len() / hd)
}

/// The mean of `rows` rows from the column sums of consecutive pieces of them (added in
/// order).
pub(crate) fn mean_of(pieces: &[Vec<f64>], rows: usize) -> Vec<f32> {
    let mut total = pieces.first().cloned().unwrap_or_default();
    for p in pieces.iter().skip(1) {
        for (t, &x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    total
        .iter()
        .map(|&s| (s / rows.max(1) as f64) as f32)
        .collect()
}

/// One KV head's keys and values of positions `base .. base + len` (padded with zeros to
/// a multiple of [`ALIGN`]), centred and packed.
pub(crate) struct PackedKv {
    pub(crate) base: usize,
    /// Packed positions (a multiple of [`ALIGN`]).
    pub(crate) len: usize,
    hd: usize,
    /// On cache lines, as every tile operand ([`LineBuf`]).
    keys: LineBuf<u32>,
    values: LineBuf<u32>,
    /// Subtracted from every key before rounding.
    key_mean: Vec<f32>,
    /// Subtracted from every value before rounding, and added back to every output row.
    pub(crate) value_mean: Vec<f32>,
}

/// Where one piece of positions of a [`PackedKv`] goes ([`PackedKv::pieces`]).
pub(crate) struct PackedPiece<'a> {
    keys: &'a mut [u32],
    values: &'a mut [u32],
    key_mean: &'a [f32],
    value_mean: &'a [f32],
    hd: usize,
}

impl PackedKv {
    /// Packs `keys` and `values` (`[position][hd]` f32 each, from `base`).
    #[cfg(test)]
    pub(crate) fn pack(
        bf: Bf16Products,
        base: usize,
        keys: &[f32],
        values: &[f32],
        hd: usize,
    ) -> Self {
        let n = keys.len() / hd;
        let key_mean = mean_of(&[column_sum(keys, hd)], n);
        let value_mean = mean_of(&[column_sum(values, hd)], n);
        let mut kv = PackedKv::zeroed(base, n, hd, key_mean, value_mean);
        if let Some(mut piece) = kv.pieces(n.max(1)).into_iter().next() {
            piece.pack(bf, keys, values);
        }
        kv
    }

    /// Room for `n` positions from `base`, to be centred on the given means and filled
    /// piece by piece ([`Self::pieces`]).
    pub(crate) fn zeroed(
        base: usize,
        n: usize,
        hd: usize,
        key_mean: Vec<f32>,
        value_mean: Vec<f32>,
    ) -> Self {
        let len = n.div_ceil(ALIGN) * ALIGN;
        PackedKv {
            base,
            len,
            hd,
            keys: LineBuf::zeroed(len * hd / 2),
            values: LineBuf::zeroed(len / 2 * hd),
            key_mean,
            value_mean,
        }
    }

    /// The destinations of consecutive pieces of `piece` positions (a multiple of
    /// [`ALIGN`], or at least all of them), which threads may fill at once.
    pub(crate) fn pieces(&mut self, piece: usize) -> Vec<PackedPiece<'_>> {
        let hd = self.hd;
        let piece = piece.div_ceil(ALIGN) * ALIGN;
        self.keys
            .chunks_mut(piece * hd / 2)
            .zip(self.values.chunks_mut(piece / 2 * hd))
            .map(|(keys, values)| PackedPiece {
                keys,
                values,
                key_mean: &self.key_mean,
                value_mean: &self.value_mean,
                hd,
            })
            .collect()
    }
}

impl PackedPiece<'_> {
    /// Centres, rounds and packs the piece's positions (`keys`, `values`: `[position][hd]`
    /// f32, as many positions as the piece has or, for the last, fewer).
    pub(crate) fn pack(&mut self, bf: Bf16Products, keys: &[f32], values: &[f32]) {
        let hd = self.hd;
        let half = hd / 2;
        let mut centred = vec![0f32; 2 * hd];
        let mut pairs = vec![0u32; hd];
        for (p, row) in keys.chunks_exact(hd).enumerate() {
            for ((c, &x), &m) in centred.iter_mut().zip(row).zip(self.key_mean) {
                *c = x - m;
            }
            bf.pairs_into(&centred[..hd], &mut pairs[..half]);
            let group = &mut self.keys[(p / KEYS) * half * KEYS..][..half * KEYS];
            for (j, &w) in pairs[..half].iter().enumerate() {
                group[j * KEYS + p % KEYS] = w;
            }
        }
        for (out, two) in self.values.chunks_exact_mut(hd).zip(values.chunks(2 * hd)) {
            // Positions `2i` and `2i + 1` interleaved, a missing last one as zeros.
            let (first, second) = two.split_at(hd);
            for (d, c) in centred.chunks_exact_mut(2).enumerate() {
                c[0] = first[d] - self.value_mean[d];
                c[1] = second.get(d).map_or(0.0, |&x| x - self.value_mean[d]);
            }
            bf.pairs_into(&centred, out);
        }
    }
}

impl Bf16Products {
    /// One row of a tile's softmax in one pass over its scores: `out[i]` becomes the pair
    /// of probabilities `exp(row[2i] − shift)`, `exp(row[2i + 1] − shift)` rounded to bf16
    /// (the left operand of [`accumulate`](Self::accumulate)), zero outside the row's
    /// keys `live = (a, b)`; returns their sum (of the unrounded values) and the largest
    /// score in `a .. b`. Scores outside `a .. b` are not read. `row.len()` must be a
    /// multiple of 32 and `out` hold `row.len() / 2` pairs.
    ///
    /// The results are rounded to bf16 for the `P·V` product, so a polynomial good to
    /// about 3e-6 relative (far below bf16's 4e-3) replaces the exactly rounded
    /// exponential of the f32 path; the exponent's f32 rounding adds about
    /// 1e-7 · (|x| + |shift|) relative. Where a score exceeds `shift` by more than about 88
    /// the sum is infinite: callers redo such a row with a larger shift.
    pub(crate) fn exp_pairs(
        self,
        row: &[f32],
        live: (usize, usize),
        shift: f32,
        out: &mut [u32],
    ) -> (f32, f32) {
        assert!(
            row.len().is_multiple_of(32) && out.len() == row.len() / 2,
            "probability pairs of {} scores into {}",
            row.len(),
            out.len()
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the proof says the CPU has AVX-512F/BW and BF16; the loop reads `row`
        // and writes `out` in whole chunks of 32 scores (16 pairs), which the assertion
        // keeps in bounds.
        unsafe {
            exp_pairs_avx512(row, live, shift, out)
        }
        #[cfg(not(target_arch = "x86_64"))]
        match self.proof {}
    }

    /// `x` (an even number of floats) rounded to bf16, in order, as pairs into `out`:
    /// query rows `[row][hd]` become `[row][hd / 2]`, probability rows `[row][n]`
    /// become `[row][n / 2]`.
    pub(crate) fn pairs(self, x: &[f32], out: &mut LineBuf<u32>) {
        out.set_len(x.len() / 2);
        self.pairs_into(x, out);
    }

    /// [`pairs`](Self::pairs) into a slice of exactly `x.len() / 2` pairs.
    pub(crate) fn pairs_into(self, x: &[f32], out: &mut [u32]) {
        assert!(
            x.len().is_multiple_of(2) && out.len() == x.len() / 2,
            "pairs of {} floats into {}",
            x.len(),
            out.len()
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the proof says the CPU has the instructions; `out` holds `x.len() / 2`
        // pairs, which is what the conversion writes.
        unsafe {
            pairs_avx512(x, out)
        }
        #[cfg(not(target_arch = "x86_64"))]
        match self.proof {}
    }

    /// Whether whole tiles of 16 rows run on AMX (and so [`scores`](Self::scores) and
    /// [`accumulate`](Self::accumulate) heed their `bands`).
    pub(crate) fn tiled(self) -> bool {
        self.tiles
    }

    /// `scores (m × n) = Q · Kᵀ` for key positions `t0 .. t1` of `kv` (both multiples of
    /// [`ALIGN`] from its base; `n = t1 − t0`), `q` the `m` query rows as
    /// [`pairs`](Self::pairs). On AMX, the rows of band `i` (rows `16 i .. 16 i + 16`,
    /// one entry of `bands` each, or none at all for every column) get only the columns
    /// `bands[i]` (multiples of 32; `(0, 0)` for none); the rest of their scores are
    /// left as they were.
    pub(crate) fn scores(
        self,
        q: &[u32],
        m: usize,
        kv: &PackedKv,
        (t0, t1): (usize, usize),
        bands: &[(usize, usize)],
        scores: &mut [f32],
    ) {
        let half = kv.hd / 2;
        let (a, b) = (t0 - kv.base, t1 - kv.base);
        let n = b - a;
        assert!(
            a % ALIGN == 0 && b % ALIGN == 0 && b <= kv.len,
            "unaligned key tile"
        );
        assert!(
            q.len() >= m * half && scores.len() >= m * n,
            "buffers too small"
        );
        let keys = &kv.keys[a * half..b * half];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the proof says the CPU has the instructions; the assertions above keep
        // every access in bounds (each micro-tile reads `rows × half` query pairs and
        // `GROUPS` whole groups, and writes `rows × GROUPS × KEYS` scores).
        let avx512 = |r0: usize, rows: usize, scores: &mut [f32]| unsafe {
            scores_avx512(&q[r0 * half..], rows, half, keys, n, &mut scores[r0 * n..])
        };
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = |_: usize, _: usize, _: &mut [f32]| match self.proof {};
        // Whole tiles of rows on AMX (`n` and `hd` are multiples of 64), band by band.
        let tiled = if self.tiles {
            let each = |r0: usize, rows: usize, (c0, c1): (usize, usize), scores: &mut [f32]| {
                let a = Bf16Rows {
                    data: &q[r0 * half..],
                    stride: half,
                };
                let b = Bf16Columns {
                    data: &keys[c0 * half..],
                    pair_stride: KEYS,
                    group: half * KEYS,
                };
                let c = &mut scores[r0 * n + c0..];
                if amx::bf16_product((rows, c1 - c0, kv.hd), a, b, c, n, false).is_err() {
                    avx512(r0, rows, scores);
                }
            };
            by_bands(m, n, bands, |r0, rows, cols| each(r0, rows, cols, scores))
        } else {
            0
        };
        avx512(tiled, m - tiled, scores);
    }

    /// `acc (m × hd) += P · V` for key positions `t0 .. t1` of `kv`, `p` the [`pairs`]
    /// (Self::pairs) of `m` rows of `t1 − t0` probabilities. On AMX, band `i` of rows
    /// reads only the columns `bands[i]` of its probabilities (the others must be zero),
    /// as in [`scores`](Self::scores).
    pub(crate) fn accumulate(
        self,
        p: &[u32],
        m: usize,
        kv: &PackedKv,
        (t0, t1): (usize, usize),
        bands: &[(usize, usize)],
        acc: &mut [f32],
    ) {
        let hd = kv.hd;
        let (a, b) = (t0 - kv.base, t1 - kv.base);
        let pairs = (b - a) / 2;
        assert!(
            a % ALIGN == 0 && b % ALIGN == 0 && b <= kv.len,
            "unaligned key tile"
        );
        assert!(
            p.len() >= m * pairs && acc.len() >= m * hd,
            "buffers too small"
        );
        let values = &kv.values[a / 2 * hd..b / 2 * hd];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `scores`.
        let avx512 = |r0: usize, rows: usize, acc: &mut [f32]| unsafe {
            accumulate_avx512(
                &p[r0 * pairs..],
                rows,
                pairs,
                values,
                hd,
                &mut acc[r0 * hd..],
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = |_: usize, _: usize, _: &mut [f32]| match self.proof {};
        let tiled = if self.tiles {
            let each = |r0: usize, rows: usize, (c0, c1): (usize, usize), acc: &mut [f32]| {
                let a = Bf16Rows {
                    data: &p[r0 * pairs + c0 / 2..],
                    stride: pairs,
                };
                let b = Bf16Columns {
                    data: &values[c0 / 2 * hd..],
                    pair_stride: hd,
                    group: KEYS,
                };
                let c = &mut acc[r0 * hd..];
                if amx::bf16_product((rows, hd, c1 - c0), a, b, c, hd, true).is_err() {
                    avx512(r0, rows, acc);
                }
            };
            by_bands(m, 2 * pairs, bands, |r0, rows, cols| {
                each(r0, rows, cols, acc)
            })
        } else {
            0
        };
        avx512(tiled, m - tiled, acc);
    }
}

/// Runs `f(first row, rows, columns)` over the whole 16-row bands of `m` rows, merging
/// neighbours that share their columns and skipping bands without any: `bands` gives
/// each band's columns, or is empty for all `n` columns everywhere. Returns the rows
/// covered (the rest go to the AVX-512 kernels).
fn by_bands(
    m: usize,
    n: usize,
    bands: &[(usize, usize)],
    mut f: impl FnMut(usize, usize, (usize, usize)),
) -> usize {
    let whole = m / 16;
    if bands.is_empty() {
        f(0, whole * 16, (0, n));
        return whole * 16;
    }
    assert_eq!(bands.len(), whole, "one column range per band of 16 rows");
    let mut i = 0;
    while i < whole {
        let cols = bands[i];
        let mut j = i + 1;
        while j < whole && bands[j] == cols {
            j += 1;
        }
        assert!(
            cols.0 <= cols.1
                && cols.1 <= n
                && cols.0.is_multiple_of(32)
                && cols.1.is_multiple_of(32),
            "band columns {cols:?} of {n}"
        );
        if cols.0 < cols.1 {
            f(16 * i, 16 * (j - i), cols);
        }
        i = j;
    }
    whole * 16
}

/// `2^f` for `|f| ≤ 1/2`, a polynomial of degree 4 fitted to relative error (below
/// 2.7e-6 there, with these f32 coefficients): the probabilities are rounded to bf16
/// (2⁻⁹ relative) right after, so more terms would only cost time.
#[cfg(target_arch = "x86_64")]
const EXP2: [f32; 5] = [
    0.999_999_17,
    0.693_122,
    0.240_249_81,
    0.055_917_04,
    0.009_560_511,
];

/// The lanes of the sixteen positions `j .. j + 16` that lie in `a .. b`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes_in(j: usize, (a, b): (usize, usize)) -> __mmask16 {
    let below = |x: usize| -> u32 {
        let k = x.saturating_sub(j).min(16);
        ((1u64 << k) - 1) as u32
    };
    (below(b) & !below(a)) as __mmask16
}

/// `exp(x − shift)` of the lanes of `live` at `p` (zero in the others), and the scores
/// themselves (zero in the others); `shift` comes as `shift · log2 e`, so the exponent
/// `x · log2 e − shift · log2 e` is one fused multiply-subtract.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp16(p: *const f32, live: __mmask16, shift: __m512) -> (__m512, __m512) {
    let x = _mm512_maskz_loadu_ps(live, p);
    // exp(x − shift) = 2^t, t = (x − shift)·log2 e, split as 2^k · 2^f with k the nearest
    // integer; `scalef` applies 2^k and goes to zero far below.
    let t = _mm512_fmsub_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), shift);
    let t = _mm512_max_ps(t, _mm512_set1_ps(-200.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, k);
    let mut y = _mm512_set1_ps(EXP2[4]);
    for &c in EXP2[..4].iter().rev() {
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c));
    }
    (_mm512_maskz_scalef_ps(live, y, k), x)
}

/// 32 scores at `src` (the lanes `l0` of the first sixteen, `l1` of the second) into 16
/// probability pairs at `dst`, their sum and maximum into `sum` and `top`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pairs_chunk(
    src: *const f32,
    dst: *mut __m512i,
    (l0, l1): (__mmask16, __mmask16),
    shift: __m512,
    (sum, top): (&mut __m512, &mut __m512),
) {
    let (y0, x0) = exp16(src, l0, shift);
    let (y1, x1) = exp16(src.add(16), l1, shift);
    *top = _mm512_mask_max_ps(*top, l0, *top, x0);
    *top = _mm512_mask_max_ps(*top, l1, *top, x1);
    *sum = _mm512_add_ps(*sum, _mm512_add_ps(y0, y1));
    // Positions `0 .. 16` in the low half, in order.
    let h = _mm512_cvtne2ps_pbh(y1, y0);
    _mm512_storeu_si512(dst.cast(), std::mem::transmute::<__m512bh, __m512i>(h));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn exp_pairs_avx512(
    row: &[f32],
    (a, b): (usize, usize),
    shift: f32,
    out: &mut [u32],
) -> (f32, f32) {
    let m = _mm512_set1_ps(shift * std::f32::consts::LOG2_E);
    let mut sum = _mm512_setzero_ps();
    let mut top = _mm512_set1_ps(f32::NEG_INFINITY);
    let dst = out.as_mut_ptr().cast::<__m512i>();
    for c in 0..row.len() / 32 {
        let j = 32 * c;
        if j + 32 <= a || j >= b {
            _mm512_storeu_si512(dst.add(c).cast(), _mm512_setzero_si512());
            continue;
        }
        // Chunks inside the keys (all but the edges) with constant masks, which the
        // compiler drops.
        let (src, to) = (row.as_ptr().add(j), dst.add(c));
        if a <= j && j + 32 <= b {
            pairs_chunk(src, to, (!0, !0), m, (&mut sum, &mut top));
        } else {
            let lanes = (lanes_in(j, (a, b)), lanes_in(j + 16, (a, b)));
            pairs_chunk(src, to, lanes, m, (&mut sum, &mut top));
        }
    }
    (_mm512_reduce_add_ps(sum), _mm512_reduce_max_ps(top))
}

/// Sixteen floats at a time with `vcvtneps2bf16` (round to nearest even), the tail one
/// pair at a time with the same rounding.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pairs_avx512(x: &[f32], out: &mut [u32]) {
    let whole = x.len() / 16 * 16;
    let dst = out.as_mut_ptr().cast::<__m256i>();
    for (i, c) in x[..whole].chunks_exact(16).enumerate() {
        let h = _mm512_cvtneps_pbh(_mm512_loadu_ps(c.as_ptr()));
        _mm256_storeu_si256(dst.add(i), std::mem::transmute::<__m256bh, __m256i>(h));
    }
    for (o, d) in out[whole / 2..].iter_mut().zip(x[whole..].chunks_exact(2)) {
        *o = pair(d[0], d[1]);
    }
}

#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($r:expr, |$R:ident| $body:expr) => {
        match $r {
            1 => {
                const $R: usize = 1;
                $body
            }
            2 => {
                const $R: usize = 2;
                $body
            }
            3 => {
                const $R: usize = 3;
                $body
            }
            4 => {
                const $R: usize = 4;
                $body
            }
            5 => {
                const $R: usize = 5;
                $body
            }
            _ => {
                const $R: usize = 6;
                $body
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bh(v: __m512i) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores_avx512(q: &[u32], m: usize, half: usize, keys: &[u32], n: usize, out: &mut [f32]) {
    let groups = n / KEYS;
    let mut r0 = 0;
    while r0 < m {
        let rows = (m - r0).min(ROWS);
        by_rows!(rows, |R| {
            for g0 in (0..groups).step_by(GROUPS) {
                score_tile::<R>(
                    q.as_ptr().add(r0 * half),
                    half,
                    keys.as_ptr().add(g0 * half * KEYS),
                    out.as_mut_ptr().add(r0 * n + g0 * KEYS),
                    n,
                );
            }
        });
        r0 += rows;
    }
}

#[cfg(target_arch = "x86_64")]
/// `R` rows × [`GROUPS`] key groups.
#[inline(always)]
unsafe fn score_tile<const R: usize>(
    q: *const u32,
    half: usize,
    keys: *const u32,
    out: *mut f32,
    ld: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); GROUPS]; R];
    for j in 0..half {
        let mut k = [_mm512_setzero_si512(); GROUPS];
        for (g, k) in k.iter_mut().enumerate() {
            *k = _mm512_loadu_si512(keys.add((g * half + j) * KEYS).cast());
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let qv = bh(_mm512_set1_epi32(*q.add(r * half + j) as i32));
            for g in 0..GROUPS {
                acc[g] = _mm512_dpbf16_ps(acc[g], bh(k[g]), qv);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (g, &a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * ld + g * KEYS), a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn accumulate_avx512(
    p: &[u32],
    m: usize,
    pairs: usize,
    values: &[u32],
    hd: usize,
    acc: &mut [f32],
) {
    let vecs = hd / KEYS;
    let mut r0 = 0;
    while r0 < m {
        let rows = (m - r0).min(OUT_ROWS);
        by_rows!(rows, |R| {
            for v0 in (0..vecs).step_by(OUT_VECS) {
                value_tile::<R>(
                    p.as_ptr().add(r0 * pairs),
                    pairs,
                    values.as_ptr().add(v0 * KEYS),
                    hd,
                    acc.as_mut_ptr().add(r0 * hd + v0 * KEYS),
                );
            }
        });
        r0 += rows;
    }
}

#[cfg(target_arch = "x86_64")]
/// `R` rows × [`OUT_VECS`] vectors of 16 dimensions, over every position pair.
#[inline(always)]
unsafe fn value_tile<const R: usize>(
    p: *const u32,
    pairs: usize,
    values: *const u32,
    hd: usize,
    acc: *mut f32,
) {
    let mut a = [[_mm512_setzero_ps(); OUT_VECS]; R];
    for (r, a) in a.iter_mut().enumerate() {
        for (v, a) in a.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(acc.add(r * hd + v * KEYS));
        }
    }
    for i in 0..pairs {
        let mut vv = [_mm512_setzero_si512(); OUT_VECS];
        for (v, x) in vv.iter_mut().enumerate() {
            *x = _mm512_loadu_si512(values.add(i * hd + v * KEYS).cast());
        }
        for (r, a) in a.iter_mut().enumerate() {
            let pv = bh(_mm512_set1_epi32(*p.add(r * pairs + i) as i32));
            for v in 0..OUT_VECS {
                a[v] = _mm512_dpbf16_ps(a[v], bh(vv[v]), pv);
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (v, &x) in a.iter().enumerate() {
            _mm512_storeu_ps(acc.add(r * hd + v * KEYS), x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::candle::attention::tests::noise;

    /// The fused softmax pass against f64's exponential: zero pairs outside the row's
    /// keys (which it must not read: they hold NaN here), inside them `exp(x − shift)`
    /// rounded to bf16, for shifts at and below the maximum and key ranges that start and
    /// end inside and on the edges of 32-score chunks; the sum of the unrounded values
    /// and the largest live score.
    #[test]
    fn exp_pairs_is_close_to_the_exponential() {
        let Some(bf) = Bf16Products::detect(Isa::Avx512Vnni) else {
            eprintln!("skipped: the CPU has no AVX-512 BF16");
            return;
        };
        let mut scores: Vec<f32> = noise(6, 1024).iter().map(|x| 60.0 * x).collect();
        scores[500] = f32::NEG_INFINITY;
        for live in [
            (0, 1024),
            (0, 1),
            (37, 500),
            (64, 96),
            (100, 1023),
            (513, 514),
        ] {
            let mut row = vec![f32::NAN; 1024];
            row[live.0..live.1].copy_from_slice(&scores[live.0..live.1]);
            let max = row[live.0..live.1]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            for shift in [max, max - 9.5] {
                let mut out = vec![u32::MAX; 512];
                let (sum, top) = bf.exp_pairs(&row, live, shift, &mut out);
                assert_eq!(top, max, "{live:?}");
                let (mut total, mut allowed) = (0f64, 0f64);
                for (i, &x) in row.iter().enumerate() {
                    let half = (out[i / 2] >> (16 * (i % 2))) as u16;
                    let got = f64::from(bf16::from_bits(half).to_f32());
                    if !(live.0..live.1).contains(&i) {
                        assert_eq!(half, 0, "{live:?}: position {i} outside the keys");
                        continue;
                    }
                    let d = f64::from(x) - f64::from(shift);
                    let w = d.exp();
                    // The polynomial's 2.7e-6 and the f32 rounding of `x · log2 e` and
                    // `shift · log2 e`, which grows with their size.
                    let e = 3e-6 + 1.5e-7 * (f64::from(x).abs() + f64::from(shift).abs());
                    total += w;
                    if w == 0.0 {
                        assert_eq!(got, 0.0, "{live:?}: position {i}");
                        continue;
                    }
                    // bf16's half unit in the last place (2⁻⁸ of the value at most) and
                    // the exponential's own error.
                    allowed += e * w;
                    let bound = (2f64.powi(-8) + e) * w + 1e-30;
                    assert!(
                        (got - w).abs() <= bound,
                        "{live:?} shift {shift}: position {i}: {got} vs {w}"
                    );
                }
                assert!(
                    (f64::from(sum) - total).abs() <= allowed + 1e-6 * total,
                    "{live:?}: sum {sum} vs {total}"
                );
            }
        }
    }

    /// Both products against f64 sums of the same bf16-rounded operands (exact but for
    /// the f32 accumulation), for row counts that leave every remainder, on AVX-512 and
    /// (where the CPU has them) on AMX tiles: odd and even numbers of 16-row tiles, and
    /// leftover rows beside them.
    #[test]
    fn products_match_sums_of_the_rounded_operands() {
        let mut families = vec![Isa::Avx512Vnni];
        match amx::support() {
            Ok(()) => families.push(Isa::Amx),
            Err(why) => eprintln!("AMX tile products skipped: {why}"),
        }
        for isa in families {
            let Some(bf) = Bf16Products::detect(isa) else {
                eprintln!("bf16 products skipped: the CPU has no AVX-512 BF16");
                return;
            };
            assert_eq!(bf.tiles, isa == Isa::Amx);
            products_of(bf);
        }
    }

    fn products_of(bf: Bf16Products) {
        let round = |x: f32| bf16::from_f32(x).to_f32();
        for (hd, positions, m) in [
            (64, 200, 13),
            (128, 64, 6),
            (256, 130, 7),
            (64, 300, 37),
            (128, 130, 48),
        ] {
            let keys = noise(1, positions * hd);
            let values = noise(2, positions * hd);
            let q = noise(3, m * hd);
            let kv = PackedKv::pack(bf, 40, &keys, &values, hd);
            assert_eq!(kv.len % ALIGN, 0);
            let km = column_mean(&keys, hd);
            let (t0, t1) = (40, 40 + kv.len);
            let n = t1 - t0;
            let mut qp = LineBuf::new();
            let scaled: Vec<f32> = q.iter().map(|x| x * 0.5).collect();
            bf.pairs(&scaled, &mut qp);
            let mut scores = vec![0f32; m * n];
            bf.scores(&qp, m, &kv, (t0, t1), &[], &mut scores);
            for r in 0..m {
                for p in 0..n {
                    let want: f64 = (0..hd)
                        .map(|d| {
                            let k = if p < positions {
                                round(keys[p * hd + d] - km[d])
                            } else {
                                0.0
                            };
                            f64::from(round(q[r * hd + d] * 0.5)) * f64::from(k)
                        })
                        .sum();
                    let got = f64::from(scores[r * n + p]);
                    assert!(
                        (got - want).abs() <= 1e-4,
                        "hd {hd} row {r} key {p}: {got} vs {want}"
                    );
                }
            }
            let probs: Vec<f32> = noise(4, m * n).iter().map(|x| x.abs()).collect();
            let mut pp = LineBuf::new();
            bf.pairs(&probs, &mut pp);
            let start = noise(5, m * hd);
            let mut acc = start.clone();
            bf.accumulate(&pp, m, &kv, (t0, t1), &[], &mut acc);
            let vm = &kv.value_mean;
            for r in 0..m {
                for d in 0..hd {
                    let want: f64 = f64::from(start[r * hd + d])
                        + (0..positions)
                            .map(|p| {
                                f64::from(round(probs[r * n + p]))
                                    * f64::from(round(values[p * hd + d] - vm[d]))
                            })
                            .sum::<f64>();
                    let got = f64::from(acc[r * hd + d]);
                    assert!(
                        (got - want).abs() <= 1e-4,
                        "hd {hd} row {r} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
