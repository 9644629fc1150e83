//! Float element types: f32, f16 and bf16 from little-endian bytes.
use crate::WeightFormat;

/// An f16 bit pattern as f32.
#[inline]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// A bf16 bit pattern as f32 (exact: bf16 is the top half of an f32).
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// One float element of `format` from its bytes.
pub(super) fn value(format: WeightFormat, b: &[u8]) -> f32 {
    match format {
        WeightFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        WeightFormat::F16 => f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
        WeightFormat::Bf16 => bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
        _ => unreachable!("value() is only called for float formats"),
    }
}
