//! AVX-512 VNNI kernels: one 32-bit lane per weight row, `vpdpbusd` of 16 rows × 4
//! columns against a broadcast of 4 activation bytes.
//!
//! Decode runs tiles of `S = 8` strips × one token (eight independent streams hide load
//! latency). Several tokens (batched decode, prompts in chunks of 8) run one strip at a
//! time ([`strip_tokens`]): a block's codes are unpacked once into registers and serve
//! every token, and software prefetch keeps the weights streaming while the longer
//! arithmetic runs. Helpers are `#[inline(always)]` and only called from the
//! `#[target_feature]` entry points, so every intrinsic inlines into AVX-512 code.
use std::arch::x86_64::*;
use std::ops::Range;
use std::ptr::read_unaligned;

use super::{bits_code, code, float_code, scale_code, Output};
use crate::packed::{StripLayout, STRIP};
use crate::{PackedMatrix, QuantizedActivations};

/// Activation pointers of one token.
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

/// Scales of one block for the 16 rows of a strip.
#[derive(Clone, Copy)]
pub(super) struct Scales {
    pub(super) dw: __m512,
    pub(super) mw: __m512,
    pub(super) s0: __m512i,
    pub(super) s1: __m512i,
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    _mm512_set1_epi32(read_unaligned(p.cast::<i32>()))
}

#[inline(always)]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

#[inline(always)]
unsafe fn negate(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(i32::MIN),
    ))
}

#[inline(always)]
pub(super) unsafe fn scales<const SC: u8>(st: *const u8, l: &StripLayout, b: usize) -> Scales {
    let bs = st.add(l.block_scales);
    let zero_i = _mm512_setzero_si512();
    let zero = _mm512_setzero_ps();
    match SC {
        code::BLOCK => Scales {
            dw: f16x16(bs.add(32 * b)),
            mw: zero,
            s0: zero_i,
            s1: zero_i,
        },
        code::BLOCK_MIN => Scales {
            dw: f16x16(bs.add(64 * b)),
            mw: f16x16(bs.add(64 * b + 32)),
            s0: zero_i,
            s1: zero_i,
        },
        code::KMIN => {
            let sup = st.add(l.super_scales + 64 * (b / 8));
            let sc =
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(bs.add(32 * b).cast())));
            let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                bs.add(32 * b + 16).cast(),
            )));
            Scales {
                dw: _mm512_mul_ps(f16x16(sup), sc),
                mw: negate(_mm512_mul_ps(f16x16(sup.add(32)), mn)),
                s0: zero_i,
                s1: zero_i,
            }
        }
        _ => Scales {
            dw: f16x16(st.add(l.super_scales + 64 * (b / 8))),
            mw: zero,
            s0: _mm512_cvtepi8_epi32(_mm_loadu_si128(bs.add(32 * b).cast())),
            s1: _mm512_cvtepi8_epi32(_mm_loadu_si128(bs.add(32 * b + 16).cast())),
        },
    }
}

/// Codes of group `g` of block `b`: columns `8g..8g+4` and `8g+4..8g+8` of 16 rows.
#[inline(always)]
pub(super) unsafe fn unpack<const BITS: u8>(
    st: *const u8,
    l: &StripLayout,
    b: usize,
    g: usize,
    m0f: __m512i,
) -> (__m512i, __m512i) {
    if BITS == code::B8 {
        let p = st.add(512 * b + 128 * g);
        return (
            _mm512_loadu_si512(p.cast()),
            _mm512_loadu_si512(p.add(64).cast()),
        );
    }
    let v = _mm512_loadu_si512(st.add(256 * b + 64 * g).cast());
    let mut lo = _mm512_and_si512(v, m0f);
    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f);
    if BITS == code::B5 {
        let m = st.add(l.masks + 64 * b + 16 * g);
        let sixteen = _mm512_set1_epi8(16);
        lo = _mm512_mask_add_epi8(lo, read_unaligned(m.cast::<u64>()), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, read_unaligned(m.add(8).cast::<u64>()), hi, sixteen);
    } else if BITS == code::B6 {
        let m = st.add(l.masks + 128 * b + 16 * g);
        let sixteen = _mm512_set1_epi8(16);
        let thirty_two = _mm512_set1_epi8(32);
        lo = _mm512_mask_add_epi8(lo, read_unaligned(m.cast::<u64>()), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, read_unaligned(m.add(8).cast::<u64>()), hi, sixteen);
        lo = _mm512_mask_add_epi8(lo, read_unaligned(m.add(64).cast::<u64>()), lo, thirty_two);
        hi = _mm512_mask_add_epi8(hi, read_unaligned(m.add(72).cast::<u64>()), hi, thirty_two);
    }
    (lo, hi)
}

