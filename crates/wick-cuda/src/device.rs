//! [`Device`]: context, stream, kernels, allocator, staging and the pass recorder.
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::{self, CudaBlas};
use cudarc::driver::{result, sys, CudaContext, CudaGraph, CudaModule, CudaStream};
use cudarc::nvrtc::{self, CompileOptions};

use crate::pool::{class_of, Pool};
use crate::{CudaError, Result};

/// The kernels: `kernels.cu`, then Qwen 3.5's gated DeltaNet (`deltanet.cu`, which uses the
/// first file's helpers), compiled as one program.
const SOURCE: &str = concat!(
    include_str!("kernels.cu"),
    "\n",
    include_str!("deltanet.cu")
);

/// Tapes shorter than this are run as they are (a graph saves nothing on a few launches).
const MIN_GRAPH_ENTRIES: usize = 16;
/// Graphs kept; past it the least recently replayed one goes.
const MAX_GRAPHS: usize = 64;
/// A tape is captured as a graph the time it is seen this often: a decode step of a
/// steady batch repeats for as long as the batch does, while a prompt chunk's shape beside
/// decoding rows (its length steered step by step, its keys growing) rarely comes back
/// more than once or twice, and capturing costs more than launching it.
const CAPTURE_AFTER: u32 = 3;
/// cuBLAS workspace bytes.
const BLAS_WORKSPACE: usize = 32 << 20;

macro_rules! kernels {
    ($($variant:ident => $name:literal,)*) => {
        /// The kernels of `kernels.cu` and `deltanet.cu`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(missing_docs)]
        pub enum Kernel { $($variant,)* }

        impl Kernel {
            const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel's name in `kernels.cu`.
            pub fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name,)* }
            }

            /// Whether the kernel takes its shared memory at launch (the flash-attention
            /// kernels and the quantized tensor-core products' double-buffered x: more than
            /// the 48 KB a block gets without asking).
            pub fn dynamic_shared(self) -> bool {
                let name = self.name();
                name.starts_with("flash_")
                    || name.starts_with("linear_mmx_")
                    || name.starts_with("glu_mmx_")
            }
        }
    };
}

