//! The CUDA backend (cargo feature `cuda`): wick's own kernels on NVIDIA GPUs through
//! [`wick_cuda`], with f32 activations, weights kept as the file stores them (f32, f16,
//! bf16, MLX's 4- and 8-bit affine groups; GGUF Q8_0/Q4_0/Q4_1/Q4_K re-laid out into
//! them, other GGUF blocks dequantized to bf16: `affine.rs`), few-row products by kernels
//! that read each weight row once per step, many-row products by cuBLAS, and per-sequence
//! KV caches attended by a kernel that reads cache lengths from device memory.
//!
//! Everything a pass does is recorded and run when the pass ends; step-varying values
//! (token ids, rotary angles, cache addresses and lengths) are uploaded, never passed as
//! kernel arguments, so the decode step of a fixed batch records the same work every time
//! and [`wick_cuda::Device`] replays it as one CUDA graph (see `docs/architecture.md`).
mod affine;
mod deltanet;
mod flash;
mod kv;
mod moe;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use wick_cuda::{Arg, Buffer, Device, Gemm, Kernel, WType};
use wick_gguf::GgmlType;

pub use deltanet::CudaDeltaState;
pub use flash::FlashAttention;
pub use kv::CudaKvLayer;

use crate::backend::candle::KvDtype;
use crate::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, DeltaInputs, DeltaParams, DeltaSegment,
    DeltaShape, DeltaState, DeltaTensors, HostWeight, NormedHeads, RopeSpec, RopeStyle,
};
use crate::weights::affine::from_gguf_blocks;
use crate::weights::AffineWeight;
use crate::{EngineError, Result};
use affine::{Layout, Sides};

/// Rows up to which a product runs on wick's own kernel by default (above: cuBLAS, on
/// tensor cores); `WICK_CUDA_KERNEL_ROWS` overrides it.
const KERNEL_ROWS: usize = 2;
/// Threads of a few-row product's block (`RB_THREADS` of `kernels.cu`).
const ROW_BLOCK_THREADS: u32 = 128;
/// Threads of an attention block (`ATTN_WARPS` of `kernels.cu`).
const ATTENTION_THREADS: u32 = 128;
/// The largest head the attention kernels take (`attention_*_n16_*`, `flash_*_d512`).
pub(crate) const MAX_HEAD_DIM: usize = 512;
const _: () = assert!(MAX_HEAD_DIM == crate::backend::capability::CUDA.max_head_dim);

pub(crate) fn cuda_err(e: wick_cuda::CudaError) -> EngineError {
    EngineError::Backend {
        backend: "cuda",
        message: e.to_string(),
    }
}

fn invalid(message: String) -> EngineError {
    EngineError::Backend {
        backend: "cuda",
        message,
    }
}

/// An activation: `rows × cols` f32 on the device.
#[derive(Clone)]
pub struct CudaTensor {
    buf: Arc<Buffer>,
    /// Bytes into `buf` where the values start (a column block of a one-row tensor is a
    /// view of it).
    offset: usize,
    rows: usize,
    cols: usize,
    /// The same values as bf16 or f16, written beside them by the kernel that made them
    /// (a norm or GLU of a prompt pass) for the cuBLAS product that reads them next.
    half: Option<HalfCopy>,
}

/// `CudaBackend::half_kind`'s codes of the half types.
const HALF_BF16: u8 = 1;
const HALF_F16: u8 = 2;

/// A tensor's values rounded to the half type of the weights a cuBLAS product multiplies
/// them with, as `to_half` would have rounded them.
#[derive(Clone)]
struct HalfCopy {
    buf: Arc<Buffer>,
    kind: WType,
}

impl CudaTensor {
    fn len(&self) -> usize {
        self.rows * self.cols
    }
    fn ptr(&self) -> u64 {
        self.buf.ptr() + self.offset as u64
    }
}

/// A weight matrix `[out, in]` on the device.
pub struct CudaMatrix {
    /// The values (affine: packed).
    buf: Buffer,
    layout: Layout,
    /// Scales and biases of an affine matrix.
    sides: Option<Sides>,
    rows: usize,
    cols: usize,
}

/// Rotary cosines then sines of a pass's rows, on the device.
pub struct CudaRope {
    buf: Buffer,
    rows: usize,
    dims: usize,
    style: RopeStyle,
}

/// Rotary tables of at most this many frequencies × rows are computed on the host (a
/// decode step's: one upload, and the step's graph as before); larger ones on the device.
const HOST_ROPE_VALUES: usize = 8192;

/// Token ids on the device.
pub struct CudaIds {
    buf: Buffer,
    /// Their copy to the host, queued by [`Backend::schedule`].
    host: std::sync::Mutex<Option<wick_cuda::Readback>>,
    n: usize,
    /// Width of the logits they index (every id is below it).
    vocab: usize,
}

/// The CUDA backend.
pub struct CudaBackend {
    dev: Device,
    /// Rows up to which products run on wick's own kernel.
    kernel_rows: usize,
    /// Rows up to which quantized products run on wick's own kernel.
    quant_rows: usize,
    /// Quantized products of more rows, up to [`affine::MMA_ROWS`], run on the tensor-core
    /// kernel that dequantizes in registers (compute capability 8.0 and later; the default,
    /// `WICK_CUDA_QUANT_MMA=0` turns it off), else the matrix is dequantized to bf16 for
    /// cuBLAS.
    quant_mma: bool,
    /// The tensor-core quantized products round x to f16 once per product (`affine_mmx_*`,
    /// the default: on an H100 it decoded the 8B's 8-bit copy 13% and its 4-bit copy 21%
    /// faster at 64 streams) rather than in every block that reads it (`affine_mma_*`,
    /// `WICK_CUDA_QUANT_MMA=per-block`, for comparison).
    quant_mma_once: bool,
    /// Products of up to 8 rows on the x-rounded-once kernels take tiles of 8 rows of x,
    /// the weights' rows as the mma's A operand (half the mma steps and x reads of a
    /// 16-row tile: on an H100 the 8B's 8-bit copy decoded 1.09× and its 4-bit copy 1.17×
    /// as fast at 8 streams); `WICK_CUDA_QUANT_MMA_TILE8=0` gives them tiles of 16.
    quant_mma_tile8: bool,
    /// Rows up to which quantized products above `quant_rows` run on the int8 tensor-core
    /// kernel (`affine::IMMA_ROWS`; `WICK_CUDA_QUANT_IMMA_ROWS`, 0 for never).
    quant_imma_rows: usize,
    /// Streaming multiprocessors of the device.
    sms: usize,
    /// KV caches store f16 (else f32).
    kv_half: bool,
    /// How prompt chunks attend.
    flash: FlashAttention,
    /// Segments of at least this many new rows attend on the flash kernels.
    flash_rows: usize,
    /// Passes of long prompt segments take the flash kernels' wide variants
    /// (`WICK_CUDA_FLASH_WIDE=0` keeps one m-tile a warp, for A/B runs).
    flash_wide: bool,
    /// Prompt segments of DeltaNet layers take the chunked form (else token by token;
    /// `WICK_CUDA_DELTA_CHUNKED=0`).
    delta_chunked: bool,
    /// The chunked form's state pass runs on the tensor cores (else on the CUDA cores;
    /// `WICK_CUDA_DELTA_MMA=0`).
    delta_mma: bool,
    /// A decode step's q/k/v products in one launch, per-head norms with the rotation and
    /// post-norms with the residual add (`linear_many`, `norm_rope_qkv`, `add_post_norm`);
    /// `WICK_CUDA_DECODE_FUSIONS=0` runs their unfused compositions instead, for A/B runs
    /// and as a way around a suspect kernel.
    decode_fusions: bool,
    /// Norms and GLUs of prompt passes write a half copy of their output for the cuBLAS
    /// product that follows (`WICK_CUDA_HALF_COPIES=0`: that product converts it itself).
    half_copies: bool,
    /// Norm kernels of prompt passes take blocks of one thread per 8 values
    /// ([`prompt_norm_threads`]; `WICK_CUDA_PROMPT_NORMS=0`: up to 1,024, as decode steps).
    prompt_norms: bool,
    /// The grouped expert products of half weights (prompt chunks and batches of more than
    /// `moe::VEC_ROWS` rows) run on the tensor cores, their inputs rounded to the weights'
    /// type (compute capability 8.0 and later; `WICK_CUDA_MOE_MMA=0`: on the CUDA cores in
    /// f32, for comparison).
    moe_mma: bool,
    /// A prompt pass's gate-and-up product of half weights stores its sums in their type
    /// for the GLU pass after it (`WICK_CUDA_HALF_GLU=0`: f32 sums).
    half_glu: bool,
    /// The half type the last cuBLAS product converted its f32 input to (0 while none has;
    /// [`HALF_BF16`] or [`HALF_F16`]): the type the half copies take.
    half_kind: AtomicU8,
}

/// Where a cuBLAS product writes: an f32 tensor, or a buffer of the weights' half type
/// (products whose only reader converts their values anyway).
#[derive(Clone, Copy)]
enum BlasOut<'a> {
    F32(&'a CudaTensor),
    Half(&'a Buffer),
}

/// Rows of one segment that one attention block takes (`struct Tile` of `kernels.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
struct Tile {
    row0: i32,
    n: i32,
}

/// The attention kernel for `nt` dimensions per lane and `up` (row, head) units a block.
fn attention_kernel(half: bool, nt: usize, up: usize) -> Kernel {
    match (half, nt, up) {
        (false, 16, _) => Kernel::AttnF32N16U4,
        (true, 16, _) => Kernel::AttnF16N16U4,
        (false, 2, 4) => Kernel::AttnF32N2U4,
        (false, 2, 8) => Kernel::AttnF32N2U8,
        (false, 2, _) => Kernel::AttnF32N2U16,
        (false, 4, 4) => Kernel::AttnF32N4U4,
        (false, 4, 8) => Kernel::AttnF32N4U8,
        (false, 4, _) => Kernel::AttnF32N4U16,
        (false, _, 4) => Kernel::AttnF32N8U4,
        (false, _, _) => Kernel::AttnF32N8U8,
        (true, 2, 4) => Kernel::AttnF16N2U4,
        (true, 2, 8) => Kernel::AttnF16N2U8,
        (true, 2, _) => Kernel::AttnF16N2U16,
        (true, 4, 4) => Kernel::AttnF16N4U4,
        (true, 4, 8) => Kernel::AttnF16N4U8,
        (true, 4, _) => Kernel::AttnF16N4U16,
        (true, _, 4) => Kernel::AttnF16N8U4,
        (true, _, _) => Kernel::AttnF16N8U8,
    }
}

/// How attention blocks are cut for a pass: `nt` head dimensions per lane (`hd` ≤ 32·nt),
/// `up` (row, head) units a block, `gc` query heads of one KV head a block, `rows` rows of
/// a segment a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AttentionShape {
    nt: usize,
    up: usize,
    gc: usize,
    rows: usize,
}

