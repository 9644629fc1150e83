//! The candle backend: CPU, portable, the default.
//!
//! Matrix products go through candle (`QMatMul` keeps GGUF quantized weights quantized
//! and uses candle's SIMD kernels; dense weights use its gemm). Rotary embeddings and
//! attention over the host KV cache are our own kernels.
mod attention;
mod kv;
mod rope;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Storage, Tensor};
use wick_gguf::GgmlType;

pub use kv::CpuKvLayer;
pub use rope::CpuRope;

use super::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, KvLayerSnapshot, RopeSpec,
};
use crate::{EngineError, Result};

/// A weight matrix on the candle backend.
#[derive(Debug)]
pub enum CandleMatrix {
    /// GGUF-quantized, multiplied without dequantizing.
    Quantized {
        /// The product operator.
        op: QMatMul,
        /// The quantized tensor (also used for embedding lookups).
        tensor: std::sync::Arc<QTensor>,
    },
    /// Dense f32.
    Dense(Tensor),
}

/// candle on the CPU.
#[derive(Debug, Clone)]
pub struct CandleBackend {
    device: Device,
}

impl Default for CandleBackend {
    fn default() -> Self {
        CandleBackend {
            device: Device::Cpu,
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
}

impl Backend for CandleBackend {
    type Tensor = Tensor;
    type Matrix = CandleMatrix;
    type Rope = CpuRope;
    type KvLayer = CpuKvLayer;
    type Ids = Vec<u32>;

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
        match w.dtype {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
                Ok(CandleMatrix::Dense(self.dense(&w)?))
            }
            _ => {
                let q = qtensor_from_ggml(
                    Self::ggml_dtype(&w)?,
                    &w.bytes,
                    w.shape.clone(),
                    &self.device,
                )?;
                let tensor = std::sync::Arc::new(q);
                let op = QMatMul::from_arc(tensor.clone())?;
                Ok(CandleMatrix::Quantized { op, tensor })
            }
        }
    }

    fn vector(&self, w: HostWeight<'_>) -> Result<Tensor> {
        let t = self.dense(&w)?;
        Ok(t.flatten_all()?)
    }

    fn matrix_shape(&self, m: &CandleMatrix) -> (usize, usize) {
        let dims = match m {
            CandleMatrix::Quantized { tensor, .. } => tensor.shape().dims().to_vec(),
            CandleMatrix::Dense(t) => t.dims().to_vec(),
        };
        (dims[0], dims[1])
    }

    fn matrix_bytes(&self, m: &CandleMatrix) -> usize {
        match m {
            CandleMatrix::Quantized { tensor, .. } => tensor.storage_size_in_bytes(),
            CandleMatrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    fn embed(&self, table: &CandleMatrix, ids: &[u32]) -> Result<Tensor> {
        let (vocab, _) = self.matrix_shape(table);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let ids_t = Tensor::new(ids, &self.device)?;
        Ok(match table {
            CandleMatrix::Quantized { tensor, .. } => {
                tensor.embedding(&ids_t)?.to_dtype(DType::F32)?
            }
            CandleMatrix::Dense(t) => t.index_select(&ids_t, 0)?,
        })
    }

    fn linear(&self, x: &Tensor, w: &CandleMatrix, bias: Option<&Tensor>) -> Result<Tensor> {
        let y = match w {
            CandleMatrix::Quantized { op, .. } => op.forward(x)?,
            CandleMatrix::Dense(t) => x.matmul(&t.t()?)?,
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok(a.add(b)?)
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        Ok(x.affine(s as f64, 0.0)?)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        let n = weight.elem_count();
        let dims = x.dims().to_vec();
        let flat = x.reshape((x.elem_count() / n, n))?;
        let y = candle_nn::ops::rms_norm(&flat, weight, eps)?;
        Ok(y.reshape(dims)?)
    }

    fn split_columns(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let mut at = 0;
        let mut out = Vec::with_capacity(widths.len());
        for &w in widths {
            out.push(x.narrow(1, at, w)?.contiguous()?);
            at += w;
        }
        Ok(out)
    }

    fn glu(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        let g = match act {
            Activation::Silu => gate.silu()?,
            Activation::GeluTanh => gate.gelu()?,
        };
        Ok(g.mul(up)?)
    }

    fn softcap(&self, x: &Tensor, cap: f32) -> Result<Tensor> {
        Ok(x.affine(1.0 / cap as f64, 0.0)?
            .tanh()?
            .affine(cap as f64, 0.0)?)
    }

    fn select_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(x.clone());
        }
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        Ok(x.index_select(&Tensor::new(ids.as_slice(), &self.device)?, 0)?)
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        Self::host(&x.contiguous()?)
    }

    fn argmax(&self, logits: &Tensor) -> Result<Vec<u32>> {
        let (_, vocab) = logits.dims2()?;
        let data = self.to_host(logits)?;
        Ok(data
            .chunks_exact(vocab.max(1))
            .map(|row| {
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect())
    }

    fn embed_ids(&self, table: &CandleMatrix, ids: &Vec<u32>) -> Result<Tensor> {
        self.embed(table, ids)
    }

    fn ids_to_host(&self, ids: &Vec<u32>) -> Result<Vec<u32>> {
        Ok(ids.clone())
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<CpuRope> {
        Ok(CpuRope::new(positions, spec))
    }

    fn rope(&self, x: &Tensor, heads: usize, table: &CpuRope) -> Result<Tensor> {
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