kernels! {
    LinearBlockF32R1 => "linear_block_f32_r1",
    LinearBlockF32R2 => "linear_block_f32_r2",
    LinearBlockF32R4 => "linear_block_f32_r4",
    LinearBlockF32R8 => "linear_block_f32_r8",
    LinearBlockF16R1 => "linear_block_f16_r1",
    LinearBlockF16R2 => "linear_block_f16_r2",
    LinearBlockF16R4 => "linear_block_f16_r4",
    LinearBlockF16R8 => "linear_block_f16_r8",
    LinearBlockBf16R1 => "linear_block_bf16_r1",
    LinearBlockBf16R2 => "linear_block_bf16_r2",
    LinearBlockBf16R4 => "linear_block_bf16_r4",
    LinearBlockBf16R8 => "linear_block_bf16_r8",
    LinearQ8Bf16R1 => "linear_q8_bf16_r1",
    LinearQ8Bf16R2 => "linear_q8_bf16_r2",
    LinearQ8F16R1 => "linear_q8_f16_r1",
    LinearQ8F16R2 => "linear_q8_f16_r2",
    LinearQ8F32R1 => "linear_q8_f32_r1",
    LinearQ8F32R2 => "linear_q8_f32_r2",
    LinearQ4Bf16R1 => "linear_q4_bf16_r1",
    LinearQ4Bf16R2 => "linear_q4_bf16_r2",
    LinearQ4F16R1 => "linear_q4_f16_r1",
    LinearQ4F16R2 => "linear_q4_f16_r2",
    LinearQ4F32R1 => "linear_q4_f32_r1",
    LinearQ4F32R2 => "linear_q4_f32_r2",
    LinearManyF32R1 => "linear_many_f32_r1",
    LinearManyF32R2 => "linear_many_f32_r2",
    LinearManyF16R1 => "linear_many_f16_r1",
    LinearManyF16R2 => "linear_many_f16_r2",
    LinearManyBf16R1 => "linear_many_bf16_r1",
    LinearManyBf16R2 => "linear_many_bf16_r2",
    LinearMulBlockF32R1 => "linear_mul_block_f32_r1",
    LinearMulBlockF32R2 => "linear_mul_block_f32_r2",
    LinearMulBlockF16R1 => "linear_mul_block_f16_r1",
    LinearMulBlockF16R2 => "linear_mul_block_f16_r2",
    LinearMulBlockBf16R1 => "linear_mul_block_bf16_r1",
    LinearMulBlockBf16R2 => "linear_mul_block_bf16_r2",
    GluBlockF32R1 => "glu_block_f32_r1",
    GluBlockF32R2 => "glu_block_f32_r2",
    GluBlockF16R1 => "glu_block_f16_r1",
    GluBlockF16R2 => "glu_block_f16_r2",
    GluBlockBf16R1 => "glu_block_bf16_r1",
    GluBlockBf16R2 => "glu_block_bf16_r2",
    GluQ8Bf16R1 => "glu_q8_bf16_r1",
    GluQ8Bf16R2 => "glu_q8_bf16_r2",
    GluQ8F16R1 => "glu_q8_f16_r1",
    GluQ8F16R2 => "glu_q8_f16_r2",
    GluQ8F32R1 => "glu_q8_f32_r1",
    GluQ8F32R2 => "glu_q8_f32_r2",
    GluQ4Bf16R1 => "glu_q4_bf16_r1",
    GluQ4Bf16R2 => "glu_q4_bf16_r2",
    GluQ4F16R1 => "glu_q4_f16_r1",
    GluQ4F16R2 => "glu_q4_f16_r2",
    GluQ4F32R1 => "glu_q4_f32_r1",
    GluQ4F32R2 => "glu_q4_f32_r2",
    ToHalf => "to_half",
    AddBias => "add_bias",
    EmbedF32 => "embed_f32",
    EmbedF16 => "embed_f16",
    EmbedBf16 => "embed_bf16",
    Add => "add",
    Scale => "scale",
    Softcap => "softcap",
    Glu => "glu",
    RmsNorm => "rms_norm",
    AddRmsNorm => "add_rms_norm",
    AddPostNorm => "add_post_norm",
    NormRopeHeads => "norm_rope_heads",
    NormRopeHeadsWarps => "norm_rope_heads_warps",
    RopeTable => "rope_table",
    Rope => "rope",
    RopeQk => "rope_qk",
    RopeQkv => "rope_qkv",
    GluSplit => "glu_split",
    GluSplitHalf => "glu_split_half",
    GatherRows => "gather_rows",
    CopyCols => "copy_cols",
    ScatterAddRows => "scatter_add_rows",
    KvAppend => "kv_append",
    AttnF32N2U4 => "attention_f32_n2_u4",
    AttnF32N2U8 => "attention_f32_n2_u8",
    AttnF32N2U16 => "attention_f32_n2_u16",
    AttnF32N4U4 => "attention_f32_n4_u4",
    AttnF32N4U8 => "attention_f32_n4_u8",
    AttnF32N4U16 => "attention_f32_n4_u16",
    AttnF32N8U4 => "attention_f32_n8_u4",
    AttnF32N8U8 => "attention_f32_n8_u8",
    AttnF16N2U4 => "attention_f16_n2_u4",
    AttnF16N2U8 => "attention_f16_n2_u8",
    AttnF16N2U16 => "attention_f16_n2_u16",
    AttnF16N4U4 => "attention_f16_n4_u4",
    AttnF16N4U8 => "attention_f16_n4_u8",
    AttnF16N4U16 => "attention_f16_n4_u16",
    AttnF16N8U4 => "attention_f16_n8_u4",
    AttnF16N8U8 => "attention_f16_n8_u8",
    AttnF32N16U4 => "attention_f32_n16_u4",
    AttnF16N16U4 => "attention_f16_n16_u4",
    AttentionMerge => "attention_merge",
    KvFlashCopy => "kv_flash_copy",
    FlashFastD64 => "flash_fast_d64",
    FlashFastD128 => "flash_fast_d128",
    FlashFastD256 => "flash_fast_d256",
    FlashExactD64 => "flash_exact_d64",
    FlashExactD128 => "flash_exact_d128",
    FlashExactD256 => "flash_exact_d256",
    FlashExactLoD64 => "flash_exact_lo_d64",
    FlashExactLoD128 => "flash_exact_lo_d128",
    FlashExactLoD256 => "flash_exact_lo_d256",
    FlashFastD512 => "flash_fast_d512",
    FlashExactD512 => "flash_exact_d512",
    FlashExactLoD512 => "flash_exact_lo_d512",
    FlashFastD64M2 => "flash_fast_d64_m2",
    FlashFastD128M2 => "flash_fast_d128_m2",
    ArgmaxRows => "argmax_rows",
    ArgmaxFinish => "argmax_finish",
    DequantQ8Bf16 => "dequant_q8_bf16",
    DequantQ8F16 => "dequant_q8_f16",
    DequantQ8F32 => "dequant_q8_f32",
    DequantQ4Bf16 => "dequant_q4_bf16",
    DequantQ4F16 => "dequant_q4_f16",
    DequantQ4F32 => "dequant_q4_f32",
    EmbedQ8Bf16 => "embed_q8_bf16",
    EmbedQ8F16 => "embed_q8_f16",
    EmbedQ8F32 => "embed_q8_f32",
    EmbedQ4Bf16 => "embed_q4_bf16",
    EmbedQ4F16 => "embed_q4_f16",
    EmbedQ4F32 => "embed_q4_f32",
    MoeRoute => "moe_route",
    MoeSort => "moe_sort",
    MoeGluRows => "moe_glu_rows",
    MoeCombine => "moe_combine",
    MoeGluVecF32 => "moe_glu_vec_f32",
    MoeGluVecF16 => "moe_glu_vec_f16",
    MoeGluVecBf16 => "moe_glu_vec_bf16",
    MoeDownVecF32 => "moe_down_vec_f32",
    MoeDownVecF16 => "moe_down_vec_f16",
    MoeDownVecBf16 => "moe_down_vec_bf16",
    MoeGroupedF32 => "moe_grouped_f32",
    MoeGroupedF16 => "moe_grouped_f16",
    MoeGroupedBf16 => "moe_grouped_bf16",
    MoeGatherF16 => "moe_gather_f16",
    MoeGatherBf16 => "moe_gather_bf16",
    MoeGroupedMmaF16 => "moe_grouped_mma_f16",
    MoeGroupedMmaBf16 => "moe_grouped_mma_bf16",
    LinearMmaQ8Bf16M1 => "linear_mma_q8_bf16_m1",
    GluMmaQ8Bf16M1 => "glu_mma_q8_bf16_m1",
    LinearMmaQ8Bf16M2 => "linear_mma_q8_bf16_m2",
    GluMmaQ8Bf16M2 => "glu_mma_q8_bf16_m2",
    LinearMmaQ8Bf16M4 => "linear_mma_q8_bf16_m4",
    GluMmaQ8Bf16M4 => "glu_mma_q8_bf16_m4",
    LinearMmaQ8F16M1 => "linear_mma_q8_f16_m1",
    GluMmaQ8F16M1 => "glu_mma_q8_f16_m1",
    LinearMmaQ8F16M2 => "linear_mma_q8_f16_m2",
    GluMmaQ8F16M2 => "glu_mma_q8_f16_m2",
    LinearMmaQ8F16M4 => "linear_mma_q8_f16_m4",
    GluMmaQ8F16M4 => "glu_mma_q8_f16_m4",
    LinearMmaQ8F32M1 => "linear_mma_q8_f32_m1",
    GluMmaQ8F32M1 => "glu_mma_q8_f32_m1",
    LinearMmaQ8F32M2 => "linear_mma_q8_f32_m2",
    GluMmaQ8F32M2 => "glu_mma_q8_f32_m2",
    LinearMmaQ8F32M4 => "linear_mma_q8_f32_m4",
    GluMmaQ8F32M4 => "glu_mma_q8_f32_m4",
    LinearMmaQ4Bf16M1 => "linear_mma_q4_bf16_m1",
    GluMmaQ4Bf16M1 => "glu_mma_q4_bf16_m1",
    LinearMmaQ4Bf16M2 => "linear_mma_q4_bf16_m2",
    GluMmaQ4Bf16M2 => "glu_mma_q4_bf16_m2",
    LinearMmaQ4Bf16M4 => "linear_mma_q4_bf16_m4",
    GluMmaQ4Bf16M4 => "glu_mma_q4_bf16_m4",
    LinearMmaQ4F16M1 => "linear_mma_q4_f16_m1",
    GluMmaQ4F16M1 => "glu_mma_q4_f16_m1",
    LinearMmaQ4F16M2 => "linear_mma_q4_f16_m2",
    GluMmaQ4F16M2 => "glu_mma_q4_f16_m2",
    LinearMmaQ4F16M4 => "linear_mma_q4_f16_m4",
    GluMmaQ4F16M4 => "glu_mma_q4_f16_m4",
    LinearMmaQ4F32M1 => "linear_mma_q4_f32_m1",
    GluMmaQ4F32M1 => "glu_mma_q4_f32_m1",
    LinearMmaQ4F32M2 => "linear_mma_q4_f32_m2",
    GluMmaQ4F32M2 => "glu_mma_q4_f32_m2",
    LinearMmaQ4F32M4 => "linear_mma_q4_f32_m4",
    GluMmaQ4F32M4 => "glu_mma_q4_f32_m4",
    AffineMmaFinish => "affine_mma_finish",
    LinearMmxQ8Bf16M0 => "linear_mmx_q8_bf16_m0",
    GluMmxQ8Bf16M0 => "glu_mmx_q8_bf16_m0",
    LinearMmxQ8F16M0 => "linear_mmx_q8_f16_m0",
    GluMmxQ8F16M0 => "glu_mmx_q8_f16_m0",
    LinearMmxQ8F32M0 => "linear_mmx_q8_f32_m0",
    GluMmxQ8F32M0 => "glu_mmx_q8_f32_m0",
    LinearMmxQ4Bf16M0 => "linear_mmx_q4_bf16_m0",
    GluMmxQ4Bf16M0 => "glu_mmx_q4_bf16_m0",
    LinearMmxQ4F16M0 => "linear_mmx_q4_f16_m0",
    GluMmxQ4F16M0 => "glu_mmx_q4_f16_m0",
    LinearMmxQ4F32M0 => "linear_mmx_q4_f32_m0",
    GluMmxQ4F32M0 => "glu_mmx_q4_f32_m0",
    LinearMmxQ8Bf16M1 => "linear_mmx_q8_bf16_m1",
    GluMmxQ8Bf16M1 => "glu_mmx_q8_bf16_m1",
    LinearMmxQ8Bf16M2 => "linear_mmx_q8_bf16_m2",
    GluMmxQ8Bf16M2 => "glu_mmx_q8_bf16_m2",
    LinearMmxQ8Bf16M4 => "linear_mmx_q8_bf16_m4",
    GluMmxQ8Bf16M4 => "glu_mmx_q8_bf16_m4",
    LinearMmxQ8F16M1 => "linear_mmx_q8_f16_m1",
    GluMmxQ8F16M1 => "glu_mmx_q8_f16_m1",
    LinearMmxQ8F16M2 => "linear_mmx_q8_f16_m2",
    GluMmxQ8F16M2 => "glu_mmx_q8_f16_m2",
    LinearMmxQ8F16M4 => "linear_mmx_q8_f16_m4",
    GluMmxQ8F16M4 => "glu_mmx_q8_f16_m4",
    LinearMmxQ8F32M1 => "linear_mmx_q8_f32_m1",
    GluMmxQ8F32M1 => "glu_mmx_q8_f32_m1",
    LinearMmxQ8F32M2 => "linear_mmx_q8_f32_m2",
    GluMmxQ8F32M2 => "glu_mmx_q8_f32_m2",
    LinearMmxQ8F32M4 => "linear_mmx_q8_f32_m4",
    GluMmxQ8F32M4 => "glu_mmx_q8_f32_m4",
    LinearMmxQ4Bf16M1 => "linear_mmx_q4_bf16_m1",
    GluMmxQ4Bf16M1 => "glu_mmx_q4_bf16_m1",
    LinearMmxQ4Bf16M2 => "linear_mmx_q4_bf16_m2",
    GluMmxQ4Bf16M2 => "glu_mmx_q4_bf16_m2",
    LinearMmxQ4Bf16M4 => "linear_mmx_q4_bf16_m4",
    GluMmxQ4Bf16M4 => "glu_mmx_q4_bf16_m4",
    LinearMmxQ4F16M1 => "linear_mmx_q4_f16_m1",
    GluMmxQ4F16M1 => "glu_mmx_q4_f16_m1",
    LinearMmxQ4F16M2 => "linear_mmx_q4_f16_m2",
    GluMmxQ4F16M2 => "glu_mmx_q4_f16_m2",
    LinearMmxQ4F16M4 => "linear_mmx_q4_f16_m4",
    GluMmxQ4F16M4 => "glu_mmx_q4_f16_m4",
    LinearMmxQ4F32M1 => "linear_mmx_q4_f32_m1",
    GluMmxQ4F32M1 => "glu_mmx_q4_f32_m1",
    LinearMmxQ4F32M2 => "linear_mmx_q4_f32_m2",
    GluMmxQ4F32M2 => "glu_mmx_q4_f32_m2",
    LinearMmxQ4F32M4 => "linear_mmx_q4_f32_m4",
    GluMmxQ4F32M4 => "glu_mmx_q4_f32_m4",
    AffineMmxX => "affine_mmx_x",
    AffineImmaX => "affine_imma_x",
    LinearImmaQ8Bf16N1 => "linear_imma_q8_bf16_n1",
    GluImmaQ8Bf16N1 => "glu_imma_q8_bf16_n1",
    LinearImmaQ8Bf16N2 => "linear_imma_q8_bf16_n2",
    GluImmaQ8Bf16N2 => "glu_imma_q8_bf16_n2",
    LinearImmaQ8Bf16N4 => "linear_imma_q8_bf16_n4",
    GluImmaQ8Bf16N4 => "glu_imma_q8_bf16_n4",
    LinearImmaQ8Bf16N8 => "linear_imma_q8_bf16_n8",
    GluImmaQ8Bf16N8 => "glu_imma_q8_bf16_n8",
    LinearImmaQ8F16N1 => "linear_imma_q8_f16_n1",
    GluImmaQ8F16N1 => "glu_imma_q8_f16_n1",
    LinearImmaQ8F16N2 => "linear_imma_q8_f16_n2",
    GluImmaQ8F16N2 => "glu_imma_q8_f16_n2",
    LinearImmaQ8F16N4 => "linear_imma_q8_f16_n4",
    GluImmaQ8F16N4 => "glu_imma_q8_f16_n4",
    LinearImmaQ8F16N8 => "linear_imma_q8_f16_n8",
    GluImmaQ8F16N8 => "glu_imma_q8_f16_n8",
    LinearImmaQ8F32N1 => "linear_imma_q8_f32_n1",
    GluImmaQ8F32N1 => "glu_imma_q8_f32_n1",
    LinearImmaQ8F32N2 => "linear_imma_q8_f32_n2",
    GluImmaQ8F32N2 => "glu_imma_q8_f32_n2",
    LinearImmaQ8F32N4 => "linear_imma_q8_f32_n4",
    GluImmaQ8F32N4 => "glu_imma_q8_f32_n4",
    LinearImmaQ8F32N8 => "linear_imma_q8_f32_n8",
    GluImmaQ8F32N8 => "glu_imma_q8_f32_n8",
    LinearImmaQ4Bf16N1 => "linear_imma_q4_bf16_n1",
    GluImmaQ4Bf16N1 => "glu_imma_q4_bf16_n1",
    LinearImmaQ4Bf16N2 => "linear_imma_q4_bf16_n2",
    GluImmaQ4Bf16N2 => "glu_imma_q4_bf16_n2",
    LinearImmaQ4Bf16N4 => "linear_imma_q4_bf16_n4",
    GluImmaQ4Bf16N4 => "glu_imma_q4_bf16_n4",
    LinearImmaQ4Bf16N8 => "linear_imma_q4_bf16_n8",
    GluImmaQ4Bf16N8 => "glu_imma_q4_bf16_n8",
    LinearImmaQ4F16N1 => "linear_imma_q4_f16_n1",
    GluImmaQ4F16N1 => "glu_imma_q4_f16_n1",
    LinearImmaQ4F16N2 => "linear_imma_q4_f16_n2",
    GluImmaQ4F16N2 => "glu_imma_q4_f16_n2",
    LinearImmaQ4F16N4 => "linear_imma_q4_f16_n4",
    GluImmaQ4F16N4 => "glu_imma_q4_f16_n4",
    LinearImmaQ4F16N8 => "linear_imma_q4_f16_n8",
    GluImmaQ4F16N8 => "glu_imma_q4_f16_n8",
    LinearImmaQ4F32N1 => "linear_imma_q4_f32_n1",
    GluImmaQ4F32N1 => "glu_imma_q4_f32_n1",
    LinearImmaQ4F32N2 => "linear_imma_q4_f32_n2",
    GluImmaQ4F32N2 => "glu_imma_q4_f32_n2",
    LinearImmaQ4F32N4 => "linear_imma_q4_f32_n4",
    GluImmaQ4F32N4 => "glu_imma_q4_f32_n4",
    LinearImmaQ4F32N8 => "linear_imma_q4_f32_n8",
    GluImmaQ4F32N8 => "glu_imma_q4_f32_n8",
    LayerNorm => "layer_norm",
    Activation => "activation",
    // deltanet.cu
    DeltaConv => "delta_conv",
    DeltaRecurrent => "delta_recurrent",
    DeltaPrep => "delta_prep",
    DeltaChunkPrep => "delta_chunk_prep",
    DeltaChunkState => "delta_chunk_state",
    DeltaChunkStateTc => "delta_chunk_state_tc",
    DeltaGatedNorm => "delta_gated_norm",
    SigmoidGate => "sigmoid_gate",
}

