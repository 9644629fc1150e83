//! [`low_rank_add`]: LoRA deltas of a few rows, `y[r] += (x[r] · Aᵀ) · Bᵀ`, with `A`
//! `[rank, cols]` and `B` `[out, rank]` packed matrices of f32, f16 or bf16 (both of one
//! format). Half-precision factors are widened to f32 as they are loaded (F16C/AVX-512
//! conversions, a shift for bf16) and everything accumulates in f32, so a half-precision
//! update is bit-identical to the f32 one fed the same (already rounded) values; the
//! halves only halve the bytes a decode step streams.
//!
//! Both products of one adapter run back to back in one unit of work, the `rank` middle
//! values of up to four rows kept on the stack, the rows gathered and scattered by index
//! (no copies of `x` or `y`). Several outputs sharing the input (q/k/v, gate/up) and every
//! adapter of each become the units of one parallel section. The arithmetic is that of
//! [`crate::matmul`]'s float kernels followed by an add — each of the two products a
//! single fused multiply-add chain from zero in column order, then `y + d` — so the
//! result is bit-identical to computing `d` with two products and adding it.
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::ggml::{bf16_bits_to_f32, f16_bits_to_f32};
use crate::packed::STRIP;
use crate::{Isa, KernelError, PackedMatrix, Result, ThreadPool, WeightFormat};

/// Largest rank [`low_rank_add`] takes (its middle values live on the stack).
pub const MAX_LOW_RANK: usize = 256;

/// Rows per tile: each loaded weight vector serves this many rows.
const TILE: usize = 4;

/// Rows of one unit of work (a long prompt's rows are split into units of this many).
const CHUNK: usize = 16;

/// Multiply-adds under which a call stays on the calling thread.
const SERIAL_WORK: usize = 1 << 16;

/// One adapter's delta over some rows of the batch.
#[derive(Debug, Clone, Copy)]
pub struct LowRankUpdate<'a> {
    /// `[rank, cols]`: f32, f16 or bf16.
    pub a: &'a PackedMatrix,
    /// `[out, rank]`, the scale folded in, in `a`'s format.
    pub b: &'a PackedMatrix,
    /// Rows of `x` and `y` it applies to, strictly ascending.
    pub rows: &'a [usize],
}

/// One output of a [`low_rank_add`] call and its updates, applied in order.
#[derive(Debug)]
pub struct LowRankOutput<'a> {
    /// `[n, out]`, updated in place.
    pub y: &'a mut [f32],
    /// The adapters' deltas.
    pub updates: &'a [LowRankUpdate<'a>],
}

