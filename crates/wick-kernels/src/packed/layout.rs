//! wick's strip layout of a weight matrix: rows in strips of 16, interleaved so that one
//! 512-bit load holds the same four columns of all 16 rows.
//!
//! Kernels keep one 32-bit lane per row and broadcast four activation bytes (or one
//! activation float) to all lanes, so a single `vpdpbusd` advances 16 rows by 4 columns
//! and each loaded weight byte serves every token of a tile.
//!
//! A quantized strip is a sequence of planes, each starting on a 64-byte boundary, for
//! `nb = cols / 32` blocks of 32 columns:
//!
//! - **data** (4/5/6-bit codes: 256 bytes per block) — four 64-byte groups `g`; byte
//!   `64g + 4r + j` holds the low 4 bits of row `r`'s code at column `8g + j` (low nibble)
//!   and at column `8g + 4 + j` (high nibble). 8-bit codes: 512 bytes per block, eight
//!   groups `i`, byte `64i + 4r + j` is the code at column `4i + j`.
//! - **masks** (5-bit: 64 bytes per block; 6-bit: 128) — for group `g` and nibble half
//!   `h`, the 64-bit word `2g + h` has bit `4r + j` set when bit 4 of that code is set;
//!   6-bit codes add a second 64-byte plane for bit 5.
//! - **block scales** — per block: 16 f16 scales (and 16 f16 mins) for 32-element
//!   formats; 16 `u8` scales and 16 `u8` mins for Q4_K/Q5_K; two sets of 16 `i8`
//!   sub-block scales for Q6_K.
//! - **super scales** (k-quants, 64 bytes per 256 columns) — 16 f16 `d` (and 16 f16
//!   `dmin`).
//!
//! A float strip is simply `[cols][16]` values (f32, f16 or bf16).
use crate::WeightFormat;

/// Rows per strip: one 32-bit lane per row in a 512-bit register.
pub(crate) const STRIP: usize = 16;

/// Bits per code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bits {
    Four,
    Five,
    Six,
    Eight,
}

/// How a block's scales are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScaleKind {
    /// One f16 scale per 32 columns, and an f16 min when `min`.
    Block { min: bool },
    /// Q4_K/Q5_K: f16 `d`/`dmin` per 256 columns, 6-bit integer scale/min per 32.
    KMin,
    /// Q6_K: f16 `d` per 256 columns, signed 8-bit scale per 16.
    K16,
}

/// Code width, scale storage and zero point of a quantized format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scheme {
    pub(crate) bits: Bits,
    pub(crate) scales: ScaleKind,
    /// Subtracted from every code.
    pub(crate) zero: i32,
}

impl Scheme {
    pub(crate) fn of(format: WeightFormat) -> Option<Scheme> {
        use Bits::*;
        use ScaleKind::*;
        let (bits, scales, zero) = match format {
            WeightFormat::Q4_0 => (Four, Block { min: false }, 8),
            WeightFormat::Q4_1 => (Four, Block { min: true }, 0),
            WeightFormat::Q5_0 => (Five, Block { min: false }, 16),
            WeightFormat::Q5_1 => (Five, Block { min: true }, 0),
            WeightFormat::Q8_0 => (Eight, Block { min: false }, 128),
            WeightFormat::Q4K => (Four, KMin, 0),
            WeightFormat::Q5K => (Five, KMin, 0),
            WeightFormat::Q6K => (Six, K16, 32),
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => return None,
        };
        Some(Scheme { bits, scales, zero })
    }
}

/// Byte offsets of the planes of one strip, and the strip stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StripLayout {
    /// 32-column blocks per row (quantized), or columns (float).
    pub(crate) nb: usize,
    pub(crate) masks: usize,
    pub(crate) block_scales: usize,
    pub(crate) super_scales: usize,
    /// Bytes from one strip to the next (a multiple of 64).
    pub(crate) stride: usize,
}

fn up64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

impl StripLayout {
    pub(crate) fn quantized(scheme: Scheme, cols: usize) -> Self {
        let nb = cols / 32;
        let data = match scheme.bits {
            Bits::Eight => 512 * nb,
            _ => 256 * nb,
        };
        let masks = match scheme.bits {
            Bits::Five => 64 * nb,
            Bits::Six => 128 * nb,
            _ => 0,
        };
        let block_scales = match scheme.scales {
            ScaleKind::Block { min: true } => 64 * nb,
            _ => 32 * nb,
        };
        let super_scales = match scheme.scales {
            ScaleKind::Block { .. } => 0,
            ScaleKind::KMin | ScaleKind::K16 => 64 * nb.div_ceil(8),
        };
        let m = data;
        let b = m + masks;
        let s = up64(b + block_scales);
        StripLayout {
            nb,
            masks: m,
            block_scales: b,
            super_scales: s,
            stride: up64(s + super_scales),
        }
    }

    pub(crate) fn float(format: WeightFormat, cols: usize) -> Self {
        let size = format.block_bytes();
        StripLayout {
            nb: cols,
            masks: 0,
            block_scales: 0,
            super_scales: 0,
            stride: up64(cols * STRIP * size),
        }
    }
}
