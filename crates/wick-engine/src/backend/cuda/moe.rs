//! Mixture-of-experts layers on the device ([`Backend::moe`]): the router's softmax and
//! top-k, then the experts' gated MLPs reading only the routed experts' weights. Decode
//! rows (at most [`VEC_ROWS`] by default) take one mat-vec per routed slot; more rows are
//! sorted by expert on the device and multiplied a tile of one expert's slots at a time.
//! Nothing is read back to the host and every launch's shape depends only on the number
//! of rows, so a decode step stays one replayable CUDA graph.
use std::borrow::Cow;

use wick_cuda::{Arg, Kernel, WType};

use super::affine::Layout;
use super::{act_kind, blocks_for, col_blocks, cuda_err, int, invalid, CudaBackend, CudaTensor};
use super::{CudaMatrix, ROW_BLOCK_THREADS};
use crate::backend::{Backend, Experts, HostWeight, MoeTensors};
use crate::Result;

/// Rows up to which the experts run as mat-vecs per routed slot (above: the grouped
/// product); `WICK_CUDA_MOE_VEC_ROWS` overrides it.
pub(super) const VEC_ROWS: usize = 4;
/// The most experts a layer may have (`MOE_MAX_EXPERTS` of `kernels.cu`).
const MAX_EXPERTS: usize = 4096;
/// Slots a tile of the grouped product takes (`MOE_TM`) and its output columns (`MOE_TN`).
const TILE_ROWS: usize = 64;
const TILE_COLS: usize = 64;
/// Output columns a block of the tensor-core grouped product takes (`MOE2_BN`).
const MMA_TILE_COLS: usize = 128;

/// `w` `[experts, rows, cols]` as one `[experts * rows, cols]` weight.
fn flattened<'a>(w: &'a HostWeight<'_>) -> Result<HostWeight<'a>> {
    let [e, rows, cols] = w.shape[..] else {
        return Err(invalid(format!(
            "'{}': expert weights of shape {:?} are not 3-D",
            w.name, w.shape
        )));
    };
    Ok(HostWeight {
        name: w.name.clone(),
        dtype: w.dtype,
        shape: vec![e * rows, cols],
        bytes: Cow::Borrowed(&w.bytes[..]),
    })
}

fn dense_type(m: &CudaMatrix, what: &str) -> Result<WType> {
    match m.layout {
        Layout::Dense(t) => Ok(t),
        Layout::Affine { .. } => Err(invalid(format!(
            "moe: {what} experts are quantized; the device path takes f32, f16 or bf16"
        ))),
    }
}

impl CudaBackend {
    /// The experts stacked as two matrices and their scales (float weights only; others
    /// stay on the host path).
    pub(super) fn moe_upload(
        &self,
        gate_up: &HostWeight<'_>,
        down: &HostWeight<'_>,
        per_expert_scale: &[f32],
    ) -> Result<Option<MoeTensors<CudaBackend>>> {
        use wick_gguf::GgmlType::{Bf16, F16, F32};
        let float = |w: &HostWeight<'_>| matches!(w.dtype, F32 | F16 | Bf16);
        if !float(gate_up) || !float(down) || per_expert_scale.len() > MAX_EXPERTS {
            return Ok(None);
        }
        let gu = self.matrix(flattened(gate_up)?)?;
        let dn = self.matrix(flattened(down)?)?;
        if !matches!(gu.layout, Layout::Dense(_)) || !matches!(dn.layout, Layout::Dense(_)) {
            return Ok(None);
        }
        let scale = self.tensor_from_host(per_expert_scale.to_vec(), 1, per_expert_scale.len())?;
        Ok(Some(MoeTensors {
            gate_up: gu,
            down: dn,
            scale,
        }))
    }