/// Element type of a weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl WType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            WType::F32 => 4,
            WType::F16 | WType::Bf16 => 2,
        }
    }
}

/// One kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device address (0 for a null pointer).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

impl Arg {
    /// The argument in an 8-byte slot, as the driver reads it (little-endian, from the
    /// slot's start, as many bytes as the parameter has).
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// `y[rows, n] = x[rows, k] · w[n, k]ᵀ` by cuBLAS, `x` of the weight's type, `y` f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// Weight matrix `[n, k]`.
    pub w: u64,
    /// Its type (and `x`'s).
    pub wtype: WType,
    /// Input `[rows, k]`.
    pub x: u64,
    /// Output `[rows, n]`: f32, or of `wtype` with `y_half`.
    pub y: u64,
    /// The output takes the weights' (half) type.
    pub y_half: bool,
    /// Rows of `x`.
    pub rows: usize,
    /// Inner dimension.
    pub k: usize,
    /// Outputs.
    pub n: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Entry {
    Launch {
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        /// Dynamic shared memory bytes.
        shared: u32,
        args: Vec<u64>,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Zero {
        dst: u64,
        bytes: usize,
    },
    Gemm(Gemm),
}

/// Counters of what the recorder did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Tapes run entry by entry.
    pub eager: u64,
    /// Tapes captured into a graph.
    pub captured: u64,
    /// Tapes replayed from a graph.
    pub replayed: u64,
    /// Bytes taken from the driver by the caching allocator.
    pub pool_bytes: usize,
    /// Of those, bytes cached free.
    pub pool_cached: usize,
}

/// Pinned host memory and its device twin: how host data reaches the device.
struct Chunk {
    host: *mut u8,
    dev: sys::CUdeviceptr,
    cap: usize,
    used: usize,
    copied: usize,
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: both were allocated by `Chunk::new` and nothing recorded refers to them
        // any more (chunks are dropped at the start of a pass, after the wait on the
        // staging event).
        unsafe {
            let _ = result::free_host(self.host as *mut c_void);
            let _ = result::free_sync(self.dev);
        }
    }
}

