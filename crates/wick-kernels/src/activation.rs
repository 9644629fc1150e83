//! Activations quantized to 8 bits per 32-element block, the other operand of every
//! quantized product.
//!
//! Each block of 32 floats becomes 32 signed bytes `q = round(x · 127 / max|x|)` (ties to
//! even) with scale `d = max|x| / 127`, plus the sums the zero points and mins of the
//! weight formats need: `Σq` over each half and the whole block, and `d · Σq`.
use crate::{Isa, KernelError, Result};

/// Reusable buffers of quantized activations (`rows × cols`, `cols` a multiple of 32).
/// Growing only, so a decode loop allocates nothing after its first step.
#[derive(Debug, Default, Clone)]
pub struct QuantizedActivations {
    rows: usize,
    cols: usize,
    pub(crate) qs: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sum32: Vec<i32>,
    pub(crate) dsum: Vec<f32>,
    pub(crate) sum16: Vec<i32>,
    /// For the AMX kernels (with `tiles` in [`Self::prepare`]): `d` and `dsum` of each
    /// whole tile of [`TILE`] tokens as `[tile][block][token]`, a block's values for the
    /// tile's tokens in a row.
    pub(crate) tile_d: Vec<f32>,
    pub(crate) tile_dsum: Vec<f32>,
    /// Rows whose scales the last [`Self::prepare`] laid out in `tile_d`/`tile_dsum`
    /// (the buffers may hold more, from an earlier call).
    pub(crate) tiled_rows: usize,
}

/// Grows `v` to at least `len` elements, never shrinking it. Calls alternate between
/// widths (a layer's 896-column inputs, then its 4,864-column one), and a `resize` down
/// and back up would fill the regrown part with zeros every time — megabytes per call
/// of a 512-row prompt chunk, all of it overwritten by the quantizer anyway.
fn grow<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// Tokens of one tile of [`QuantizedActivations::tile_d`].
pub(crate) const TILE: usize = 16;

/// Raw write access to a [`QuantizedActivations`] for threads that fill disjoint rows.
#[derive(Clone, Copy)]
pub(crate) struct ActivationWriter {
    cols: usize,
    qs: *mut i8,
    d: *mut f32,
    sum32: *mut i32,
    dsum: *mut f32,
    sum16: *mut i32,
    /// Rows written into `tile_d`/`tile_dsum` too (the whole tiles), and those buffers.
    tiled_rows: usize,
    tile_d: *mut f32,
    tile_dsum: *mut f32,
}

// SAFETY: the pointers target buffers that outlive the parallel section, and callers
// write disjoint rows.
unsafe impl Send for ActivationWriter {}
unsafe impl Sync for ActivationWriter {}

impl QuantizedActivations {
    /// Empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Resizes for `rows × cols` (keeping capacity) and hands out a writer; with `tiles`,
    /// the writer also fills the tile layout of the scales for the whole tiles.
    pub(crate) fn prepare(&mut self, rows: usize, cols: usize, tiles: bool) -> ActivationWriter {
        let nb = cols / 32;
        self.rows = rows;
        self.cols = cols;
        grow(&mut self.qs, rows * cols);
        grow(&mut self.d, rows * nb);
        grow(&mut self.sum32, rows * nb);
        grow(&mut self.dsum, rows * nb);
        grow(&mut self.sum16, rows * nb * 2);
        let tiled_rows = if tiles { rows / TILE * TILE } else { 0 };
        self.tiled_rows = tiled_rows;
        grow(&mut self.tile_d, tiled_rows * nb);
        grow(&mut self.tile_dsum, tiled_rows * nb);
        ActivationWriter {
            cols,
            qs: self.qs.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            sum32: self.sum32.as_mut_ptr(),
            dsum: self.dsum.as_mut_ptr(),
            sum16: self.sum16.as_mut_ptr(),
            tiled_rows,
            tile_d: self.tile_d.as_mut_ptr(),
            tile_dsum: self.tile_dsum.as_mut_ptr(),
        }
    }

    /// Quantizes `x` (`rows × cols`, `cols` a multiple of 32) on the calling thread.
    pub fn quantize(&mut self, isa: Isa, x: &[f32], rows: usize, cols: usize) -> Result<()> {
        if !cols.is_multiple_of(32) {
            return Err(KernelError::Shape {
                op: "quantize activations",
                what: "row width (multiple of 32)",
                expected: cols.div_ceil(32) * 32,
                found: cols,
            });
        }
        if x.len() != rows * cols {
            return Err(KernelError::Shape {
                op: "quantize activations",
                what: "input",
                expected: rows * cols,
                found: x.len(),
            });
        }
        let w = self.prepare(rows, cols, false);
        // SAFETY: `w` points into buffers just sized for `rows × cols`.
        unsafe { w.rows(isa, x, 0..rows) };
        Ok(())
    }

    /// Block scale of row `r`, block `b`.
    pub fn scale(&self, r: usize, b: usize) -> f32 {
        self.d[r * self.cols / 32 + b]
    }

    /// Quantized values of row `r`.
    pub fn row(&self, r: usize) -> &[i8] {
        &self.qs[r * self.cols..(r + 1) * self.cols]
    }
}

