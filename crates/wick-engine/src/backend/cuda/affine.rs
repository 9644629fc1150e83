//! Quantized matrices on the GPU, kept quantized: MLX's affine layout (4 or 8 bits per
//! value, a scale and a bias per group of 32, 64 or 128 inputs) as files store it, and the
//! GGUF blocks that re-lay out into it without loss (Q8_0, Q4_0, Q4_1, Q4_K: groups of 32,
//! scales and biases kept as f16 where that is exact, else f32).
//!
//! Products of few rows (decode) read the packed values once per step through
//! `linear_q{4,8}_*`; products of up to [`MMA_ROWS`] rows (batched decode, short prompt
//! chunks) run on the tensor cores through `{linear,glu}_mma_q{4,8}_*`, which dequantize
//! the packed values in registers; products of more rows (long prompt chunks) dequantize
//! the matrix to bf16 into a temporary and hand that to cuBLAS, as a bf16 file's weights
//! are.
use wick_cuda::{Arg, Buffer, Kernel, WType};
use wick_gguf::GgmlType;

use super::{blocks_for, col_blocks, cuda_err, int, invalid, CudaBackend, CudaMatrix, CudaTensor};
#[cfg(doc)]
use crate::weights::affine::from_gguf_blocks;
use crate::weights::AffineWeight;
use crate::Result;

/// Rows up to which a quantized product runs on the quantized kernel by default, which
/// reads the packed weights once per two rows (above, dequantizing to bf16 for cuBLAS
/// costs less: on the H200 an 8B 4-bit model decoded 8 rows at 232 tok/s on a kernel of
/// eight-row passes); `WICK_CUDA_QUANT_ROWS` overrides it.
pub(super) const QUANT_ROWS: usize = 2;

/// Rows up to which a quantized product above [`QUANT_ROWS`] runs on the tensor-core
/// kernel (it reads the packed weights once per 64 rows; above, one dequantized bf16 copy
/// serves cuBLAS's whole product).
pub(super) const MMA_ROWS: usize = 256;

/// Rows up to which a quantized product above [`QUANT_ROWS`] runs on the int8 tensor-core
/// kernel (`{linear,glu}_imma_q*`: x quantized to int8 once, the packed codes multiplied as
/// they are) rather than the f16 one; `WICK_CUDA_QUANT_IMMA_ROWS` overrides it. 0 (never):
/// on an H100 at 8 streams it decoded an 8B's 8-bit copy 7% faster than the f16 kernel and
/// its 4-bit copy 10% slower, and lost on both at 64 (`docs/gpu-runs/2026-12-07-h100-int8-quant`).
pub(super) const IMMA_ROWS: usize = 0;
/// Weight rows one block of `linear_imma_q*` makes (a `glu_imma_q*` block: half as many
/// gate rows and their up rows).
const IMMA_COLS: usize = 16;
/// Rows of x one n-tile of the int8 product holds (the `n` of m16n8k32).
const IMMA_TILE: usize = 8;
/// Threads of an int8 product block (`QI_WARPS` warps).
const IMMA_THREADS: u32 = 256;

/// Outputs one block of `linear_mma_q*` makes (`QM_COLS` of `kernels.cu`; a `glu_mma_q*`
/// block makes half as many gate and up pairs).
const MMA_COLS: usize = 64;
/// Outputs one block of `linear_mmx_q*` makes (`QX_COLS`).
const MMX_COLS: usize = 128;
/// Inputs of one slab of x in shared memory (`QM_SLAB`): the unit the inputs are split in
/// between blocks.
const MMA_SLAB: usize = 256;
/// Most slices the inputs of one product are split into.
const MMA_MAX_SLICES: usize = 16;
/// Blocks per SM a tensor-core product aims at (with fewer, too few weight loads are in
/// flight to reach the memory's bandwidth): four of `affine_mma`'s 4 warps, two of
/// `affine_mmx`'s 8 (`QM_MIN_BLOCKS`, `QX_MIN_BLOCKS`).
const MMA_BLOCKS_PER_SM: usize = 4;
const MMX_BLOCKS_PER_SM: usize = 2;
/// Padding of the x tile's rows in shared memory, in halves (`QM_STRIDE - QM_SLAB`).
const MMA_PAD: usize = 4;

