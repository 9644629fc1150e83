//! AVX2 kernels: the strip layout read as two halves of 8 rows, `vpmaddubsw` +
//! `vpmaddwd` standing in for `vpdpbusd`.
//!
//! `vpmaddubsw` saturates pairs at ±32767; codes up to 6 bits stay far below that, and
//! 8-bit codes (Q8_0) are turned back into signed values and multiplied as
//! `|w| · sign(x, w)` (at most 2 · 128 · 127), so the integer sums equal the AVX-512 ones.
use std::arch::x86_64::*;
use std::ops::Range;
use std::ptr::read_unaligned;

use super::{bits_code, code, float_code, scale_code, Output};
use crate::packed::{StripLayout, STRIP};
use crate::{PackedMatrix, QuantizedActivations};

const HALF: usize = 8;

#[derive(Clone, Copy)]
struct Tok {
    qs: *const u8,
    d: *const f32,
    sum32: *const i32,
    dsum: *const f32,
    sum16: *const i32,
}

impl Tok {
    #[inline(always)]
    unsafe fn new(a: &QuantizedActivations, t: usize) -> Self {
        let (cols, nb) = (a.cols(), a.cols() / 32);
        Tok {
            qs: a.qs.as_ptr().add(t * cols).cast(),
            d: a.d.as_ptr().add(t * nb),
            sum32: a.sum32.as_ptr().add(t * nb),
            dsum: a.dsum.as_ptr().add(t * nb),
            sum16: a.sum16.as_ptr().add(2 * t * nb),
        }
    }
}

/// One half-strip: the strip's bytes and which half (0: rows 0–7, 1: rows 8–15).
#[derive(Clone, Copy)]
struct Half {
    st: *const u8,
    h: usize,
}

#[derive(Clone, Copy)]
struct Scales {
    dw: __m256,
    mw: __m256,
    s0: __m256i,
    s1: __m256i,
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m256i {
    _mm256_set1_epi32(read_unaligned(p.cast::<i32>()))
}

#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

#[inline(always)]
unsafe fn scales<const SC: u8>(hs: Half, l: &StripLayout, b: usize) -> Scales {
    let (st, h) = (hs.st, hs.h);
    let bs = st.add(l.block_scales);
    let zero_i = _mm256_setzero_si256();
    let zero = _mm256_setzero_ps();
    match SC {
        code::BLOCK => Scales {
            dw: f16x8(bs.add(32 * b + 16 * h)),
            mw: zero,
            s0: zero_i,
            s1: zero_i,
        },
        code::BLOCK_MIN => Scales {
            dw: f16x8(bs.add(64 * b + 16 * h)),
            mw: f16x8(bs.add(64 * b + 32 + 16 * h)),
            s0: zero_i,
            s1: zero_i,
        },
        code::KMIN => {
            let sup = st.add(l.super_scales + 64 * (b / 8) + 16 * h);
            let u8x8 =
                |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())));
            let sc = u8x8(bs.add(32 * b + 8 * h));
            let mn = u8x8(bs.add(32 * b + 16 + 8 * h));
            let neg = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
            Scales {
                dw: _mm256_mul_ps(f16x8(sup), sc),
                mw: _mm256_xor_ps(_mm256_mul_ps(f16x8(sup.add(32)), mn), neg),
                s0: zero_i,
                s1: zero_i,
            }
        }
        _ => Scales {
            dw: f16x8(st.add(l.super_scales + 64 * (b / 8) + 16 * h)),
            mw: zero,
            s0: _mm256_cvtepi8_epi32(_mm_loadl_epi64(bs.add(32 * b + 8 * h).cast())),
            s1: _mm256_cvtepi8_epi32(_mm_loadl_epi64(bs.add(32 * b + 16 + 8 * h).cast())),
        },
    }
}

/// 0x10-or-zero bytes from the 32 mask bits at `p` (bit `i` ↔ byte `i`).
#[inline(always)]
unsafe fn mask_bytes(p: *const u8, value: i8) -> __m256i {
    let m = _mm256_set1_epi32(read_unaligned(p.cast::<i32>()));
    let pick = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let bytes = _mm256_and_si256(_mm256_shuffle_epi8(m, pick), bit);
    _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(value))
}