/// Where a tile writes.
#[derive(Clone, Copy)]
pub(super) struct Dest {
    pub(super) out: *mut f32,
    pub(super) mask: __mmask16,
    pub(super) bias: *const f32,
}

#[inline(always)]
pub(super) unsafe fn store<const S: usize, const T: usize>(
    acc: &[[__m512; T]; S],
    dest: &[Dest; S],
    ld: usize,
) {
    for s in 0..S {
        let d = dest[s];
        let bias = (!d.bias.is_null()).then(|| _mm512_maskz_loadu_ps(d.mask, d.bias));
        for (t, &a) in acc[s].iter().enumerate() {
            let v = match bias {
                Some(bv) => _mm512_add_ps(a, bv),
                None => a,
            };
            _mm512_mask_storeu_ps(d.out.add(t * ld), d.mask, v);
        }
    }
}

/// `S` strips × `T` tokens of a quantized matrix.
#[inline(always)]
unsafe fn tile<const BITS: u8, const SC: u8, const Z: i32, const S: usize, const T: usize>(
    st: [*const u8; S],
    l: &StripLayout,
    tok: [Tok; T],
    dest: [Dest; S],
    ld: usize,
) {
    let m0f = _mm512_set1_epi8(0x0F);
    let zero_i = _mm512_setzero_si512();
    let mut accf = [[_mm512_setzero_ps(); T]; S];
    for b in 0..l.nb {
        let mut sc = [Scales {
            dw: _mm512_setzero_ps(),
            mw: _mm512_setzero_ps(),
            s0: zero_i,
            s1: zero_i,
        }; S];
        for s in 0..S {
            sc[s] = scales::<SC>(st[s], l, b);
        }
        let mut dx = [_mm512_setzero_ps(); T];
        for t in 0..T {
            dx[t] = _mm512_set1_ps(*tok[t].d.add(b));
        }
        let mut ints = [[zero_i; T]; S];
        if SC == code::K16 {
            for half in 0..2 {
                let mut acc = [[zero_i; T]; S];
                for t in 0..T {
                    let z = _mm512_set1_epi32(-Z * *tok[t].sum16.add(2 * b + half));
                    for a in acc.iter_mut() {
                        a[t] = z;
                    }
                }
                for g in 2 * half..2 * half + 2 {
                    let mut v = [(zero_i, zero_i); S];
                    for s in 0..S {
                        v[s] = unpack::<BITS>(st[s], l, b, g, m0f);
                    }
                    for t in 0..T {
                        let x0 = bcast4(tok[t].qs.add(32 * b + 8 * g));
                        let x1 = bcast4(tok[t].qs.add(32 * b + 8 * g + 4));
                        for s in 0..S {
                            acc[s][t] = _mm512_dpbusd_epi32(acc[s][t], v[s].0, x0);
                            acc[s][t] = _mm512_dpbusd_epi32(acc[s][t], v[s].1, x1);
                        }
                    }
                }
                for s in 0..S {
                    let sub = if half == 0 { sc[s].s0 } else { sc[s].s1 };
                    for t in 0..T {
                        ints[s][t] =
                            _mm512_add_epi32(ints[s][t], _mm512_mullo_epi32(acc[s][t], sub));
                    }
                }
            }
        } else {
            if Z != 0 {
                for t in 0..T {
                    let z = _mm512_set1_epi32(-Z * *tok[t].sum32.add(b));
                    for a in ints.iter_mut() {
                        a[t] = z;
                    }
                }
            }
            for g in 0..4 {
                let mut v = [(zero_i, zero_i); S];
                for s in 0..S {
                    v[s] = unpack::<BITS>(st[s], l, b, g, m0f);
                }
                for t in 0..T {
                    let x0 = bcast4(tok[t].qs.add(32 * b + 8 * g));
                    let x1 = bcast4(tok[t].qs.add(32 * b + 8 * g + 4));
                    for s in 0..S {
                        ints[s][t] = _mm512_dpbusd_epi32(ints[s][t], v[s].0, x0);
                        ints[s][t] = _mm512_dpbusd_epi32(ints[s][t], v[s].1, x1);
                    }
                }
            }
        }
        for s in 0..S {
            for t in 0..T {
                let scale = _mm512_mul_ps(sc[s].dw, dx[t]);
                accf[s][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints[s][t]), scale, accf[s][t]);
                if SC == code::BLOCK_MIN || SC == code::KMIN {
                    let ds = _mm512_set1_ps(*tok[t].dsum.add(b));
                    accf[s][t] = _mm512_fmadd_ps(sc[s].mw, ds, accf[s][t]);
                }
            }
        }
    }
    store(&accf, &dest, ld);
}

