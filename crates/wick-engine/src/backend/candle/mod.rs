//! The CPU backend (named after candle, which it grew from), portable, the default.
//!
//! Activations are [`HostTensor`]s: row-major f32 matrices in recycled buffers. The work
//! is done by wick's own CPU kernels (`wick-kernels`): weight matrices of the common
//! formats (F32/F16/BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are repacked at
//! load and multiplied by runtime-dispatched SIMD kernels on a low-latency thread pool;
//! norms, gated activations and residual adds are kernels writing straight into the
//! result. Other quantized formats (Q2_K, Q3_K …) fall back to candle's `QMatMul`.
//! Rotary embeddings and attention over the host KV cache are our own code too.
//! `WICK_PROFILE=1` prints the time spent in each op.
mod attention;
pub mod block_pool;
mod exp;
mod kv;
mod norm;
mod prefill_attention;
mod prefill_bf16;
mod profile;
mod rope;
mod tensor;

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use wick_gguf::GgmlType;
use wick_kernels::elementwise::{self, GluActivation};
use wick_kernels::{
    Isa, LowRankOutput, LowRankUpdate, PackedMatrix, Product, QuantizedActivations, ThreadPool,
    WeightFormat,
};

pub use block_pool::KvDtype;
pub use kv::CpuKvLayer;
pub use rope::CpuRope;
pub use tensor::HostTensor;

use super::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, KvLayerSnapshot,
    LowRankDelta, RopeSpec,
};
use crate::{EngineError, Result};

/// A weight matrix on the CPU backend.
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

/// The CPU backend: wick's kernels, candle for the rare formats they do not cover.
#[derive(Debug, Clone)]
pub struct CandleBackend {
    device: Device,
    pool: &'static ThreadPool,
    isa: Isa,
    kv_dtype: KvDtype,
    /// Long prompt chunks' attention products in bf16 where the CPU has AVX-512 BF16.
    bf16_prompt_attention: bool,
}

impl Default for CandleBackend {
    fn default() -> Self {
        CandleBackend {
            device: Device::Cpu,
            pool: ThreadPool::global(),
            isa: Isa::best(),
            kv_dtype: KvDtype::F32,
            bf16_prompt_attention: prompt_attention_setting().unwrap_or(true),
        }
    }
}

/// `WICK_PROMPT_ATTENTION=f32|bf16`: the precision of long prompt chunks' attention
/// products when set (`Some(true)` for bf16).
fn prompt_attention_setting() -> Option<bool> {
    match std::env::var("WICK_PROMPT_ATTENTION").ok()?.as_str() {
        "f32" => Some(false),
        "bf16" => Some(true),
        _ => None,
    }
}

thread_local! {
    /// Quantized activations of the last product on this thread, reused so a decode
    /// step allocates no kernel scratch.
    static ACTIVATIONS: RefCell<QuantizedActivations> = RefCell::new(QuantizedActivations::new());

}

/// `m` as the fused low-rank kernels take it: packed f32, f16 or bf16.
fn float_packed(m: &CandleMatrix) -> Option<&PackedMatrix> {
    match m {
        CandleMatrix::Packed(p)
            if matches!(
                p.format(),
                WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16
            ) =>
        {
            Some(p)
        }
        _ => None,
    }
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
            backend: "cpu",
            message: e.to_string(),
        }
    }
}

impl CandleBackend {
    /// The CPU backend, with an f32 KV cache.
    pub fn cpu() -> Self {
        Self::default()
    }

    /// The same backend, storing KV caches it creates as `dtype`.
    pub fn with_kv_dtype(self, dtype: KvDtype) -> Self {
        CandleBackend {
            kv_dtype: dtype,
            ..self
        }
    }

    /// The same backend, running its kernels in the family `isa` (or the best smaller one
    /// the CPU has), to compare families or check that they agree.
    pub fn with_isa(self, isa: Isa) -> Self {
        CandleBackend { isa, ..self }
    }