/// Codes of group `g` of block `b` for 8 rows: columns `8g..8g+4` and `8g+4..8g+8`.
#[inline(always)]
unsafe fn unpack<const BITS: u8>(
    hs: Half,
    l: &StripLayout,
    b: usize,
    g: usize,
    m0f: __m256i,
) -> (__m256i, __m256i) {
    let (st, h) = (hs.st, hs.h);
    if BITS == code::B8 {
        let p = st.add(512 * b + 128 * g + 32 * h);
        let flip = _mm256_set1_epi8(-128);
        return (
            _mm256_xor_si256(_mm256_loadu_si256(p.cast()), flip),
            _mm256_xor_si256(_mm256_loadu_si256(p.add(64).cast()), flip),
        );
    }
    let v = _mm256_loadu_si256(st.add(256 * b + 64 * g + 32 * h).cast());
    let mut lo = _mm256_and_si256(v, m0f);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
    if BITS == code::B5 {
        let m = st.add(l.masks + 64 * b + 16 * g + 4 * h);
        lo = _mm256_or_si256(lo, mask_bytes(m, 16));
        hi = _mm256_or_si256(hi, mask_bytes(m.add(8), 16));
    } else if BITS == code::B6 {
        let m = st.add(l.masks + 128 * b + 16 * g + 4 * h);
        lo = _mm256_or_si256(lo, mask_bytes(m, 16));
        hi = _mm256_or_si256(hi, mask_bytes(m.add(8), 16));
        lo = _mm256_or_si256(lo, mask_bytes(m.add(64), 32));
        hi = _mm256_or_si256(hi, mask_bytes(m.add(72), 32));
    }
    (lo, hi)
}

/// `acc + Σ` of four u8 × i8 products per lane (or, for 8-bit codes, i8 × i8).
#[inline(always)]
unsafe fn dot4<const BITS: u8>(acc: __m256i, w: __m256i, x: __m256i, ones: __m256i) -> __m256i {
    let pairs = if BITS == code::B8 {
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    } else {
        _mm256_maddubs_epi16(w, x)
    };
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones))
}

#[derive(Clone, Copy)]
struct Dest {
    out: *mut f32,
    valid: usize,
    bias: *const f32,
}

#[inline(always)]
unsafe fn store<const H: usize, const T: usize>(
    acc: &[[__m256; T]; H],
    dest: &[Dest; H],
    ld: usize,
) {
    for s in 0..H {
        let d = dest[s];
        for (t, &a) in acc[s].iter().enumerate() {
            let mut lanes = [0f32; HALF];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            let o = d.out.add(t * ld);
            for (i, &v) in lanes.iter().enumerate().take(d.valid) {
                *o.add(i) = if d.bias.is_null() {
                    v
                } else {
                    v + *d.bias.add(i)
                };
            }
        }
    }
}