/// Adds every update of every output of `outputs`, all computed from `x` (`n × cols`,
/// row-major): `y[r] = y[r] + (x[r] · Aᵀ) · Bᵀ` for each row `r` of each update, updates
/// of one output in order.
pub fn low_rank_add(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    n: usize,
    outputs: &mut [LowRankOutput<'_>],
) -> Result<()> {
    let cols = x.len().checked_div(n).unwrap_or(0);
    if x.len() != n * cols {
        return Err(shape("input", n * cols, x.len()));
    }
    let mut macs = 0usize;
    for o in outputs.iter() {
        let Some(first) = o.updates.first() else {
            continue;
        };
        let out = first.b.rows();
        if o.y.len() != n * out {
            return Err(shape("output", n * out, o.y.len()));
        }
        for u in o.updates {
            check_update(u, n, cols, out)?;
            macs += u.rows.len() * u.a.rows() * (cols + out);
        }
    }
    // Units of work: where an output's updates touch disjoint rows, each update in
    // chunks of `CHUNK` of its rows (they may run in parallel); else blocks of `CHUNK`
    // batch rows, each running every update in order over its rows in the block.
    let mut units: Vec<Unit> = Vec::new();
    for (i, o) in outputs.iter().enumerate() {
        if disjoint(o.updates) {
            for (u, up) in o.updates.iter().enumerate() {
                units.extend(up.rows.chunks(CHUNK).map(|c| Unit {
                    output: i,
                    updates: u..u + 1,
                    rows: c[0]..c[c.len() - 1] + 1,
                }));
            }
        } else if !o.updates.is_empty() {
            units.extend((0..n).step_by(CHUNK).map(|r| Unit {
                output: i,
                updates: 0..o.updates.len(),
                rows: r..(r + CHUNK).min(n),
            }));
        }
    }
    let targets: Vec<(*mut f32, usize, &[LowRankUpdate<'_>])> = outputs
        .iter_mut()
        .map(|o| {
            let out = o.updates.first().map_or(0, |u| u.b.rows());
            (o.y.as_mut_ptr(), out, o.updates)
        })
        .collect();
    let targets = Shared(targets);
    let next = AtomicUsize::new(0);
    let work = |_thread: usize| loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(unit) = units.get(k) else {
            break;
        };
        let (y, out, updates) = targets.get(unit.output);
        for u in &updates[unit.updates.clone()] {
            let from = u.rows.partition_point(|&r| r < unit.rows.start);
            let to = u.rows.partition_point(|&r| r < unit.rows.end);
            // SAFETY: rows were checked against `n`, `y` holds `n × out` floats and `x`
            // `n × cols`; units running at once write disjoint rows of one output or
            // different outputs.
            unsafe { update(isa, u, &u.rows[from..to], x, cols, y, out) };
        }
    };
    if macs < SERIAL_WORK || units.len() < 2 {
        work(0);
    } else {
        pool.run(&work);
    }
    Ok(())
}

/// One unit of work: `updates` of `output`, over their rows in `rows`.
struct Unit {
    output: usize,
    updates: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
}

/// Checks one update against an input of `n × cols` and an output `out` wide.
fn check_update(u: &LowRankUpdate<'_>, n: usize, cols: usize, out: usize) -> Result<()> {
    let (a, b) = (u.a, u.b);
    if factor_kind(a.format()).is_none() || a.format() != b.format() {
        return Err(KernelError::Unsupported {
            what: "low-rank factors other than f32, f16 or bf16 (both of one format)",
        });
    }
    if a.cols() != cols {
        return Err(shape("A columns", cols, a.cols()));
    }
    if b.cols() != a.rows() {
        return Err(shape("B columns", a.rows(), b.cols()));
    }
    if b.rows() != out {
        return Err(shape("B rows", out, b.rows()));
    }
    if a.rows() > MAX_LOW_RANK {
        return Err(KernelError::Unsupported {
            what: "a low rank above 256",
        });
    }
    if let Some(&row) = u.rows.iter().find(|&&r| r >= n) {
        return Err(KernelError::RowOutOfRange { row, rows: n });
    }
    if u.rows.windows(2).any(|w| w[0] >= w[1]) {
        return Err(KernelError::Unsupported {
            what: "low-rank update rows that are not strictly ascending",
        });
    }
    Ok(())
}

/// Raw output pointers shared by the units of one call.
struct Shared<'a>(Vec<(*mut f32, usize, &'a [LowRankUpdate<'a>])>);

// SAFETY: units write disjoint rows (or different outputs) through the pointers.
unsafe impl Sync for Shared<'_> {}

impl<'a> Shared<'a> {
    fn get(&self, i: usize) -> (*mut f32, usize, &'a [LowRankUpdate<'a>]) {
        self.0[i]
    }
}

fn shape(what: &'static str, expected: usize, found: usize) -> KernelError {
    KernelError::Shape {
        op: "low_rank_add",
        what,
        expected,
        found,
    }
}

/// Whether no row appears in two of `updates`.
fn disjoint(updates: &[LowRankUpdate<'_>]) -> bool {
    updates.iter().enumerate().all(|(i, u)| {
        updates[..i]
            .iter()
            .all(|v| u.rows.iter().all(|r| !v.rows.contains(r)))
    })
}

/// Update `u` over `rows` (some of its rows), in tiles of up to [`TILE`] rows, added
/// to `y` (`out` wide, indexed by row).
///
/// # Safety
/// Every row of `rows` is below the row count of `x` (`cols` wide) and of `y`.
unsafe fn update(
    isa: Isa,
    u: &LowRankUpdate<'_>,
    rows: &[usize],
    x: &[f32],
    cols: usize,
    y: *mut f32,
    out: usize,
) {
    for tile in rows.chunks(TILE) {
        let ys: [*mut f32; TILE] =
            std::array::from_fn(|i| y.add(tile.get(i).map_or(0, |&r| r * out)));
        run_tile(isa, u, tile, x, cols, &ys, true);
    }
}

/// Up to [`TILE`] rows of `u`: the middle values, then the delta stored to `ys` (or
/// added to them, with `add`).
unsafe fn run_tile(
    isa: Isa,
    u: &LowRankUpdate<'_>,
    tile: &[usize],
    x: &[f32],
    cols: usize,
    ys: &[*mut f32; TILE],
    add: bool,
) {
    let mut mid = [[0f32; MAX_LOW_RANK]; TILE];
    let xs: [*const f32; TILE] =
        std::array::from_fn(|i| x.as_ptr().add(tile.get(i).map_or(0, |&r| r * cols)));
    let rows = tile.len();
    // `check_update` let only these formats through.
    let kind = factor_kind(u.a.format()).unwrap_or(F32);
    match (isa.vector(), kind) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni, F16) => avx512::tile::<F16>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni, BF16) => avx512::tile::<BF16>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni, _) => avx512::tile::<F32>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, F16) => avx2::tile::<F16>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, BF16) => avx2::tile::<BF16>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => avx2::tile::<F32>(u.a, u.b, &xs, ys, rows, &mut mid, add),
        _ => scalar_tile(u.a, u.b, &xs, ys, rows, &mut mid, add),
    }
}