/// The slices the inputs of a tensor-core product are split into so that `blocks` tiles
/// fill `sms` SMs (`per_sm` blocks each), each slice at least one slab of `cols` inputs
/// and none empty.
fn mma_slices(blocks: usize, sms: usize, per_sm: usize, cols: usize) -> usize {
    let slabs = cols.div_ceil(MMA_SLAB);
    let want = (per_sm * sms)
        .div_ceil(blocks.max(1))
        .clamp(1, MMA_MAX_SLICES.min(slabs));
    slabs.div_ceil(slabs.div_ceil(want))
}

/// How a matrix's numbers are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// One value per element.
    Dense(WType),
    /// `bits` per value, and per `group` inputs a scale and a bias of type `side`.
    Affine {
        bits: u32,
        group: usize,
        side: WType,
    },
}

/// A matrix's scales and biases, `[rows, cols / group]` each.
pub(super) struct Sides {
    pub(super) scales: Buffer,
    pub(super) biases: Buffer,
}

#[derive(Clone, Copy)]
enum Op {
    /// The product kernel for one row, or passes of up to two.
    Linear {
        one: bool,
    },
    /// The same for a fused `[gate; up]` matrix, storing act(gate)·up.
    Glu {
        one: bool,
    },
    Dequant,
    Embed,
}

fn kernel(op: Op, bits: u32, side: WType) -> Kernel {
    use Kernel::*;
    let table: [[Kernel; 3]; 2] = match op {
        Op::Linear { one: true } => [
            [LinearQ8Bf16R1, LinearQ8F16R1, LinearQ8F32R1],
            [LinearQ4Bf16R1, LinearQ4F16R1, LinearQ4F32R1],
        ],
        Op::Linear { one: false } => [
            [LinearQ8Bf16R2, LinearQ8F16R2, LinearQ8F32R2],
            [LinearQ4Bf16R2, LinearQ4F16R2, LinearQ4F32R2],
        ],
        Op::Glu { one: true } => [
            [GluQ8Bf16R1, GluQ8F16R1, GluQ8F32R1],
            [GluQ4Bf16R1, GluQ4F16R1, GluQ4F32R1],
        ],
        Op::Glu { one: false } => [
            [GluQ8Bf16R2, GluQ8F16R2, GluQ8F32R2],
            [GluQ4Bf16R2, GluQ4F16R2, GluQ4F32R2],
        ],
        Op::Dequant => [
            [DequantQ8Bf16, DequantQ8F16, DequantQ8F32],
            [DequantQ4Bf16, DequantQ4F16, DequantQ4F32],
        ],
        Op::Embed => [
            [EmbedQ8Bf16, EmbedQ8F16, EmbedQ8F32],
            [EmbedQ4Bf16, EmbedQ4F16, EmbedQ4F32],
        ],
    };
    let row = if bits == 8 { 0 } else { 1 };
    let col = match side {
        WType::Bf16 => 0,
        WType::F16 => 1,
        WType::F32 => 2,
    };
    table[row][col]
}