    /// The same backend with long prompt chunks' attention products in bf16 (where the
    /// CPU has AVX-512 BF16; the default, unless `WICK_PROMPT_ATTENTION=f32`) or in f32.
    pub fn with_bf16_prompt_attention(self, on: bool) -> Self {
        CandleBackend {
            bf16_prompt_attention: on,
            ..self
        }
    }

    /// The same backend with long prompt chunks' attention products in the precision the
    /// model's weights call for: f32 on f32 weights (bf16 operands would move their
    /// log-probabilities by a few hundredths of a nat, far past what f32 weights promise),
    /// bf16 on quantized or half-precision weights, whose own rounding is of that size
    /// already. `WICK_PROMPT_ATTENTION=f32|bf16` overrides it.
    pub fn with_prompt_attention_for(self, base: crate::adapters::BasePrecision) -> Self {
        let bf16 =
            prompt_attention_setting().unwrap_or(base == crate::adapters::BasePrecision::Rounded);
        self.with_bf16_prompt_attention(bf16)
    }

    /// Whether long prompt chunks' attention products may run in bf16 (they do where the
    /// CPU has AVX-512 BF16).
    pub fn bf16_prompt_attention(&self) -> bool {
        self.bf16_prompt_attention
    }

    /// How this backend's KV caches store numbers.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// [`Backend::attention`], each row seeing keys up to `ends[row]` when given
    /// ([`Backend::attention_to`]) or up to its own position.
    fn attention_rows(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        segments: &mut [AttentionSegment<'_, CpuKvLayer>],
        params: &AttentionParams,
        ends: Option<&[usize]>,
    ) -> Result<HostTensor> {
        let _t = profile::op("attention", q.rows());
        let row = params.kv_heads * params.head_dim;
        let (k, v) = (k.data(), v.data());
        let mut starts = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            starts.push(seg.cache.len);
            let (a, b) = (seg.rows.start * row, seg.rows.end * row);
            seg.cache.append(&k[a..b], &v[a..b]);
        }
        let out = {
            let mut rows = Vec::new();
            for (seg, &start) in segments.iter().zip(&starts) {
                for (i, r) in seg.rows.clone().enumerate() {
                    let pos = start + i;
                    // Never past the keys this pass appended.
                    let end = ends
                        .and_then(|e| e.get(r))
                        .map_or(pos + 1, |&e| e.clamp(pos + 1, seg.cache.len));
                    rows.push(attention::RowSource {
                        cache: &*seg.cache,
                        pos,
                        end,
                    });
                }
            }
            attention::attend(
                self.pool,
                self.isa,
                self.bf16_prompt_attention,
                q.data(),
                &rows,
                params,
            )
        };
        for seg in segments.iter_mut() {
            seg.cache.evict();
        }
        HostTensor::from_vec(out, q.rows(), q.cols())
    }