impl ActivationWriter {
    /// Quantizes rows `rows` of `x` (the full `rows × cols` input) into the buffers.
    ///
    /// # Safety
    /// The buffers must be sized for `x` (see [`QuantizedActivations::prepare`]) and no
    /// other thread may write the same rows.
    pub(crate) unsafe fn rows(&self, isa: Isa, x: &[f32], rows: std::ops::Range<usize>) {
        let cols = self.cols;
        let nb = cols / 32;
        for r in rows {
            let xr = &x[r * cols..(r + 1) * cols];
            for b in 0..nb {
                let src = &xr[32 * b..32 * b + 32];
                let at = r * nb + b;
                let qs = std::slice::from_raw_parts_mut(self.qs.add(r * cols + 32 * b), 32);
                let s = block(isa, src, qs);
                *self.d.add(at) = s.d;
                *self.sum32.add(at) = s.sum[0] + s.sum[1];
                *self.dsum.add(at) = s.d * (s.sum[0] + s.sum[1]) as f32;
                *self.sum16.add(2 * at) = s.sum[0];
                *self.sum16.add(2 * at + 1) = s.sum[1];
                if r < self.tiled_rows {
                    let t = (r / TILE * nb + b) * TILE + r % TILE;
                    *self.tile_d.add(t) = s.d;
                    *self.tile_dsum.add(t) = s.d * (s.sum[0] + s.sum[1]) as f32;
                }
            }
        }
    }
}

/// Scale and half sums of one quantized block.
pub(crate) struct BlockStats {
    pub(crate) d: f32,
    pub(crate) sum: [i32; 2],
}

/// The scale multiplier of a block whose largest magnitude is `amax`.
#[inline]
fn inverse_scale(amax: f32) -> (f32, f32) {
    if amax > 0.0 {
        (amax / 127.0, 127.0 / amax)
    } else {
        (0.0, 0.0)
    }
}

/// Quantizes one 32-element block with the fastest available code.
#[inline]
fn block(isa: Isa, x: &[f32], q: &mut [i8]) -> BlockStats {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.vector() == Isa::Avx512Vnni {
            // SAFETY: the ISA was detected; slices are 32 long.
            return unsafe { block_avx512(x, q) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: as above.
            return unsafe { block_avx2(x, q) };
        }
    }
    let _ = isa;
    block_scalar(x, q)
}

/// The scalar reference: every SIMD version must agree with it exactly.
pub(crate) fn block_scalar(x: &[f32], q: &mut [i8]) -> BlockStats {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, id) = inverse_scale(amax);
    let mut sum = [0i32; 2];
    for (i, (q, &v)) in q.iter_mut().zip(x).enumerate() {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *q = r;
        sum[i / 16] += r as i32;
    }
    BlockStats { d, sum }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn block_avx512(x: &[f32], q: &mut [i8]) -> BlockStats {
    use std::arch::x86_64::*;
    let v0 = _mm512_loadu_ps(x.as_ptr());
    let v1 = _mm512_loadu_ps(x.as_ptr().add(16));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    let (d, id) = inverse_scale(amax);
    let idv = _mm512_set1_ps(id);
    let lim = _mm512_set1_ps(127.0);
    let nlim = _mm512_set1_ps(-127.0);
    let r0 = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v0, idv), lim), nlim);
    let r1 = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v1, idv), lim), nlim);
    let i0 = _mm512_cvtps_epi32(r0);
    let i1 = _mm512_cvtps_epi32(r1);
    _mm_storeu_si128(q.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(i1));
    BlockStats {
        d,
        sum: [_mm512_reduce_add_epi32(i0), _mm512_reduce_add_epi32(i1)],
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(x: &[f32], q: &mut [i8]) -> BlockStats {
    use std::arch::x86_64::*;
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_andnot_ps(sign, v[0]);
    for &vi in &v[1..] {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, vi));
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
    let (d, id) = inverse_scale(_mm_cvtss_f32(m1));
    let idv = _mm256_set1_ps(id);
    let lim = _mm256_set1_ps(127.0);
    let nlim = _mm256_set1_ps(-127.0);
    let mut ints = [_mm256_setzero_si256(); 4];
    for (o, &vi) in ints.iter_mut().zip(&v) {
        let r = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(vi, idv), lim), nlim);
        *o = _mm256_cvtps_epi32(r);
    }
    // i32 → i16 → i8 with saturation; packs interleave 128-bit lanes, so restore order.
    let w01 = _mm256_packs_epi32(ints[0], ints[1]);
    let w23 = _mm256_packs_epi32(ints[2], ints[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr().cast(), b);
    let hsum = |a: __m256i, b: __m256i| {
        let s = _mm256_add_epi32(a, b);
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01));
        _mm_cvtsi128_si32(s1)
    };
    BlockStats {
        d,
        sum: [hsum(ints[0], ints[1]), hsum(ints[2], ints[3])],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seed: u32, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let v = (s as f32 / u32::MAX as f32 - 0.5) * 8.0;
                // Exact halves and zeros exercise the tie rule and the empty block.
                match i % 37 {
                    0 => 0.5,
                    1 => -1.5,
                    _ => v,
                }
            })
            .collect()
    }

    #[test]
    fn every_isa_matches_the_scalar_block_exactly() {
        let mut x = sample(7, 32 * 64);
        x[32..64].iter_mut().for_each(|v| *v = 0.0);
        for isa in Isa::available() {
            for blk in x.chunks_exact(32) {
                let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
                let s = block_scalar(blk, &mut a);
                let f = block(isa, blk, &mut b);
                assert_eq!(a, b, "{isa:?}");
                assert_eq!((s.d, s.sum), (f.d, f.sum), "{isa:?}");
            }
        }
    }

    #[test]
    fn dequantized_blocks_are_within_half_a_step() {
        let x = sample(3, 32 * 16);
        let mut a = QuantizedActivations::new();
        a.quantize(Isa::best(), &x, 4, 128).unwrap();
        for r in 0..4 {
            for c in 0..128 {
                let d = a.scale(r, c / 32);
                let back = d * a.row(r)[c] as f32;
                assert!((back - x[r * 128 + c]).abs() <= d * 0.5 + 1e-6);
            }
        }
    }
}