/// The tensor-core product kernel for bits, side type, row tile (8, 16, 32 or 64 rows; 8
/// only for the kernels that read x rounded once, the others taking 16), whether it is the
/// fused `[gate; up]` form, and whether it reads x rounded once (`*_mmx_*`) or rounds it
/// itself (`*_mma_*`).
fn mma_kernel(bits: u32, side: WType, tile: usize, glu: bool, once: bool) -> Kernel {
    use Kernel::*;
    type Table = [[[Kernel; 3]; 3]; 2];
    // The x-rounded-once kernels have a tile of 8 rows besides (`*_m0`).
    type Wide = [[[Kernel; 4]; 3]; 2];
    const LINEAR: Table = [
        [
            [LinearMmaQ8Bf16M1, LinearMmaQ8Bf16M2, LinearMmaQ8Bf16M4],
            [LinearMmaQ8F16M1, LinearMmaQ8F16M2, LinearMmaQ8F16M4],
            [LinearMmaQ8F32M1, LinearMmaQ8F32M2, LinearMmaQ8F32M4],
        ],
        [
            [LinearMmaQ4Bf16M1, LinearMmaQ4Bf16M2, LinearMmaQ4Bf16M4],
            [LinearMmaQ4F16M1, LinearMmaQ4F16M2, LinearMmaQ4F16M4],
            [LinearMmaQ4F32M1, LinearMmaQ4F32M2, LinearMmaQ4F32M4],
        ],
    ];
    const GLU: Table = [
        [
            [GluMmaQ8Bf16M1, GluMmaQ8Bf16M2, GluMmaQ8Bf16M4],
            [GluMmaQ8F16M1, GluMmaQ8F16M2, GluMmaQ8F16M4],
            [GluMmaQ8F32M1, GluMmaQ8F32M2, GluMmaQ8F32M4],
        ],
        [
            [GluMmaQ4Bf16M1, GluMmaQ4Bf16M2, GluMmaQ4Bf16M4],
            [GluMmaQ4F16M1, GluMmaQ4F16M2, GluMmaQ4F16M4],
            [GluMmaQ4F32M1, GluMmaQ4F32M2, GluMmaQ4F32M4],
        ],
    ];
    const LINEAR_ONCE: Wide = [
        [
            [
                LinearMmxQ8Bf16M0,
                LinearMmxQ8Bf16M1,
                LinearMmxQ8Bf16M2,
                LinearMmxQ8Bf16M4,
            ],
            [
                LinearMmxQ8F16M0,
                LinearMmxQ8F16M1,
                LinearMmxQ8F16M2,
                LinearMmxQ8F16M4,
            ],
            [
                LinearMmxQ8F32M0,
                LinearMmxQ8F32M1,
                LinearMmxQ8F32M2,
                LinearMmxQ8F32M4,
            ],
        ],
        [
            [
                LinearMmxQ4Bf16M0,
                LinearMmxQ4Bf16M1,
                LinearMmxQ4Bf16M2,
                LinearMmxQ4Bf16M4,
            ],
            [
                LinearMmxQ4F16M0,
                LinearMmxQ4F16M1,
                LinearMmxQ4F16M2,
                LinearMmxQ4F16M4,
            ],
            [
                LinearMmxQ4F32M0,
                LinearMmxQ4F32M1,
                LinearMmxQ4F32M2,
                LinearMmxQ4F32M4,
            ],
        ],
    ];
    const GLU_ONCE: Wide = [
        [
            [
                GluMmxQ8Bf16M0,
                GluMmxQ8Bf16M1,
                GluMmxQ8Bf16M2,
                GluMmxQ8Bf16M4,
            ],
            [GluMmxQ8F16M0, GluMmxQ8F16M1, GluMmxQ8F16M2, GluMmxQ8F16M4],
            [GluMmxQ8F32M0, GluMmxQ8F32M1, GluMmxQ8F32M2, GluMmxQ8F32M4],
        ],
        [
            [
                GluMmxQ4Bf16M0,
                GluMmxQ4Bf16M1,
                GluMmxQ4Bf16M2,
                GluMmxQ4Bf16M4,
            ],
            [GluMmxQ4F16M0, GluMmxQ4F16M1, GluMmxQ4F16M2, GluMmxQ4F16M4],
            [GluMmxQ4F32M0, GluMmxQ4F32M1, GluMmxQ4F32M2, GluMmxQ4F32M4],
        ],
    ];
    let b = usize::from(bits != 8);
    let s = match side {
        WType::Bf16 => 0,
        WType::F16 => 1,
        WType::F32 => 2,
    };
    let t = match tile {
        8 => 0,
        16 => 1,
        32 => 2,
        _ => 3,
    };
    match (glu, once) {
        (false, false) => LINEAR[b][s][t.max(1) - 1],
        (true, false) => GLU[b][s][t.max(1) - 1],
        (false, true) => LINEAR_ONCE[b][s][t],
        (true, true) => GLU_ONCE[b][s][t],
    }
}