    fn err(message: impl Into<String>) -> EngineError {
        EngineError::Backend {
            backend: "cpu",
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

    /// Every element of a weight as f32, in file order.
    pub(crate) fn floats(&self, w: &HostWeight<'_>) -> Result<Vec<f32>> {
        let len: usize = w.shape.iter().product();
        if let Some(format) = kernel_format(w.dtype) {
            let mut out = vec![0f32; len];
            wick_kernels::ggml::dequantize_row(format, &w.bytes, &mut out)
                .map_err(|e| Self::err(format!("'{}': {e}", w.name)))?;
            return Ok(out);
        }
        let q = qtensor_from_ggml(
            Self::ggml_dtype(w)?,
            &w.bytes,
            w.shape.clone(),
            &self.device,
        )?;
        Ok(q.dequantize(&self.device)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// A candle copy of `x` (for the `QMatMul` fallback).
    fn to_candle(&self, x: &HostTensor) -> Result<Tensor> {
        Ok(Tensor::from_slice(
            x.data(),
            (x.rows(), x.cols()),
            &self.device,
        )?)
    }

    fn from_candle(t: &Tensor) -> Result<HostTensor> {
        let (rows, cols) = t.dims2()?;
        let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        HostTensor::from_vec(data, rows, cols)
    }

    /// A tensor shaped like `like`, every element written by `f`.
    fn map(
        like: &HostTensor,
        f: impl FnOnce(&[f32], &mut [f32]) -> Result<()>,
    ) -> Result<HostTensor> {
        HostTensor::build(like.rows(), like.cols(), |out| f(like.data(), out))
    }

    fn same_shape(op: &str, a: &HostTensor, b: &HostTensor) -> Result<()> {
        if (a.rows(), a.cols()) != (b.rows(), b.cols()) {
            return Err(Self::err(format!(
                "{op}: shapes [{}, {}] and [{}, {}] differ",
                a.rows(),
                a.cols(),
                b.rows(),
                b.cols()
            )));
        }
        Ok(())
    }

    /// Several products of one input in one kernel call.
    fn packed_linear_many(
        &self,
        x: &HostTensor,
        ws: &[&PackedMatrix],
        biases: &[Option<&HostTensor>],
    ) -> Result<Vec<HostTensor>> {
        let n = x.rows();
        if let Some(w) = ws.iter().find(|w| w.cols() != x.cols()) {
            return Err(Self::err(format!(
                "input of width {} for a matrix of {} columns",
                x.cols(),
                w.cols()
            )));
        }
        let mut bufs: Vec<Vec<f32>> = ws.iter().map(|w| tensor::buffer(n * w.rows())).collect();
        {
            let mut products: Vec<Product<'_>> = bufs
                .iter_mut()
                .zip(ws)
                .zip(biases)
                .map(|((out, &weight), bias)| Product {
                    weight,
                    out,
                    bias: bias.map(|b| b.data()),
                })
                .collect();
            ACTIVATIONS.with(|act| {
                wick_kernels::matmul(
                    self.pool,
                    self.isa,
                    x.data(),
                    n,
                    &mut products,
                    &mut act.borrow_mut(),
                )
            })?;
        }
        bufs.into_iter()
            .zip(ws)
            .map(|(b, w)| HostTensor::from_vec(b, n, w.rows()))
            .collect()
    }
}

impl Backend for CandleBackend {
    type Tensor = HostTensor;
    type Matrix = CandleMatrix;
    type Rope = CpuRope;
    type KvLayer = CpuKvLayer;
    type Ids = Vec<u32>;
    type DeltaState = crate::backend::DeltaState;

    fn name(&self) -> &'static str {
        "cpu"
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

    fn vector(&self, w: HostWeight<'_>) -> Result<HostTensor> {
        let data = self.floats(&w)?;
        let len = data.len();
        HostTensor::from_vec(data, 1, len)
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

    fn embed(&self, table: &CandleMatrix, ids: &[u32]) -> Result<HostTensor> {
        let _t = profile::op("embed", ids.len());
        let (vocab, hidden) = self.matrix_shape(table);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        match table {
            CandleMatrix::Packed(p) => HostTensor::build(ids.len(), hidden, |out| {
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(hidden)) {
                    p.dequantize_row(id as usize, row)?;
                }
                Ok(())
            }),
            CandleMatrix::Quantized { tensor, .. } => {
                let ids_t = Tensor::new(ids, &self.device)?;
                Self::from_candle(&tensor.embedding(&ids_t)?)
            }
        }
    }

    fn linear(
        &self,
        x: &HostTensor,
        w: &CandleMatrix,
        bias: Option<&HostTensor>,
    ) -> Result<HostTensor> {
        let mut out = self.linear_many(x, &[(w, bias)])?;
        out.pop().ok_or_else(|| Self::err("no product"))
    }

    fn linear_many(
        &self,
        x: &HostTensor,
        ws: &[(&CandleMatrix, Option<&HostTensor>)],
    ) -> Result<Vec<HostTensor>> {
        let _t = profile::op("linear", x.rows());
        let packed: Vec<&PackedMatrix> = ws
            .iter()
            .filter_map(|(w, _)| match w {
                CandleMatrix::Packed(p) => Some(&**p),
                CandleMatrix::Quantized { .. } => None,
            })
            .collect();
        if packed.len() == ws.len() && ws.len() <= wick_kernels::MAX_PRODUCTS {
            let biases: Vec<Option<&HostTensor>> = ws.iter().map(|(_, b)| *b).collect();
            return self.packed_linear_many(x, &packed, &biases);
        }
        ws.iter()
            .map(|&(w, bias)| match w {
                CandleMatrix::Packed(p) => {
                    Ok(self.packed_linear_many(x, &[&**p], &[bias])?.remove(0))
                }
                CandleMatrix::Quantized { op, .. } => {
                    let mut y = op.forward(&self.to_candle(x)?)?;
                    if let Some(b) = bias {
                        y = y.broadcast_add(&Tensor::from_slice(
                            b.data(),
                            b.cols(),
                            &self.device,
                        )?)?;
                    }
                    Self::from_candle(&y)
                }
            })
            .collect()
    }

    fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        let _t = profile::op("add", a.rows());
        Self::same_shape("add", a, b)?;
        Self::map(a, |a, out| {
            Ok(elementwise::add(self.isa, a, b.data(), out)?)
        })
    }

    fn scale(&self, x: &HostTensor, s: f32) -> Result<HostTensor> {
        let _t = profile::op("scale", x.rows());
        Self::map(x, |x, out| Ok(elementwise::scale(self.isa, x, s, out)?))
    }

    fn rms_norm(&self, x: &HostTensor, weight: &HostTensor, eps: f32) -> Result<HostTensor> {
        let _t = profile::op("rms_norm", x.rows());
        Self::map(x, |x, out| {
            Ok(elementwise::rms_norm(
                self.pool,
                self.isa,
                x,
                weight.data(),
                eps,
                out,
            )?)
        })
    }

    fn split_columns(&self, x: &HostTensor, widths: &[usize]) -> Result<Vec<HostTensor>> {
        let _t = profile::op("split_columns", x.rows());
        let cols = x.cols();
        if widths.iter().sum::<usize>() != cols {
            return Err(Self::err(format!(
                "split of {cols} columns into {widths:?}"
            )));
        }
        let mut at = 0;
        let mut out = Vec::with_capacity(widths.len());
        for &w in widths {
            out.push(HostTensor::build(x.rows(), w, |o| {
                for (src, dst) in x
                    .data()
                    .chunks_exact(cols)
                    .zip(o.chunks_exact_mut(w.max(1)))
                {
                    dst.copy_from_slice(&src[at..at + w]);
                }
                Ok(())
            })?);
            at += w;
        }
        Ok(out)
    }

    fn glu(&self, gate: &HostTensor, up: &HostTensor, act: Activation) -> Result<HostTensor> {
        let _t = profile::op("glu", gate.rows());
        Self::same_shape("glu", gate, up)?;
        let act = match act {
            Activation::Silu => GluActivation::Silu,
            Activation::GeluTanh => GluActivation::GeluTanh,
        };
        Self::map(gate, |g, out| {
            Ok(elementwise::glu(
                self.pool,
                self.isa,
                act,
                g,
                up.data(),
                out,
            )?)
        })
    }

    fn capabilities(&self) -> &'static crate::backend::capability::Capabilities {
        &crate::backend::capability::CPU
    }

    fn layer_norm(
        &self,
        x: &HostTensor,
        weight: &HostTensor,
        bias: Option<&HostTensor>,
        eps: f32,
    ) -> Result<HostTensor> {
        let _t = profile::op("layer_norm", x.rows());
        let n = weight.data().len();
        if n == 0 || !x.cols().is_multiple_of(n) || bias.is_some_and(|b| b.data().len() != n) {
            return Err(Self::err(format!(
                "layer_norm of {} columns with a weight of {n}",
                x.cols()
            )));
        }
        Self::map(x, |x, out| {
            crate::backend::candle::norm::layer_norm(
                x,
                weight.data(),
                bias.map(|b| b.data()),
                eps,
                out,
            );
            Ok(())
        })
    }

    fn activation(&self, x: &HostTensor, act: Activation) -> Result<HostTensor> {
        let _t = profile::op("activation", x.rows());
        Self::map(x, |x, out| {
            crate::backend::candle::norm::activation(x, act, out);
            Ok(())
        })
    }

    fn softcap(&self, x: &HostTensor, cap: f32) -> Result<HostTensor> {
        let _t = profile::op("softcap", x.rows());
        Self::map(x, |x, out| Ok(elementwise::softcap(self.isa, x, cap, out)?))
    }

    fn select_rows(&self, x: &HostTensor, rows: &[usize]) -> Result<HostTensor> {
        let _t = profile::op("select_rows", rows.len());
        if rows.len() == x.rows() && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(x.clone());
        }
        let cols = x.cols();
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows()) {
            return Err(Self::err(format!("row {bad} of a {}-row tensor", x.rows())));
        }
        HostTensor::build(rows.len(), cols, |out| {
            for (&r, o) in rows.iter().zip(out.chunks_exact_mut(cols)) {
                o.copy_from_slice(&x.data()[r * cols..(r + 1) * cols]);
            }
            Ok(())
        })
    }