#[inline(always)]
unsafe fn tile<const BITS: u8, const SC: u8, const Z: i32, const H: usize, const T: usize>(
    hs: [Half; H],
    l: &StripLayout,
    tok: [Tok; T],
    dest: [Dest; H],
    ld: usize,
) {
    let m0f = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let zero_i = _mm256_setzero_si256();
    // 8-bit codes are multiplied as signed values, so they need no zero point.
    let z = if BITS == code::B8 { 0 } else { Z };
    let mut accf = [[_mm256_setzero_ps(); T]; H];
    for b in 0..l.nb {
        let mut sc = [Scales {
            dw: _mm256_setzero_ps(),
            mw: _mm256_setzero_ps(),
            s0: zero_i,
            s1: zero_i,
        }; H];
        for s in 0..H {
            sc[s] = scales::<SC>(hs[s], l, b);
        }
        let mut ints = [[zero_i; T]; H];
        if SC == code::K16 {
            for half in 0..2 {
                let mut acc = [[zero_i; T]; H];
                for t in 0..T {
                    let zv = _mm256_set1_epi32(-z * *tok[t].sum16.add(2 * b + half));
                    for a in acc.iter_mut() {
                        a[t] = zv;
                    }
                }
                for g in 2 * half..2 * half + 2 {
                    let mut v = [(zero_i, zero_i); H];
                    for s in 0..H {
                        v[s] = unpack::<BITS>(hs[s], l, b, g, m0f);
                    }
                    for t in 0..T {
                        let x0 = bcast4(tok[t].qs.add(32 * b + 8 * g));
                        let x1 = bcast4(tok[t].qs.add(32 * b + 8 * g + 4));
                        for s in 0..H {
                            acc[s][t] = dot4::<BITS>(acc[s][t], v[s].0, x0, ones);
                            acc[s][t] = dot4::<BITS>(acc[s][t], v[s].1, x1, ones);
                        }
                    }
                }
                for s in 0..H {
                    let sub = if half == 0 { sc[s].s0 } else { sc[s].s1 };
                    for t in 0..T {
                        ints[s][t] =
                            _mm256_add_epi32(ints[s][t], _mm256_mullo_epi32(acc[s][t], sub));
                    }
                }
            }
        } else {
            if z != 0 {
                for t in 0..T {
                    let zv = _mm256_set1_epi32(-z * *tok[t].sum32.add(b));
                    for a in ints.iter_mut() {
                        a[t] = zv;
                    }
                }
            }
            for g in 0..4 {
                let mut v = [(zero_i, zero_i); H];
                for s in 0..H {
                    v[s] = unpack::<BITS>(hs[s], l, b, g, m0f);
                }
                for t in 0..T {
                    let x0 = bcast4(tok[t].qs.add(32 * b + 8 * g));
                    let x1 = bcast4(tok[t].qs.add(32 * b + 8 * g + 4));
                    for s in 0..H {
                        ints[s][t] = dot4::<BITS>(ints[s][t], v[s].0, x0, ones);
                        ints[s][t] = dot4::<BITS>(ints[s][t], v[s].1, x1, ones);
                    }
                }
            }
        }
        for t in 0..T {
            let dx = _mm256_set1_ps(*tok[t].d.add(b));
            for s in 0..H {
                let scale = _mm256_mul_ps(sc[s].dw, dx);
                accf[s][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints[s][t]), scale, accf[s][t]);
                if SC == code::BLOCK_MIN || SC == code::KMIN {
                    let ds = _mm256_set1_ps(*tok[t].dsum.add(b));
                    accf[s][t] = _mm256_fmadd_ps(sc[s].mw, ds, accf[s][t]);
                }
            }
        }
    }
    store(&accf, &dest, ld);
}

/// Half-strip `i` (strip `i / 2`) for tokens starting at `t0`.
#[inline(always)]
unsafe fn dest(out: &Output, i: usize, t0: usize) -> Dest {
    let row0 = i * HALF;
    Dest {
        out: out.ptr.add(t0 * out.ld + row0),
        valid: out.rows.saturating_sub(row0).min(HALF),
        bias: if out.bias.is_null() {
            std::ptr::null()
        } else {
            out.bias.add(row0)
        },
    }
}

const TOKENS: usize = 4;

macro_rules! by_tokens {
    ($tt:expr, |$T:ident| $body:expr) => {
        match $tt {
            1 => {
                const $T: usize = 1;
                $body
            }
            2 => {
                const $T: usize = 2;
                $body
            }
            3 => {
                const $T: usize = 3;
                $body
            }
            _ => {
                const $T: usize = 4;
                $body
            }
        }
    };
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_quantized<const BITS: u8, const SC: u8, const Z: i32>(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    let l = w.layout();
    let base = w.strip(0).as_ptr();
    let hp = |i: usize| Half {
        st: base.add((i / 2) * l.stride),
        h: i % 2,
    };
    let halves = 2 * strips.start..2 * strips.end;
    if tokens.len() == 1 {
        let t = tokens.start;
        let tok = [Tok::new(act, t)];
        let mut i = halves.start;
        while i + 4 <= halves.end {
            tile::<BITS, SC, Z, 4, 1>(
                [hp(i), hp(i + 1), hp(i + 2), hp(i + 3)],
                &l,
                tok,
                [
                    dest(&out, i, t),
                    dest(&out, i + 1, t),
                    dest(&out, i + 2, t),
                    dest(&out, i + 3, t),
                ],
                out.ld,
            );
            i += 4;
        }
        for i in i..halves.end {
            tile::<BITS, SC, Z, 1, 1>([hp(i)], &l, tok, [dest(&out, i, t)], out.ld);
        }
        return;
    }
    // 5- and 6-bit codes need three more constant registers to expand their high bits;
    // two tokens per tile keep everything in the 16 ymm registers.
    let per_tile = if BITS == code::B5 || BITS == code::B6 {
        2
    } else {
        TOKENS
    };
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let tt = (tokens.end - t0).min(per_tile);
        by_tokens!(tt, |T| {
            let tok: [Tok; T] = std::array::from_fn(|k| Tok::new(act, t0 + k));
            for i in halves.clone() {
                tile::<BITS, SC, Z, 1, T>([hp(i)], &l, tok, [dest(&out, i, t0)], out.ld);
            }
        });
        t0 += tt;
    }
}

