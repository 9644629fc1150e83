//! The candle backend: CPU, portable, the default.
//!
//! Activations are candle tensors; the work is done by wick's own CPU kernels
//! (`wick-kernels`): weight matrices of the common GGUF formats (F32/F16/BF16, Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are repacked at load and multiplied with
//! runtime-dispatched SIMD kernels on a low-latency thread pool, and norms, gated
//! activations and residual adds are fused kernels writing straight into the result.
//! Other quantized formats fall back to candle's `QMatMul`. Rotary embeddings and
//! attention over the host KV cache are our own kernels too.
mod attention;
mod kv;
mod profile;
mod rope;

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Storage, Tensor};
use wick_gguf::GgmlType;
use wick_kernels::elementwise::{self, GluActivation};
use wick_kernels::{Isa, PackedMatrix, Product, QuantizedActivations, ThreadPool, WeightFormat};

pub use kv::CpuKvLayer;
pub use rope::CpuRope;

use super::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, KvLayerSnapshot, RopeSpec,
};
use crate::{EngineError, Result};

/// A weight matrix on the candle backend.
#[derive(Debug)]
pub enum CandleMatrix {
    /// Repacked for wick's kernels (float formats and the common quantized ones).
    Packed(Arc<PackedMatrix>),
    /// Another GGUF-quantized format, multiplied by candle without dequantizing.
    Quantized {
        /// The product operator.
        op: QMatMul,
        /// The quantized tensor (also used for embedding lookups).
        tensor: Arc<QTensor>,
    },
}

/// candle tensors on the CPU, computed by wick's kernels.
#[derive(Debug, Clone)]
pub struct CandleBackend {
    device: Device,
    pool: &'static ThreadPool,
    isa: Isa,
}

impl Default for CandleBackend {
    fn default() -> Self {
        CandleBackend {
            device: Device::Cpu,
            pool: ThreadPool::global(),
            isa: Isa::best(),
        }
    }
}

thread_local! {
    /// Quantized activations of the last product on this thread, reused so a decode
    /// step allocates no kernel scratch.
    static ACTIVATIONS: RefCell<QuantizedActivations> = RefCell::new(QuantizedActivations::new());
}

/// The kernels' name for a file's element type, when they handle it.
fn kernel_format(t: GgmlType) -> Option<WeightFormat> {
    Some(match t {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::Bf16 => WeightFormat::Bf16,
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q5_0 => WeightFormat::Q5_0,
        GgmlType::Q5_1 => WeightFormat::Q5_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q4K => WeightFormat::Q4K,
        GgmlType::Q5K => WeightFormat::Q5K,
        GgmlType::Q6K => WeightFormat::Q6K,
        _ => return None,
    })
}

impl From<wick_kernels::KernelError> for EngineError {
    fn from(e: wick_kernels::KernelError) -> Self {
        EngineError::Backend {
            backend: "candle",
            message: e.to_string(),
        }
    }
}

impl CandleBackend {
    /// The CPU backend.
    pub fn cpu() -> Self {
        Self::default()
    }

    fn err(message: impl Into<String>) -> EngineError {
        EngineError::Backend {
            backend: "candle",
            message: message.into(),
        }
    }

    fn ggml_dtype(w: &HostWeight<'_>) -> Result<GgmlDType> {
        Ok(match w.dtype {
            GgmlType::F32 => GgmlDType::F32,
            GgmlType::F16 => GgmlDType::F16,
            GgmlType::Bf16 => GgmlDType::BF16,
            GgmlType::Q4_0 => GgmlDType::Q4_0,
            GgmlType::Q4_1 => GgmlDType::Q4_1,
            GgmlType::Q5_0 => GgmlDType::Q5_0,
            GgmlType::Q5_1 => GgmlDType::Q5_1,
            GgmlType::Q8_0 => GgmlDType::Q8_0,
            GgmlType::Q2K => GgmlDType::Q2K,
            GgmlType::Q3K => GgmlDType::Q3K,
            GgmlType::Q4K => GgmlDType::Q4K,
            GgmlType::Q5K => GgmlDType::Q5K,
            GgmlType::Q6K => GgmlDType::Q6K,
            GgmlType::Q8K => GgmlDType::Q8K,
            other => {
                return Err(EngineError::UnsupportedDtype {
                    source_name: "candle backend".into(),
                    tensor: w.name.clone(),
                    dtype: other.to_string(),
                })
            }
        })
    }