impl AttentionShape {
    /// For `group` query heads per KV head of `hd` dimensions and segments of at most
    /// `seg_rows` rows: a block takes every query head of its KV head (reading each key
    /// once for all of them) and, for prompt rows, as many rows as fit.
    fn new(hd: usize, group: usize, seg_rows: usize) -> Self {
        let nt = match hd {
            0..=64 => 2,
            65..=128 => 4,
            129..=256 => 8,
            _ => 16,
        };
        let up_max = match nt {
            16 => 4,
            8 => 8,
            _ => 16,
        };
        let gc = group.clamp(1, up_max);
        let need = gc * (up_max / gc).min(seg_rows.max(1));
        let up = [4, 8, 16]
            .into_iter()
            .find(|&u| u >= need)
            .unwrap_or(up_max)
            .min(up_max);
        AttentionShape {
            nt,
            up,
            gc,
            rows: (up / gc).max(1),
        }
    }
}

/// One segment as the kernels read it (`struct Seg` of `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Seg {
    k: u64,
    v: u64,
    len_before: i32,
    row_start: i32,
    rows: i32,
    window: i32,
}

/// Little-endian 4-byte values of `bytes` (f32 or u32).
pub(crate) fn words<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// The `half, kind` arguments of a kernel that may write a half copy of its output.
fn half_args(h: &Option<HalfCopy>) -> [Arg; 2] {
    match h {
        Some(h) => [
            Arg::Ptr(h.buf.ptr()),
            Arg::I32(i32::from(h.kind != WType::Bf16)),
        ],
        None => [Arg::Ptr(0), Arg::I32(0)],
    }
}

/// Column blocks of 256 threads for a row kernel over `cols` values.
fn col_blocks(cols: usize) -> u32 {
    cols.div_ceil(256).max(1) as u32
}

/// Threads of a norm's block over groups of `n` (one value or more per thread).
fn norm_threads(n: usize) -> u32 {
    n.next_multiple_of(32).clamp(32, 1024) as u32
}

/// Launches of a norm kernel with at least this many rows (prompt passes) take
/// [`prompt_norm_threads`].
const PROMPT_NORM_ROWS: usize = 64;

/// Heads a block of `norm_rope_heads_warps` takes (a warp each; `NORM_HEAD_WARPS` in
/// kernels.cu).
const NORM_HEAD_WARPS: u32 = 8;

/// Threads of a norm block in a prompt pass: one for every `NORM_CACHE` (8) values of a
/// row, at least 128. A decode step's few rows take up to 1,024 ([`norm_threads`]), which
/// spreads a row over the card; with thousands of rows that leaves two blocks an SM, each
/// thread with two or three values between two block-wide reductions (Gemma 4 E4B's
/// `add_post_norm` at 4,096 rows read and wrote at 1.3 TB/s on an H100).
fn prompt_norm_threads(n: usize) -> u32 {
    n.div_ceil(8).next_multiple_of(32).clamp(128, 1024) as u32
}

/// Which of a few-row product's kernels (passes of up to 1, 2, 4 or 8 rows) takes `rows`.
fn row_class(rows: usize) -> usize {
    match rows {
        0 | 1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    }
}

/// The column of a dense product kernel table (`[f32, f16, bf16]`) for weights of `t`.
fn dense_column(t: WType) -> usize {
    match t {
        WType::F32 => 0,
        WType::F16 => 1,
        WType::Bf16 => 2,
    }
}

/// The kernels' code for an activation (`act` in `kernels.cu`).
fn act_kind(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    }
}

fn blocks_for(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 8192) as u32
}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(format!("{what} {v} is too large for the CUDA kernels")))
}