/// Factor element kinds, as the kernels' const parameter: f32, f16 or bf16.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// The kernels' kind of a factor format, `None` for formats they do not take.
fn factor_kind(f: WeightFormat) -> Option<u8> {
    match f {
        WeightFormat::F32 => Some(F32),
        WeightFormat::F16 => Some(F16),
        WeightFormat::Bf16 => Some(BF16),
        _ => None,
    }
}

/// Element `i` of a float strip of `m`'s format, widened to f32 (exactly).
///
/// # Safety
/// `i` is inside the strip `w` points to.
unsafe fn factor_at(m: &PackedMatrix, w: *const u8, i: usize) -> f32 {
    match m.format() {
        WeightFormat::F16 => f16_bits_to_f32(w.cast::<u16>().add(i).read_unaligned()),
        WeightFormat::Bf16 => bf16_bits_to_f32(w.cast::<u16>().add(i).read_unaligned()),
        _ => w.cast::<f32>().add(i).read_unaligned(),
    }
}

/// The portable tile: the same fused multiply-add chains as the SIMD ones.
unsafe fn scalar_tile(
    a: &PackedMatrix,
    b: &PackedMatrix,
    xs: &[*const f32; TILE],
    ys: &[*mut f32; TILE],
    rows: usize,
    mid: &mut [[f32; MAX_LOW_RANK]; TILE],
    add: bool,
) {
    let (cols, rank, out) = (a.cols(), a.rows(), b.rows());
    for s in 0..a.strips() {
        let w = a.strip(s).as_ptr();
        for lane in 0..STRIP {
            for t in 0..rows {
                let mut acc = 0f32;
                for k in 0..cols {
                    acc = factor_at(a, w, k * STRIP + lane).mul_add(*xs[t].add(k), acc);
                }
                mid[t][s * STRIP + lane] = acc;
            }
        }
    }
    for s in 0..b.strips() {
        let w = b.strip(s).as_ptr();
        let valid = (out - s * STRIP).min(STRIP);
        for lane in 0..valid {
            for t in 0..rows {
                let mut acc = 0f32;
                for j in 0..rank {
                    acc = factor_at(b, w, j * STRIP + lane).mul_add(mid[t][j], acc);
                }
                let at = ys[t].add(s * STRIP + lane);
                *at = if add { *at + acc } else { acc };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BF16, F16, MAX_LOW_RANK, STRIP, TILE};
    use crate::PackedMatrix;

    /// The 16 factors at element `i` of strip `w` (of kind `K`), as f32.
    macro_rules! load16 {
        ($k:expr, $w:expr, $i:expr) => {
            if $k == F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256($w.cast::<u16>().add($i).cast()))
            } else if $k == BF16 {
                let h = _mm256_loadu_si256($w.cast::<u16>().add($i).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_loadu_ps($w.cast::<f32>().add($i))
            }
        };
    }

    /// Up to [`TILE`] rows: `mid = x · Aᵀ` strip by strip, then `y += mid · Bᵀ`, the
    /// factors of kind `K`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const K: u8>(
        a: &PackedMatrix,
        b: &PackedMatrix,
        xs: &[*const f32; TILE],
        ys: &[*mut f32; TILE],
        rows: usize,
        mid: &mut [[f32; MAX_LOW_RANK]; TILE],
        add: bool,
    ) {
        match rows {
            1 => rows_n::<1, K>(a, b, xs, ys, mid, add),
            2 => rows_n::<2, K>(a, b, xs, ys, mid, add),
            3 => rows_n::<3, K>(a, b, xs, ys, mid, add),
            _ => rows_n::<4, K>(a, b, xs, ys, mid, add),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn rows_n<const T: usize, const K: u8>(
        a: &PackedMatrix,
        b: &PackedMatrix,
        xs: &[*const f32; TILE],
        ys: &[*mut f32; TILE],
        mid: &mut [[f32; MAX_LOW_RANK]; TILE],
        add: bool,
    ) {
        let (cols, rank, out) = (a.cols(), a.rows(), b.rows());
        for s in 0..a.strips() {
            let w = a.strip(s).as_ptr();
            let mut acc = [_mm512_setzero_ps(); T];
            for k in 0..cols {
                let wv = load16!(K, w, k * STRIP);
                for t in 0..T {
                    acc[t] = _mm512_fmadd_ps(wv, _mm512_set1_ps(*xs[t].add(k)), acc[t]);
                }
            }
            for t in 0..T {
                _mm512_storeu_ps(mid[t].as_mut_ptr().add(s * STRIP), acc[t]);
            }
        }
        for s in 0..b.strips() {
            let w = b.strip(s).as_ptr();
            let mut acc = [_mm512_setzero_ps(); T];
            for j in 0..rank {
                let wv = load16!(K, w, j * STRIP);
                for t in 0..T {
                    acc[t] = _mm512_fmadd_ps(wv, _mm512_set1_ps(mid[t][j]), acc[t]);
                }
            }
            let valid = (out - s * STRIP).min(STRIP);
            let mask: __mmask16 = if valid >= STRIP {
                0xFFFF
            } else {
                (1u16 << valid) - 1
            };
            for t in 0..T {
                let at = ys[t].add(s * STRIP);
                let v = if add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), acc[t])
                } else {
                    acc[t]
                };
                _mm512_mask_storeu_ps(at, mask, v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BF16, F16, MAX_LOW_RANK, STRIP, TILE};
    use crate::PackedMatrix;

    const HALF: usize = STRIP / 2;

    /// The 8 factors at element `i` of strip `w` (of kind `K`), as f32.
    macro_rules! load8 {
        ($k:expr, $w:expr, $i:expr) => {
            if $k == F16 {
                _mm256_cvtph_ps(_mm_loadu_si128($w.cast::<u16>().add($i).cast()))
            } else if $k == BF16 {
                let h = _mm_loadu_si128($w.cast::<u16>().add($i).cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_loadu_ps($w.cast::<f32>().add($i))
            }
        };
    }

    /// Up to [`TILE`] rows, each strip as two 8-lane halves, the factors of kind `K`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const K: u8>(
        a: &PackedMatrix,
        b: &PackedMatrix,
        xs: &[*const f32; TILE],
        ys: &[*mut f32; TILE],
        rows: usize,
        mid: &mut [[f32; MAX_LOW_RANK]; TILE],
        add: bool,
    ) {
        match rows {
            1 => rows_n::<1, K>(a, b, xs, ys, mid, add),
            2 => rows_n::<2, K>(a, b, xs, ys, mid, add),
            3 => rows_n::<3, K>(a, b, xs, ys, mid, add),
            _ => rows_n::<4, K>(a, b, xs, ys, mid, add),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_n<const T: usize, const K: u8>(
        a: &PackedMatrix,
        b: &PackedMatrix,
        xs: &[*const f32; TILE],
        ys: &[*mut f32; TILE],
        mid: &mut [[f32; MAX_LOW_RANK]; TILE],
        add: bool,
    ) {
        let (cols, rank, out) = (a.cols(), a.rows(), b.rows());
        for s in 0..a.strips() {
            let w = a.strip(s).as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            for k in 0..cols {
                let lo = load8!(K, w, k * STRIP);
                let hi = load8!(K, w, k * STRIP + HALF);
                for t in 0..T {
                    let xv = _mm256_set1_ps(*xs[t].add(k));
                    acc[t][0] = _mm256_fmadd_ps(lo, xv, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(hi, xv, acc[t][1]);
                }
            }
            for t in 0..T {
                let m = mid[t].as_mut_ptr().add(s * STRIP);
                _mm256_storeu_ps(m, acc[t][0]);
                _mm256_storeu_ps(m.add(HALF), acc[t][1]);
            }
        }
        for s in 0..b.strips() {
            let w = b.strip(s).as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            for j in 0..rank {
                let lo = load8!(K, w, j * STRIP);
                let hi = load8!(K, w, j * STRIP + HALF);
                for t in 0..T {
                    let mv = _mm256_set1_ps(mid[t][j]);
                    acc[t][0] = _mm256_fmadd_ps(lo, mv, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(hi, mv, acc[t][1]);
                }
            }
            let valid = (out - s * STRIP).min(STRIP);
            for t in 0..T {
                let mut d = [0f32; STRIP];
                _mm256_storeu_ps(d.as_mut_ptr(), acc[t][0]);
                _mm256_storeu_ps(d.as_mut_ptr().add(HALF), acc[t][1]);
                let at = ys[t].add(s * STRIP);
                for (l, &dv) in d.iter().enumerate().take(valid) {
                    *at.add(l) = if add { *at.add(l) + dv } else { dv };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{matmul, Product, QuantizedActivations};

    fn packed(rows: usize, cols: usize, seed: u32) -> (PackedMatrix, Vec<f32>) {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        (
            PackedMatrix::from_ggml(WeightFormat::F32, rows, cols, &bytes).unwrap(),
            v,
        )
    }

    /// `y + (x·Aᵀ)·Bᵀ` the long way: two [`matmul`] calls on the gathered rows, then adds.
    fn reference(x: &[f32], cols: usize, y: &mut [f32], u: LowRankUpdate<'_>, isa: Isa) {
        let (a, b, rows, out) = (u.a, u.b, u.rows, u.b.rows());
        let pool = ThreadPool::new(1);
        let mut act = QuantizedActivations::new();
        let xs: Vec<f32> = rows
            .iter()
            .flat_map(|&r| x[r * cols..(r + 1) * cols].to_vec())
            .collect();
        let mut t = vec![0f32; rows.len() * a.rows()];
        let mut p = [Product {
            weight: a,
            out: &mut t,
            bias: None,
        }];
        matmul(&pool, isa, &xs, rows.len(), &mut p, &mut act).unwrap();
        let mut d = vec![0f32; rows.len() * out];
        let mut p = [Product {
            weight: b,
            out: &mut d,
            bias: None,
        }];
        matmul(&pool, isa, &t, rows.len(), &mut p, &mut act).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            for c in 0..out {
                y[r * out + c] += d[i * out + c];
            }
        }
    }

    /// Bit-identical to two products and an add, for every family, tile size, a rank
    /// that is not a multiple of 16 and an output with a partial last strip; stacked
    /// (overlapping) updates apply in order.
    #[test]
    fn equals_two_products_and_an_add() {
        let (n, cols, out) = (40, 40, 37);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
            .collect();
        let y0: Vec<f32> = (0..n * out)
            .map(|i| ((i * 3) % 11) as f32 * 0.2 - 1.0)
            .collect();
        let (a1, _) = packed(5, cols, 1);
        let (b1, _) = packed(out, 5, 2);
        let (a2, _) = packed(20, cols, 3);
        let (b2, _) = packed(out, 20, 4);
        // More rows than one unit takes; the second update overlaps the first (stacked).
        let rows1: Vec<usize> = (0..n).filter(|r| r % 3 != 1).collect();
        let rows2 = [1usize, 2, 7, 30];
        let pool = ThreadPool::new(2);
        for isa in Isa::available() {
            let mut want = y0.clone();
            reference(
                &x,
                cols,
                &mut want,
                LowRankUpdate {
                    a: &a1,
                    b: &b1,
                    rows: &rows1,
                },
                isa,
            );
            reference(
                &x,
                cols,
                &mut want,
                LowRankUpdate {
                    a: &a2,
                    b: &b2,
                    rows: &rows2,
                },
                isa,
            );
            let mut got = y0.clone();
            let ups = [
                LowRankUpdate {
                    a: &a1,
                    b: &b1,
                    rows: &rows1,
                },
                LowRankUpdate {
                    a: &a2,
                    b: &b2,
                    rows: &rows2,
                },
            ];
            let mut second = y0.clone();
            let disjoint_rows: Vec<usize> = (0..n).step_by(2).collect();
            let more = [LowRankUpdate {
                a: &a1,
                b: &b1,
                rows: &disjoint_rows,
            }];
            low_rank_add(
                &pool,
                isa,
                &x,
                n,
                &mut [
                    LowRankOutput {
                        y: &mut got,
                        updates: &ups,
                    },
                    LowRankOutput {
                        y: &mut second,
                        updates: &more,
                    },
                ],
            )
            .unwrap();
            assert_eq!(got, want, "{isa:?}");
            let mut want2 = y0.clone();
            reference(
                &x,
                cols,
                &mut want2,
                LowRankUpdate {
                    a: &a1,
                    b: &b1,
                    rows: &disjoint_rows,
                },
                isa,
            );
            assert_eq!(second, want2, "{isa:?}");
        }
    }

    /// `v` (`rows × cols`) rounded to `format` (f16 or bf16), packed in it and, widened
    /// back, in f32.
    fn half_and_f32(
        v: &[f32],
        rows: usize,
        cols: usize,
        format: WeightFormat,
    ) -> (PackedMatrix, PackedMatrix) {
        let bits: Vec<u16> = v
            .iter()
            .map(|&x| match format {
                WeightFormat::F16 => half::f16::from_f32(x).to_bits(),
                _ => half::bf16::from_f32(x).to_bits(),
            })
            .collect();
        let wide: Vec<f32> = bits
            .iter()
            .map(|&b| match format {
                WeightFormat::F16 => f16_bits_to_f32(b),
                _ => bf16_bits_to_f32(b),
            })
            .collect();
        let hb: Vec<u8> = bits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let fb: Vec<u8> = wide.iter().flat_map(|x| x.to_le_bytes()).collect();
        (
            PackedMatrix::from_ggml(format, rows, cols, &hb).unwrap(),
            PackedMatrix::from_ggml(WeightFormat::F32, rows, cols, &fb).unwrap(),
        )
    }

    /// Half-precision factors give exactly what f32 factors holding the same (rounded)
    /// values give, on every family: the widening is exact and the chains are the same.
    /// Every tile size, a rank that is not a multiple of 16, a partial last strip, and
    /// stacked updates in both formats.
    #[test]
    fn half_factors_equal_f32_factors_of_the_same_values() {
        let (n, cols, out) = (23, 48, 37);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
            .collect();
        let y0: Vec<f32> = (0..n * out)
            .map(|i| ((i * 3) % 11) as f32 * 0.2 - 1.0)
            .collect();
        let rows1: Vec<usize> = (0..n).filter(|r| r % 3 != 1).collect();
        let rows2 = [0usize, 4, 5, 22];
        let pool = ThreadPool::new(2);
        for format in [WeightFormat::F16, WeightFormat::Bf16] {
            let (_, a1) = packed(5, cols, 1);
            let (_, b1) = packed(out, 5, 2);
            let (_, a2) = packed(18, cols, 3);
            let (_, b2) = packed(out, 18, 4);
            let (a1h, a1f) = half_and_f32(&a1, 5, cols, format);
            let (b1h, b1f) = half_and_f32(&b1, out, 5, format);
            let (a2h, a2f) = half_and_f32(&a2, 18, cols, format);
            let (b2h, b2f) = half_and_f32(&b2, out, 18, format);
            for isa in Isa::available() {
                let run = |ups: &[LowRankUpdate<'_>]| {
                    let mut y = y0.clone();
                    low_rank_add(
                        &pool,
                        isa,
                        &x,
                        n,
                        &mut [LowRankOutput {
                            y: &mut y,
                            updates: ups,
                        }],
                    )
                    .unwrap();
                    y
                };
                let half = run(&[
                    LowRankUpdate {
                        a: &a1h,
                        b: &b1h,
                        rows: &rows1,
                    },
                    LowRankUpdate {
                        a: &a2h,
                        b: &b2h,
                        rows: &rows2,
                    },
                ]);
                let wide = run(&[
                    LowRankUpdate {
                        a: &a1f,
                        b: &b1f,
                        rows: &rows1,
                    },
                    LowRankUpdate {
                        a: &a2f,
                        b: &b2f,
                        rows: &rows2,
                    },
                ]);
                assert_eq!(half, wide, "{format:?} {isa:?}");
                assert_ne!(half, y0, "{format:?} {isa:?}: no update applied");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let pool = ThreadPool::new(1);
        let (a, _) = packed(4, 8, 1);
        let (b, _) = packed(6, 4, 2);
        let x = vec![0f32; 2 * 8];
        let mut y = vec![0f32; 2 * 6];
        let rows = [2usize];
        let ups = [LowRankUpdate {
            a: &a,
            b: &b,
            rows: &rows,
        }];
        let mut outs = [LowRankOutput {
            y: &mut y,
            updates: &ups,
        }];
        assert!(low_rank_add(&pool, Isa::best(), &x, 2, &mut outs).is_err());
        let (q, _) = {
            let bytes = vec![0u8; 34 * 6];
            (
                PackedMatrix::from_ggml(WeightFormat::Q8_0, 6, 32, &bytes).unwrap(),
                (),
            )
        };
        let rows = [0usize];
        let ups = [LowRankUpdate {
            a: &a,
            b: &q,
            rows: &rows,
        }];
        let mut y = vec![0f32; 2 * 6];
        let mut outs = [LowRankOutput {
            y: &mut y,
            updates: &ups,
        }];
        assert!(low_rank_add(&pool, Isa::best(), &x, 2, &mut outs).is_err());
        // A of one float format and B of another.
        let (_, bv) = packed(6, 4, 2);
        let (bh, _) = half_and_f32(&bv, 6, 4, WeightFormat::F16);
        let ups = [LowRankUpdate {
            a: &a,
            b: &bh,
            rows: &rows,
        }];
        let mut y = vec![0f32; 2 * 6];
        let mut outs = [LowRankOutput {
            y: &mut y,
            updates: &ups,
        }];
        assert!(low_rank_add(&pool, Isa::best(), &x, 2, &mut outs).is_err());
    }
}
