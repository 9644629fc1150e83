//! Strip kernels: products of a range of strips (16 output rows each) with a range of
//! tokens, one module per instruction-set family.
//!
//! Every family computes exactly the same arithmetic in the same order — integer block
//! dot products, then per block `acc = fma(int, d_w · d_x, acc)` (and `fma(min, d_x·Σq,
//! acc)`), then the bias — so results are bit-identical whichever family runs.
mod scalar;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use std::ops::Range;

/// Tokens of one AMX tile product (the kernels' whole tiles).
pub(crate) const TILE_TOKENS: usize = crate::activation::TILE;

use crate::packed::{Bits, ScaleKind};
use crate::{Isa, PackedMatrix, QuantizedActivations, WeightFormat};

/// Where one matrix's products go: token `t`, row `r` lands at `ptr[t · ld + r]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    pub(crate) ptr: *mut f32,
    /// Floats from one token's outputs to the next (the matrix rows).
    pub(crate) ld: usize,
    /// Valid rows (the last strip may be padded).
    pub(crate) rows: usize,
    /// `rows` floats added to every token's outputs, or null.
    pub(crate) bias: *const f32,
}

// SAFETY: kernels running in parallel write disjoint rows of the output.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

/// Const-generic codes of a quantized scheme, shared by the SIMD families (x86-64 only so
/// far: the portable family takes the scheme as a value).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod code {
    /// Code width.
    pub const B4: u8 = 4;
    pub const B5: u8 = 5;
    pub const B6: u8 = 6;
    pub const B8: u8 = 8;
    /// Scale storage.
    pub const BLOCK: u8 = 0;
    pub const BLOCK_MIN: u8 = 1;
    pub const KMIN: u8 = 2;
    pub const K16: u8 = 3;
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn bits_code(b: Bits) -> u8 {
    match b {
        Bits::Four => code::B4,
        Bits::Five => code::B5,
        Bits::Six => code::B6,
        Bits::Eight => code::B8,
    }
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn scale_code(s: ScaleKind) -> u8 {
    match s {
        ScaleKind::Block { min: false } => code::BLOCK,
        ScaleKind::Block { min: true } => code::BLOCK_MIN,
        ScaleKind::KMin => code::KMIN,
        ScaleKind::K16 => code::K16,
    }
}

/// Products of strips `strips` of a quantized `w` with activation rows `tokens`.
///
/// # Safety
/// `out` must be valid for every (token, row) of the call and not written concurrently
/// for the same strips; `act` must hold `w.cols()` columns and the tokens.
pub(crate) unsafe fn quantized(
    isa: Isa,
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    #[cfg(target_arch = "x86_64")]
    {
        // `support` also asks for the tile state, which a caller naming `Isa::Amx` without
        // `Isa::available` has not done yet (it is a load of a settled value after that).
        if isa == Isa::Amx && tokens.len() >= TILE_TOKENS && crate::amx::support().is_ok() {
            return amx::quantized(w, strips, act, tokens, out);
        }
        if isa.vector() == Isa::Avx512Vnni {
            return avx512::quantized(w, strips, act, tokens, out);
        }
        if isa == Isa::Avx2 {
            return avx2::quantized(w, strips, act, tokens, out);
        }
    }
    let _ = isa;
    scalar::quantized(w, strips, act, tokens, out)
}

/// Products of strips `strips` of a float `w` with rows `tokens` of `x` (`w.cols()` wide).
///
/// # Safety
/// As [`quantized`]; `x` must hold the tokens.
pub(crate) unsafe fn float(
    isa: Isa,
    w: &PackedMatrix,
    strips: Range<usize>,
    x: &[f32],
    tokens: Range<usize>,
    out: Output,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.vector() == Isa::Avx512Vnni {
            return avx512::float(w, strips, x, tokens, out);
        }
        if isa == Isa::Avx2 {
            return avx2::float(w, strips, x, tokens, out);
        }
    }
    let _ = isa;
    scalar::float(w, strips, x, tokens, out)
}

/// Float element code for the SIMD families: 0 f32, 1 f16, 2 bf16.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn float_code(f: WeightFormat) -> u8 {
    match f {
        WeightFormat::F16 => 1,
        WeightFormat::Bf16 => 2,
        _ => 0,
    }
}