impl CudaBackend {
    /// Opens GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self> {
        let dev = Device::new(ordinal).map_err(cuda_err)?;
        tracing::info!("CUDA backend on {}", dev.name());
        if std::env::var("WICK_CUDA_GRAPHS").is_ok_and(|v| v == "0") {
            dev.set_graphs(false);
        }
        let sms = dev.sm_count();
        let kernel_rows = std::env::var("WICK_CUDA_KERNEL_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(KERNEL_ROWS);
        let quant_rows = std::env::var("WICK_CUDA_QUANT_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(affine::QUANT_ROWS);
        let flash_rows = std::env::var("WICK_CUDA_FLASH_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(flash::FLASH_ROWS)
            .max(1);
        let flash_wide = std::env::var("WICK_CUDA_FLASH_WIDE").map_or(true, |v| v != "0");
        let delta_chunked = std::env::var("WICK_CUDA_DELTA_CHUNKED").map_or(true, |v| v != "0");
        let delta_mma = std::env::var("WICK_CUDA_DELTA_MMA").map_or(true, |v| v != "0");
        let decode_fusions = std::env::var("WICK_CUDA_DECODE_FUSIONS").map_or(true, |v| v != "0");
        let half_copies = std::env::var("WICK_CUDA_HALF_COPIES").map_or(true, |v| v != "0");
        let half_glu = std::env::var("WICK_CUDA_HALF_GLU").map_or(true, |v| v != "0");
        let prompt_norms = std::env::var("WICK_CUDA_PROMPT_NORMS").map_or(true, |v| v != "0");
        let moe_mma = std::env::var("WICK_CUDA_MOE_MMA").map_or(true, |v| v != "0")
            && dev.compute_capability().0 >= 8;
        let quant_mma_env = std::env::var("WICK_CUDA_QUANT_MMA").ok();
        let quant_mma = quant_mma_env.as_deref() != Some("0") && dev.compute_capability().0 >= 8;
        let quant_mma_once = quant_mma_env.as_deref() != Some("per-block");
        let quant_mma_tile8 = std::env::var("WICK_CUDA_QUANT_MMA_TILE8").map_or(true, |v| v != "0");
        let quant_imma_rows = std::env::var("WICK_CUDA_QUANT_IMMA_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(affine::IMMA_ROWS);
        Ok(CudaBackend {
            dev,
            kernel_rows,
            quant_rows,
            quant_mma,
            quant_mma_once,
            quant_mma_tile8,
            quant_imma_rows,
            sms,
            kv_half: false,
            flash: FlashAttention::from_env(),
            flash_rows,
            flash_wide,
            delta_chunked,
            delta_mma,
            decode_fusions,
            half_copies,
            half_glu,
            prompt_norms,
            moe_mma,
            half_kind: AtomicU8::new(0),
        })
    }

    /// How prompt chunks attend (default: `WICK_CUDA_FLASH`, else [`FlashAttention::Fast`]).
    pub fn with_flash(mut self, mode: FlashAttention) -> Self {
        self.flash = mode;
        self
    }

    /// Whether norms and GLUs of prompt passes write the half copy of their output that
    /// the cuBLAS product after them reads (default: on, unless `WICK_CUDA_HALF_COPIES=0`);
    /// off, that product converts its f32 input in a pass of its own. Either way the
    /// product sees the same values.
    pub fn with_half_copies(mut self, on: bool) -> Self {
        self.half_copies = on;
        self
    }

    /// Whether a prompt pass's gate-and-up product of bf16 or f16 weights stores its sums
    /// in that type for the GLU pass that reads them (default: on, unless
    /// `WICK_CUDA_HALF_GLU=0`), as PyTorch does with half models; off, in f32.
    pub fn with_half_glu(mut self, on: bool) -> Self {
        self.half_glu = on;
        self
    }

    /// Whether the grouped expert products of bf16/f16 weights run on the tensor cores
    /// with their inputs rounded to the weights' type (default: on, unless
    /// `WICK_CUDA_MOE_MMA=0`) or on the CUDA cores in f32. Ignored (off) before compute
    /// capability 8.0.
    pub fn with_moe_mma(mut self, on: bool) -> Self {
        self.moe_mma = on && self.dev.compute_capability().0 >= 8;
        self
    }

    /// Whether quantized products of 3 to 256 rows run on the tensor-core kernel that
    /// dequantizes in registers (default: on, unless `WICK_CUDA_QUANT_MMA=0`) or dequantize
    /// the matrix to bf16 for cuBLAS. Ignored (off) before compute capability 8.0.
    pub fn with_quant_mma(mut self, on: bool) -> Self {
        self.quant_mma = on && self.dev.compute_capability().0 >= 8;
        self
    }

    /// Whether the tensor-core quantized products round x to f16 once per product (the
    /// default) or in every block that reads it (`WICK_CUDA_QUANT_MMA=per-block`).
    pub fn with_quant_mma_rounding_once(mut self, once: bool) -> Self {
        self.quant_mma_once = once;
        self
    }

    /// Whether quantized products of up to 8 rows on the x-rounded-once kernels take tiles
    /// of 8 rows of x (the default) rather than 16 (`WICK_CUDA_QUANT_MMA_TILE8=0`).
    pub fn with_quant_mma_tile8(mut self, on: bool) -> Self {
        self.quant_mma_tile8 = on;
        self
    }

    /// Rows up to which quantized products of more than the mat-vec's rows run on the int8
    /// tensor-core kernel (x quantized to int8 once, the packed codes multiplied as they
    /// are; default `WICK_CUDA_QUANT_IMMA_ROWS`, else 0), above it on the f16 one that
    /// dequantizes in registers; 0 keeps them all on the f16 one. Ignored where the
    /// tensor-core products are off.
    pub fn with_quant_imma_rows(mut self, rows: usize) -> Self {
        self.quant_imma_rows = rows;
        self
    }

    /// Whether an affine product of `rows` rows runs on the int8 tensor-core kernel.
    fn affine_imma_rows(&self, rows: usize) -> bool {
        self.affine_mma_rows(rows) && rows <= self.quant_imma_rows
    }

    /// Whether an affine product of `rows` rows runs on the tensor-core kernel.
    fn affine_mma_rows(&self, rows: usize) -> bool {
        self.quant_mma && rows > self.quant_rows && rows <= affine::MMA_ROWS
    }

    /// The flash kernel segments of many rows attend on, for heads of `hd` dimensions:
    /// none when flash attention is off, the head size has no kernel (a multiple of 8 up to
    /// 256), or the GPU lacks the instructions (compute capability 8.0) or the shared
    /// memory.
    fn flash_kernel(&self, hd: usize) -> Option<flash::FlashKernel> {
        let k = flash::FlashKernel::select(self.flash, self.kv_half, hd)?;
        let (major, _) = self.dev.compute_capability();
        (major >= 8 && k.shared_bytes() <= self.dev.max_shared()).then_some(k)
    }

    /// Stores KV caches as f16 ([`KvDtype::F16`]) or f32.
    pub fn with_kv_dtype(mut self, kv: KvDtype) -> Self {
        self.kv_half = kv == KvDtype::F16;
        self
    }

    /// How the KV caches store numbers.
    pub fn kv_dtype(&self) -> KvDtype {
        if self.kv_half {
            KvDtype::F16
        } else {
            KvDtype::F32
        }
    }

    /// The device layer.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let buf = self.dev.alloc(rows * cols * 4).map_err(cuda_err)?;
        Ok(CudaTensor {
            buf: Arc::new(buf),
            offset: 0,
            rows,
            cols,
            half: None,
        })
    }

    /// Room for the half copy of a `rows`-row output of `len` values, when the product
    /// that reads it goes to cuBLAS (more rows than wick's own kernels take) and an earlier
    /// cuBLAS product has said which half type its weights are.
    fn half_copy(&self, rows: usize, len: usize) -> Result<Option<HalfCopy>> {
        if !self.half_copies || rows <= self.kernel_rows {
            return Ok(None);
        }
        let kind = match self.half_kind.load(Ordering::Relaxed) {
            HALF_BF16 => WType::Bf16,
            HALF_F16 => WType::F16,
            _ => return Ok(None),
        };
        let buf = self.dev.alloc(len * 2).map_err(cuda_err)?;
        Ok(Some(HalfCopy {
            buf: Arc::new(buf),
            kind,
        }))
    }

    /// Threads of a norm kernel's block over `rows` rows of `n` values.
    fn norm_block(&self, n: usize, rows: usize) -> u32 {
        if self.prompt_norms && rows >= PROMPT_NORM_ROWS {
            prompt_norm_threads(n)
        } else {
            norm_threads(n)
        }
    }

    fn launch(&self, k: Kernel, grid: (u32, u32, u32), block: u32, args: &[Arg]) -> Result<()> {
        self.dev.launch(k, grid, block, args).map_err(cuda_err)
    }

    /// Runs `f` as one pass of the device (its work runs together when it returns).
    fn op<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.dev.begin_pass().map_err(cuda_err)?;
        let out = f();
        let end = self.dev.end_pass().map_err(cuda_err);
        let out = out?;
        end?;
        Ok(out)
    }

    fn stage<T: bytemuck::Pod>(&self, data: &[T]) -> Result<u64> {
        self.dev.stage(bytemuck::cast_slice(data)).map_err(cuda_err)
    }

    fn same_shape(&self, what: &str, a: &CudaTensor, b: &CudaTensor) -> Result<()> {
        if a.rows != b.rows || a.cols != b.cols {
            return Err(invalid(format!(
                "{what}: shapes {}x{} and {}x{} differ",
                a.rows, a.cols, b.rows, b.cols
            )));
        }
        Ok(())
    }

    fn elementwise(&self, k: Kernel, x: &CudaTensor, extra: &[Arg]) -> Result<CudaTensor> {
        let out = self.tensor(x.rows, x.cols)?;
        let n = x.len();
        let mut args = vec![Arg::Ptr(x.ptr()), Arg::Ptr(out.ptr())];
        args.extend_from_slice(extra);
        args.push(Arg::I64(n as i64));
        self.launch(k, (blocks_for(n), 1, 1), 256, &args)?;
        Ok(out)
    }

    /// A kernel `(a, b, out, n, extra…)` over two tensors of one shape.
    fn binary(
        &self,
        what: &str,
        k: Kernel,
        a: &CudaTensor,
        b: &CudaTensor,
        extra: &[Arg],
    ) -> Result<CudaTensor> {
        self.same_shape(what, a, b)?;
        let out = self.tensor(a.rows, a.cols)?;
        let n = a.len();
        let mut args = vec![
            Arg::Ptr(a.ptr()),
            Arg::Ptr(b.ptr()),
            Arg::Ptr(out.ptr()),
            Arg::I64(n as i64),
        ];
        args.extend_from_slice(extra);
        self.launch(k, (blocks_for(n), 1, 1), 256, &args)?;
        Ok(out)
    }

    /// `rms_norm(x (+ y)) · weight` over every `weight.len()` values, and with `y` the sum
    /// it normalized.
    fn norm(
        &self,
        x: &CudaTensor,
        y: Option<&CudaTensor>,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<(Option<CudaTensor>, CudaTensor)> {
        let n = weight.len();
        if n == 0 || !x.len().is_multiple_of(n) {
            return Err(invalid(format!(
                "rms_norm: {} values in groups of {n}",
                x.len()
            )));
        }
        if let Some(y) = y {
            self.same_shape("add_rms_norm", x, y)?;
        }
        let mut out = self.tensor(x.rows, x.cols)?;
        let half = self.half_copy(x.rows, x.len())?;
        let groups = ((x.len() / n) as u32, 1, 1);
        let [half_ptr, half_kind] = half_args(&half);
        let tail = [
            Arg::I32(int(n, "norm size")?),
            Arg::F32(eps),
            half_ptr,
            half_kind,
        ];
        let sum = match y {
            None => {
                let args = [
                    Arg::Ptr(x.ptr()),
                    Arg::Ptr(weight.ptr()),
                    Arg::Ptr(out.ptr()),
                ];
                self.launch(
                    Kernel::RmsNorm,
                    groups,
                    self.norm_block(n, x.len() / n),
                    &[&args[..], &tail].concat(),
                )?;
                None
            }
            Some(y) => {
                let sum = self.tensor(x.rows, x.cols)?;
                let args = [
                    Arg::Ptr(x.ptr()),
                    Arg::Ptr(y.ptr()),
                    Arg::Ptr(weight.ptr()),
                    Arg::Ptr(sum.ptr()),
                    Arg::Ptr(out.ptr()),
                ];
                self.launch(
                    Kernel::AddRmsNorm,
                    groups,
                    self.norm_block(n, x.len() / n),
                    &[&args[..], &tail].concat(),
                )?;
                Some(sum)
            }
        };
        out.half = half;
        Ok((sum, out))
    }

    fn upload_weight(&self, w: &HostWeight<'_>) -> Result<(Buffer, WType)> {
        let (bytes, wtype): (std::borrow::Cow<'_, [u8]>, WType) = match w.dtype {
            GgmlType::F32 => (std::borrow::Cow::Borrowed(&w.bytes[..]), WType::F32),
            GgmlType::F16 => (std::borrow::Cow::Borrowed(&w.bytes[..]), WType::F16),
            GgmlType::Bf16 => (std::borrow::Cow::Borrowed(&w.bytes[..]), WType::Bf16),
            _ => {
                // Other GGUF blocks: dequantized on the host, kept as bf16.
                let values = w.dequantize()?;
                let bf: Vec<u16> = values
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                (
                    std::borrow::Cow::Owned(bytemuck::cast_slice(&bf).to_vec()),
                    WType::Bf16,
                )
            }
        };
        let expected = w.shape.iter().product::<usize>() * wtype.size();
        if bytes.len() != expected {
            return Err(invalid(format!(
                "'{}': {} bytes for shape {:?} of {:?}",
                w.name,
                bytes.len(),
                w.shape,
                wtype
            )));
        }
        let buf = self.dev.upload_owned(&bytes).map_err(cuda_err)?;
        Ok((buf, wtype))
    }

    /// Attention of `q` over each segment's cache: after appending the segment's rows of
    /// `new_kv` (keys, values), or, without, over a cache an earlier layer of the pass
    /// already appended this pass's rows to (KV sharing: its last `rows.len()` tokens are
    /// the rows'). A cache keeps every token (see `kv.rs`), so nothing is evicted.
    fn attend(
        &self,
        q: &CudaTensor,
        new_kv: Option<(&CudaTensor, &CudaTensor)>,
        segments: &mut [AttentionSegment<'_, CudaKvLayer>],
        p: &AttentionParams,
        ends: Option<&[usize]>,
    ) -> Result<CudaTensor> {
        let (heads, kv_heads, hd) = (p.heads, p.kv_heads, p.head_dim);
        let total = q.rows;
        if q.cols != heads * hd {
            return Err(invalid(format!(
                "attention: q {}x{} for {heads} heads of {hd}",
                q.rows, q.cols
            )));
        }
        if let Some((k, v)) = new_kv {
            if k.cols != kv_heads * hd || v.cols != kv_heads * hd {
                return Err(invalid(format!(
                    "attention: k {}x{}, v {}x{} for {kv_heads} KV heads of {hd}",
                    k.rows, k.cols, v.rows, v.cols
                )));
            }
            if k.rows != total || v.rows != total {
                return Err(invalid("attention: q, k and v rows differ".into()));
            }
        }
        if hd > MAX_HEAD_DIM || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(invalid(format!(
                "attention: {heads} heads over {kv_heads} KV heads of {hd} dimensions is not supported (head size at most {MAX_HEAD_DIM})"
            )));
        }
        if let Some(e) = ends {
            if e.len() != total {
                return Err(invalid("attention: one end per row expected".into()));
            }
        }
        self.op(|| {
            let mut segs = Vec::with_capacity(segments.len());
            let mut seg_of_row = vec![0i32; total];
            for (si, s) in segments.iter_mut().enumerate() {
                if s.rows.end > total || s.rows.start > s.rows.end {
                    return Err(invalid(format!(
                        "attention: segment rows {:?} outside {total}",
                        s.rows
                    )));
                }
                if s.cache.shape() != (kv_heads, hd) {
                    return Err(EngineError::Cache(
                        "attention: cache of another layer shape".into(),
                    ));
                }
                let n = s.rows.len();
                let (kp, vp, at) = match new_kv {
                    Some(_) => s.cache.reserve_append(n)?,
                    None => s.cache.last_tokens(n)?,
                };
                if let Some(e) = ends {
                    let end = at + n;
                    for (i, r) in s.rows.clone().enumerate() {
                        if e[r] < at + i + 1 || e[r] > end {
                            return Err(invalid(format!(
                                "attention: row {r} sees up to {} (its position {}, the segment ends at {end})",
                                e[r],
                                at + i
                            )));
                        }
                    }
                }
                for r in s.rows.clone() {
                    seg_of_row[r] = si as i32;
                }
                segs.push(Seg {
                    k: kp,
                    v: vp,
                    len_before: int(at, "cache length")?,
                    row_start: int(s.rows.start, "row")?,
                    rows: int(n, "rows")?,
                    window: s.cache.window().map_or(Ok(0), |w| int(w, "window"))?,
                });
            }
            let segs_dev = self.stage(&segs)?;
            let rows_dev = self.stage(&seg_of_row)?;
            let ends_dev = match ends {
                Some(e) => {
                    let e: Vec<i32> = e.iter().map(|&x| x as i32).collect();
                    self.stage(&e)?
                }
                None => 0,
            };
            if let Some((k, v)) = new_kv {
                let row = int(kv_heads * hd, "KV row")?;
                self.launch(
                    Kernel::KvAppend,
                    (total as u32, col_blocks(kv_heads * hd), 1),
                    256,
                    &[
                        Arg::Ptr(k.ptr()),
                        Arg::Ptr(v.ptr()),
                        Arg::Ptr(segs_dev),
                        Arg::Ptr(rows_dev),
                        Arg::I32(row),
                        Arg::I32(i32::from(self.kv_half)),
                    ],
                )?;
            }
            let group = heads / kv_heads;
            let out = self.tensor(total, heads * hd)?;
            // Prompt chunks on the tensor cores, the other segments (decode rows) on the
            // CUDA-core kernel.
            let fk = self.flash_kernel(hd);
            let (flash, other): (Vec<usize>, Vec<usize>) = (0..segs.len())
                .partition(|&i| fk.is_some() && segs[i].rows as usize >= self.flash_rows);
            let longest = flash.iter().map(|&i| segs[i].rows as usize).max();
            let fk = fk.map(|k| match k.wide() {
                Some(w)
                    if self.flash_wide
                        && longest >= Some(flash::FLASH_WIDE_ROWS)
                        && w.shared_bytes() <= self.dev.max_shared() =>
                {
                    w
                }
                _ => k,
            });
            let plan = fk.map(|fk| {
                flash::FlashPlan::new(
                    &segs,
                    &flash,
                    group,
                    kv_heads,
                    fk.units(),
                    fk.bn,
                    self.sms,
                )
            });
            // A grid holds at most 65,535 row tiles: past that, everything goes the slow way.
            let (flash, other) = match &plan {
                Some(p) if p.tiles.len() > 65_535 => (Vec::new(), (0..segs.len()).collect()),
                _ => (flash, other),
            };
            let staged = flash::Staged {
                segs: segs_dev,
                seg_of_row: rows_dev,
                ends: ends_dev,
            };
            if !other.is_empty() {
                self.attend_rows(&segs, &other, !flash.is_empty(), q, &out, &staged, group, p)?;
            }
            if let (Some(fk), Some(plan), false) = (fk, &plan, flash.is_empty()) {
                let shape = flash::Shape {
                    heads,
                    kv_heads,
                    hd,
                    scale: p.scale,
                    softcap: p.softcap.unwrap_or(0.0),
                };
                self.flash_attend(fk, plan, &segs, &flash, q, &out, &staged, &shape)?;
            }
            Ok(out)
        })
    }

    /// Records the CUDA-core attention of segments `which` of `segs` into their rows of
    /// `out` (every row of the pass unless `some_rows`: then the merge of split keys is
    /// told the rows).
    #[allow(clippy::too_many_arguments)]
    fn attend_rows(
        &self,
        segs: &[Seg],
        which: &[usize],
        some_rows: bool,
        q: &CudaTensor,
        out: &CudaTensor,
        staged: &flash::Staged,
        group: usize,
        p: &AttentionParams,
    ) -> Result<()> {
        let (heads, kv_heads, hd) = (p.heads, p.kv_heads, p.head_dim);
        let total = q.rows;
        let seg_rows = which
            .iter()
            .map(|&i| segs[i].rows as usize)
            .max()
            .unwrap_or(1);
        let shape = AttentionShape::new(hd, group, seg_rows);
        let mut tiles = Vec::with_capacity(total.div_ceil(shape.rows) + which.len());
        for s in which.iter().map(|&i| &segs[i]) {
            let (start, n) = (s.row_start as usize, s.rows as usize);
            for r0 in (start..start + n).step_by(shape.rows) {
                tiles.push(Tile {
                    row0: r0 as i32,
                    n: (start + n - r0).min(shape.rows) as i32,
                });
            }
        }
        let tiles_dev = self.stage(&tiles)?;
        let chunks = group.div_ceil(shape.gc);
        let blocks = tiles.len() * kv_heads * chunks;
        // Enough parts of the keys per block to give every SM four blocks; a function
        // of the shapes only, so a decode step's launches repeat.
        let parts = (4 * self.sms).div_ceil(blocks.max(1)).clamp(1, 32);
        let (ml, acc) = if parts > 1 {
            let slots = total * heads * parts;
            (
                Some(self.dev.alloc(slots * 2 * 4).map_err(cuda_err)?),
                Some(self.dev.alloc(slots * hd * 4).map_err(cuda_err)?),
            )
        } else {
            (None, None)
        };
        let ptr = |b: &Option<Buffer>| b.as_ref().map_or(0, Buffer::ptr);
        self.launch(
            attention_kernel(self.kv_half, shape.nt, shape.up),
            (tiles.len() as u32, (kv_heads * chunks) as u32, parts as u32),
            ATTENTION_THREADS,
            &[
                Arg::Ptr(q.ptr()),
                Arg::Ptr(out.ptr()),
                Arg::Ptr(ptr(&ml)),
                Arg::Ptr(ptr(&acc)),
                Arg::Ptr(staged.segs),
                Arg::Ptr(staged.seg_of_row),
                Arg::Ptr(tiles_dev),
                Arg::Ptr(staged.ends),
                Arg::I32(heads as i32),
                Arg::I32(kv_heads as i32),
                Arg::I32(hd as i32),
                Arg::I32(shape.gc as i32),
                Arg::F32(p.scale),
                Arg::F32(p.softcap.unwrap_or(0.0)),
            ],
        )?;
        if parts > 1 {
            let (merged, rows_dev) = if some_rows {
                let rows: Vec<i32> = which
                    .iter()
                    .flat_map(|&i| segs[i].row_start..segs[i].row_start + segs[i].rows)
                    .collect();
                (rows.len(), self.stage(&rows)?)
            } else {
                (total, 0)
            };
            self.launch(
                Kernel::AttentionMerge,
                (merged as u32, heads as u32, 1),
                hd.next_multiple_of(32) as u32,
                &[
                    Arg::Ptr(ptr(&ml)),
                    Arg::Ptr(ptr(&acc)),
                    Arg::Ptr(out.ptr()),
                    Arg::I32(heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(parts as i32),
                    Arg::Ptr(rows_dev),
                ],
            )?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Rope = CudaRope;
    type KvLayer = CudaKvLayer;
    type Ids = CudaIds;
    type DeltaState = CudaDeltaState;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn pass<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.op(f)
    }

    fn matrix(&self, w: HostWeight<'_>) -> Result<CudaMatrix> {
        if w.shape.len() != 2 {
            return Err(invalid(format!(
                "'{}' is not a matrix: shape {:?}",
                w.name, w.shape
            )));
        }
        let (rows, cols) = (w.shape[0], w.shape[1]);
        if let Some(a) = from_gguf_blocks(&w)? {
            return self.affine_from_host(a);
        }
        let (buf, wtype) = self.upload_weight(&w)?;
        Ok(CudaMatrix {
            buf,
            layout: Layout::Dense(wtype),
            sides: None,
            rows,
            cols,
        })
    }

    fn affine_matrix(&self, w: AffineWeight<'_>) -> Result<CudaMatrix> {
        self.affine_from_host(w)
    }

    fn vector(&self, w: HostWeight<'_>) -> Result<CudaTensor> {
        let values = match w.dtype {
            GgmlType::F32 => words(&w.bytes),
            _ => w.dequantize()?,
        };
        self.tensor_from_host(values.clone(), 1, values.len())
    }

    fn can_fuse(&self, parts: &[&CudaMatrix]) -> bool {
        parts.len() > 1
            && parts
                .iter()
                .all(|m| m.layout == parts[0].layout && m.cols == parts[0].cols)
    }

    fn fuse_matrices(&self, parts: Vec<CudaMatrix>) -> Result<CudaMatrix> {
        let Some(first) = parts.first() else {
            return Err(invalid("fuse_matrices: no matrices".into()));
        };
        let (layout, cols) = (first.layout, first.cols);
        if parts.iter().any(|m| m.layout != layout || m.cols != cols) {
            return Err(invalid(
                "fuse_matrices: matrices of different shapes or types".into(),
            ));
        }
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        // Every buffer of a matrix is row-major by output row: the fused one is each
        // buffer's parts one after the other.
        let concat = |pick: &dyn Fn(&CudaMatrix) -> Result<&Buffer>| -> Result<Buffer> {
            let mut total = 0;
            for m in &parts {
                total += pick(m)?.bytes();
            }
            let buf = self.dev.alloc_owned(total).map_err(cuda_err)?;
            let mut at = 0u64;
            for m in &parts {
                let b = pick(m)?;
                self.dev
                    .copy(buf.ptr() + at, b.ptr(), b.bytes())
                    .map_err(cuda_err)?;
                at += b.bytes() as u64;
            }
            Ok(buf)
        };
        let buf = concat(&|m| Ok(&m.buf))?;
        let sides = match layout {
            Layout::Dense(_) => None,
            Layout::Affine { .. } => Some(Sides {
                scales: concat(&|m| Ok(&affine::sides(m)?.scales))?,
                biases: concat(&|m| Ok(&affine::sides(m)?.biases))?,
            }),
        };
        self.dev.synchronize().map_err(cuda_err)?;
        Ok(CudaMatrix {
            buf,
            layout,
            sides,
            rows,
            cols,
        })
    }

    fn matrix_shape(&self, m: &CudaMatrix) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        m.buf.bytes()
            + m.sides
                .as_ref()
                .map_or(0, |s| s.scales.bytes() + s.biases.bytes())
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32]) -> Result<CudaTensor> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({})",
                table.rows
            )));
        }
        self.op(|| {
            let at = self.stage(ids)?;
            self.gather(table, at, ids.len())
        })
    }

    fn linear_many(
        &self,
        x: &CudaTensor,
        ws: &[(&CudaMatrix, Option<&CudaTensor>)],
    ) -> Result<Vec<CudaTensor>> {
        // Two or three dense matrices of one type without biases, multiplying a row or two
        // (a decode step's query, key and value projections): one launch.
        let wtype = match ws.first() {
            Some((w, _)) => match w.layout {
                Layout::Dense(t) => Some(t),
                Layout::Affine { .. } => None,
            },
            None => None,
        };
        let one_launch = self.decode_fusions
            && (2..=3).contains(&ws.len())
            && (1..=self.kernel_rows.min(2)).contains(&x.rows)
            && ws.iter().all(|(w, b)| {
                b.is_none()
                    && w.cols == x.cols
                    && matches!(w.layout, Layout::Dense(t) if Some(t) == wtype)
            });
        let Some(wtype) = wtype.filter(|_| one_launch) else {
            return ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect();
        };
        let ys = ws
            .iter()
            .map(|(w, _)| self.tensor(x.rows, w.rows))
            .collect::<Result<Vec<_>>>()?;
        let part = |i: usize| ws.get(i).zip(ys.get(i));
        let mut args = vec![Arg::Ptr(x.ptr())];
        args.extend((0..3).map(|i| Arg::Ptr(part(i).map_or(0, |(w, _)| w.0.buf.ptr()))));
        args.extend((0..3).map(|i| Arg::Ptr(part(i).map_or(0, |(_, y)| y.ptr()))));
        args.push(Arg::I32(int(x.rows, "rows")?));
        args.push(Arg::I32(int(x.cols, "columns")?));
        for i in 0..3 {
            args.push(Arg::I32(int(
                part(i).map_or(0, |(w, _)| w.0.rows),
                "outputs",
            )?));
        }
        let blocks: usize = ws.iter().map(|(w, _)| w.rows.div_ceil(2)).sum();
        use Kernel::*;
        let kernel = [
            [LinearManyF32R1, LinearManyF16R1, LinearManyBf16R1],
            [LinearManyF32R2, LinearManyF16R2, LinearManyBf16R2],
        ][x.rows - 1][dense_column(wtype)];
        self.op(|| self.launch(kernel, (blocks as u32, 1, 1), ROW_BLOCK_THREADS, &args))?;
        Ok(ys)
    }

    fn linear(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        if x.cols != w.cols {
            return Err(invalid(format!(
                "linear: input of {} columns for a {}x{} matrix",
                x.cols, w.rows, w.cols
            )));
        }
        if let Some(b) = bias {
            if b.len() != w.rows {
                return Err(invalid(format!(
                    "linear: bias of {} for {} outputs",
                    b.len(),
                    w.rows
                )));
            }
        }
        let y = self.tensor(x.rows, w.rows)?;
        if x.rows == 0 {
            return Ok(y);
        }
        self.op(|| match w.layout {
            Layout::Dense(wtype) if x.rows <= self.kernel_rows => {
                use Kernel::*;
                let block = [
                    [LinearBlockF32R1, LinearBlockF16R1, LinearBlockBf16R1],
                    [LinearBlockF32R2, LinearBlockF16R2, LinearBlockBf16R2],
                    [LinearBlockF32R4, LinearBlockF16R4, LinearBlockBf16R4],
                    [LinearBlockF32R8, LinearBlockF16R8, LinearBlockBf16R8],
                ];
                self.launch(
                    block[row_class(x.rows)][dense_column(wtype)],
                    (w.rows.div_ceil(2) as u32, 1, 1),
                    ROW_BLOCK_THREADS,
                    &[
                        Arg::Ptr(x.ptr()),
                        Arg::Ptr(w.buf.ptr()),
                        Arg::Ptr(bias.map_or(0, |b| b.ptr())),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(int(x.rows, "rows")?),
                        Arg::I32(int(w.cols, "columns")?),
                        Arg::I32(int(w.rows, "outputs")?),
                    ],
                )
            }
            Layout::Dense(wtype) => {
                self.blas_product(x, w.buf.ptr(), wtype, w, bias, BlasOut::F32(&y))
            }
            Layout::Affine { bits, group, side } if x.rows <= self.quant_rows => {
                self.affine_rows(x, w, (bits, group, side), bias, &y)
            }
            Layout::Affine { bits, group, side } if self.affine_imma_rows(x.rows) => {
                self.affine_imma(x, w, (bits, group, side), bias, None, &y)
            }
            Layout::Affine { bits, group, side } if self.affine_mma_rows(x.rows) => {
                self.affine_mma(x, w, (bits, group, side), bias, None, &y)
            }
            Layout::Affine { bits, group, side } => {
                let dense = self.affine_to_bf16(w, (bits, group, side))?;
                self.blas_product(x, dense.ptr(), WType::Bf16, w, bias, BlasOut::F32(&y))
            }
        })?;
        Ok(y)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        self.binary("add", Kernel::Add, a, b, &[])
    }

    fn scale(&self, x: &CudaTensor, s: f32) -> Result<CudaTensor> {
        self.elementwise(Kernel::Scale, x, &[Arg::F32(s)])
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        Ok(self.norm(x, None, weight, eps)?.1)
    }

    fn add_rms_norm(
        &self,
        x: &CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<(CudaTensor, CudaTensor)> {
        match self.norm(x, Some(y), weight, eps)? {
            (Some(sum), out) => Ok((sum, out)),
            (None, _) => Err(invalid("add_rms_norm: no sum".into())),
        }
    }

    fn add_post_norm(
        &self,
        x: &CudaTensor,
        y: &CudaTensor,
        post: &CudaTensor,
        eps: f32,
        scale: f32,
        next: Option<&CudaTensor>,
    ) -> Result<(CudaTensor, Option<CudaTensor>)> {
        if !self.decode_fusions {
            return crate::backend::add_post_norm_apart(self, x, y, post, eps, scale, next);
        }
        let n = post.len();
        if n == 0 || !x.len().is_multiple_of(n) || next.is_some_and(|w| w.len() != n) {
            return Err(invalid(format!(
                "add_post_norm: {} values in groups of {n}",
                x.len()
            )));
        }
        self.same_shape("add_post_norm", x, y)?;
        let sum = self.tensor(x.rows, x.cols)?;
        let mut out = next.map(|_| self.tensor(x.rows, x.cols)).transpose()?;
        let half = if out.is_some() {
            self.half_copy(x.rows, x.len())?
        } else {
            None
        };
        let [half_ptr, half_kind] = half_args(&half);
        self.launch(
            Kernel::AddPostNorm,
            ((x.len() / n) as u32, 1, 1),
            self.norm_block(n, x.len() / n),
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(y.ptr()),
                Arg::Ptr(post.ptr()),
                Arg::Ptr(next.map_or(0, |w| w.ptr())),
                Arg::Ptr(sum.ptr()),
                Arg::Ptr(out.as_ref().map_or(0, |o| o.ptr())),
                Arg::I32(int(n, "norm size")?),
                Arg::F32(eps),
                Arg::F32(scale),
                half_ptr,
                half_kind,
            ],
        )?;
        if let Some(o) = out.as_mut() {
            o.half = half;
        }
        Ok((sum, out))
    }

    fn split_columns(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        if widths.iter().sum::<usize>() != x.cols {
            return Err(invalid(format!(
                "split_columns: widths {widths:?} of {} columns",
                x.cols
            )));
        }
        if x.rows == 1 {
            // One row: each block of columns is a contiguous run of it.
            let mut off = 0;
            return Ok(widths
                .iter()
                .map(|&w| {
                    let part = CudaTensor {
                        buf: x.buf.clone(),
                        offset: x.offset + off * 4,
                        rows: 1,
                        cols: w,
                        half: None,
                    };
                    off += w;
                    part
                })
                .collect());
        }
        self.op(|| {
            let mut off = 0;
            let mut parts = Vec::with_capacity(widths.len());
            for &w in widths {
                let out = self.tensor(x.rows, w)?;
                self.launch(
                    Kernel::CopyCols,
                    (x.rows as u32, col_blocks(w), 1),
                    256,
                    &[
                        Arg::Ptr(x.ptr()),
                        Arg::Ptr(out.ptr()),
                        Arg::I32(int(x.cols, "columns")?),
                        Arg::I32(off as i32),
                        Arg::I32(w as i32),
                    ],
                )?;
                off += w;
                parts.push(out);
            }
            Ok(parts)
        })
    }

    fn glu(&self, gate: &CudaTensor, up: &CudaTensor, act: Activation) -> Result<CudaTensor> {
        self.binary("glu", Kernel::Glu, gate, up, &[Arg::I32(act_kind(act))])
    }

    fn linear_act_mul(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        mul: &CudaTensor,
        act: Activation,
    ) -> Result<CudaTensor> {
        let wtype = match w.layout {
            Layout::Dense(t) if self.decode_fusions && (1..=2).contains(&x.rows) => t,
            _ => {
                let gate = self.linear(x, w, None)?;
                return self.glu(&gate, mul, act);
            }
        };
        if x.cols != w.cols || mul.rows != x.rows || mul.cols != w.rows {
            return Err(invalid(format!(
                "linear_act_mul: {}x{} input and {}x{} factor for a {}x{} matrix",
                x.rows, x.cols, mul.rows, mul.cols, w.rows, w.cols
            )));
        }
        let y = self.tensor(x.rows, w.rows)?;
        use Kernel::*;
        let kernel = [
            [
                LinearMulBlockF32R1,
                LinearMulBlockF16R1,
                LinearMulBlockBf16R1,
            ],
            [
                LinearMulBlockF32R2,
                LinearMulBlockF16R2,
                LinearMulBlockBf16R2,
            ],
        ][x.rows - 1][dense_column(wtype)];
        self.op(|| {
            self.launch(
                kernel,
                (w.rows.div_ceil(2) as u32, 1, 1),
                ROW_BLOCK_THREADS,
                &[
                    Arg::Ptr(x.ptr()),
                    Arg::Ptr(w.buf.ptr()),
                    Arg::Ptr(mul.ptr()),
                    Arg::Ptr(y.ptr()),
                    Arg::I32(int(x.rows, "rows")?),
                    Arg::I32(int(w.cols, "columns")?),
                    Arg::I32(int(w.rows, "outputs")?),
                    Arg::I32(act_kind(act)),
                ],
            )
        })?;
        Ok(y)
    }

    fn linear_glu(
        &self,
        x: &CudaTensor,
        gate_up: &CudaMatrix,
        width: usize,
        act: Activation,
    ) -> Result<CudaTensor> {
        if x.cols != gate_up.cols || gate_up.rows != 2 * width {
            return Err(invalid(format!(
                "linear_glu: input of {} columns for a {}x{} matrix of two {width}-row halves",
                x.cols, gate_up.rows, gate_up.cols
            )));
        }
        // One kernel pairs each gate row with its up row and stores act(gate)·up; many rows
        // go to cuBLAS and the GLU kernel.
        let fused = match gate_up.layout {
            Layout::Dense(_) => x.rows <= self.kernel_rows,
            Layout::Affine { .. } => x.rows <= self.quant_rows || self.affine_mma_rows(x.rows),
        };
        if !fused || x.rows == 0 {
            // The product of both halves, then one pass that reads each row's gate and up
            // columns where they lie. Half weights: the product stores its sums in their
            // type (as PyTorch's bf16 models do), half the bytes written and read again.
            let mut y = self.tensor(x.rows, width)?;
            if x.rows == 0 {
                return Ok(y);
            }
            let half = self.half_copy(x.rows, y.len())?;
            let [half_ptr, half_kind] = half_args(&half);
            let tail = [
                Arg::I32(int(width, "width")?),
                Arg::I32(act_kind(act)),
                half_ptr,
                half_kind,
            ];
            let grid = (x.rows as u32, col_blocks(width), 1);
            match gate_up.layout {
                Layout::Dense(wtype) if wtype != WType::F32 && self.half_glu => {
                    let both = self.dev.alloc(x.rows * 2 * width * 2).map_err(cuda_err)?;
                    self.op(|| {
                        let out = BlasOut::Half(&both);
                        self.blas_product(x, gate_up.buf.ptr(), wtype, gate_up, None, out)
                    })?;
                    let kind = Arg::I32(if wtype == WType::Bf16 { 0 } else { 1 });
                    let args = [Arg::Ptr(both.ptr()), kind, Arg::Ptr(y.ptr())];
                    self.launch(
                        Kernel::GluSplitHalf,
                        grid,
                        256,
                        &[&args[..], &tail].concat(),
                    )?;
                }
                _ => {
                    let both = self.linear(x, gate_up, None)?;
                    let args = [Arg::Ptr(both.ptr()), Arg::Ptr(y.ptr())];
                    self.launch(Kernel::GluSplit, grid, 256, &[&args[..], &tail].concat())?;
                }
            }
            y.half = half;
            return Ok(y);
        }
        let y = self.tensor(x.rows, width)?;
        let kind = act_kind(act);
        self.op(|| match gate_up.layout {
            Layout::Dense(wtype) => {
                use Kernel::*;
                let table = [
                    [GluBlockF32R1, GluBlockF16R1, GluBlockBf16R1],
                    [GluBlockF32R2, GluBlockF16R2, GluBlockBf16R2],
                ];
                self.launch(
                    table[usize::from(x.rows > 1)][dense_column(wtype)],
                    (width as u32, 1, 1),
                    ROW_BLOCK_THREADS,
                    &[
                        Arg::Ptr(x.ptr()),
                        Arg::Ptr(gate_up.buf.ptr()),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(int(x.rows, "rows")?),
                        Arg::I32(int(gate_up.cols, "columns")?),
                        Arg::I32(int(width, "width")?),
                        Arg::I32(kind),
                    ],
                )
            }
            Layout::Affine { bits, group, side } if x.rows <= self.quant_rows => {
                self.affine_glu_rows(x, gate_up, (bits, group, side), width, kind, &y)
            }
            Layout::Affine { bits, group, side } if self.affine_imma_rows(x.rows) => self
                .affine_imma(
                    x,
                    gate_up,
                    (bits, group, side),
                    None,
                    Some((width, kind)),
                    &y,
                ),
            Layout::Affine { bits, group, side } => self.affine_mma(
                x,
                gate_up,
                (bits, group, side),
                None,
                Some((width, kind)),
                &y,
            ),
        })?;
        Ok(y)
    }

    fn capabilities(&self) -> &'static crate::backend::capability::Capabilities {
        &crate::backend::capability::CUDA
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        eps: f32,
    ) -> Result<CudaTensor> {
        let n = weight.len();
        if n == 0 || !x.len().is_multiple_of(n) || bias.is_some_and(|b| b.len() != n) {
            return Err(invalid(format!(
                "layer_norm: {} values in groups of {n} (bias of {})",
                x.len(),
                bias.map_or(0, CudaTensor::len)
            )));
        }
        let out = self.tensor(x.rows, x.cols)?;
        self.launch(
            Kernel::LayerNorm,
            ((x.len() / n) as u32, 1, 1),
            self.norm_block(n, x.len() / n),
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(weight.ptr()),
                Arg::Ptr(bias.map_or(0, CudaTensor::ptr)),
                Arg::Ptr(out.ptr()),
                Arg::I32(int(n, "norm size")?),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    fn activation(&self, x: &CudaTensor, act: Activation) -> Result<CudaTensor> {
        self.elementwise(Kernel::Activation, x, &[Arg::I32(act_kind(act))])
    }

    fn softcap(&self, x: &CudaTensor, cap: f32) -> Result<CudaTensor> {
        self.elementwise(Kernel::Softcap, x, &[Arg::F32(cap)])
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(invalid(format!("select_rows: row {bad} of {}", x.rows)));
        }
        if rows.len() == x.rows && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(x.clone());
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.op(|| {
            let at = self.stage(&idx)?;
            let out = self.tensor(rows.len(), x.cols)?;
            self.launch(
                Kernel::GatherRows,
                (rows.len() as u32, col_blocks(x.cols), 1),
                256,
                &[
                    Arg::Ptr(x.ptr()),
                    Arg::Ptr(at),
                    Arg::Ptr(out.ptr()),
                    Arg::I32(int(x.cols, "columns")?),
                ],
            )?;
            Ok(out)
        })
    }

    fn rows_to_host(&self, x: &CudaTensor, groups: &[usize]) -> Result<Vec<Vec<f32>>> {
        if groups.iter().sum::<usize>() != x.rows {
            return Err(invalid(format!(
                "rows_to_host: groups {groups:?} of {} rows",
                x.rows
            )));
        }
        let bytes = self.dev.download(x.ptr(), x.len() * 4).map_err(cuda_err)?;
        let all: Vec<f32> = words(&bytes);
        let mut out = Vec::with_capacity(groups.len());
        let mut at = 0;
        for &g in groups {
            let n = g * x.cols;
            out.push(all[at..at + n].to_vec());
            at += n;
        }
        Ok(out)
    }

    fn argmax(&self, logits: &CudaTensor) -> Result<CudaIds> {
        self.op(|| self.argmax_with(logits, 0, 0, 0))
    }

    fn masked_argmax(&self, logits: &CudaTensor, masks: &[Option<Vec<u32>>]) -> Result<CudaIds> {
        if masks.len() != logits.rows {
            return Err(invalid(format!(
                "masked_argmax: {} masks for {} rows",
                masks.len(),
                logits.rows
            )));
        }
        if masks.iter().all(Option::is_none) {
            return self.argmax(logits);
        }
        let words = masks.iter().flatten().map(Vec::len).max().unwrap_or(0);
        let mut flat = Vec::new();
        let mut at = Vec::with_capacity(masks.len());
        for m in masks {
            match m {
                Some(m) => {
                    at.push(flat.len() as i32);
                    flat.extend_from_slice(m);
                    flat.resize(flat.len() + (words - m.len()), 0);
                }
                None => at.push(-1),
            }
        }
        self.op(|| {
            let masks_dev = self.stage(&flat)?;
            let at_dev = self.stage(&at)?;
            self.argmax_with(logits, masks_dev, at_dev, words)
        })
    }

    fn embed_ids(&self, table: &CudaMatrix, ids: &CudaIds) -> Result<CudaTensor> {
        // The ids are argmaxes of logits; a table with fewer rows than the logits are wide
        // could be read past its end, so it is refused.
        if ids.vocab > table.rows {
            return Err(invalid(format!(
                "ids of a {}-wide vocabulary for a table of {} rows",
                ids.vocab, table.rows
            )));
        }
        self.gather(table, ids.buf.ptr(), ids.n)
    }

    fn ids_to_host(&self, ids: &CudaIds) -> Result<Vec<u32>> {
        let queued = ids
            .host
            .lock()
            .map_err(|_| invalid("ids lock poisoned".into()))?
            .take();
        let bytes = match queued {
            Some(r) => r.wait(),
            None => self.dev.download(ids.buf.ptr(), ids.n * 4),
        }
        .map_err(cuda_err)?;
        Ok(words(&bytes))
    }

    fn schedule_tensor(&self, x: &CudaTensor) -> Result<()> {
        let _ = x;
        self.dev.flush().map_err(cuda_err)
    }

    fn schedule(&self, ids: &CudaIds) -> Result<()> {
        let r = self
            .dev
            .read_later(ids.buf.ptr(), ids.n * 4)
            .map_err(cuda_err)?;
        *ids.host
            .lock()
            .map_err(|_| invalid("ids lock poisoned".into()))? = Some(r);
        Ok(())
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<CudaRope> {
        let flat = positions
            .iter()
            .map(|&p| int(p, "rotary position"))
            .collect::<Result<Vec<_>>>()?;
        self.rotary_table(positions.len(), &flat, None, spec)
    }

    fn rope_table_axes(
        &self,
        positions: &[[usize; 3]],
        axes: &[u8],
        spec: &RopeSpec,
    ) -> Result<CudaRope> {
        if axes.len() != spec.inv_freq.len() || axes.iter().any(|&a| a > 2) {
            return Err(invalid(format!(
                "{} rotary axes (each 0..=2) for {} frequencies",
                axes.len(),
                spec.inv_freq.len()
            )));
        }
        let flat = positions
            .iter()
            .flatten()
            .map(|&p| int(p, "rotary position"))
            .collect::<Result<Vec<_>>>()?;
        self.rotary_table(positions.len(), &flat, Some(axes), spec)
    }

    fn rope(&self, x: &CudaTensor, heads: usize, table: &CudaRope) -> Result<CudaTensor> {
        if table.rows != x.rows || heads == 0 || !x.cols.is_multiple_of(heads) {
            return Err(invalid(format!(
                "rope: table of {} rows for {}x{} in {heads} heads",
                table.rows, x.rows, x.cols
            )));
        }
        let hd = x.cols / heads;
        if table.dims > hd {
            return Err(invalid(format!(
                "rope: {} rotated dimensions of a {hd}-dimension head",
                table.dims
            )));
        }
        let out = self.tensor(x.rows, x.cols)?;
        self.launch(
            Kernel::Rope,
            (x.rows as u32, col_blocks(x.cols), 1),
            256,
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(out.ptr()),
                Arg::Ptr(table.buf.ptr()),
                Arg::I32(int(x.rows, "rows")?),
                Arg::I32(heads as i32),
                Arg::I32(hd as i32),
                Arg::I32(table.dims as i32),
                Arg::I32(i32::from(table.style == RopeStyle::Neox)),
            ],
        )?;
        Ok(out)
    }

    fn rope_qk(
        &self,
        q: &CudaTensor,
        heads: usize,
        k: &CudaTensor,
        kv_heads: usize,
        table: &CudaRope,
    ) -> Result<(CudaTensor, CudaTensor)> {
        let hd = q.cols.checked_div(heads).unwrap_or(0);
        if table.rows != q.rows
            || k.rows != q.rows
            || heads == 0
            || kv_heads == 0
            || q.cols != heads * hd
            || k.cols != kv_heads * hd
            || table.dims > hd
        {
            return Ok((self.rope(q, heads, table)?, self.rope(k, kv_heads, table)?));
        }
        let (q_out, k_out) = (self.tensor(q.rows, q.cols)?, self.tensor(k.rows, k.cols)?);
        self.launch(
            Kernel::RopeQk,
            (q.rows as u32, col_blocks(q.cols + k.cols), 1),
            256,
            &[
                Arg::Ptr(q.ptr()),
                Arg::Ptr(q_out.ptr()),
                Arg::Ptr(k.ptr()),
                Arg::Ptr(k_out.ptr()),
                Arg::Ptr(table.buf.ptr()),
                Arg::I32(int(q.rows, "rows")?),
                Arg::I32(heads as i32),
                Arg::I32(kv_heads as i32),
                Arg::I32(int(hd, "head size")?),
                Arg::I32(table.dims as i32),
                Arg::I32(i32::from(table.style == RopeStyle::Neox)),
            ],
        )?;
        Ok((q_out, k_out))
    }

    fn norm_rope_qkv(
        &self,
        q: (&CudaTensor, &CudaTensor),
        k: Option<(&CudaTensor, &CudaTensor)>,
        v: Option<(&CudaTensor, &CudaTensor)>,
        heads: usize,
        kv_heads: usize,
        table: &CudaRope,
        eps: f32,
    ) -> Result<NormedHeads<CudaTensor>> {
        let rows = q.0.rows;
        let hd = q.0.cols.checked_div(heads).unwrap_or(0);
        let fits = |t: Option<(&CudaTensor, &CudaTensor)>| {
            t.is_none_or(|(t, w)| t.rows == rows && t.cols == kv_heads * hd && w.len() == hd)
        };
        // One block a head, one thread a value, the head staged in shared memory.
        if !self.decode_fusions
            || heads == 0
            || hd == 0
            || hd > 1024
            || q.0.cols != heads * hd
            || q.1.len() != hd
            || table.rows != rows
            || table.dims > hd
            || !fits(k)
            || !fits(v)
        {
            return crate::backend::norm_rope_qkv_apart(self, q, k, v, heads, kv_heads, table, eps);
        }
        let q_out = self.tensor(rows, q.0.cols)?;
        let k_out = k.map(|(t, _)| self.tensor(rows, t.cols)).transpose()?;
        let v_out = v.map(|(t, _)| self.tensor(rows, t.cols)).transpose()?;
        let (kn, vn) = (
            k.map_or(0, |_| kv_heads) as u32,
            v.map_or(0, |_| kv_heads) as u32,
        );
        let ptr = |t: Option<&CudaTensor>| Arg::Ptr(t.map_or(0, |t| t.ptr()));
        let all = heads as u32 + kn + vn;
        // A prompt's rows: a warp per head (see `norm_rope_heads_warps`).
        let (kernel, grid, block) = if self.prompt_norms && rows >= PROMPT_NORM_ROWS {
            (
                Kernel::NormRopeHeadsWarps,
                (rows as u32, all.div_ceil(NORM_HEAD_WARPS), 1),
                32 * NORM_HEAD_WARPS,
            )
        } else {
            (
                Kernel::NormRopeHeads,
                (rows as u32, all, 1),
                norm_threads(hd),
            )
        };
        self.launch(
            kernel,
            grid,
            block,
            &[
                Arg::Ptr(q.0.ptr()),
                Arg::Ptr(q.1.ptr()),
                Arg::Ptr(q_out.ptr()),
                ptr(k.map(|t| t.0)),
                ptr(k.map(|t| t.1)),
                ptr(k_out.as_ref()),
                ptr(v.map(|t| t.0)),
                ptr(v.map(|t| t.1)),
                ptr(v_out.as_ref()),
                Arg::Ptr(table.buf.ptr()),
                Arg::I32(int(rows, "rows")?),
                Arg::I32(heads as i32),
                Arg::I32(kn as i32),
                Arg::I32(vn as i32),
                Arg::I32(hd as i32),
                Arg::I32(table.dims as i32),
                Arg::I32(i32::from(table.style == RopeStyle::Neox)),
                Arg::F32(eps),
            ],
        )?;
        Ok(NormedHeads {
            q: q_out,
            k: k_out,
            v: v_out,
        })
    }

    fn split_rope_qkv(
        &self,
        qkv: &CudaTensor,
        widths: &[usize],
        heads: usize,
        kv_heads: usize,
        table: &CudaRope,
    ) -> Result<(CudaTensor, CudaTensor, CudaTensor)> {
        let hd = widths
            .first()
            .and_then(|w| w.checked_div(heads))
            .unwrap_or(0);
        let (qn, kn) = (heads * hd, kv_heads * hd);
        // One row splits into views for free (decode steps keep their launches); shapes
        // the kernel does not take go the default way.
        if qkv.rows < 2
            || hd == 0
            || kv_heads == 0
            || widths != [qn, kn, kn]
            || qkv.cols != qn + 2 * kn
            || table.rows != qkv.rows
            || table.dims > hd
        {
            return crate::backend::split_then_rope_qk(self, qkv, widths, heads, kv_heads, table);
        }
        let q = self.tensor(qkv.rows, qn)?;
        let k = self.tensor(qkv.rows, kn)?;
        let v = self.tensor(qkv.rows, kn)?;
        self.launch(
            Kernel::RopeQkv,
            (qkv.rows as u32, col_blocks(qkv.cols), 1),
            256,
            &[
                Arg::Ptr(qkv.ptr()),
                Arg::Ptr(q.ptr()),
                Arg::Ptr(k.ptr()),
                Arg::Ptr(v.ptr()),
                Arg::Ptr(table.buf.ptr()),
                Arg::I32(int(qkv.rows, "rows")?),
                Arg::I32(int(heads, "heads")?),
                Arg::I32(int(kv_heads, "KV heads")?),
                Arg::I32(int(hd, "head size")?),
                Arg::I32(table.dims as i32),
                Arg::I32(i32::from(table.style == RopeStyle::Neox)),
            ],
        )?;
        Ok((q, k, v))
    }

    fn new_kv_layer(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> CudaKvLayer {
        CudaKvLayer::new(self.dev.clone(), kv_heads, head_dim, self.kv_half, window)
    }

    fn kv_layer_from_snapshot(&self, s: &crate::backend::KvLayerSnapshot) -> Result<CudaKvLayer> {
        self.op(|| CudaKvLayer::from_snapshot(self.dev.clone(), s, self.kv_half))
    }

    fn new_delta_state(&self, shape: &DeltaShape) -> CudaDeltaState {
        CudaDeltaState::new(self.dev.clone(), shape)
    }

    fn delta_state_from_host(&self, s: DeltaState) -> Result<CudaDeltaState> {
        self.op(|| CudaDeltaState::from_host(self.dev.clone(), &s))
    }

    fn delta_weights(&self, p: &DeltaParams<'_>) -> Result<Option<DeltaTensors<CudaTensor>>> {
        self.delta_upload(p)
    }

    fn delta_net(
        &self,
        p: &DeltaParams<'_>,
        uploaded: Option<&DeltaTensors<CudaTensor>>,
        x: DeltaInputs<'_, CudaTensor>,
        segments: &mut [DeltaSegment<'_, CudaDeltaState>],
    ) -> Result<CudaTensor> {
        let w = uploaded.ok_or_else(|| {
            invalid("delta_net: the layer's vectors were not uploaded (delta_weights)".into())
        })?;
        self.delta_mix(p, w, x, segments)
    }

    fn moe_weights(
        &self,
        gate_up: &HostWeight<'_>,
        down: &HostWeight<'_>,
        per_expert_scale: &[f32],
    ) -> Result<Option<crate::backend::MoeTensors<Self>>> {
        self.moe_upload(gate_up, down, per_expert_scale)
    }

    fn moe(
        &self,
        experts: &crate::backend::Experts<Self>,
        x: &CudaTensor,
        logits: &CudaTensor,
        rows: usize,
    ) -> Result<CudaTensor> {
        match experts.stacked() {
            Some(t) => self.moe_device(experts, t, x, logits, rows),
            None => experts.forward_on_host(self, x, logits, rows),
        }
    }

    fn sigmoid_gate(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        shape: (usize, usize),
    ) -> Result<CudaTensor> {
        if (x.rows, x.cols) != shape {
            return Err(invalid(format!(
                "sigmoid_gate: a {}x{} tensor for {shape:?}",
                x.rows, x.cols
            )));
        }
        self.binary("sigmoid_gate", Kernel::SigmoidGate, x, gate, &[])
    }

    fn tensor_from_host(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(invalid(format!(
                "{} values for a {rows}x{cols} tensor",
                data.len()
            )));
        }
        let buf = self
            .dev
            .upload(bytemuck::cast_slice(&data))
            .map_err(cuda_err)?;
        Ok(CudaTensor {
            buf: Arc::new(buf),
            offset: 0,
            rows,
            cols,
            half: None,
        })
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        segments: &mut [AttentionSegment<'_, CudaKvLayer>],
        params: &AttentionParams,
    ) -> Result<CudaTensor> {
        self.attend(q, Some((k, v)), segments, params, None)
    }

    fn attention_to(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        segments: &mut [AttentionSegment<'_, CudaKvLayer>],
        params: &AttentionParams,
        ends: &[usize],
    ) -> Result<CudaTensor> {
        self.attend(q, Some((k, v)), segments, params, Some(ends))
    }

    fn attention_shared(
        &self,
        q: &CudaTensor,
        new_kv: Option<(&CudaTensor, &CudaTensor)>,
        segments: &mut [AttentionSegment<'_, CudaKvLayer>],
        params: &AttentionParams,
        evict: bool,
        ends: Option<&[usize]>,
    ) -> Result<CudaTensor> {
        // The caches keep every token (a window only bounds what the kernels read), so
        // there is nothing to evict whichever layer reads last.
        let _ = evict;
        self.attend(q, new_kv, segments, params, ends)
    }

    fn add_rows(&self, y: &CudaTensor, rows: &[usize], d: &CudaTensor) -> Result<CudaTensor> {
        if d.rows != rows.len() || d.cols != y.cols || rows.iter().any(|&r| r >= y.rows) {
            return Err(invalid(format!(
                "add_rows: {}x{} delta at rows {rows:?} of {}x{}",
                d.rows, d.cols, y.rows, y.cols
            )));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.op(|| {
            let out = self.tensor(y.rows, y.cols)?;
            self.dev
                .copy(out.ptr(), y.ptr(), y.len() * 4)
                .map_err(cuda_err)?;
            let at = self.stage(&idx)?;
            self.launch(
                Kernel::ScatterAddRows,
                (rows.len() as u32, col_blocks(y.cols), 1),
                256,
                &[
                    Arg::Ptr(out.ptr()),
                    Arg::Ptr(at),
                    Arg::Ptr(d.ptr()),
                    Arg::I32(int(y.cols, "columns")?),
                ],
            )?;
            Ok(out)
        })
    }
}

impl CudaBackend {
    /// Row-wise argmax in two stages (slices of each row, then the slices' winners), with
    /// the masks at `masks`/`mask_at` (0: none).
    fn argmax_with(
        &self,
        logits: &CudaTensor,
        masks: u64,
        mask_at: u64,
        words: usize,
    ) -> Result<CudaIds> {
        let rows = logits.rows;
        let parts = logits.cols.div_ceil(2048).clamp(1, 128);
        let part = self.dev.alloc(rows * parts * 8).map_err(cuda_err)?;
        let buf = self.dev.alloc(rows * 4).map_err(cuda_err)?;
        self.launch(
            Kernel::ArgmaxRows,
            (rows as u32, parts as u32, 1),
            256,
            &[
                Arg::Ptr(logits.ptr()),
                Arg::Ptr(part.ptr()),
                Arg::I32(int(logits.cols, "vocabulary")?),
                Arg::Ptr(masks),
                Arg::Ptr(mask_at),
                Arg::I32(int(words, "mask words")?),
            ],
        )?;
        self.launch(
            Kernel::ArgmaxFinish,
            (rows as u32, 1, 1),
            128,
            &[
                Arg::Ptr(part.ptr()),
                Arg::Ptr(buf.ptr()),
                Arg::I32(parts as i32),
            ],
        )?;
        Ok(CudaIds {
            buf,
            host: Default::default(),
            n: rows,
            vocab: logits.cols,
        })
    }

    /// The rotary table of `rows` positions (`positions` holds one a row, or three with
    /// `axes`: the position each frequency turns with), angles in f64 as the CPU backend
    /// takes them. A decode step's few rows are computed on the host and uploaded like
    /// every step-varying value, so the step records the same launches and its graph
    /// replays; a prompt's on the device (`rope_table`), since a pass is recorded whole
    /// before it runs and millions of host `sin_cos` calls held the GPU idle (tens of
    /// milliseconds for Gemma 4's 384 frequencies at 4,096 tokens).
    fn rotary_table(
        &self,
        rows: usize,
        positions: &[i32],
        axes: Option<&[u8]>,
        spec: &RopeSpec,
    ) -> Result<CudaRope> {
        let half = spec.dims / 2;
        if spec.inv_freq.len() != half || half == 0 {
            return Err(invalid(format!(
                "rope: {} frequencies for {} dimensions",
                spec.inv_freq.len(),
                spec.dims
            )));
        }
        let stride = if axes.is_some() { 3 } else { 1 };
        if positions.len() != rows * stride {
            return Err(invalid(format!(
                "rope: {} positions for {rows} rows",
                positions.len()
            )));
        }
        if rows * half <= HOST_ROPE_VALUES {
            // A decode step's few rows: one upload of the finished table.
            let mut cs = vec![0f32; 2 * rows * half];
            let (cos, sin) = cs.split_at_mut(rows * half);
            for r in 0..rows {
                for (i, &f) in spec.inv_freq.iter().enumerate() {
                    let axis = axes.map_or(0, |a| usize::from(a[i]));
                    let p = positions[r * stride + axis] as f64 * spec.position_scale as f64;
                    let (s, c) = (p * f as f64).sin_cos();
                    cos[r * half + i] = c as f32 * spec.attention_factor;
                    sin[r * half + i] = s as f32 * spec.attention_factor;
                }
            }
            return Ok(CudaRope {
                buf: self
                    .dev
                    .upload(bytemuck::cast_slice(&cs))
                    .map_err(cuda_err)?,
                rows,
                dims: spec.dims,
                style: spec.style,
            });
        }
        let buf = self.dev.alloc(2 * rows * half * 4).map_err(cuda_err)?;
        let pos = self
            .dev
            .upload(bytemuck::cast_slice(positions))
            .map_err(cuda_err)?;
        let freq = self
            .dev
            .upload(bytemuck::cast_slice(&spec.inv_freq))
            .map_err(cuda_err)?;
        let axes = axes
            .map(|a| self.dev.upload(a).map_err(cuda_err))
            .transpose()?;
        self.launch(
            Kernel::RopeTable,
            (int(rows, "rotary rows")? as u32, col_blocks(half), 1),
            256,
            &[
                Arg::Ptr(pos.ptr()),
                Arg::I32(stride as i32),
                Arg::Ptr(axes.as_ref().map_or(0, |a| a.ptr())),
                Arg::Ptr(freq.ptr()),
                Arg::Ptr(buf.ptr()),
                Arg::I32(rows as i32),
                Arg::I32(half as i32),
                Arg::F32(spec.position_scale),
                Arg::F32(spec.attention_factor),
            ],
        )?;
        Ok(CudaRope {
            buf,
            rows,
            dims: spec.dims,
            style: spec.style,
        })
    }

    /// Embedding rows of `table` for `n` ids at device address `ids`.
    fn gather(&self, table: &CudaMatrix, ids: u64, n: usize) -> Result<CudaTensor> {
        let out = self.tensor(n, table.cols)?;
        let k = match table.layout {
            Layout::Dense(WType::F32) => Kernel::EmbedF32,
            Layout::Dense(WType::F16) => Kernel::EmbedF16,
            Layout::Dense(WType::Bf16) => Kernel::EmbedBf16,
            Layout::Affine { bits, group, side } => {
                self.gather_affine(table, (bits, group, side), ids, &out)?;
                return Ok(out);
            }
        };
        self.launch(
            k,
            (n as u32, col_blocks(table.cols), 1),
            256,
            &[
                Arg::Ptr(table.buf.ptr()),
                Arg::Ptr(ids),
                Arg::Ptr(out.ptr()),
                Arg::I32(int(table.cols, "hidden size")?),
            ],
        )?;
        Ok(out)
    }

    /// `y = x · wᵀ (+ bias)` by cuBLAS for the dense `[w.rows, w.cols]` weights of type
    /// `wtype` at `wptr`, inside a pass: half weights take x rounded to their type.
    fn blas_product(
        &self,
        x: &CudaTensor,
        wptr: u64,
        wtype: WType,
        w: &CudaMatrix,
        bias: Option<&CudaTensor>,
        y: BlasOut<'_>,
    ) -> Result<()> {
        let half;
        let input = match wtype {
            WType::F32 => x.ptr(),
            // Its maker wrote the half copy this product needs.
            kind if x.half.as_ref().is_some_and(|h| h.kind == kind) => {
                x.half.as_ref().map_or(0, |h| h.buf.ptr())
            }
            kind => {
                // Later norms and GLUs of the pass write their outputs' copies in this
                // type (the model's products share one weight type).
                let code = if kind == WType::Bf16 {
                    HALF_BF16
                } else {
                    HALF_F16
                };
                self.half_kind.store(code, Ordering::Relaxed);
                let n = x.len();
                half = self.dev.alloc(n * 2).map_err(cuda_err)?;
                self.launch(
                    Kernel::ToHalf,
                    (blocks_for(n), 1, 1),
                    256,
                    &[
                        Arg::Ptr(x.ptr()),
                        Arg::Ptr(half.ptr()),
                        Arg::I64(n as i64),
                        Arg::I32(if kind == WType::Bf16 { 0 } else { 1 }),
                    ],
                )?;
                half.ptr()
            }
        };
        self.dev
            .gemm(Gemm {
                w: wptr,
                wtype,
                x: input,
                y: match y {
                    BlasOut::F32(t) => t.ptr(),
                    BlasOut::Half(b) => b.ptr(),
                },
                y_half: matches!(y, BlasOut::Half(_)),
                rows: x.rows,
                k: w.cols,
                n: w.rows,
            })
            .map_err(cuda_err)?;
        if let Some(b) = bias {
            let BlasOut::F32(y) = y else {
                return Err(invalid("a half product output takes no bias".into()));
            };
            let n = y.len();
            self.launch(
                Kernel::AddBias,
                (blocks_for(n), 1, 1),
                256,
                &[
                    Arg::Ptr(y.ptr()),
                    Arg::Ptr(b.ptr()),
                    Arg::I64(n as i64),
                    Arg::I32(w.rows as i32),
                ],
            )?;
        }
        Ok(())
    }
}