impl Chunk {
    fn new(cap: usize) -> Result<Chunk> {
        // SAFETY: plain allocations of `cap` bytes.
        unsafe {
            let host = result::malloc_host(cap, 0)? as *mut u8;
            let dev = match result::malloc_sync(cap) {
                Ok(d) => d,
                Err(e) => {
                    let _ = result::free_host(host as *mut c_void);
                    return Err(e.into());
                }
            };
            Ok(Chunk {
                host,
                dev,
                cap,
                used: 0,
                copied: 0,
            })
        }
    }
}

/// Pinned host memory an asynchronous read lands in, with the event that says it did.
struct Slot {
    host: *mut u8,
    cap: usize,
    event: sys::CUevent,
}

// SAFETY: the pinned memory is read only after the event completed, by the one holder of
// the slot's `Readback`.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: allocated by `Device::read_later`; a slot is dropped only once no read
        // into it is pending (its holder waited, or the device is going away).
        unsafe {
            let _ = result::event::synchronize(self.event);
            let _ = result::event::destroy(self.event);
            let _ = result::free_host(self.host as *mut c_void);
        }
    }
}

/// Device memory on its way to the host ([`Device::read_later`]).
pub struct Readback {
    slot: Arc<Slot>,
    bytes: usize,
}

impl Readback {
    /// Waits for the copy and returns the bytes.
    pub fn wait(&self) -> Result<Vec<u8>> {
        // SAFETY: the event was recorded after the copy into the slot was queued.
        unsafe { result::event::synchronize(self.slot.event) }?;
        // SAFETY: `bytes <= cap`, and the copy into it has completed.
        Ok(unsafe { std::slice::from_raw_parts(self.slot.host, self.bytes) }.to_vec())
    }
}

struct Captured {
    tape: Vec<Entry>,
    graph: CudaGraph,
    /// The pass count when it last ran (the least recent goes first when the cache is full).
    used: u64,
}

struct State {
    depth: usize,
    tape: Vec<Entry>,
    chunks: Vec<Chunk>,
    /// Staging was copied and the copy may not have run yet: wait on `staged` before
    /// writing it again.
    staging_in_flight: bool,
    graphs: HashMap<u64, Captured>,
    seen: HashMap<u64, u32>,
    /// Passes that could be graphs, counted (the clock of [`Captured::used`]).
    passes: u64,
    graphs_on: bool,
    stats: Stats,
}

// SAFETY: the raw pointers in `State` (pinned host memory) are only touched under the
// device's mutex.
unsafe impl Send for State {}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: Vec<sys::CUfunction>,
    _module: Arc<CudaModule>,
    blas: CudaBlas,
    staged: sys::CUevent,
    state: Mutex<State>,
    pool: Mutex<Pool>,
    slots: Mutex<Vec<Arc<Slot>>>,
    name: String,
    /// Kernels that follow another of wick's kernels are launched with programmatic
    /// dependent launch (compute capability 9.0 and later; `WICK_CUDA_PDL=0` turns it off).
    pdl: bool,
    /// Compute capability.
    cc: (u32, u32),
    /// Dynamic shared memory a block of a [`Kernel::dynamic_shared`] kernel may take.
    max_shared: usize,
}

// SAFETY: CUfunction and CUevent handles are usable from any thread of the process once
// the context is current, which every entry point makes sure of.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// A CUDA device with wick's kernels loaded. Cheap to clone (shared).
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