/// Blocks the batched kernel prefetches (into L2) ahead of the one it computes. A block
/// of several tokens takes long enough that the hardware prefetcher alone leaves the
/// loads of the next ones exposed, so streaming and arithmetic add up instead of
/// overlapping. Measured on a whole SmolLM2 decode step (`decode/step`, one thread):
/// 4 blocks ahead 9.9 ms at 8 tokens, 8 blocks 8.9 ms, 16 blocks 7.8 ms, 32 blocks 9.2 ms;
/// the L2 hint beat L1 (2 tokens: 6.0 ms against 7.7 ms at 8 blocks).
const AHEAD: usize = 16;

/// Prefetches every plane of block `b` of the strip at `st`, or of block `b − nb` of the
/// next strip in memory when `b` runs past the end (prefetches never fault, and the
/// pointers are only computed, with wrapping arithmetic, never dereferenced).
#[inline(always)]
unsafe fn prefetch<const BITS: u8, const SC: u8>(st: *const u8, l: &StripLayout, b: usize) {
    let (st, b) = if b < l.nb {
        (st, b)
    } else {
        (st.wrapping_add(l.stride), b - l.nb)
    };
    let line = |p: *const u8| _mm_prefetch::<_MM_HINT_T1>(p.cast());
    let data = if BITS == code::B8 { 512 } else { 256 };
    for i in (0..data).step_by(64) {
        line(st.wrapping_add(data * b + i));
    }
    match BITS {
        code::B5 => line(st.wrapping_add(l.masks + 64 * b)),
        code::B6 => {
            line(st.wrapping_add(l.masks + 128 * b));
            line(st.wrapping_add(l.masks + 128 * b + 64));
        }
        _ => {}
    }
    let scales = if SC == code::BLOCK_MIN { 64 } else { 32 };
    line(st.wrapping_add(l.block_scales + scales * b));
    if SC == code::KMIN || SC == code::K16 {
        line(st.wrapping_add(l.super_scales + 64 * (b / 8)));
    }
}

