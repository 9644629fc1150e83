//! A weight as a file holds it, before any backend uploads it.
use wick_gguf::GgmlType;

use crate::{EngineError, Result};

/// A weight as it comes out of a file: element type, row-major shape, little-endian bytes.
/// GGUF quantized blocks and safetensors F32/F16/BF16 all fit (`GgmlType` covers both).
#[derive(Debug, Clone)]
pub struct HostWeight<'a> {
    /// Name as the file spells it (for error messages).
    pub name: String,
    /// Element type.
    pub dtype: GgmlType,
    /// Row-major shape (`[out, in]` for a matrix).
    pub shape: Vec<usize>,
    /// Raw bytes.
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

impl HostWeight<'_> {
    /// The values as f32, whatever the element type: floats converted, GGUF quantized
    /// blocks dequantized by the CPU backend's kernels (what a trainer keeps as its
    /// frozen base).
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        crate::backend::candle::CandleBackend::cpu().floats(self)
    }

    /// The values of a float (F32/F16/BF16) weight as f32; `role` names what the weight
    /// is for in the error another element type gets.
    pub(crate) fn float_values(&self, role: &str) -> Result<Vec<f32>> {
        let b = &self.bytes;
        Ok(match self.dtype {
            GgmlType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            GgmlType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::Bf16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(EngineError::UnsupportedDtype {
                    source_name: role.into(),
                    tensor: self.name.clone(),
                    dtype: other.to_string(),
                })
            }
        })
    }
}
