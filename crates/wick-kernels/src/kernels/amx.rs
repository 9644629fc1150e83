//! AMX kernels for quantized products of many tokens: the tile unit computes each block's
//! integer dot products for 16 tokens × 16 rows at once, AVX-512 applies the scales.
//!
//! For one strip (16 rows) of a unit, the codes of every block are first unpacked once
//! into a scratch buffer, as the right operand of `tdpbssd` wants them — eight rows of 64
//! bytes per 32-column block, row `k` holding columns `4k .. 4k + 4` of all 16 weight
//! rows (the strip layout's own order), each code minus its zero point as a signed byte
//! — and the block scales as f32 vectors. Then each tile of 16 tokens runs through the
//! blocks: the tile unit multiplies the tokens' 32 activation bytes of block `b` (left
//! operand, read straight from the quantized activations) by the block's codes, giving
//! 16 × 16 exact sums `Σ (q − z)·x` — the integers the VNNI kernels compute — and the
//! vector code turns them into floats with the same multiply and fused multiply-adds in
//! the same block order as [`super::avx512`], so the result is bit for bit theirs. While
//! it does, the tile unit already computes block `b + 1` into the other pair of
//! accumulator tiles.
//!
//! Q6_K's sub-blocks of 16 columns have scales of their own: two products of 16 columns
//! per block, combined as `p₀·s₀ + p₁·s₁` in f32, which is exact (|p·s| < 2²³, the sum
//! < 2²⁴), so it equals the VNNI kernels' integer sum converted.
//!
//! Tokens that do not fill a tile of 16 go to the AVX-512 kernels (the same bits).
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::avx512::{self, dest, scales, unpack};
use super::{bits_code, code, scale_code, Output, TILE_TOKENS};
use crate::amx::TileConfig;
use crate::packed::StripLayout;
use crate::{PackedMatrix, QuantizedActivations};

/// 32-column blocks: tiles 0–3 hold the sums of four consecutive blocks, 4 and 5 their
/// activations (16 tokens × 32 bytes), 6 and 7 their codes (8 × 64 bytes), alternating
/// between consecutive blocks. A tile is not renamed: loading the next block's operands
/// into tiles a product still reads, or starting a product in a result tile not yet
/// stored, waits for it, so several blocks are kept in flight.
static CONFIG_32: TileConfig = TileConfig::new([
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 32),
    (16, 32),
    (8, 64),
    (8, 64),
]);

/// 16-column sub-blocks (Q6_K): tiles 0, 1 the two halves of one block, 2, 3 of the
/// next; 4, 5 the halves' activations (16 tokens × 16 bytes), 6, 7 their codes (4 × 64
/// bytes).
static CONFIG_16: TileConfig = TileConfig::new([
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 16),
    (16, 16),
    (4, 64),
    (4, 64),
]);

/// Blocks a tile's stored sums wait before they are scaled: loads right behind the
/// tile store stall until it completes.
const DEFER: usize = 2;
/// Blocks of stored sums kept (more than [`DEFER`]).
const RING: usize = 4;

/// Bytes of unpacked codes per block.
const BLOCK_BYTES: usize = 512;
/// Scale vectors kept per block: `dw`, `mw`, and Q6_K's two sub-block scales.
const SCALE_VECS: usize = 4;

/// One thread's scratch: unpacked codes and scales of a strip, and the integer sums of
/// the block being scaled.
#[derive(Default)]
struct Scratch {
    codes: Vec<__m512i>,
    scales: Vec<__m512>,
    sums: Vec<__m512i>,
}