/// One strip × `T` tokens (`T ≥ 2`): a block's eight code vectors are unpacked once and
/// stay in registers while every token runs its dot products against them, activation
/// bytes coming straight from memory as broadcast operands. Each token needs only its
/// float accumulator across blocks, so up to eight tokens fit the 32 registers without
/// spilling; the float steps per block are exactly [`tile`]'s.
#[inline(always)]
unsafe fn strip_tokens<const BITS: u8, const SC: u8, const Z: i32, const T: usize>(
    st: *const u8,
    l: &StripLayout,
    tok: [Tok; T],
    dest: Dest,
    ld: usize,
) {
    let m0f = _mm512_set1_epi8(0x0F);
    let zero_i = _mm512_setzero_si512();
    let mut accf = [_mm512_setzero_ps(); T];
    for b in 0..l.nb {
        prefetch::<BITS, SC>(st, l, b + AHEAD);
        let sc = scales::<SC>(st, l, b);
        let mut w = [zero_i; 8];
        for g in 0..4 {
            (w[2 * g], w[2 * g + 1]) = unpack::<BITS>(st, l, b, g, m0f);
        }
        for t in 0..T {
            // `w[i]` holds columns `4i..4i + 4` of the block. Two partial sums halve the
            // dependency chain; integer sums are exact in any order.
            let x = tok[t].qs.add(32 * b);
            let ints = if SC == code::K16 {
                let mut part = [zero_i; 2];
                for half in 0..2 {
                    let mut a = _mm512_set1_epi32(-Z * *tok[t].sum16.add(2 * b + half));
                    let mut c = zero_i;
                    for i in (4 * half..4 * half + 4).step_by(2) {
                        a = _mm512_dpbusd_epi32(a, w[i], bcast4(x.add(4 * i)));
                        c = _mm512_dpbusd_epi32(c, w[i + 1], bcast4(x.add(4 * i + 4)));
                    }
                    part[half] = _mm512_add_epi32(a, c);
                }
                _mm512_add_epi32(
                    _mm512_mullo_epi32(part[0], sc.s0),
                    _mm512_mullo_epi32(part[1], sc.s1),
                )
            } else {
                let mut a = if Z != 0 {
                    _mm512_set1_epi32(-Z * *tok[t].sum32.add(b))
                } else {
                    zero_i
                };
                if T >= CHAIN_TOKENS {
                    // Enough tokens' chains interleave to hide the latency: one chain, one
                    // instruction fewer per token and block.
                    for (i, &wi) in w.iter().enumerate() {
                        a = _mm512_dpbusd_epi32(a, wi, bcast4(x.add(4 * i)));
                    }
                    a
                } else {
                    let mut c = zero_i;
                    for i in (0..8).step_by(2) {
                        a = _mm512_dpbusd_epi32(a, w[i], bcast4(x.add(4 * i)));
                        c = _mm512_dpbusd_epi32(c, w[i + 1], bcast4(x.add(4 * i + 4)));
                    }
                    _mm512_add_epi32(a, c)
                }
            };
            let scale = _mm512_mul_ps(sc.dw, _mm512_set1_ps(*tok[t].d.add(b)));
            accf[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), scale, accf[t]);
            if SC == code::BLOCK_MIN || SC == code::KMIN {
                let ds = _mm512_set1_ps(*tok[t].dsum.add(b));
                accf[t] = _mm512_fmadd_ps(sc.mw, ds, accf[t]);
            }
        }
    }
    store(&[accf], &[dest], ld);
}

/// The pointers of strip `s` for tokens starting at `t0`.
#[inline(always)]
pub(super) unsafe fn dest(out: &Output, s: usize, t0: usize) -> Dest {
    let valid = out.rows.saturating_sub(s * STRIP).min(STRIP);
    Dest {
        out: out.ptr.add(t0 * out.ld + s * STRIP),
        mask: if valid >= STRIP {
            0xFFFF
        } else {
            (1u16 << valid) - 1
        },
        bias: if out.bias.is_null() {
            std::ptr::null()
        } else {
            out.bias.add(s * STRIP)
        },
    }
}

/// Fewest tokens of [`strip_tokens`] that sum a block's eight products in one dependency
/// chain per token (integer sums: the same result either way).
const CHAIN_TOKENS: usize = 6;

/// Tokens per prompt tile.
const TOKENS: usize = 8;