    /// A dense f32 tensor from float bytes (F32/F16/BF16).
    fn dense(&self, w: &HostWeight<'_>) -> Result<Tensor> {
        let dtype = match w.dtype {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::Bf16 => DType::BF16,
            _ => {
                let q = qtensor_from_ggml(
                    Self::ggml_dtype(w)?,
                    &w.bytes,
                    w.shape.clone(),
                    &self.device,
                )?;
                return Ok(q.dequantize(&self.device)?);
            }
        };
        let t = Tensor::from_raw_buffer(&w.bytes, dtype, &w.shape, &self.device)?;
        Ok(t.to_dtype(DType::F32)?)
    }

    /// Runs `f` on the contiguous f32 data of `t`.
    fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        let (storage, layout) = t.storage_and_layout();
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| Self::err("tensor is not contiguous"))?;
        match &*storage {
            Storage::Cpu(cpu) => Ok(f(&cpu.as_slice::<f32>()?[start..end])),
            _ => Err(Self::err(
                "only CPU tensors are supported by the candle backend's kernels",
            )),
        }
    }

    fn host(t: &Tensor) -> Result<Vec<f32>> {
        Self::with_slice(t, |s| s.to_vec())
    }

    fn tensor(&self, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_vec(data, shape, &self.device)?)
    }

    /// A new tensor shaped like `like`, filled by `f` from `like`'s data.
    fn map(
        &self,
        like: &Tensor,
        f: impl FnOnce(&[f32], &mut [f32]) -> Result<()>,
    ) -> Result<Tensor> {
        let mut out = vec![0f32; like.elem_count()];
        Self::with_slice(like, |x| f(x, &mut out))??;
        self.tensor(out, like.dims())
    }

    /// `x · wᵀ (+ bias)` through the kernels.
    fn packed_linear(&self, x: &Tensor, w: &PackedMatrix, bias: Option<&Tensor>) -> Result<Tensor> {
        let mut out = self.packed_linear_many(x, &[w], &[bias])?;
        out.pop().ok_or_else(|| Self::err("no product"))
    }

    /// Several products of one input in one kernel call.
    fn packed_linear_many(
        &self,
        x: &Tensor,
        ws: &[&PackedMatrix],
        biases: &[Option<&Tensor>],
    ) -> Result<Vec<Tensor>> {
        let (n, k) = x.dims2()?;
        if let Some(w) = ws.iter().find(|w| w.cols() != k) {
            return Err(Self::err(format!(
                "input of width {k} for a matrix of {} columns",
                w.cols()
            )));
        }
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows()]).collect();
        // Borrow every bias's data for the duration of the call.
        let storages: Vec<_> = biases
            .iter()
            .map(|b| b.map(|b| b.storage_and_layout()))
            .collect();
        let mut bias_slices: Vec<Option<&[f32]>> = Vec::with_capacity(ws.len());
        for s in &storages {
            bias_slices.push(match s {
                None => None,
                Some((storage, layout)) => {
                    let (start, end) = layout
                        .contiguous_offsets()
                        .ok_or_else(|| Self::err("bias is not contiguous"))?;
                    match &**storage {
                        Storage::Cpu(cpu) => Some(&cpu.as_slice::<f32>()?[start..end]),
                        _ => return Err(Self::err("bias is not on the CPU")),
                    }
                }
            });
        }
        Self::with_slice(x, |xs| {
            let mut products: Vec<Product<'_>> = ws
                .iter()
                .zip(outs.iter_mut())
                .zip(&bias_slices)
                .map(|((&weight, out), &bias)| Product { weight, out, bias })
                .collect();
            ACTIVATIONS.with(|act| {
                wick_kernels::matmul(
                    self.pool,
                    self.isa,
                    xs,
                    n,
                    &mut products,
                    &mut act.borrow_mut(),
                )
            })
        })??;
        outs.into_iter()
            .zip(ws)
            .map(|(o, w)| self.tensor(o, &[n, w.rows()]))
            .collect()
    }
}