    /// [`Backend::moe`] on the device, for experts [`CudaBackend::moe_upload`] stacked.
    pub(super) fn moe_device(
        &self,
        experts: &Experts<CudaBackend>,
        t: &MoeTensors<CudaBackend>,
        x: &CudaTensor,
        logits: &CudaTensor,
        rows: usize,
    ) -> Result<CudaTensor> {
        let (n_exp, k) = (experts.len(), experts.top_k());
        let (h, i) = (experts.hidden(), experts.intermediate());
        if x.rows != rows || x.cols != h || logits.rows != rows || logits.cols != n_exp {
            return Err(invalid(format!(
                "moe: input {}x{} and logits {}x{} for {rows} rows, hidden {h}, {n_exp} experts",
                x.rows, x.cols, logits.rows, logits.cols
            )));
        }
        if t.gate_up.rows != n_exp * 2 * i
            || t.gate_up.cols != h
            || t.down.rows != n_exp * h
            || t.down.cols != i
            || k == 0
            || k > n_exp
            || n_exp > MAX_EXPERTS
        {
            return Err(invalid(format!(
                "moe: stacked experts {}x{} and {}x{} for {n_exp} experts (top {k}) of {h} -> {i}",
                t.gate_up.rows, t.gate_up.cols, t.down.rows, t.down.cols
            )));
        }
        let (gu_type, dn_type) = (
            dense_type(&t.gate_up, "gate/up")?,
            dense_type(&t.down, "down")?,
        );
        let y = self.tensor(rows, h)?;
        if rows == 0 {
            return Ok(y);
        }
        let nk = rows * k;
        let act = act_kind(experts.activation());
        let (e32, k32, h32, i32_) = (
            int(n_exp, "experts")?,
            int(k, "top k")?,
            int(h, "hidden size")?,
            int(i, "expert size")?,
        );
        let vec_rows = std::env::var("WICK_CUDA_MOE_VEC_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(VEC_ROWS);
        self.op(|| {
            let ids = self.dev.alloc(nk * 4).map_err(cuda_err)?;
            let weights = self.dev.alloc(nk * 4).map_err(cuda_err)?;
            self.launch(
                Kernel::MoeRoute,
                (int(rows, "rows")? as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(logits.ptr()),
                    Arg::Ptr(t.scale.ptr()),
                    Arg::Ptr(ids.ptr()),
                    Arg::Ptr(weights.ptr()),
                    Arg::I32(e32),
                    Arg::I32(k32),
                ],
            )?;
            let hidden_units = self.tensor(nk, i)?;
            if rows <= vec_rows {
                let glu = [
                    Kernel::MoeGluVecF32,
                    Kernel::MoeGluVecF16,
                    Kernel::MoeGluVecBf16,
                ];
                self.launch(
                    glu[super::dense_column(gu_type)],
                    (i as u32, nk as u32, 1),
                    ROW_BLOCK_THREADS,
                    &[
                        Arg::Ptr(x.ptr()),
                        Arg::Ptr(t.gate_up.buf.ptr()),
                        Arg::Ptr(ids.ptr()),
                        Arg::Ptr(hidden_units.ptr()),
                        Arg::I32(k32),
                        Arg::I32(h32),
                        Arg::I32(i32_),
                        Arg::I32(e32),
                        Arg::I32(act),
                    ],
                )?;
                let down = [
                    Kernel::MoeDownVecF32,
                    Kernel::MoeDownVecF16,
                    Kernel::MoeDownVecBf16,
                ];
                self.launch(
                    down[super::dense_column(dn_type)],
                    (h.div_ceil(2) as u32, rows as u32, 1),
                    ROW_BLOCK_THREADS,
                    &[
                        Arg::Ptr(hidden_units.ptr()),
                        Arg::Ptr(t.down.buf.ptr()),
                        Arg::Ptr(ids.ptr()),
                        Arg::Ptr(weights.ptr()),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(k32),
                        Arg::I32(i32_),
                        Arg::I32(h32),
                        Arg::I32(e32),
                    ],
                )?;
                return Ok(());
            }
            // Each expert's slots in runs of TILE_ROWS: at most one partial run an active
            // expert, so this many tiles at most.
            let max_tiles = nk.div_ceil(TILE_ROWS) + n_exp.min(nk);
            let order = self.dev.alloc(nk * 4).map_err(cuda_err)?;
            let tiles = self.dev.alloc(max_tiles * 12).map_err(cuda_err)?;
            let tiles_n = self.dev.alloc(4).map_err(cuda_err)?;
            self.launch(
                Kernel::MoeSort,
                (1, 1, 1),
                1024,
                &[
                    Arg::Ptr(ids.ptr()),
                    Arg::Ptr(order.ptr()),
                    Arg::Ptr(tiles.ptr()),
                    Arg::Ptr(tiles_n.ptr()),
                    Arg::I32(int(nk, "routed slots")?),
                    Arg::I32(e32),
                ],
            )?;
            let grouped = [
                Kernel::MoeGroupedF32,
                Kernel::MoeGroupedF16,
                Kernel::MoeGroupedBf16,
            ];
            let product = |a: u64,
                           a_div: usize,
                           w: &CudaMatrix,
                           wt: WType,
                           per: usize,
                           inp: usize,
                           out: u64| {
                let tiles_grid = int(max_tiles, "expert tiles")? as u32;
                let mma = match wt {
                    WType::Bf16 => Some((Kernel::MoeGatherBf16, Kernel::MoeGroupedMmaBf16)),
                    WType::F16 => Some((Kernel::MoeGatherF16, Kernel::MoeGroupedMmaF16)),
                    WType::F32 => None,
                };
                if let (Some((gather, grouped_mma)), true) =
                    (mma, self.moe_mma && inp.is_multiple_of(8))
                {
                    // Half weights on the tensor cores: the slots' inputs gathered in expert
                    // order and rounded to the weights' type (as a dense layer's cuBLAS
                    // product reads them), then the tiles' products.
                    let ah = self.dev.alloc(nk * inp * 2).map_err(cuda_err)?;
                    self.launch(
                        gather,
                        (int(nk, "routed slots")? as u32, 1, 1),
                        inp.div_ceil(4).next_multiple_of(32).min(256) as u32,
                        &[
                            Arg::Ptr(a),
                            Arg::Ptr(order.ptr()),
                            Arg::Ptr(ah.ptr()),
                            Arg::I32(int(a_div, "top k")?),
                            Arg::I32(int(inp, "expert inputs")?),
                        ],
                    )?;
                    return self.launch(
                        grouped_mma,
                        (tiles_grid, per.div_ceil(MMA_TILE_COLS) as u32, 1),
                        128,
                        &[
                            Arg::Ptr(ah.ptr()),
                            Arg::Ptr(order.ptr()),
                            Arg::Ptr(tiles.ptr()),
                            Arg::Ptr(tiles_n.ptr()),
                            Arg::Ptr(w.buf.ptr()),
                            Arg::Ptr(out),
                            Arg::I32(int(per, "expert outputs")?),
                            Arg::I32(int(inp, "expert inputs")?),
                        ],
                    );
                }
                self.launch(
                    grouped[super::dense_column(wt)],
                    (tiles_grid, per.div_ceil(TILE_COLS) as u32, 1),
                    256,
                    &[
                        Arg::Ptr(a),
                        Arg::Ptr(order.ptr()),
                        Arg::Ptr(tiles.ptr()),
                        Arg::Ptr(tiles_n.ptr()),
                        Arg::Ptr(w.buf.ptr()),
                        Arg::Ptr(out),
                        Arg::I32(int(a_div, "top k")?),
                        Arg::I32(int(per, "expert outputs")?),
                        Arg::I32(int(inp, "expert inputs")?),
                    ],
                )
            };
            let both = self.tensor(nk, 2 * i)?;
            product(x.ptr(), k, &t.gate_up, gu_type, 2 * i, h, both.ptr())?;
            let n = nk * i;
            self.launch(
                Kernel::MoeGluRows,
                (blocks_for(n), 1, 1),
                256,
                &[
                    Arg::Ptr(both.ptr()),
                    Arg::Ptr(hidden_units.ptr()),
                    Arg::I64(n as i64),
                    Arg::I32(i32_),
                    Arg::I32(act),
                ],
            )?;
            let per_slot = self.tensor(nk, h)?;
            product(
                hidden_units.ptr(),
                1,
                &t.down,
                dn_type,
                h,
                i,
                per_slot.ptr(),
            )?;
            self.launch(
                Kernel::MoeCombine,
                (rows as u32, col_blocks(h), 1),
                256,
                &[
                    Arg::Ptr(per_slot.ptr()),
                    Arg::Ptr(weights.ptr()),
                    Arg::Ptr(y.ptr()),
                    Arg::I32(k32),
                    Arg::I32(h32),
                ],
            )
        })?;
        Ok(y)
    }
}