    fn tensor_from_host(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<HostTensor> {
        HostTensor::from_vec(data, rows, cols)
    }

    fn rows_to_host(&self, x: &HostTensor, groups: &[usize]) -> Result<Vec<Vec<f32>>> {
        let _t = profile::op("to_host", x.rows());
        let cols = x.cols();
        let mut at = 0;
        let mut out = Vec::with_capacity(groups.len());
        for &n in groups {
            let part = x.data().get(at * cols..(at + n) * cols).ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "rows {at}..{} of a {}-row tensor",
                    at + n,
                    x.rows()
                ))
            })?;
            out.push(part.to_vec());
            at += n;
        }
        Ok(out)
    }

    fn argmax(&self, logits: &HostTensor) -> Result<Vec<u32>> {
        let _t = profile::op("argmax", logits.rows());
        Ok(logits
            .data()
            .chunks_exact(logits.cols().max(1))
            .map(first_max)
            .collect())
    }

    fn masked_argmax(&self, logits: &HostTensor, masks: &[Option<Vec<u32>>]) -> Result<Vec<u32>> {
        let _t = profile::op("masked_argmax", logits.rows());
        let cols = logits.cols().max(1);
        let mut row = Vec::new();
        Ok(logits
            .data()
            .chunks_exact(cols)
            .enumerate()
            .map(|(i, x)| match masks.get(i).and_then(Option::as_deref) {
                Some(mask) => {
                    row.clear();
                    row.extend_from_slice(x);
                    super::apply_token_mask(mask, &mut row);
                    first_max(&row)
                }
                None => first_max(x),
            })
            .collect())
    }

    fn embed_ids(&self, table: &CandleMatrix, ids: &Vec<u32>) -> Result<HostTensor> {
        self.embed(table, ids)
    }

    fn ids_to_host(&self, ids: &Vec<u32>) -> Result<Vec<u32>> {
        Ok(ids.clone())
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<CpuRope> {
        let _t = profile::op("rope_table", positions.len());
        Ok(CpuRope::new(positions, spec))
    }

    fn rope_table_axes(
        &self,
        positions: &[[usize; 3]],
        axes: &[u8],
        spec: &RopeSpec,
    ) -> Result<CpuRope> {
        let _t = profile::op("rope_table", positions.len());
        if axes.len() != spec.inv_freq.len() || axes.iter().any(|&a| a > 2) {
            return Err(EngineError::InvalidInput(format!(
                "{} rotary axes (each 0..=2) for {} frequencies",
                axes.len(),
                spec.inv_freq.len()
            )));
        }
        Ok(CpuRope::with_axes(positions, axes, spec))
    }

    fn rope(&self, x: &HostTensor, heads: usize, table: &CpuRope) -> Result<HostTensor> {
        let _t = profile::op("rope", x.rows());
        Self::map(x, |x, out| {
            out.copy_from_slice(x);
            table.apply(out, heads);
            Ok(())
        })
    }

    fn new_kv_layer(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> CpuKvLayer {
        CpuKvLayer::new(kv_heads, head_dim, window, self.kv_dtype)
    }

    fn kv_layer_from_snapshot(&self, s: &KvLayerSnapshot) -> Result<CpuKvLayer> {
        CpuKvLayer::from_snapshot(s, self.kv_dtype)
    }

    fn new_delta_state(&self, shape: &crate::backend::DeltaShape) -> crate::backend::DeltaState {
        crate::backend::DeltaState::new(shape)
    }

    fn delta_state_from_host(
        &self,
        s: crate::backend::DeltaState,
    ) -> Result<crate::backend::DeltaState> {
        Ok(s)
    }

    fn attention(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        segments: &mut [AttentionSegment<'_, CpuKvLayer>],
        params: &AttentionParams,
    ) -> Result<HostTensor> {
        self.attention_rows(q, k, v, segments, params, None)
    }

    fn attention_to(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        segments: &mut [AttentionSegment<'_, CpuKvLayer>],
        params: &AttentionParams,
        ends: &[usize],
    ) -> Result<HostTensor> {
        if ends.len() != q.rows() {
            return Err(Self::err(format!(
                "attention_to got {} key ends for {} rows",
                ends.len(),
                q.rows()
            )));
        }
        self.attention_rows(q, k, v, segments, params, Some(ends))
    }

    fn attention_shared(
        &self,
        q: &HostTensor,
        new_kv: Option<(&HostTensor, &HostTensor)>,
        segments: &mut [AttentionSegment<'_, CpuKvLayer>],
        params: &AttentionParams,
        evict: bool,
        ends: Option<&[usize]>,
    ) -> Result<HostTensor> {
        let _t = profile::op("attention", q.rows());
        if ends.is_some_and(|e| e.len() != q.rows()) {
            return Err(Self::err(format!(
                "attention_shared got {} key ends for {} rows",
                ends.map_or(0, <[usize]>::len),
                q.rows()
            )));
        }
        let row = params.kv_heads * params.head_dim;
        let mut starts = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            let n = seg.rows.len();
            match new_kv {
                Some((k, v)) => {
                    starts.push(seg.cache.len);
                    let (a, b) = (seg.rows.start * row, seg.rows.end * row);
                    seg.cache.append(&k.data()[a..b], &v.data()[a..b]);
                }
                None => {
                    let start = seg.cache.len.checked_sub(n).ok_or_else(|| {
                        Self::err("a shared KV cache holds fewer tokens than the pass")
                    })?;
                    if seg.cache.row() != row || start < seg.cache.start {
                        return Err(Self::err(
                            "a shared KV cache does not hold this pass's keys",
                        ));
                    }
                    starts.push(start);
                }
            }
        }
        let out = {
            let mut rows = Vec::new();
            for (seg, &start) in segments.iter().zip(&starts) {
                for (i, r) in seg.rows.clone().enumerate() {
                    let pos = start + i;
                    // Never past the keys this pass holds.
                    let end = ends
                        .and_then(|e| e.get(r))
                        .map_or(pos + 1, |&e| e.clamp(pos + 1, seg.cache.len));
                    rows.push(attention::RowSource {
                        cache: &*seg.cache,
                        pos,
                        end,
                    });
                }
            }
            attention::attend(
                self.pool,
                self.isa,
                self.bf16_prompt_attention,
                q.data(),
                &rows,
                params,
            )
        };
        if evict {
            for seg in segments.iter_mut() {
                seg.cache.evict();
            }
        }
        HostTensor::from_vec(out, q.rows(), q.cols())
    }

    fn low_rank_add(
        &self,
        x: &HostTensor,
        mut ys: Vec<HostTensor>,
        deltas: &[&[LowRankDelta<'_, Self>]],
    ) -> Result<Vec<HostTensor>> {
        let _t = profile::op("low_rank_add", x.rows());
        if ys.len() != deltas.len() {
            return Err(Self::err(format!(
                "low_rank_add of {} outputs with {} delta lists",
                ys.len(),
                deltas.len()
            )));
        }
        // Factors the fused kernel does not take go the long way (two products each).
        let mut updates: Vec<Vec<LowRankUpdate<'_>>> = Vec::with_capacity(deltas.len());
        for ds in deltas {
            let mut these = Vec::with_capacity(ds.len());
            for d in ds.iter() {
                match (float_packed(d.a), float_packed(d.b)) {
                    (Some(a), Some(b))
                        if a.rows() <= wick_kernels::MAX_LOW_RANK && a.format() == b.format() =>
                    {
                        these.push(LowRankUpdate { a, b, rows: d.rows })
                    }
                    _ => return super::low_rank_add_by_products(self, x, ys, deltas),
                }
            }
            updates.push(these);
        }
        {
            let mut outputs: Vec<LowRankOutput<'_>> = ys
                .iter_mut()
                .zip(&updates)
                .map(|(y, u)| LowRankOutput {
                    y: y.data_mut(),
                    updates: u,
                })
                .collect();
            wick_kernels::low_rank_add(self.pool, self.isa, x.data(), x.rows(), &mut outputs)?;
        }
        Ok(ys)
    }

    fn add_rows(&self, y: &HostTensor, rows: &[usize], d: &HostTensor) -> Result<HostTensor> {
        let _t = profile::op("add_rows", rows.len());
        let cols = y.cols();
        if d.cols() != cols || d.rows() != rows.len() {
            return Err(Self::err(format!(
                "add_rows of a [{}, {}] delta at {} rows of a [{}, {cols}] tensor",
                d.rows(),
                d.cols(),
                rows.len(),
                y.rows()
            )));
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= y.rows()) {
            return Err(Self::err(format!("row {bad} of a {}-row tensor", y.rows())));
        }
        HostTensor::build(y.rows(), cols, |out| {
            out.copy_from_slice(y.data());
            for (&r, delta) in rows.iter().zip(d.data().chunks_exact(cols.max(1))) {
                for (o, v) in out[r * cols..(r + 1) * cols].iter_mut().zip(delta) {
                    *o += v;
                }
            }
            Ok(())
        })
    }
}

/// The index of the first largest number of `row`, NaNs never chosen (0 when `row[0]` is
/// NaN, as a running `>` comparison from `row[0]` gives): the maximum is found sixteen
/// lanes at a time (it does not depend on order), then its first position.
fn first_max(row: &[f32]) -> u32 {
    if row.first().is_none_or(|x| x.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    row.iter().position(|&x| x == max).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::first_max;

    /// The running comparison the backend argmax must agree with (the host sampler's
    /// greedy pick keeps the first of equal maxima too).
    fn running(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn first_max_is_the_running_comparison() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for len in [1usize, 5, 16, 17, 100, 49152] {
            for case in 0..20 {
                // Few distinct values, so maxima tie; some NaNs and infinities.
                let mut row: Vec<f32> = (0..len).map(|_| (next() % 7) as f32 - 3.0).collect();
                match case % 4 {
                    1 => row[next() as usize % len] = f32::NAN,
                    2 => row[0] = f32::NAN,
                    3 => row[next() as usize % len] = f32::INFINITY,
                    _ => {}
                }
                assert_eq!(first_max(&row), running(&row), "len {len} case {case}");
            }
        }
        assert_eq!(first_max(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(first_max(&[0.0, -0.0, 0.0]), 0);
        assert_eq!(first_max(&[-0.0, 0.0]), 0);
        assert_eq!(first_max(&[]), 0);
    }
}
