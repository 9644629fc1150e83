//! ggml's block layouts as files store them: decoding a block into its integer codes and
//! scales, and the scalar dequantization every fast path is checked against.
//!
//! A block decodes to codes `q` (unsigned, a few bits each) and per-group scales such that
//! element `i` is `scale · (q[i] − zero) + min` (see [`Codes`]). The packer turns the same
//! codes into wick's strip layout, so both share this one decoder.
mod float;
mod kquant;
mod legacy;

pub use float::{bf16_bits_to_f32, f16_bits_to_f32};
pub(crate) use kquant::{q6k_scales, raw_scale_mins, super_scales_bits};

use crate::{KernelError, Result, WeightFormat};

/// The integer codes and scales of one block (fixed-size, so decoding allocates nothing).
///
/// Element `i < len` of the block is `scales[i / group] · (q[i] − zero) + mins[i / group]`,
/// computed in that order in f32 (this reproduces ggml's dequantization bit for bit).
#[derive(Debug, Clone, PartialEq)]
pub struct Codes {
    /// Unsigned codes, one per element (the first `len` are used).
    pub q: [u8; 256],
    /// Elements in the block.
    pub len: usize,
    /// Elements sharing one scale (32, or 16 for Q6_K).
    pub group: usize,
    /// Scale of each group.
    pub scales: [f32; 16],
    /// Offset of each group (zero for formats without mins).
    pub mins: [f32; 16],
    /// Subtracted from every code before scaling.
    pub zero: i32,
}

impl Codes {
    pub(crate) fn new(len: usize, group: usize, zero: i32) -> Self {
        Codes {
            q: [0; 256],
            len,
            group,
            scales: [0.0; 16],
            mins: [0.0; 16],
            zero,
        }
    }

    /// The element values in f32 (`out.len() == len`).
    pub fn values(&self, out: &mut [f32]) {
        for (i, (o, &q)) in out.iter_mut().zip(&self.q[..self.len]).enumerate() {
            let g = i / self.group;
            *o = self.scales[g] * (q as i32 - self.zero) as f32 + self.mins[g];
        }
    }
}

/// Decodes one block of a quantized format (`bytes.len() == format.block_bytes()`).
pub fn block_codes(format: WeightFormat, bytes: &[u8]) -> Result<Codes> {
    if bytes.len() != format.block_bytes() {
        return Err(KernelError::ByteLength {
            what: "ggml block",
            expected: format.block_bytes(),
            found: bytes.len(),
        });
    }
    Ok(match format {
        WeightFormat::Q4_0 => legacy::q4_0(bytes),
        WeightFormat::Q4_1 => legacy::q4_1(bytes),
        WeightFormat::Q5_0 => legacy::q5_0(bytes),
        WeightFormat::Q5_1 => legacy::q5_1(bytes),
        WeightFormat::Q8_0 => legacy::q8_0(bytes),
        WeightFormat::Q4K => kquant::q4k(bytes),
        WeightFormat::Q5K => kquant::q5k(bytes),
        WeightFormat::Q6K => kquant::q6k(bytes),
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            // A float "block" is one element; give it as a scale with a unit code.
            let mut c = Codes::new(1, 1, 0);
            c.q[0] = 1;
            c.scales[0] = float::value(format, bytes);
            c
        }
    })
}

/// Dequantizes one row (`out.len()` elements) stored as `bytes` in `format`: the slow,
/// obviously-correct reference.
pub fn dequantize_row(format: WeightFormat, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let expected = format.row_bytes(out.len())?;
    if bytes.len() != expected {
        return Err(KernelError::ByteLength {
            what: "ggml row",
            expected,
            found: bytes.len(),
        });
    }
    if !format.is_quantized() {
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(format.block_bytes())) {
            *o = float::value(format, b);
        }
        return Ok(());
    }
    let n = format.block_elems();
    for (o, b) in out
        .chunks_exact_mut(n)
        .zip(bytes.chunks_exact(format.block_bytes()))
    {
        block_codes(format, b)?.values(o);
    }
    Ok(())
}

/// Little-endian f16 at `at`, widened.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}