impl Scratch {
    /// Grows the buffers to at least these lengths. They never shrink: calls alternate
    /// between matrices of different widths, and `resize` back up would refill the
    /// regrown part each time (a memset of 78 KB per unit of a 4,864-column matrix).
    fn reserve(&mut self, codes: usize, scales: usize, sums: usize) {
        // SAFETY: all-zero bits are a valid vector of any lane type.
        let (zi, zf) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        if self.codes.len() < codes {
            self.codes.resize(codes, zi);
        }
        if self.scales.len() < scales {
            self.scales.resize(scales, zf);
        }
        if self.sums.len() < sums {
            self.sums.resize(sums, zi);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `C(tile c) = A(tile ta) · B(tile tb)` for the left operand at `a` (rows `stride`
/// bytes apart) and the right one at `b` (64-byte rows).
macro_rules! product {
    ($c:literal, $ta:literal, $tb:literal, $a:expr, $stride:expr, $b:expr) => {
        asm!(
            concat!("tilezero tmm", $c),
            concat!("tileloadd tmm", $ta, ", [{a} + {sa}*1]"),
            concat!("tileloadd tmm", $tb, ", [{b} + {sb}*1]"),
            concat!("tdpbssd tmm", $c, ", tmm", $ta, ", tmm", $tb),
            a = in(reg) $a,
            sa = in(reg) $stride,
            b = in(reg) $b,
            sb = in(reg) 64usize,
            options(nostack, readonly),
        )
    };
}

/// Stores tile `c` (16 rows of 64 bytes) at `to`.
macro_rules! store_tile {
    ($c:literal, $to:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $c),
            p = in(reg) $to,
            s = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// Unpacks strip `st`'s codes (minus the zero point) and scales into the scratch.
#[inline(always)]
unsafe fn unpack_strip<const BITS: u8, const SC: u8, const Z: i32>(
    st: *const u8,
    l: &StripLayout,
    codes: *mut __m512i,
    scale_out: *mut __m512,
) {
    let m0f = _mm512_set1_epi8(0x0F);
    // `Z` as a byte: 128 wraps to −128, and `q − (−128)` wraps to `q − 128` all the same.
    let z = _mm512_set1_epi8(Z as i8);
    for b in 0..l.nb {
        let out = codes.add(8 * b);
        for g in 0..4 {
            let (lo, hi) = unpack::<BITS>(st, l, b, g, m0f);
            *out.add(2 * g) = _mm512_sub_epi8(lo, z);
            *out.add(2 * g + 1) = _mm512_sub_epi8(hi, z);
        }
        let sc = scales::<SC>(st, l, b);
        let s = scale_out.add(SCALE_VECS * b);
        *s = sc.dw;
        *s.add(1) = sc.mw;
        *s.add(2) = _mm512_cvtepi32_ps(sc.s0);
        *s.add(3) = _mm512_cvtepi32_ps(sc.s1);
    }
}

/// Block `b`'s sums, as a 16 × 16 tile of i32 at `sums` (Q6_K: two tiles, the halves),
/// into the accumulators of the tile's tokens; `dx` and `dsum` hold the tokens' scales
/// and scaled sums of this block, one float per token.
#[inline(always)]
unsafe fn scale_block<const SC: u8>(
    acc: &mut [__m512; TILE_TOKENS],
    sums: *const __m512i,
    scale: *const __m512,
    dx: *const f32,
    dsum: *const f32,
) {
    let dw = *scale;
    let mw = *scale.add(1);
    for (t, a) in acc.iter_mut().enumerate() {
        let ints = if SC == code::K16 {
            let p0 = _mm512_cvtepi32_ps(*sums.add(t));
            let p1 = _mm512_cvtepi32_ps(*sums.add(TILE_TOKENS + t));
            _mm512_fmadd_ps(p1, *scale.add(3), _mm512_mul_ps(p0, *scale.add(2)))
        } else {
            _mm512_cvtepi32_ps(*sums.add(t))
        };
        let s = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(t)));
        *a = _mm512_fmadd_ps(ints, s, *a);
        if SC == code::BLOCK_MIN || SC == code::KMIN {
            *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(*dsum.add(t)), *a);
        }
    }
}

/// Blocks in flight, each in its own set of result tiles: two (four measured slower for
/// 32-column blocks: 208 against 254 GMAC/s on a 4864 × 896 Q5_0 matrix, 128 tokens).
const fn sets(_sc: u8) -> usize {
    2
}

/// Starts block `b`'s products into the accumulator tiles of `set` (below
/// [`sets`]); operand tiles alternate between consecutive blocks.
#[inline(always)]
unsafe fn start<const SC: u8>(set: usize, x: *const u8, cols: usize, codes: *const u8, b: usize) {
    let a = x.add(32 * b);
    let w = codes.add(BLOCK_BYTES * b);
    if SC == code::K16 {
        if set == 0 {
            product!(0, 4, 6, a, cols, w);
            product!(1, 5, 7, a.add(16), cols, w.add(256));
        } else {
            product!(2, 4, 6, a, cols, w);
            product!(3, 5, 7, a.add(16), cols, w.add(256));
        }
        return;
    }
    match set {
        0 => product!(0, 4, 6, a, cols, w),
        1 => product!(1, 5, 7, a, cols, w),
        2 => product!(2, 4, 6, a, cols, w),
        _ => product!(3, 5, 7, a, cols, w),
    }
}

/// Stores the accumulator tiles of `set` at `to`.
#[inline(always)]
unsafe fn finish<const SC: u8>(set: usize, to: *mut __m512i) {
    if SC == code::K16 {
        if set == 0 {
            store_tile!(0, to);
            store_tile!(1, to.add(TILE_TOKENS));
        } else {
            store_tile!(2, to);
            store_tile!(3, to.add(TILE_TOKENS));
        }
        return;
    }
    match set {
        0 => store_tile!(0, to),
        1 => store_tile!(1, to),
        2 => store_tile!(2, to),
        _ => store_tile!(3, to),
    }
}

/// Strips `strips` × the tokens of `tokens` that fill tiles; returns the first token left.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn run<const BITS: u8, const SC: u8, const Z: i32>(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
    s: &mut Scratch,
) -> usize {
    let l = w.layout();
    let (cols, nb) = (w.cols(), l.nb);
    let tiles = tokens.len() / TILE_TOKENS;
    if SC == code::K16 {
        CONFIG_16.load();
    } else {
        CONFIG_32.load();
    }
    s.reserve(8 * nb, SCALE_VECS * nb, RING * 2 * TILE_TOKENS);
    let codes = s.codes.as_mut_ptr();
    let scale = s.scales.as_mut_ptr();
    let sums = s.sums.as_mut_ptr();
    // `sums` holds RING blocks' tiles.
    let half = 2 * TILE_TOKENS;
    // The tokens' block scales and scaled sums, a block's sixteen in a row.
    let (dxt, dst) = (&act.tile_d, &act.tile_dsum);
    let first_tile = tokens.start / TILE_TOKENS;
    for strip in strips {
        unpack_strip::<BITS, SC, Z>(w.strip(strip).as_ptr(), &l, codes, scale);
        for tile in 0..tiles {
            let t0 = tokens.start + tile * TILE_TOKENS;
            let x = act.qs.as_ptr().add(t0 * cols).cast::<u8>();
            let dx = dxt.as_ptr().add((first_tile + tile) * nb * TILE_TOKENS);
            let ds = dst.as_ptr().add((first_tile + tile) * nb * TILE_TOKENS);
            let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
            let wc = codes.cast::<u8>().cast_const();
            let sets = sets(SC);
            for b in 0..(sets - 1).min(nb) {
                start::<SC>(b, x, cols, wc, b);
            }
            for b in 0..nb + DEFER {
                if b < nb {
                    let ahead = b + sets - 1;
                    if ahead < nb {
                        start::<SC>(ahead % sets, x, cols, wc, ahead);
                    }
                    finish::<SC>(b % sets, sums.add((b % RING) * half));
                }
                if b >= DEFER {
                    let b = b - DEFER;
                    scale_block::<SC>(
                        &mut acc,
                        sums.add((b % RING) * half),
                        scale.add(SCALE_VECS * b),
                        dx.add(b * TILE_TOKENS),
                        ds.add(b * TILE_TOKENS),
                    );
                }
            }
            avx512::store(&[acc], &[dest(&out, strip, t0)], out.ld);
        }
    }
    tokens.start + tiles * TILE_TOKENS
}

/// Products of strips `strips` of a quantized `w` with activation rows `tokens`: whole
/// tiles of 16 tokens on the tile unit, the rest on AVX-512.
///
/// # Safety
/// As [`super::quantized`]; the CPU must have AMX ([`crate::amx::support`]).
pub(super) unsafe fn quantized(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    let Some(sch) = w.scheme() else { return };
    // Whole tiles start on a multiple of 16 tokens and need the transposed scales.
    let prepared = tokens.start.is_multiple_of(TILE_TOKENS)
        && act.tiled_rows >= tokens.start + tokens.len() / TILE_TOKENS * TILE_TOKENS;
    if !prepared {
        return avx512::quantized(w, strips, act, tokens, out);
    }
    let rest = SCRATCH.with_borrow_mut(|s| {
        let (st, tk) = (strips.clone(), tokens.clone());
        use code::*;
        match (bits_code(sch.bits), scale_code(sch.scales), sch.zero) {
            (B4, BLOCK, 8) => run::<B4, BLOCK, 8>(w, st, act, tk, out, s),
            (B4, BLOCK_MIN, 0) => run::<B4, BLOCK_MIN, 0>(w, st, act, tk, out, s),
            (B5, BLOCK, 16) => run::<B5, BLOCK, 16>(w, st, act, tk, out, s),
            (B5, BLOCK_MIN, 0) => run::<B5, BLOCK_MIN, 0>(w, st, act, tk, out, s),
            (B8, BLOCK, 128) => run::<B8, BLOCK, 128>(w, st, act, tk, out, s),
            (B4, KMIN, 0) => run::<B4, KMIN, 0>(w, st, act, tk, out, s),
            (B5, KMIN, 0) => run::<B5, KMIN, 0>(w, st, act, tk, out, s),
            (B6, K16, 32) => run::<B6, K16, 32>(w, st, act, tk, out, s),
            _ => tokens.start,
        }
    });
    if rest < tokens.end {
        avx512::quantized(w, strips, act, rest..tokens.end, out);
    }
}