pub(super) unsafe fn quantized(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    let Some(sch) = w.scheme() else { return };
    use code::*;
    match (bits_code(sch.bits), scale_code(sch.scales), sch.zero) {
        (B4, BLOCK, 8) => run_quantized::<B4, BLOCK, 8>(w, strips, act, tokens, out),
        (B4, BLOCK_MIN, 0) => run_quantized::<B4, BLOCK_MIN, 0>(w, strips, act, tokens, out),
        (B5, BLOCK, 16) => run_quantized::<B5, BLOCK, 16>(w, strips, act, tokens, out),
        (B5, BLOCK_MIN, 0) => run_quantized::<B5, BLOCK_MIN, 0>(w, strips, act, tokens, out),
        (B8, BLOCK, 128) => run_quantized::<B8, BLOCK, 128>(w, strips, act, tokens, out),
        (B4, KMIN, 0) => run_quantized::<B4, KMIN, 0>(w, strips, act, tokens, out),
        (B5, KMIN, 0) => run_quantized::<B5, KMIN, 0>(w, strips, act, tokens, out),
        (B6, K16, 32) => run_quantized::<B6, K16, 32>(w, strips, act, tokens, out),
        _ => super::scalar::quantized(w, strips, act, tokens, out),
    }
}

#[inline(always)]
unsafe fn load_f<const F: u8>(p: *const u8) -> __m256 {
    match F {
        0 => _mm256_loadu_ps(p.cast()),
        1 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        ))),
    }
}

#[inline(always)]
unsafe fn float_tile<const F: u8, const H: usize, const T: usize>(
    hs: [Half; H],
    cols: usize,
    x: [*const f32; T],
    dest: [Dest; H],
    ld: usize,
) {
    let size = if F == 0 { 4 } else { 2 };
    let mut acc = [[_mm256_setzero_ps(); T]; H];
    for k in 0..cols {
        let mut wv = [_mm256_setzero_ps(); H];
        for s in 0..H {
            wv[s] = load_f::<F>(hs[s].st.add((k * STRIP + HALF * hs[s].h) * size));
        }
        for t in 0..T {
            let xv = _mm256_set1_ps(*x[t].add(k));
            for s in 0..H {
                acc[s][t] = _mm256_fmadd_ps(wv[s], xv, acc[s][t]);
            }
        }
    }
    store(&acc, &dest, ld);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_float<const F: u8>(
    w: &PackedMatrix,
    strips: Range<usize>,
    x: &[f32],
    tokens: Range<usize>,
    out: Output,
) {
    let (cols, stride) = (w.cols(), w.layout().stride);
    let base = w.strip(0).as_ptr();
    let hp = |i: usize| Half {
        st: base.add((i / 2) * stride),
        h: i % 2,
    };
    let xp = |t: usize| x.as_ptr().add(t * cols);
    let halves = 2 * strips.start..2 * strips.end;
    if tokens.len() == 1 {
        let t = tokens.start;
        let mut i = halves.start;
        while i + 4 <= halves.end {
            float_tile::<F, 4, 1>(
                [hp(i), hp(i + 1), hp(i + 2), hp(i + 3)],
                cols,
                [xp(t)],
                [
                    dest(&out, i, t),
                    dest(&out, i + 1, t),
                    dest(&out, i + 2, t),
                    dest(&out, i + 3, t),
                ],
                out.ld,
            );
            i += 4;
        }
        for i in i..halves.end {
            float_tile::<F, 1, 1>([hp(i)], cols, [xp(t)], [dest(&out, i, t)], out.ld);
        }
        return;
    }
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let tt = (tokens.end - t0).min(TOKENS);
        by_tokens!(tt, |T| {
            let xs: [*const f32; T] = std::array::from_fn(|k| xp(t0 + k));
            for i in halves.clone() {
                float_tile::<F, 1, T>([hp(i)], cols, xs, [dest(&out, i, t0)], out.ld);
            }
        });
        t0 += tt;
    }
}

pub(super) unsafe fn float(
    w: &PackedMatrix,
    strips: Range<usize>,
    x: &[f32],
    tokens: Range<usize>,
    out: Output,
) {
    match float_code(w.format()) {
        0 => run_float::<0>(w, strips, x, tokens, out),
        1 => run_float::<1>(w, strips, x, tokens, out),
        _ => run_float::<2>(w, strips, x, tokens, out),
    }
}