/// The int8 tensor-core product kernel for bits, side type, n-tiles of 8 rows (1, 2, 4 or
/// 8) and whether it is the fused `[gate; up]` form.
fn imma_kernel(bits: u32, side: WType, tiles: usize, glu: bool) -> Kernel {
    use Kernel::*;
    type Table = [[[Kernel; 4]; 3]; 2];
    const LINEAR: Table = [
        [
            [
                LinearImmaQ8Bf16N1,
                LinearImmaQ8Bf16N2,
                LinearImmaQ8Bf16N4,
                LinearImmaQ8Bf16N8,
            ],
            [
                LinearImmaQ8F16N1,
                LinearImmaQ8F16N2,
                LinearImmaQ8F16N4,
                LinearImmaQ8F16N8,
            ],
            [
                LinearImmaQ8F32N1,
                LinearImmaQ8F32N2,
                LinearImmaQ8F32N4,
                LinearImmaQ8F32N8,
            ],
        ],
        [
            [
                LinearImmaQ4Bf16N1,
                LinearImmaQ4Bf16N2,
                LinearImmaQ4Bf16N4,
                LinearImmaQ4Bf16N8,
            ],
            [
                LinearImmaQ4F16N1,
                LinearImmaQ4F16N2,
                LinearImmaQ4F16N4,
                LinearImmaQ4F16N8,
            ],
            [
                LinearImmaQ4F32N1,
                LinearImmaQ4F32N2,
                LinearImmaQ4F32N4,
                LinearImmaQ4F32N8,
            ],
        ],
    ];
    const GLU: Table = [
        [
            [
                GluImmaQ8Bf16N1,
                GluImmaQ8Bf16N2,
                GluImmaQ8Bf16N4,
                GluImmaQ8Bf16N8,
            ],
            [
                GluImmaQ8F16N1,
                GluImmaQ8F16N2,
                GluImmaQ8F16N4,
                GluImmaQ8F16N8,
            ],
            [
                GluImmaQ8F32N1,
                GluImmaQ8F32N2,
                GluImmaQ8F32N4,
                GluImmaQ8F32N8,
            ],
        ],
        [
            [
                GluImmaQ4Bf16N1,
                GluImmaQ4Bf16N2,
                GluImmaQ4Bf16N4,
                GluImmaQ4Bf16N8,
            ],
            [
                GluImmaQ4F16N1,
                GluImmaQ4F16N2,
                GluImmaQ4F16N4,
                GluImmaQ4F16N8,
            ],
            [
                GluImmaQ4F32N1,
                GluImmaQ4F32N2,
                GluImmaQ4F32N4,
                GluImmaQ4F32N8,
            ],
        ],
    ];
    let b = usize::from(bits != 8);
    let s = match side {
        WType::Bf16 => 0,
        WType::F16 => 1,
        WType::F32 => 2,
    };
    let t = match tiles {
        1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    };
    (if glu { &GLU } else { &LINEAR })[b][s][t]
}

/// Rows of the matrix one block of `linear_q*` / `glu_q*` takes (`AFFINE_ROWS` of
/// `kernels.cu`; a `glu_q*` block takes half of them from each half).
const AFFINE_ROWS: usize = 8;

fn side_type(dtype: GgmlType) -> Option<WType> {
    match dtype {
        GgmlType::Bf16 => Some(WType::Bf16),
        GgmlType::F16 => Some(WType::F16),
        GgmlType::F32 => Some(WType::F32),
        _ => None,
    }
}

/// f32 scales and biases as f16 where every one of them survives the trip (GGUF blocks
/// re-laid out by [`from_gguf_blocks`]: Q8_0's and Q4_0's are an f16 scale times a power of
/// two), else `None`.
fn narrow_sides(w: &AffineWeight<'_>) -> Option<(Vec<u8>, Vec<u8>)> {
    if w.scales.dtype != GgmlType::F32 || w.biases.dtype != GgmlType::F32 {
        return None;
    }
    let narrow = |bytes: &[u8]| -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(bytes.len() / 2);
        for c in bytes.chunks_exact(4) {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let h = half::f16::from_f32(v);
            if h.to_f32() != v {
                return None;
            }
            out.extend_from_slice(&h.to_le_bytes());
        }
        Some(out)
    };
    Some((narrow(&w.scales.bytes)?, narrow(&w.biases.bytes)?))
}

/// The scales and biases of an affine matrix.
pub(super) fn sides(m: &CudaMatrix) -> Result<&Sides> {
    m.sides
        .as_ref()
        .ok_or_else(|| invalid("affine matrix without scales".into()))
}