impl Backend for CandleBackend {
    type Tensor = Tensor;
    type Matrix = CandleMatrix;
    type Rope = CpuRope;
    type KvLayer = CpuKvLayer;

    fn name(&self) -> &'static str {
        "candle"
    }

    fn matrix(&self, w: HostWeight<'_>) -> Result<CandleMatrix> {
        if w.shape.len() != 2 {
            return Err(Self::err(format!(
                "'{}' is not a matrix: shape {:?}",
                w.name, w.shape
            )));
        }
        if let Some(format) = kernel_format(w.dtype) {
            let m = PackedMatrix::from_ggml(format, w.shape[0], w.shape[1], &w.bytes)
                .map_err(|e| Self::err(format!("'{}': {e}", w.name)))?;
            return Ok(CandleMatrix::Packed(Arc::new(m)));
        }
        let q = qtensor_from_ggml(
            Self::ggml_dtype(&w)?,
            &w.bytes,
            w.shape.clone(),
            &self.device,
        )?;
        let tensor = Arc::new(q);
        let op = QMatMul::from_arc(tensor.clone())?;
        Ok(CandleMatrix::Quantized { op, tensor })
    }

    fn vector(&self, w: HostWeight<'_>) -> Result<Tensor> {
        let t = self.dense(&w)?;
        Ok(t.flatten_all()?)
    }

    fn matrix_shape(&self, m: &CandleMatrix) -> (usize, usize) {
        match m {
            CandleMatrix::Packed(p) => (p.rows(), p.cols()),
            CandleMatrix::Quantized { tensor, .. } => {
                let dims = tensor.shape().dims();
                (dims[0], dims[1])
            }
        }
    }

    fn matrix_bytes(&self, m: &CandleMatrix) -> usize {
        match m {
            CandleMatrix::Packed(p) => p.byte_size(),
            CandleMatrix::Quantized { tensor, .. } => tensor.storage_size_in_bytes(),
        }
    }

    fn embed(&self, table: &CandleMatrix, ids: &[u32]) -> Result<Tensor> {
        let _t = profile::op("embed", ids.len());
        let (vocab, _) = self.matrix_shape(table);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        Ok(match table {
            CandleMatrix::Packed(p) => {
                let h = p.cols();
                let mut out = vec![0f32; ids.len() * h];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(h)) {
                    p.dequantize_row(id as usize, row)?;
                }
                self.tensor(out, &[ids.len(), h])?
            }
            CandleMatrix::Quantized { tensor, .. } => {
                let ids_t = Tensor::new(ids, &self.device)?;
                tensor.embedding(&ids_t)?.to_dtype(DType::F32)?
            }
        })
    }

    fn linear(&self, x: &Tensor, w: &CandleMatrix, bias: Option<&Tensor>) -> Result<Tensor> {
        let _t = profile::op("linear", x.dims()[0]);
        match w {
            CandleMatrix::Packed(p) => self.packed_linear(x, p, bias),
            CandleMatrix::Quantized { op, .. } => {
                let y = op.forward(x)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
        }
    }

    fn linear_many(
        &self,
        x: &Tensor,
        ws: &[(&CandleMatrix, Option<&Tensor>)],
    ) -> Result<Vec<Tensor>> {
        let _t = profile::op("linear", x.dims()[0]);
        let packed: Vec<&PackedMatrix> = ws
            .iter()
            .filter_map(|(w, _)| match w {
                CandleMatrix::Packed(p) => Some(&**p),
                CandleMatrix::Quantized { .. } => None,
            })
            .collect();
        if packed.len() != ws.len() || ws.len() > wick_kernels::MAX_PRODUCTS {
            return ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect();
        }
        self.packed_linear_many(x, &packed, &ws.iter().map(|(_, b)| *b).collect::<Vec<_>>())
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let _t = profile::op("add", a.dims()[0]);
        if a.dims() != b.dims() {
            return Ok(a.broadcast_add(b)?);
        }
        Self::with_slice(b, |b| {
            self.map(a, |a, out| Ok(elementwise::add(self.isa, a, b, out)?))
        })?
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let _t = profile::op("scale", x.dims()[0]);
        self.map(x, |x, out| Ok(elementwise::scale(self.isa, x, s, out)?))
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        let _t = profile::op("rms_norm", x.dims()[0]);
        Self::with_slice(weight, |w| {
            self.map(x, |x, out| {
                Ok(elementwise::rms_norm(self.pool, self.isa, x, w, eps, out)?)
            })
        })?
    }

    fn glu(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        let _t = profile::op("glu", gate.dims()[0]);
        let act = match act {
            Activation::Silu => GluActivation::Silu,
            Activation::GeluTanh => GluActivation::GeluTanh,
        };
        Self::with_slice(up, |up| {
            self.map(gate, |g, out| {
                Ok(elementwise::glu(self.pool, self.isa, act, g, up, out)?)
            })
        })?
    }

    fn softcap(&self, x: &Tensor, cap: f32) -> Result<Tensor> {
        let _t = profile::op("softcap", x.dims()[0]);
        self.map(x, |x, out| Ok(elementwise::softcap(self.isa, x, cap, out)?))
    }

    fn select_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let _t = profile::op("select_rows", rows.len());
        let (n, _) = x.dims2()?;
        if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(x.clone());
        }
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        Ok(x.index_select(&Tensor::new(ids.as_slice(), &self.device)?, 0)?)
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        let _t = profile::op("to_host", x.dims()[0]);
        Self::host(&x.contiguous()?)
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<CpuRope> {
        let _t = profile::op("rope_table", positions.len());
        Ok(CpuRope::new(positions, spec))
    }

    fn rope(&self, x: &Tensor, heads: usize, table: &CpuRope) -> Result<Tensor> {
        let _t = profile::op("rope", x.dims()[0]);
        let mut data = Self::host(x)?;
        table.apply(&mut data, heads);
        self.tensor(data, x.dims())
    }

    fn new_kv_layer(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> CpuKvLayer {
        CpuKvLayer::new(kv_heads, head_dim, window)
    }

    fn kv_layer_from_snapshot(&self, s: &KvLayerSnapshot) -> Result<CpuKvLayer> {
        CpuKvLayer::from_snapshot(s)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segments: &mut [AttentionSegment<'_, CpuKvLayer>],
        params: &AttentionParams,
    ) -> Result<Tensor> {
        let _t = profile::op("attention", q.dims()[0]);
        let row = params.kv_heads * params.head_dim;
        let k = Self::host(k)?;
        let v = Self::host(v)?;
        let mut starts = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            starts.push(seg.cache.len);
            let (a, b) = (seg.rows.start * row, seg.rows.end * row);
            seg.cache.append(&k[a..b], &v[a..b]);
        }
        let out = {
            let mut rows = Vec::new();
            for (seg, &start) in segments.iter().zip(&starts) {
                for (i, _) in seg.rows.clone().enumerate() {
                    rows.push(attention::RowSource {
                        cache: &*seg.cache,
                        pos: start + i,
                    });
                }
            }
            Self::with_slice(q, |qs| attention::attend(qs, &rows, params))?
        };
        for seg in segments.iter_mut() {
            seg.cache.evict();
        }
        self.tensor(out, q.dims())
    }
}
