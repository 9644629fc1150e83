//! The weight formats the kernels read: ggml's float and block-quantized types.
use crate::{KernelError, Result};

/// Element type of a weight matrix as a GGUF (or safetensors) file stores it.
///
/// Quantized formats group a row into blocks that share scales: the 32-element "legacy"
/// blocks (`Q4_0` … `Q8_0`) and the 256-element k-quant super-blocks (`Q4K` … `Q6K`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum WeightFormat {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 × 4-bit `q`, one f16 scale: `d · (q − 8)`.
    Q4_0,
    /// 32 × 4-bit `q`, f16 scale and offset: `d · q + m`.
    Q4_1,
    /// 32 × 5-bit `q`, one f16 scale: `d · (q − 16)`.
    Q5_0,
    /// 32 × 5-bit `q`, f16 scale and offset: `d · q + m`.
    Q5_1,
    /// 32 × 8-bit signed `q`, one f16 scale: `d · q`.
    Q8_0,
    /// 256 × 4-bit `q` in 8 sub-blocks with 6-bit scales and mins:
    /// `d · sc · q − dmin · mn`.
    Q4K,
    /// 256 × 5-bit `q`, sub-block scales and mins like [`WeightFormat::Q4K`].
    Q5K,
    /// 256 × 6-bit `q` in 16 sub-blocks with 8-bit signed scales: `d · sc · (q − 32)`.
    Q6K,
}

impl WeightFormat {
    /// Every format, in declaration order (for tests and benches).
    pub const ALL: [WeightFormat; 11] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ];

    /// Elements per block (1 for float formats).
    pub const fn block_elems(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => 1,
            WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Q8_0 => 32,
            WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => 256,
        }
    }

    /// Bytes per block in the file.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::Bf16 => 2,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q5_0 => 22,
            WeightFormat::Q5_1 => 24,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4K => 144,
            WeightFormat::Q5K => 176,
            WeightFormat::Q6K => 210,
        }
    }

    /// Whether the format is block-quantized (products then quantize activations).
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes one row of `cols` elements occupies in the file.
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        let block = self.block_elems();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(KernelError::RaggedRow {
                format: self,
                block,
                cols,
            });
        }
        Ok(cols / block * self.block_bytes())
    }
}