/// Device memory: a buffer of the caching allocator (given back to it when dropped) or
/// one of its own (freed when dropped; weights).
pub struct Buffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    /// Size class in the pool, or `None` for a buffer of its own.
    class: Option<usize>,
    home: Arc<Inner>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl Buffer {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes asked for.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        match self.class {
            Some(class) => {
                if let Ok(mut pool) = self.home.pool.lock() {
                    pool.give(class, self.ptr);
                }
            }
            None => {
                let _ = self.home.ctx.bind_to_thread();
                // Work already recorded may still read it: run it first.
                if let Ok(mut st) = self.home.state.lock() {
                    let _ = flush(&self.home, &mut st);
                }
                let _ = self.home.stream.synchronize();
                // SAFETY: allocated by `malloc_sync` for this buffer alone.
                let _ = unsafe { result::free_sync(self.ptr) };
            }
        }
    }
}

/// The kernels' PTX for `arch`: compiled once per process, and kept on disk (see
/// [`ptx_cache_file`]) so that later processes skip the seconds NVRTC takes.
fn compiled(arch: &'static str) -> Result<String> {
    static CACHE: Mutex<Vec<(&'static str, String)>> = Mutex::new(Vec::new());
    let mut cache = lock(&CACHE);
    if let Some((_, ptx)) = cache.iter().find(|(a, _)| *a == arch) {
        return Ok(ptx.clone());
    }
    let file = ptx_cache_file(arch);
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        if ptx.contains(".entry") {
            cache.push((arch, ptx.clone()));
            return Ok(ptx);
        }
    }
    let started = std::time::Instant::now();
    let ptx = nvrtc::compile_ptx_with_opts(
        SOURCE,
        CompileOptions {
            arch: Some(arch),
            name: Some("wick_kernels.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|e| CudaError::Compile(format!("{e:?}")))?
    .to_src();
    tracing::info!(
        "compiled the CUDA kernels for {arch} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(f) = file {
        store_ptx(&f, &ptx);
    }
    cache.push((arch, ptx.clone()));
    Ok(ptx)
}

/// Where the PTX of this build's kernels for `arch` is kept:
/// `$WICK_CUDA_CACHE`, else `$XDG_CACHE_HOME/wick/cuda`, else `~/.cache/wick/cuda`; the
/// name carries a hash of the kernel source, so a changed source is compiled afresh.
fn ptx_cache_file(arch: &str) -> Option<std::path::PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let dir = env("WICK_CUDA_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| env("XDG_CACHE_HOME").map(|d| std::path::Path::new(&d).join("wick/cuda")))
        .or_else(|| env("HOME").map(|d| std::path::Path::new(&d).join(".cache/wick/cuda")))?;
    let mut h = DefaultHasher::new();
    SOURCE.hash(&mut h);
    Some(dir.join(format!("kernels-{:016x}-{arch}.ptx", h.finish())))
}

/// Writes `ptx` to `file` through a temporary name (never a half-written cache entry);
/// failures only cost the next process a compile.
fn store_ptx(file: &std::path::Path, ptx: &str) {
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let written = file
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, ptx))
        .and_then(|()| std::fs::rename(&tmp, file));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::debug!(
            "not keeping the CUDA kernels' PTX in {}: {e}",
            file.display()
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn check_libraries() -> Result<()> {
    // SAFETY: probing whether a shared library can be opened.
    let (driver, nvrtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [
        (driver, "libcuda (the NVIDIA driver)"),
        (nvrtc, "libnvrtc (CUDA 13)"),
        (blas, "libcublas (CUDA 13)"),
    ]
    .iter()
    .filter(|(ok, _)| !ok)
    .map(|(_, name)| *name)
    .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CudaError::Unavailable(format!(
            "cannot load {} (put the CUDA 13 libraries on LD_LIBRARY_PATH)",
            missing.join(", ")
        )))
    }
}

impl Device {
    /// Opens device `ordinal` and compiles the kernels for it.
    pub fn new(ordinal: usize) -> Result<Device> {
        check_libraries()?;
        let count = CudaContext::device_count()?;
        if ordinal as i32 >= count {
            return Err(CudaError::Unavailable(format!(
                "no CUDA device {ordinal} ({count} found)"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // wick synchronizes itself (one stream); cudarc's per-buffer events are not used.
        // SAFETY: no cudarc buffer is created on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let ptx = compiled(arch)?;
        let module = ctx.load_module(nvrtc::Ptx::from_src(ptx))?;
        // Kernels that take their shared memory at launch may take what a block can opt
        // into (227 KB on Hopper), less their static shared memory.
        let optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_or(48 << 10, |n| n.max(0) as usize);
        let mut max_shared = optin;
        let mut functions = Vec::with_capacity(Kernel::ALL.len());
        for k in Kernel::ALL {
            let f = module.load_function(k.name())?;
            if k.dynamic_shared() {
                use sys::CUfunction_attribute::{
                    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC,
                    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES as STATIC,
                };
                let fixed = f.get_attribute(STATIC)?.max(0) as usize;
                let room = optin.saturating_sub(fixed);
                f.set_attribute(MAX_DYNAMIC, room as i32)?;
                max_shared = max_shared.min(room);
            }
            functions.push(f.cu_function());
        }
        let blas = CudaBlas::new(stream.clone())?;
        // A workspace of its own, so that cuBLAS allocates nothing while a graph is being
        // captured (its products are replayed with the rest of a pass).
        let workspace = {
            // SAFETY: a plain allocation, kept for the device's lifetime.
            let ptr = unsafe { result::malloc_sync(BLAS_WORKSPACE) }?;
            // SAFETY: the handle is live; the workspace outlives it (leaked with the device).
            unsafe {
                cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut c_void,
                    BLAS_WORKSPACE,
                )
            }
            .result()?;
            ptr
        };
        let _ = workspace;
        let staged = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let pdl = major >= 9 && std::env::var("WICK_CUDA_PDL").map_or(true, |v| v != "0");
        Ok(Device {
            inner: Arc::new(Inner {
                ctx,
                stream,
                functions,
                _module: module,
                blas,
                staged,
                state: Mutex::new(State {
                    depth: 0,
                    tape: Vec::new(),
                    chunks: Vec::new(),
                    staging_in_flight: false,
                    graphs: HashMap::new(),
                    seen: HashMap::new(),
                    passes: 0,
                    graphs_on: true,
                    stats: Stats::default(),
                }),
                pool: Mutex::new(Pool::default()),
                slots: Mutex::new(Vec::new()),
                name,
                pdl,
                cc: (major as u32, minor as u32),
                max_shared,
            }),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.inner
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(1, |n| n.max(1) as usize)
    }

    /// `(free, total)` bytes of device memory.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.inner.ctx.mem_get_info()?)
    }

    /// Whether repeated passes are replayed as CUDA graphs (on by default).
    pub fn set_graphs(&self, on: bool) {
        let mut st = lock(&self.inner.state);
        st.graphs_on = on;
        if !on {
            st.graphs.clear();
        }
    }

    /// What the recorder and the allocator did so far.
    pub fn stats(&self) -> Stats {
        let mut s = lock(&self.inner.state).stats;
        let pool = lock(&self.inner.pool);
        s.pool_bytes = pool.held;
        s.pool_cached = pool.cached;
        s
    }

    /// A buffer of its own holding `data` (weights): copied before this returns.
    pub fn upload_owned(&self, data: &[u8]) -> Result<Buffer> {
        self.inner.ctx.bind_to_thread()?;
        let bytes = data.len().max(1);
        let ptr = self.driver_alloc(bytes)?;
        // SAFETY: `ptr` holds at least `data.len()` bytes.
        unsafe { result::memcpy_htod_sync(ptr, data) }?;
        Ok(Buffer {
            ptr,
            bytes: data.len(),
            class: None,
            home: self.inner.clone(),
        })
    }

    /// A buffer of its own of `bytes` bytes (contents undefined): freed when dropped,
    /// never cached (weights made on the device).
    pub fn alloc_owned(&self, bytes: usize) -> Result<Buffer> {
        self.inner.ctx.bind_to_thread()?;
        let ptr = self.driver_alloc(bytes.max(1))?;
        Ok(Buffer {
            ptr,
            bytes,
            class: None,
            home: self.inner.clone(),
        })
    }

    fn driver_alloc(&self, bytes: usize) -> Result<sys::CUdeviceptr> {
        // SAFETY: a plain allocation.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(p) => Ok(p),
            Err(_) => {
                // Out of memory: run what is recorded, then give the cache back and retry.
                {
                    let mut st = lock(&self.inner.state);
                    flush(&self.inner, &mut st)?;
                }
                self.inner.stream.synchronize()?;
                let released = lock(&self.inner.pool).release_cached();
                tracing::debug!(
                    "CUDA allocation of {bytes} bytes failed; released {released} cached bytes"
                );
                // SAFETY: as above.
                Ok(unsafe { result::malloc_sync(bytes) }?)
            }
        }
    }

    /// A buffer of at least `bytes` bytes from the caching allocator (contents undefined).
    pub fn alloc(&self, bytes: usize) -> Result<Buffer> {
        let class = class_of(bytes);
        let cached = lock(&self.inner.pool).take(class);
        let ptr = match cached {
            Some(p) => p,
            None => {
                self.inner.ctx.bind_to_thread()?;
                let p = self.driver_alloc(class)?;
                lock(&self.inner.pool).held += class;
                p
            }
        };
        Ok(Buffer {
            ptr,
            bytes,
            class: Some(class),
            home: self.inner.clone(),
        })
    }

    /// [`Device::alloc`] filled with zero bytes (when the pass runs).
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<Buffer> {
        let b = self.alloc(bytes)?;
        self.record(Entry::Zero { dst: b.ptr, bytes })?;
        Ok(b)
    }

    /// Copies `data` to the device for this pass: the address is valid for work recorded
    /// in the same pass (outside a pass, for the next recorded entry only).
    pub fn stage(&self, data: &[u8]) -> Result<u64> {
        let mut st = lock(&self.inner.state);
        stage_locked(&self.inner, &mut st, data)
    }

    /// A buffer of the caching allocator holding `data` once the pass runs.
    pub fn upload(&self, data: &[u8]) -> Result<Buffer> {
        let b = self.alloc(data.len())?;
        let mut st = lock(&self.inner.state);
        let src = stage_locked(&self.inner, &mut st, data)?;
        push(
            &self.inner,
            &mut st,
            Entry::Copy {
                dst: b.ptr,
                src,
                bytes: data.len(),
            },
        )?;
        Ok(b)
    }

    /// Records a kernel launch of `grid` blocks of `block` threads.
    pub fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_shared(kernel, grid, block, 0, args)
    }

    /// Records a kernel launch whose blocks take `shared` bytes of dynamic shared memory
    /// (at most [`Device::max_shared`] for a kernel that [`Kernel::dynamic_shared`]).
    pub fn launch_shared(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shared: usize,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let limit = if kernel.dynamic_shared() {
            self.inner.max_shared
        } else {
            48 << 10
        };
        if shared > limit {
            return Err(CudaError::Invalid(format!(
                "{}: {shared} bytes of shared memory (at most {limit})",
                kernel.name()
            )));
        }
        self.record(Entry::Launch {
            kernel,
            grid,
            block,
            shared: shared as u32,
            args: args.iter().map(|a| a.slot()).collect(),
        })
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.cc
    }

    /// Dynamic shared memory bytes a block of a [`Kernel::dynamic_shared`] kernel may take.
    pub fn max_shared(&self) -> usize {
        self.inner.max_shared
    }

    /// Records a device-to-device copy.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.record(Entry::Copy { dst, src, bytes })
    }

    /// Records a cuBLAS product.
    pub fn gemm(&self, g: Gemm) -> Result<()> {
        if g.rows == 0 || g.n == 0 {
            return Ok(());
        }
        for (what, v) in [("rows", g.rows), ("k", g.k), ("n", g.n)] {
            if v > i32::MAX as usize {
                return Err(CudaError::Invalid(format!("gemm {what} {v} is too large")));
            }
        }
        self.record(Entry::Gemm(g))
    }

    fn record(&self, e: Entry) -> Result<()> {
        let mut st = lock(&self.inner.state);
        push(&self.inner, &mut st, e)
    }

    /// Runs everything recorded, then copies `bytes` bytes at `src` to the host.
    pub fn download(&self, src: u64, bytes: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; bytes];
        {
            let mut st = lock(&self.inner.state);
            flush(&self.inner, &mut st)?;
        }
        if bytes > 0 {
            self.inner.ctx.bind_to_thread()?;
            // SAFETY: `out` has `bytes` bytes; the stream is synchronized before it is read.
            unsafe { result::memcpy_dtoh_async(&mut out[..], src, self.inner.stream.cu_stream()) }?;
        }
        self.inner.stream.synchronize()?;
        Ok(out)
    }

    /// Runs everything recorded so far and queues a copy of `bytes` bytes at `src` to the
    /// host behind it, without waiting: the next pass can be recorded and queued before
    /// [`Readback::wait`] returns this one's bytes.
    pub fn read_later(&self, src: u64, bytes: usize) -> Result<Readback> {
        {
            let mut st = lock(&self.inner.state);
            flush(&self.inner, &mut st)?;
        }
        self.inner.ctx.bind_to_thread()?;
        let slot = {
            let mut slots = lock(&self.inner.slots);
            match slots
                .iter()
                .find(|s| Arc::strong_count(s) == 1 && s.cap >= bytes)
            {
                Some(s) => s.clone(),
                None => {
                    let cap = bytes.max(4096);
                    // SAFETY: plain allocations.
                    let host = unsafe { result::malloc_host(cap, 0) }? as *mut u8;
                    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
                    let s = Arc::new(Slot { host, cap, event });
                    slots.push(s.clone());
                    s
                }
            }
        };
        let stream = self.inner.stream.cu_stream();
        // SAFETY: the slot holds `cap >= bytes` pinned bytes, free (no other holder) and
        // not read until the event recorded after the copy completes.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(slot.host, bytes);
            result::memcpy_dtoh_async(dst, src, stream)?;
            result::event::record(slot.event, stream)?;
        }
        Ok(Readback { slot, bytes })
    }

    /// Starts a pass (passes nest; the outermost one counts). Work recorded until the
    /// matching [`Device::end_pass`] runs as one tape, or as a replayed graph when the same
    /// tape ran before.
    pub fn begin_pass(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        if st.depth == 0 {
            flush(&self.inner, &mut st)?;
            wait_staging(&self.inner, &mut st)?;
            // One chunk as large as the last pass needed, so the next one stages at the
            // same addresses.
            if st.chunks.len() > 1 {
                let total: usize = st.chunks.iter().map(|c| c.cap).sum();
                // Queued kernels may still read the old chunks' device memory.
                self.inner.stream.synchronize()?;
                st.chunks.clear();
                st.chunks.push(Chunk::new(total)?);
                st.graphs.clear();
            }
            for c in &mut st.chunks {
                c.used = 0;
                c.copied = 0;
            }
            lock(&self.inner.pool).settle();
        }
        st.depth += 1;
        Ok(())
    }

    /// Ends a pass; the outermost end runs what the pass recorded.
    pub fn end_pass(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        // Flushed while still inside the pass, so that it may be replayed.
        let ran = if st.depth == 1 {
            flush(&self.inner, &mut st)
        } else {
            Ok(())
        };
        st.depth = st.depth.saturating_sub(1);
        ran
    }

    /// Starts everything recorded so far, without waiting for it.
    pub fn flush(&self) -> Result<()> {
        let mut st = lock(&self.inner.state);
        flush(&self.inner, &mut st)
    }

    /// Waits for everything recorded so far.
    pub fn synchronize(&self) -> Result<()> {
        {
            let mut st = lock(&self.inner.state);
            flush(&self.inner, &mut st)?;
        }
        Ok(self.inner.stream.synchronize()?)
    }
}

fn wait_staging(inner: &Inner, st: &mut State) -> Result<()> {
    if st.staging_in_flight {
        // SAFETY: the event was created on this context.
        unsafe { result::event::synchronize(inner.staged) }?;
        st.staging_in_flight = false;
    }
    Ok(())
}

fn stage_locked(inner: &Inner, st: &mut State, data: &[u8]) -> Result<u64> {
    inner.ctx.bind_to_thread()?;
    wait_staging(inner, st)?;
    let need = data.len().max(1).div_ceil(256) * 256;
    let fits = st.chunks.last().is_some_and(|c| c.cap - c.used >= need);
    if !fits {
        let last = st.chunks.last().map_or(0, |c| c.cap);
        st.chunks
            .push(Chunk::new((2 * last).max(need).max(1 << 20))?);
    }
    let Some(c) = st.chunks.last_mut() else {
        return Err(CudaError::Invalid("no staging memory".into()));
    };
    let at = c.used;
    // SAFETY: `at + data.len() <= cap`; the pinned memory is not being copied from (the
    // staging event was waited on).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), c.host.add(at), data.len()) };
    c.used += need;
    Ok(c.dev + at as u64)
}

fn push(inner: &Inner, st: &mut State, e: Entry) -> Result<()> {
    st.tape.push(e);
    if st.depth == 0 {
        flush(inner, st)?;
    }
    Ok(())
}

/// Copies what was staged and runs the tape: replayed from a graph when it ran before.
fn flush(inner: &Inner, st: &mut State) -> Result<()> {
    inner.ctx.bind_to_thread()?;
    let stream = inner.stream.cu_stream();
    let mut copied = false;
    for c in &mut st.chunks {
        if c.used > c.copied {
            // SAFETY: the range lies within both allocations; the host side is not written
            // until the event recorded below has completed.
            unsafe {
                let src = std::slice::from_raw_parts(c.host.add(c.copied), c.used - c.copied);
                result::memcpy_htod_async(c.dev + c.copied as u64, src, stream)?;
            }
            c.copied = c.used;
            copied = true;
        }
    }
    if copied {
        // SAFETY: event and stream of this context.
        unsafe { result::event::record(inner.staged, stream) }?;
        st.staging_in_flight = true;
    }
    if st.depth == 0 {
        // Outside a pass the staged data served its one entry.
        for c in &mut st.chunks {
            c.used = 0;
            c.copied = 0;
        }
    }
    let tape = std::mem::take(&mut st.tape);
    if tape.is_empty() {
        return Ok(());
    }
    let graphable = st.graphs_on && st.depth > 0 && tape.len() >= MIN_GRAPH_ENTRIES;
    if graphable {
        let mut h = DefaultHasher::new();
        tape.hash(&mut h);
        let key = h.finish();
        st.passes += 1;
        let now = st.passes;
        if let Some(g) = st.graphs.get_mut(&key).filter(|g| g.tape == tape) {
            g.graph.launch()?;
            g.used = now;
            st.stats.replayed += 1;
            return Ok(());
        }
        if st.seen.len() > 4096 {
            st.seen.clear();
        }
        let seen = st.seen.entry(key).or_insert(0);
        *seen += 1;
        if *seen >= CAPTURE_AFTER {
            inner
                .stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let ran = run(inner, &tape);
            let graph = inner.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            ran?;
            if let Some(graph) = graph? {
                graph.launch()?;
                if st.graphs.len() >= MAX_GRAPHS {
                    // The least recently replayed goes: a busy decode step's graph stays
                    // while the one-off shapes of prompt chunks come and go.
                    if let Some(&old) = st.graphs.iter().min_by_key(|(_, g)| g.used).map(|(k, _)| k)
                    {
                        st.graphs.remove(&old);
                    }
                }
                st.graphs.insert(
                    key,
                    Captured {
                        tape,
                        graph,
                        used: now,
                    },
                );
                st.stats.captured += 1;
                return Ok(());
            }
            return Err(CudaError::Driver("stream capture returned no graph".into()));
        }
    }
    run(inner, &tape)?;
    st.stats.eager += 1;
    Ok(())
}

fn run(inner: &Inner, tape: &[Entry]) -> Result<()> {
    let stream = inner.stream.cu_stream();
    // Whether the entry before is one of wick's kernels (each of which waits, before it
    // reads or writes anything but weights, for the kernel before it: `pdl_wait`).
    let mut after_kernel = false;
    for e in tape {
        let launched = matches!(e, Entry::Launch { .. });
        match e {
            Entry::Launch {
                kernel,
                grid,
                block,
                shared,
                args,
            } => {
                let mut slots = args.clone();
                let mut params: Vec<*mut c_void> = slots
                    .iter_mut()
                    .map(|s| s as *mut u64 as *mut c_void)
                    .collect();
                let f = inner.functions[*kernel as usize];
                let failed = |err| CudaError::Driver(format!("{}: {err:?}", kernel.name()));
                if inner.pdl && after_kernel {
                    // SAFETY: as below; the kernel waits for the one before it (`pdl_wait`)
                    // before it touches what that one reads or writes.
                    unsafe { launch_dependent(f, *grid, *block, *shared, stream, &mut params) }
                        .map_err(failed)?;
                } else {
                    // SAFETY: the function was loaded from the module; the arguments are
                    // the slots the kernel's parameters read; the buffers they name are
                    // alive or reused only by entries that run later on the same stream.
                    unsafe {
                        result::launch_kernel(
                            f,
                            *grid,
                            (*block, 1, 1),
                            *shared,
                            stream,
                            &mut params,
                        )
                    }
                    .map_err(failed)?;
                }
            }
            Entry::Copy { dst, src, bytes } => {
                // SAFETY: both ranges are live device memory of at least `bytes` bytes.
                unsafe { result::memcpy_dtod_async(*dst, *src, *bytes, stream) }?;
            }
            Entry::Zero { dst, bytes } => {
                // SAFETY: as above.
                unsafe { result::memset_d8_async(*dst, 0, *bytes, stream) }?;
            }
            Entry::Gemm(g) => gemm(inner, g)?,
        }
        after_kernel = launched;
    }
    Ok(())
}

/// Launches `f` allowed to start before the kernel ahead of it on `stream` has finished
/// (programmatic stream serialization): its blocks run up to `griddepcontrol.wait`.
///
/// # Safety
/// As `cuLaunchKernel`: `f` is a loaded function whose parameters `params` fill, and it
/// waits (`pdl_wait`) before reading or writing memory that kernels ahead of it use.
unsafe fn launch_dependent(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    shared: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> std::result::Result<(), result::DriverError> {
    // SAFETY: a plain-data C struct; zero is a valid (empty) value of every field.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract; `config` and `attr` outlive the call.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

fn gemm(inner: &Inner, g: &Gemm) -> Result<()> {
    use cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
    let ty = match g.wtype {
        WType::F32 => cudaDataType::CUDA_R_32F,
        WType::F16 => cudaDataType::CUDA_R_16F,
        WType::Bf16 => cudaDataType::CUDA_R_16BF,
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Row-major y = x · wᵀ is column-major yᵀ = w · xᵀ with w read transposed.
    // SAFETY: the handle is bound to this stream; the pointers hold the shapes given.
    unsafe {
        cublas::result::gemm_ex(
            *inner.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            g.n as i32,
            g.rows as i32,
            g.k as i32,
            &alpha as *const f32 as *const c_void,
            g.w as *const c_void,
            ty,
            g.k as i32,
            g.x as *const c_void,
            ty,
            g.k as i32,
            &beta as *const f32 as *const c_void,
            g.y as *mut c_void,
            if g.y_half {
                ty
            } else {
                cudaDataType::CUDA_R_32F
            },
            g.n as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs only NVRTC (no GPU): skipped where libnvrtc cannot be loaded.
    #[test]
    fn kernels_compile_with_nvrtc_and_export_every_entry() {
        // SAFETY: probing whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc is not on the library path");
            return;
        }
        let ptx = compiled("compute_90").unwrap();
        for k in Kernel::ALL {
            assert!(
                ptx.contains(&format!(".entry {}(", k.name())),
                "{} is not in the PTX",
                k.name()
            );
        }
    }

    /// The experts' decode products (`moe_glu_vec_*`, `moe_down_vec_*`): one row a block, as
    /// the one-row product kernels.
    fn moe_vec(name: &str) -> bool {
        name.starts_with("moe_glu_vec_") || name.starts_with("moe_down_vec_")
    }

    /// Registers and bytes spilled of every kernel, as ptxas (through NVRTC, no GPU
    /// needed) reports them for sm_90.
    fn ptxas_report() -> Vec<(String, usize, usize)> {
        let src = std::ffi::CString::new(SOURCE).unwrap();
        let prog = nvrtc::result::create_program(&src, None).unwrap();
        let opts = ["--gpu-architecture=sm_90", "--ptxas-options=-v"];
        // SAFETY: `prog` is a live program; the log is read before it is destroyed.
        let log = unsafe {
            nvrtc::result::compile_program(prog, &opts).unwrap();
            let log = nvrtc::result::get_program_log(prog).unwrap();
            nvrtc::result::destroy_program(prog).unwrap();
            log
        };
        let log: Vec<u8> = log.iter().map(|&c| c as u8).collect();
        let log = String::from_utf8_lossy(&log);
        let mut out = Vec::new();
        let mut current: Option<String> = None;
        let mut spills = 0usize;
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                current = rest.split('\'').next().map(str::to_string);
            } else if let Some(rest) = line.split("bytes stack frame, ").nth(1) {
                spills = rest
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(usize::MAX);
            } else if let Some(rest) = line.split("Used ").nth(1) {
                let Some(name) = current.take() else { continue };
                let regs: usize = rest
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(usize::MAX);
                out.push((name, regs, spills));
            }
        }
        assert!(!out.is_empty(), "no kernels in the ptxas log:\n{log}");
        out
    }

    /// The few-row product kernels run at the bandwidth limit only with enough blocks per
    /// SM: with the registers of eight rows in a one-row kernel (255, spilling) the 4-bit
    /// products ran at a quarter of it on the H200. At least three blocks must fit an SM's
    /// registers (the experts' decode mat-vecs too). The attention kernels (every head size
    /// up to 512), the DeltaNet tensor-core kernels, the other mixture-of-experts kernels and
    /// the affine tensor-core products must not spill either.
    #[test]
    fn products_and_attention_kernels_fit_their_registers_without_spills() {
        // SAFETY: probing whether the library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc is not on the library path");
            return;
        }
        let mut few_rows = 0;
        let mut attention = 0;
        let mut experts = 0;
        let mut quantized_mma = 0;
        for (name, regs, spills) in ptxas_report() {
            let moe = name.starts_with("moe_");
            let few = (name.starts_with("linear_") || name.starts_with("glu_") || moe_vec(&name))
                && (name.ends_with("_r1") || name.ends_with("_r2") || moe_vec(&name));
            let attends = name.starts_with("attention_f")
                || name.starts_with("flash_")
                || name == "delta_chunk_state_tc";
            let tensor_products =
                name.contains("_mma_q") || name.contains("_mmx_q") || name.contains("_imma_q");
            if !few && !attends && !moe && !tensor_products {
                continue;
            }
            eprintln!("{name}: {regs} registers, {spills} bytes spilled");
            assert_eq!(spills, 0, "{name} spills {spills} bytes");
            if tensor_products {
                quantized_mma += 1;
                continue;
            }
            if moe {
                experts += 1;
            }
            if attends || (moe && !few) {
                attention += usize::from(attends);
                continue;
            }
            // Registers go to a warp in units of 256; 65,536 per SM.
            let per_block = (regs * 32).next_multiple_of(256) * (128 / 32);
            assert!(
                65_536 / per_block >= 3,
                "{name} uses {regs} registers: fewer than three blocks fit on an SM"
            );
            few_rows += 1;
        }
        assert_eq!(few_rows, 54, "one- and two-row product kernels in the log");
        assert_eq!(
            attention, 33,
            "attention, flash and DeltaNet tensor-core kernels in the log"
        );
        assert_eq!(experts, 17, "mixture-of-experts kernels in the log");
        assert_eq!(
            quantized_mma, 132,
            "affine tensor-core product kernels in the log"
        );
    }
}