impl CudaBackend {
    /// Uploads packed values and their sides as an affine matrix.
    pub(super) fn upload_affine(
        &self,
        (rows, cols): (usize, usize),
        (bits, group, side): (u32, usize, WType),
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
    ) -> Result<CudaMatrix> {
        let groups = rows * cols / group;
        if packed.len() != rows * cols * bits as usize / 8
            || scales.len() != groups * side.size()
            || biases.len() != groups * side.size()
        {
            return Err(invalid(format!(
                "affine matrix {rows}x{cols} at {bits} bits: {} packed, {} scale and {} bias bytes",
                packed.len(),
                scales.len(),
                biases.len()
            )));
        }
        let up = |b: &[u8]| self.dev.upload_owned(b).map_err(cuda_err);
        Ok(CudaMatrix {
            buf: up(packed)?,
            layout: Layout::Affine { bits, group, side },
            sides: Some(Sides {
                scales: up(scales)?,
                biases: up(biases)?,
            }),
            rows,
            cols,
        })
    }

    /// An affine matrix: kept packed at 4 and 8 bits with scales and biases of one float
    /// type, else dequantized to bf16.
    pub(super) fn affine_from_host(&self, w: AffineWeight<'_>) -> Result<CudaMatrix> {
        w.validate()?;
        if matches!(w.bits, 4 | 8) {
            if let Some((scales, biases)) = narrow_sides(&w) {
                return self.upload_affine(
                    (w.rows, w.cols),
                    (w.bits, w.group_size, WType::F16),
                    &w.packed,
                    &scales,
                    &biases,
                );
            }
        }
        let side = side_type(w.scales.dtype).filter(|_| w.biases.dtype == w.scales.dtype);
        match side {
            Some(side) if matches!(w.bits, 4 | 8) => self.upload_affine(
                (w.rows, w.cols),
                (w.bits, w.group_size, side),
                &w.packed,
                &w.scales.bytes,
                &w.biases.bytes,
            ),
            _ => {
                let values = w.dequantize()?;
                self.dense_bf16(&values, w.rows, w.cols)
            }
        }
    }

    /// Row-major f32 values uploaded as a bf16 matrix.
    pub(super) fn dense_bf16(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix> {
        let bf: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        Ok(CudaMatrix {
            buf: self
                .dev
                .upload_owned(bytemuck::cast_slice(&bf))
                .map_err(cuda_err)?,
            layout: Layout::Dense(WType::Bf16),
            sides: None,
            rows,
            cols,
        })
    }

    /// `y = x · wᵀ (+ bias)` for an affine `w` and few rows of `x`, inside a pass.
    pub(super) fn affine_rows(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
        bias: Option<&CudaTensor>,
        y: &CudaTensor,
    ) -> Result<()> {
        let s = sides(w)?;
        self.launch(
            kernel(Op::Linear { one: x.rows == 1 }, bits, side),
            (w.rows.div_ceil(AFFINE_ROWS) as u32, 1, 1),
            super::ROW_BLOCK_THREADS,
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(w.buf.ptr()),
                Arg::Ptr(s.scales.ptr()),
                Arg::Ptr(s.biases.ptr()),
                Arg::Ptr(bias.map_or(0, |b| b.ptr())),
                Arg::Ptr(y.ptr()),
                Arg::I32(int(x.rows, "rows")?),
                Arg::I32(int(w.cols, "columns")?),
                Arg::I32(int(w.rows, "outputs")?),
                Arg::I32(int(group, "group size")?),
            ],
        )
    }