/// Most tokens of a call that runs 5-bit codes through [`strip_tokens`]: prompts of
/// 5-bit formats keep [`tile`], which measured faster there (Q5_0, 128 tokens of a
/// 4864 × 896 matrix: 3.6 ms against 3.7–4.0 ms); every other format's prompts are
/// faster with [`strip_tokens`] (Q4_1 −4%, Q4_K −2%, Q6_K −4%).
const BATCH: usize = 16;

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
            4 => {
                const $T: usize = 4;
                $body
            }
            5 => {
                const $T: usize = 5;
                $body
            }
            6 => {
                const $T: usize = 6;
                $body
            }
            7 => {
                const $T: usize = 7;
                $body
            }
            _ => {
                const $T: usize = 8;
                $body
            }
        }
    };
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn run_quantized<const BITS: u8, const SC: u8, const Z: i32>(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    let l = w.layout();
    let base = w.strip(0).as_ptr();
    let sp = |s: usize| base.add(s * l.stride);
    if tokens.len() == 1 {
        let t = tokens.start;
        let tok = [Tok::new(act, t)];
        let mut s = strips.start;
        while s + 8 <= strips.end {
            tile::<BITS, SC, Z, 8, 1>(
                std::array::from_fn(|i| sp(s + i)),
                &l,
                tok,
                std::array::from_fn(|i| dest(&out, s + i, t)),
                out.ld,
            );
            s += 8;
        }
        while s + 4 <= strips.end {
            tile::<BITS, SC, Z, 4, 1>(
                [sp(s), sp(s + 1), sp(s + 2), sp(s + 3)],
                &l,
                tok,
                [
                    dest(&out, s, t),
                    dest(&out, s + 1, t),
                    dest(&out, s + 2, t),
                    dest(&out, s + 3, t),
                ],
                out.ld,
            );
            s += 4;
        }
        for s in s..strips.end {
            tile::<BITS, SC, Z, 1, 1>([sp(s)], &l, tok, [dest(&out, s, t)], out.ld);
        }
        return;
    }
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let tt = (tokens.end - t0).min(TOKENS);
        by_tokens!(tt, |T| {
            let tok: [Tok; T] = std::array::from_fn(|i| Tok::new(act, t0 + i));
            for s in strips.clone() {
                if BITS == code::B5 && tokens.len() > BATCH {
                    tile::<BITS, SC, Z, 1, T>([sp(s)], &l, tok, [dest(&out, s, t0)], out.ld);
                } else {
                    strip_tokens::<BITS, SC, Z, T>(sp(s), &l, tok, dest(&out, s, t0), out.ld);
                }
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
unsafe fn load_f<const F: u8>(p: *const u8) -> __m512 {
    match F {
        0 => _mm512_loadu_ps(p.cast()),
        1 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        ))),
    }
}

/// `S` strips × `T` tokens of a float matrix.
#[inline(always)]
unsafe fn float_tile<const F: u8, const S: usize, const T: usize>(
    st: [*const u8; S],
    cols: usize,
    x: [*const f32; T],
    dest: [Dest; S],
    ld: usize,
) {
    let size = if F == 0 { 4 } else { 2 };
    let mut acc = [[_mm512_setzero_ps(); T]; S];
    for k in 0..cols {
        let mut wv = [_mm512_setzero_ps(); S];
        for s in 0..S {
            wv[s] = load_f::<F>(st[s].add(k * STRIP * size));
        }
        for t in 0..T {
            let xv = _mm512_set1_ps(*x[t].add(k));
            for s in 0..S {
                acc[s][t] = _mm512_fmadd_ps(wv[s], xv, acc[s][t]);
            }
        }
    }
    store(&acc, &dest, ld);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn run_float<const F: u8>(
    w: &PackedMatrix,
    strips: Range<usize>,
    x: &[f32],
    tokens: Range<usize>,
    out: Output,
) {
    let (cols, stride) = (w.cols(), w.layout().stride);
    let base = w.strip(0).as_ptr();
    let sp = |s: usize| base.add(s * stride);
    let xp = |t: usize| x.as_ptr().add(t * cols);
    if tokens.len() == 1 {
        let t = tokens.start;
        let mut s = strips.start;
        while s + 4 <= strips.end {
            float_tile::<F, 4, 1>(
                [sp(s), sp(s + 1), sp(s + 2), sp(s + 3)],
                cols,
                [xp(t)],
                [
                    dest(&out, s, t),
                    dest(&out, s + 1, t),
                    dest(&out, s + 2, t),
                    dest(&out, s + 3, t),
                ],
                out.ld,
            );
            s += 4;
        }
        for s in s..strips.end {
            float_tile::<F, 1, 1>([sp(s)], cols, [xp(t)], [dest(&out, s, t)], out.ld);
        }
        return;
    }
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let tt = (tokens.end - t0).min(TOKENS);
        by_tokens!(tt, |T| {
            let xs: [*const f32; T] = std::array::from_fn(|i| xp(t0 + i));
            for s in strips.clone() {
                float_tile::<F, 1, T>([sp(s)], cols, xs, [dest(&out, s, t0)], out.ld);
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