    /// `y = act(x · gateᵀ) · (x · upᵀ)` for an affine `[gate; up]` matrix (`width` rows
    /// each) and few rows of `x`, inside a pass.
    pub(super) fn affine_glu_rows(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
        width: usize,
        act: i32,
        y: &CudaTensor,
    ) -> Result<()> {
        let s = sides(w)?;
        let pairs = AFFINE_ROWS / 2;
        self.launch(
            kernel(Op::Glu { one: x.rows == 1 }, bits, side),
            (width.div_ceil(pairs) as u32, 1, 1),
            super::ROW_BLOCK_THREADS,
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(w.buf.ptr()),
                Arg::Ptr(s.scales.ptr()),
                Arg::Ptr(s.biases.ptr()),
                Arg::Ptr(y.ptr()),
                Arg::I32(int(x.rows, "rows")?),
                Arg::I32(int(w.cols, "columns")?),
                Arg::I32(int(width, "width")?),
                Arg::I32(int(group, "group size")?),
                Arg::I32(act),
            ],
        )
    }

    /// `y = x · wᵀ (+ bias)` for an affine `w`, or with `glu` = (width, activation kind)
    /// `y = act(x · gateᵀ) · (x · upᵀ)` for an affine `[gate; up]` matrix, on the tensor
    /// cores, inside a pass: row tiles of up to 64 rows, the inputs split into slices (their
    /// sums added by `affine_mma_finish`) until the blocks fill the SMs.
    pub(super) fn affine_mma(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
        bias: Option<&CudaTensor>,
        glu: Option<(usize, i32)>,
        y: &CudaTensor,
    ) -> Result<()> {
        let s = sides(w)?;
        let rows = x.rows;
        let once = self.quant_mma_once;
        let tile = match rows {
            0..=8 if once && self.quant_mma_tile8 => 8,
            0..=16 => 16,
            17..=32 => 32,
            _ => 64,
        };
        let row_tiles = rows.div_ceil(tile);
        let (cols_per_block, per_sm) = if once {
            (MMX_COLS, MMX_BLOCKS_PER_SM)
        } else {
            (MMA_COLS, MMA_BLOCKS_PER_SM)
        };
        let (out, col_tiles) = match glu {
            Some((width, _)) => (width, width.div_ceil(cols_per_block / 2)),
            None => (w.rows, w.rows.div_ceil(cols_per_block)),
        };
        let slices = mma_slices(col_tiles * row_tiles, self.sms, per_sm, w.cols);
        // Raw sums go through `part` with several slices, and always for GLU.
        let part = if slices > 1 || glu.is_some() {
            Some(
                self.dev
                    .alloc(slices * rows * w.rows * 4)
                    .map_err(cuda_err)?,
            )
        } else {
            None
        };
        let part_ptr = part.as_ref().map_or(0, |p| p.ptr());
        let grid = (
            int(col_tiles, "column tiles")? as u32,
            slices as u32,
            int(row_tiles, "row tiles")? as u32,
        );
        let kernel = mma_kernel(bits, side, tile, glu.is_some(), once);
        // x rounded to f16 once, in the lanes' order, padded to whole tiles and slabs.
        let rounded = if once {
            let (rows_pad, in_pad) = (row_tiles * tile, w.cols.div_ceil(MMA_SLAB) * MMA_SLAB);
            let xh = self.dev.alloc(rows_pad * in_pad * 2).map_err(cuda_err)?;
            self.launch(
                Kernel::AffineMmxX,
                (blocks_for(rows_pad * in_pad / 8), 1, 1),
                256,
                &[
                    Arg::Ptr(x.ptr()),
                    Arg::Ptr(xh.ptr()),
                    Arg::I32(int(rows, "rows")?),
                    Arg::I32(int(w.cols, "columns")?),
                    Arg::I32(int(rows_pad, "rows")?),
                    Arg::I32(int(in_pad, "columns")?),
                    Arg::I32(bits as i32),
                ],
            )?;
            Some(xh)
        } else {
            None
        };
        let head = [
            Arg::Ptr(rounded.as_ref().map_or(x.ptr(), |xh| xh.ptr())),
            Arg::Ptr(w.buf.ptr()),
            Arg::Ptr(s.scales.ptr()),
            Arg::Ptr(s.biases.ptr()),
        ];
        let tail = [
            Arg::I32(int(rows, "rows")?),
            Arg::I32(int(w.cols, "columns")?),
            Arg::I32(int(out, "outputs")?),
            Arg::I32(int(group, "group size")?),
        ];
        let mut args = head.to_vec();
        if glu.is_none() {
            args.push(Arg::Ptr(bias.map_or(0, |b| b.ptr())));
        }
        args.extend([Arg::Ptr(y.ptr()), Arg::Ptr(part_ptr)]);
        args.extend(tail);
        if once {
            // Two buffers of the tile's rows of one slab (`affine_mmx`'s `xsh`).
            let shared = 2 * tile * (MMA_SLAB + MMA_PAD) * 2;
            self.dev
                .launch_shared(kernel, grid, 256, shared, &args)
                .map_err(cuda_err)?;
        } else {
            self.launch(kernel, grid, 128, &args)?;
        }
        if part.is_some() {
            self.launch(
                Kernel::AffineMmaFinish,
                (blocks_for(rows * out), 1, 1),
                256,
                &[
                    Arg::Ptr(part_ptr),
                    Arg::Ptr(bias.map_or(0, |b| b.ptr())),
                    Arg::Ptr(y.ptr()),
                    Arg::I32(int(rows, "rows")?),
                    Arg::I32(int(out, "outputs")?),
                    Arg::I32(slices as i32),
                    Arg::I32(glu.map_or(-1, |(_, act)| act)),
                ],
            )?;
        }
        Ok(())
    }

    /// `y = x · wᵀ (+ bias)` for an affine `w`, or with `glu` = (width, activation kind)
    /// `y = act(x · gateᵀ) · (x · upᵀ)` for an affine `[gate; up]` matrix, on the int8
    /// tensor cores, inside a pass: x quantized to int8 in blocks of 32 inputs once
    /// (`affine_imma_x`), then one launch whose blocks each make 16 weight rows for up to
    /// 64 rows of x (more rows: several row tiles, each reading the weights again).
    pub(super) fn affine_imma(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
        bias: Option<&CudaTensor>,
        glu: Option<(usize, i32)>,
        y: &CudaTensor,
    ) -> Result<()> {
        let s = sides(w)?;
        let rows = x.rows;
        if !w.cols.is_multiple_of(32) || !group.is_multiple_of(32) {
            return Err(invalid(format!(
                "int8 affine product: {} inputs in groups of {group} (both must be multiples of 32)",
                w.cols
            )));
        }
        let tiles = rows.div_ceil(IMMA_TILE).min(8).next_power_of_two();
        let tile_rows = tiles * IMMA_TILE;
        let row_tiles = rows.div_ceil(tile_rows);
        let rows_pad = row_tiles * tile_rows;
        let blocks32 = w.cols / 32;
        let xq = self.dev.alloc(rows_pad * w.cols).map_err(cuda_err)?;
        let xs = self.dev.alloc(rows_pad * blocks32 * 8).map_err(cuda_err)?;
        self.launch(
            Kernel::AffineImmaX,
            (blocks_for(rows_pad * blocks32), 1, 1),
            256,
            &[
                Arg::Ptr(x.ptr()),
                Arg::Ptr(xq.ptr()),
                Arg::Ptr(xs.ptr()),
                Arg::I32(int(rows, "rows")?),
                Arg::I32(int(w.cols, "columns")?),
                Arg::I32(int(rows_pad, "rows")?),
                Arg::I32(bits as i32),
            ],
        )?;
        let (out, col_tiles) = match glu {
            Some((width, _)) => (width, width.div_ceil(IMMA_COLS / 2)),
            None => (w.rows, w.rows.div_ceil(IMMA_COLS)),
        };
        let mut args = vec![
            Arg::Ptr(xq.ptr()),
            Arg::Ptr(xs.ptr()),
            Arg::Ptr(w.buf.ptr()),
            Arg::Ptr(s.scales.ptr()),
            Arg::Ptr(s.biases.ptr()),
        ];
        if glu.is_none() {
            args.push(Arg::Ptr(bias.map_or(0, |b| b.ptr())));
        }
        args.extend([
            Arg::Ptr(y.ptr()),
            Arg::I32(int(rows, "rows")?),
            Arg::I32(int(w.cols, "columns")?),
            Arg::I32(int(out, "outputs")?),
            Arg::I32(int(group, "group size")?),
        ]);
        if let Some((_, act)) = glu {
            args.push(Arg::I32(act));
        }
        self.launch(
            imma_kernel(bits, side, tiles, glu.is_some()),
            (
                int(col_tiles, "column tiles")? as u32,
                int(row_tiles, "row tiles")? as u32,
                1,
            ),
            IMMA_THREADS,
            &args,
        )
    }

    /// The affine `w` dequantized to bf16 into a temporary, inside a pass.
    pub(super) fn affine_to_bf16(
        &self,
        w: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
    ) -> Result<Buffer> {
        let s = sides(w)?;
        let n = w.rows * w.cols;
        let out = self.dev.alloc(n * 2).map_err(cuda_err)?;
        let loads = n * bits as usize / 128;
        self.launch(
            kernel(Op::Dequant, bits, side),
            (blocks_for(loads), 1, 1),
            256,
            &[
                Arg::Ptr(w.buf.ptr()),
                Arg::Ptr(s.scales.ptr()),
                Arg::Ptr(s.biases.ptr()),
                Arg::Ptr(out.ptr()),
                Arg::I64(loads as i64),
                Arg::I32(int(w.cols, "columns")?),
                Arg::I32(int(group, "group size")?),
            ],
        )?;
        Ok(out)
    }

    /// Rows of an affine embedding table for `n` ids at device address `ids`.
    pub(super) fn gather_affine(
        &self,
        table: &CudaMatrix,
        (bits, group, side): (u32, usize, WType),
        ids: u64,
        out: &CudaTensor,
    ) -> Result<()> {
        let s = sides(table)?;
        self.launch(
            kernel(Op::Embed, bits, side),
            (out.rows as u32, col_blocks(table.cols), 1),
            256,
            &[
                Arg::Ptr(table.buf.ptr()),
                Arg::Ptr(s.scales.ptr()),
                Arg::Ptr(s.biases.ptr()),
                Arg::Ptr(ids),
                Arg::Ptr(out.ptr()),
                Arg::I32(int(table.cols, "hidden size")?),
                Arg::I32(int(group, "group size")?),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HostWeight;
    use crate::weights::affine::from_gguf_blocks;
    use std::borrow::Cow;

    fn q8_0(blocks: &[(f32, [i8; 32])]) -> HostWeight<'static> {
        let mut bytes = Vec::new();
        for (d, qs) in blocks {
            bytes.extend(half::f16::from_f32(*d).to_le_bytes());
            bytes.extend(qs.iter().map(|&q| q as u8));
        }
        HostWeight {
            name: "w".into(),
            dtype: GgmlType::Q8_0,
            shape: vec![blocks.len(), 32],
            bytes: Cow::Owned(bytes),
        }
    }

    #[test]
    fn q8_0_sides_narrow_to_f16_exactly() {
        let mut qs = [0i8; 32];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = (i as i8 * 9).wrapping_sub(100);
        }
        qs[0] = -128;
        qs[1] = 127;
        let w = q8_0(&[(0.0123, qs), (-3.5, qs)]);
        let want = w.dequantize().unwrap();
        let a = from_gguf_blocks(&w).unwrap().unwrap();
        let (scales, biases) = narrow_sides(&a).unwrap();
        let side = |b: &[u8], g: usize| half::f16::from_le_bytes([b[2 * g], b[2 * g + 1]]).to_f32();
        for (i, &q) in a.packed.iter().enumerate() {
            let got = side(&scales, i / 32) * q as f32 + side(&biases, i / 32);
            assert_eq!(got, want[i], "value {i}");
        }
    }

    #[test]
    fn tensor_core_products_split_their_inputs_until_the_sms_are_full() {
        // 8 rows of a 4096 x 4096 matrix on 132 SMs: 64 tiles, 16 slabs of inputs; 9
        // slices wanted make slices of 2 slabs, so 8 of them (none empty).
        assert_eq!(mma_slices(64, 132, MMA_BLOCKS_PER_SM, 4096), 8);
        for (blocks, cols) in [(64, 4096), (7, 14336), (3, 96 * 256 + 32), (128, 14336)] {
            let s = mma_slices(blocks, 132, MMA_BLOCKS_PER_SM, cols);
            let slabs = cols.div_ceil(MMA_SLAB);
            let per = slabs.div_ceil(s);
            assert!(
                (s - 1) * per < slabs,
                "{s} slices of {per} of {slabs} slabs: one empty"
            );
        }
        // Enough tiles already: one slice; a row shorter than a slab: one slice.
        assert_eq!(mma_slices(4008, 132, MMA_BLOCKS_PER_SM, 4096), 1);
        assert_eq!(mma_slices(1, 132, MMA_BLOCKS_PER_SM, 96), 1);
        // Long rows and few tiles: at most MMA_MAX_SLICES.
        assert!(mma_slices(1, 132, MMA_BLOCKS_PER_SM, 1 << 20) <= MMA_MAX_SLICES);
    }

    #[test]
    fn sides_that_f16_cannot_hold_stay_f32() {
        let a = from_gguf_blocks(&q8_0(&[(1000.0, [1; 32])]))
            .unwrap()
            .unwrap();
        assert!(narrow_sides(&a).is_none());
    }
}
