//! The MLX backend (cargo feature `mlx`): MLX's GPU backend (CUDA from the `mlx-cuda-13`
//! wheel, Metal on Apple) or its CPU backend, through `wick-mlx`.
//!
//! Activations are in one compute dtype (the checkpoint's bf16/f16 for safetensors, f32
//! for GGUF, whose scales are exact in f32). Matrices are dense in that dtype or in MLX's
//! affine quantized layout, multiplied by MLX's quantized matmul: mlx-community
//! checkpoints load as they are, and GGUF `Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K` blocks are
//! re-laid out losslessly (see [`crate::weights::affine`]); other GGUF types are
//! dequantized. Norms, rotary embeddings and attention use MLX's fused `fast` kernels,
//! the gated MLP activation is fused by `mx::compile`. Nothing runs until logits or ids
//! are read, so a whole forward pass is one lazy graph; [`Backend::schedule`] starts a
//! step before the host reads the previous step's ids.
mod arena;
mod attention;
mod deltanet;
mod kernels;
mod kv;
mod load;
mod rope;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use attention::Reach;
use wick_mlx::{Array, Device, GluActivation, MlxError, Quantized, Stream};

pub use deltanet::MlxDeltaState;
pub use kv::MlxKvLayer;
pub use rope::MlxRope;
/// MLX element types (the backend's compute dtype is one of bf16, f16, f32).
pub use wick_mlx::Dtype;

use super::{
    Activation, AttentionParams, AttentionSegment, Backend, DeltaInputs, DeltaParams, DeltaSegment,
    DeltaShape, DeltaState, DeltaTensors, HostWeight, KvLayerSnapshot, RopeSpec,
};
use crate::weights::AffineWeight;
use crate::{EngineError, Result};

pub(crate) fn mlx_err(e: MlxError) -> EngineError {
    EngineError::Backend {
        backend: "mlx",
        message: e.to_string(),
    }
}

/// A weight matrix on MLX.
#[derive(Debug)]
pub enum MlxMatrix {
    /// Dense `[out, in]` in the compute dtype.
    Dense(Array),
    /// MLX affine quantization.
    Affine {
        /// Packed weight, scales and biases.
        q: Quantized,
        /// `[out, in]`.
        shape: (usize, usize),
    },
}

/// Where the MLX backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxDevice {
    /// The runtime's GPU (CUDA or Metal).
    Gpu,
    /// MLX's CPU backend.
    Cpu,
}

/// MLX on one device, computing in one dtype.
#[derive(Debug, Clone)]
pub struct MlxBackend {
    stream: Stream,
    dtype: Dtype,
    report: Arc<Mutex<BTreeMap<String, usize>>>,
    tuning: Arc<kernels::Tuning>,
    /// Where the DeltaNet mixer runs: on the host (the trait's default, wick's own
    /// kernels) or as MLX ops.
    deltanet: DeltaNetPlace,
}

/// Where the MLX backend runs Qwen 3.5's gated DeltaNet mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaNetPlace {
    /// On the host with wick's CPU kernels, the states in host memory, the rows copied out
    /// and back: the faster form on MLX's CPU device (measured by `benches/deltanet.rs`).
    Host,
    /// As MLX ops on the backend's device, the states as MLX arrays: a step stays one lazy
    /// graph (the GPU's form).
    Device,
}

impl MlxBackend {
    /// A backend on `device` computing in `dtype` (bf16, f16 or f32).
    pub fn new(device: MlxDevice, dtype: Dtype) -> Result<Self> {
        if !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(EngineError::InvalidInput(format!(
                "MLX compute dtype must be bfloat16, float16 or float32, not {dtype}"
            )));
        }
        let device = match device {
            MlxDevice::Gpu => Device::Gpu,
            MlxDevice::Cpu => Device::Cpu,
        };
        let stream = Stream::new(device).map_err(mlx_err)?;
        Ok(MlxBackend {
            tuning: Arc::new(kernels::Tuning::from_env(stream.device() == Device::Gpu)),
            deltanet: match std::env::var("WICK_MLX_DELTANET").as_deref() {
                Ok("host") => DeltaNetPlace::Host,
                Ok("device") => DeltaNetPlace::Device,
                Ok(other) => {
                    return Err(EngineError::InvalidInput(format!(
                        "WICK_MLX_DELTANET={other}: expected host or device"
                    )))
                }
                Err(_) if stream.device() == Device::Gpu => DeltaNetPlace::Device,
                Err(_) => DeltaNetPlace::Host,
            },
            stream,
            dtype,
            report: Arc::default(),
        })
    }

    /// This backend with the DeltaNet mixer at `place` (by default the device's form: MLX
    /// ops on a GPU, the host on MLX's CPU device; `WICK_MLX_DELTANET=host|device` sets it).
    pub fn with_deltanet(mut self, place: DeltaNetPlace) -> Self {
        self.deltanet = place;
        self
    }

    /// Where the DeltaNet mixer runs.
    pub fn deltanet(&self) -> DeltaNetPlace {
        self.deltanet
    }

    /// The backend a checkpoint of float type `dtype` runs on: the default device, the
    /// checkpoint's dtype. `WICK_MLX_DEVICE=gpu|cpu` and `WICK_MLX_DTYPE=bf16|f16|f32`
    /// override both.
    pub fn for_checkpoint(dtype: Dtype) -> Result<Self> {
        let device = match std::env::var("WICK_MLX_DEVICE").as_deref() {
            Ok("cpu") => MlxDevice::Cpu,
            Ok("gpu") => MlxDevice::Gpu,
            Ok(other) => {
                return Err(EngineError::InvalidInput(format!(
                    "WICK_MLX_DEVICE={other}: expected gpu or cpu"
                )))
            }
            Err(_) => Self::default_device(),
        };
        let dtype = match std::env::var("WICK_MLX_DTYPE").as_deref() {
            Ok("bf16") | Ok("bfloat16") => Dtype::BF16,
            Ok("f16") | Ok("float16") => Dtype::F16,
            Ok("f32") | Ok("float32") => Dtype::F32,
            Ok(other) => {
                return Err(EngineError::InvalidInput(format!(
                    "WICK_MLX_DTYPE={other}: expected bf16, f16 or f32"
                )))
            }
            Err(_) => dtype,
        };
        let be = Self::new(device, dtype)?;
        tracing::info!(
            mlx = %wick_mlx::version(),
            device = ?be.device(),
            dtype = %be.dtype(),
            tuning = %be.tuning,
            "MLX backend"
        );
        Ok(be)
    }

    /// Logs how the weights were brought in (one line per kind of conversion); GGUF
    /// types that had to be dequantized are logged as warnings (more memory, no
    /// quantized kernels).
    pub fn log_load_report(&self) {
        for (what, count) in self.load_report() {
            if what.contains("dequantized") {
                tracing::warn!("MLX load: {count} matrices {what}");
            } else {
                tracing::info!("MLX load: {count} matrices {what}");
            }
        }
    }

    /// The GPU when the runtime has one, else the CPU.
    pub fn default_device() -> MlxDevice {
        if wick_mlx::gpu_available() {
            MlxDevice::Gpu
        } else {
            MlxDevice::Cpu
        }
    }

    /// The device it runs on.
    pub fn device(&self) -> MlxDevice {
        match self.stream.device() {
            Device::Gpu => MlxDevice::Gpu,
            Device::Cpu => MlxDevice::Cpu,
        }
    }

    /// The activation dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// How each loaded matrix was brought into MLX (`"Q4_1 → affine 4-bit g32
    /// (lossless)"` …) and how many matrices went that way.
    pub fn load_report(&self) -> Vec<(String, usize)> {
        self.report
            .lock()
            .map(|r| r.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default()
    }

    pub(crate) fn note(&self, what: String) {
        if let Ok(mut r) = self.report.lock() {
            *r.entry(what).or_default() += 1;
        }
    }

    fn cols(x: &Array) -> i32 {
        x.shape().last().copied().unwrap_or(0)
    }
}

/// One key end per query row, or an error naming `op`.
fn check_ends(op: &str, q: &Array, ends: Option<&[usize]>) -> Result<()> {
    let rows = q.shape().first().copied().unwrap_or(0) as usize;
    match ends {
        Some(e) if e.len() != rows => Err(EngineError::Backend {
            backend: "mlx",
            message: format!("{op} got {} key ends for {rows} rows", e.len()),
        }),
        _ => Ok(()),
    }
}

impl Backend for MlxBackend {
    type Tensor = Array;
    type Matrix = MlxMatrix;
    type Rope = MlxRope;
    type KvLayer = MlxKvLayer;
    type Ids = Array;
    type DeltaState = MlxDeltaState;

    fn capabilities(&self) -> &'static crate::backend::capability::Capabilities {
        &crate::backend::capability::MLX
    }

    fn name(&self) -> &'static str {
        "mlx"
    }

    fn matrix(&self, w: HostWeight<'_>) -> Result<MlxMatrix> {
        load::matrix(self, w)
    }

    fn affine_matrix(&self, w: AffineWeight<'_>) -> Result<MlxMatrix> {
        load::affine(self, w, None)
    }

    fn vector(&self, w: HostWeight<'_>) -> Result<Array> {
        let a = load::float(self, &w)?;
        let n = a.size() as i32;
        self.stream.reshape(&a, &[n]).map_err(mlx_err)
    }

    fn matrix_shape(&self, m: &MlxMatrix) -> (usize, usize) {
        match m {
            MlxMatrix::Dense(a) => {
                let s = a.shape();
                (s[0] as usize, s[1] as usize)
            }
            MlxMatrix::Affine { shape, .. } => *shape,
        }
    }

    fn matrix_bytes(&self, m: &MlxMatrix) -> usize {
        match m {
            MlxMatrix::Dense(a) => a.nbytes(),
            MlxMatrix::Affine { q, .. } => {
                q.weight.nbytes() + q.scales.nbytes() + q.biases.nbytes()
            }
        }
    }

    fn embed(&self, table: &MlxMatrix, ids: &[u32]) -> Result<Array> {
        let (vocab, _) = self.matrix_shape(table);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let ids = Array::from_slice(ids, &[ids.len() as i32]).map_err(mlx_err)?;
        self.embed_ids(table, &ids)
    }

    fn linear(&self, x: &Array, w: &MlxMatrix, bias: Option<&Array>) -> Result<Array> {
        let s = &self.stream;
        let y = match w {
            MlxMatrix::Dense(w) => kernels::dense_product(self, &self.tuning, x, w)?,
            MlxMatrix::Affine { q, .. } => s.quantized_matmul(x, q).map_err(mlx_err)?,
        };
        match bias {
            Some(b) => s.add(&y, b).map_err(mlx_err),
            None => Ok(y),
        }
    }

    fn add(&self, a: &Array, b: &Array) -> Result<Array> {
        self.stream.add(a, b).map_err(mlx_err)
    }

    fn scale(&self, x: &Array, k: f32) -> Result<Array> {
        self.stream.scale(x, k).map_err(mlx_err)
    }

    fn rms_norm(&self, x: &Array, weight: &Array, eps: f32) -> Result<Array> {
        let s = &self.stream;
        let n = weight.size() as i32;
        let cols = Self::cols(x);
        if cols == n {
            return s.rms_norm(x, weight, eps).map_err(mlx_err);
        }
        // Per-head norms (Qwen 3's q/k norms): groups of `n` within each row.
        let rows = x.shape()[0];
        let g = s.reshape(x, &[rows, cols / n.max(1), n]).map_err(mlx_err)?;
        let y = s.rms_norm(&g, weight, eps).map_err(mlx_err)?;
        s.reshape(&y, &[rows, cols]).map_err(mlx_err)
    }

    fn add_rms_norm(
        &self,
        x: &Array,
        y: &Array,
        weight: &Array,
        eps: f32,
    ) -> Result<(Array, Array)> {
        if let Some(pair) = kernels::add_rms_norm(self, &self.tuning, x, y, weight, eps)? {
            return Ok(pair);
        }
        let sum = self.add(x, y)?;
        let normed = self.rms_norm(&sum, weight, eps)?;
        Ok((sum, normed))
    }

    fn can_fuse(&self, parts: &[&MlxMatrix]) -> bool {
        self.tuning.fuse && load::can_stack(parts)
    }

    fn fuse_matrices(&self, parts: Vec<MlxMatrix>) -> Result<MlxMatrix> {
        load::stack(self, parts)
    }

    fn split_columns(&self, x: &Array, widths: &[usize]) -> Result<Vec<Array>> {
        let rows = x.shape()[0];
        let mut at = 0i32;
        let mut out = Vec::with_capacity(widths.len());
        for &w in widths {
            let w = w as i32;
            out.push(
                self.stream
                    .slice(x, &[0, at], &[rows, at + w])
                    .map_err(mlx_err)?,
            );
            at += w;
        }
        Ok(out)
    }

    fn glu(&self, gate: &Array, up: &Array, act: Activation) -> Result<Array> {
        let act = match act {
            Activation::Silu => GluActivation::Silu,
            Activation::GeluTanh => GluActivation::GeluTanh,
        };
        self.stream.glu(gate, up, act).map_err(mlx_err)
    }

    fn softcap(&self, x: &Array, cap: f32) -> Result<Array> {
        self.stream.softcap(x, cap).map_err(mlx_err)
    }

    fn layer_norm(
        &self,
        x: &Array,
        weight: &Array,
        bias: Option<&Array>,
        eps: f32,
    ) -> Result<Array> {
        let s = &self.stream;
        let n = weight.size() as i32;
        let cols = Self::cols(x);
        if n == 0 || cols % n != 0 || bias.is_some_and(|b| b.size() as i32 != n) {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: format!("layer_norm of {cols} columns with a weight of {n}"),
            });
        }
        if cols == n {
            return s.layer_norm(x, Some(weight), bias, eps).map_err(mlx_err);
        }
        // Groups of `n` within each row, as rms_norm does.
        let rows = x.shape()[0];
        let g = s.reshape(x, &[rows, cols / n, n]).map_err(mlx_err)?;
        let y = s.layer_norm(&g, Some(weight), bias, eps).map_err(mlx_err)?;
        s.reshape(&y, &[rows, cols]).map_err(mlx_err)
    }

    fn activation(&self, x: &Array, act: Activation) -> Result<Array> {
        let act = match act {
            Activation::Silu => GluActivation::Silu,
            Activation::GeluTanh => GluActivation::GeluTanh,
        };
        self.stream.activation(x, act).map_err(mlx_err)
    }

    fn select_rows(&self, x: &Array, rows: &[usize]) -> Result<Array> {
        let n = x.shape()[0] as usize;
        if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(x.clone());
        }
        if rows.len() == 1 {
            let r = rows[0] as i32;
            return self
                .stream
                .slice(x, &[r, 0], &[r + 1, Self::cols(x)])
                .map_err(mlx_err);
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]).map_err(mlx_err)?;
        self.stream.take(x, &idx, 0).map_err(mlx_err)
    }

    fn rows_to_host(&self, x: &Array, groups: &[usize]) -> Result<Vec<Vec<f32>>> {
        let x = self.stream.astype(x, Dtype::F32).map_err(mlx_err)?;
        let cols = x.shape().get(1).copied().unwrap_or(0) as usize;
        let mut at = 0;
        let mut out = Vec::with_capacity(groups.len());
        for &n in groups {
            out.push(x.read_range::<f32>(at * cols, n * cols).map_err(mlx_err)?);
            at += n;
        }
        Ok(out)
    }

    fn argmax(&self, logits: &Array) -> Result<Array> {
        self.stream.argmax(logits, -1).map_err(mlx_err)
    }

    fn masked_argmax(&self, logits: &Array, masks: &[Option<Vec<u32>>]) -> Result<Array> {
        if masks.iter().all(Option::is_none) {
            return self.argmax(logits);
        }
        let s = &self.stream;
        let shape = logits.shape();
        let (rows, cols) = (shape[0] as usize, Self::cols(logits) as usize);
        // One byte per logit (MLX's bool): the bit words expanded on the host, which is
        // cheaper than the ops that would expand them on the device for one step.
        let mut allowed = vec![1u8; rows * cols];
        for (row, mask) in allowed.chunks_exact_mut(cols.max(1)).zip(masks) {
            if let Some(mask) = mask {
                expand_mask(mask, row);
            }
        }
        let allowed = Array::from_bytes(&allowed, &[rows as i32, cols as i32], Dtype::Bool)
            .map_err(mlx_err)?;
        let floor = Array::from_slice(&[f32::NEG_INFINITY], &[1]).map_err(mlx_err)?;
        let floor = s.astype(&floor, logits.dtype()).map_err(mlx_err)?;
        let masked = s.where_(&allowed, logits, &floor).map_err(mlx_err)?;
        s.argmax(&masked, -1).map_err(mlx_err)
    }

    fn schedule_tensor(&self, x: &Array) -> Result<()> {
        wick_mlx::async_eval(&[x]).map_err(mlx_err)
    }

    fn embed_ids(&self, table: &MlxMatrix, ids: &Array) -> Result<Array> {
        let s = &self.stream;
        match table {
            MlxMatrix::Dense(t) => s.take(t, ids, 0).map_err(mlx_err),
            MlxMatrix::Affine { q, .. } => {
                let rows = Quantized {
                    weight: s.take(&q.weight, ids, 0).map_err(mlx_err)?,
                    scales: s.take(&q.scales, ids, 0).map_err(mlx_err)?,
                    biases: s.take(&q.biases, ids, 0).map_err(mlx_err)?,
                    group_size: q.group_size,
                    bits: q.bits,
                };
                let x = s.dequantize(&rows).map_err(mlx_err)?;
                s.astype(&x, self.dtype).map_err(mlx_err)
            }
        }
    }

    fn ids_to_host(&self, ids: &Array) -> Result<Vec<u32>> {
        // argmax yields u32 already: read the queued array itself, adding no node.
        if ids.dtype() == Dtype::U32 {
            return ids.to_vec::<u32>().map_err(mlx_err);
        }
        let ids = self.stream.astype(ids, Dtype::U32).map_err(mlx_err)?;
        ids.to_vec::<u32>().map_err(mlx_err)
    }

    fn schedule(&self, ids: &Array) -> Result<()> {
        wick_mlx::async_eval(&[ids]).map_err(mlx_err)
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<MlxRope> {
        MlxRope::new(positions, spec)
    }

    fn rope_table_axes(
        &self,
        positions: &[[usize; 3]],
        axes: &[u8],
        spec: &RopeSpec,
    ) -> Result<MlxRope> {
        MlxRope::with_axes(positions, axes, spec)
    }

    fn rope(&self, x: &Array, heads: usize, table: &MlxRope) -> Result<Array> {
        table.apply(&self.stream, x, heads)
    }

    fn new_kv_layer(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> MlxKvLayer {
        MlxKvLayer::new(self.stream, self.dtype, kv_heads, head_dim, window)
    }

    fn kv_layer_from_snapshot(&self, s: &KvLayerSnapshot) -> Result<MlxKvLayer> {
        MlxKvLayer::from_snapshot(self.stream, self.dtype, s)
    }

    fn new_delta_state(&self, shape: &DeltaShape) -> MlxDeltaState {
        MlxDeltaState::new(shape, self.deltanet)
    }

    fn delta_state_from_host(&self, s: DeltaState) -> Result<MlxDeltaState> {
        MlxDeltaState::from_host(s, self.deltanet)
    }

    fn delta_weights(&self, p: &DeltaParams<'_>) -> Result<Option<DeltaTensors<Array>>> {
        match self.deltanet {
            DeltaNetPlace::Host => Ok(None),
            DeltaNetPlace::Device => deltanet::weights(p).map(Some),
        }
    }

    fn delta_net(
        &self,
        p: &DeltaParams<'_>,
        uploaded: Option<&DeltaTensors<Array>>,
        x: DeltaInputs<'_, Array>,
        segments: &mut [DeltaSegment<'_, MlxDeltaState>],
    ) -> Result<Array> {
        if self.deltanet == DeltaNetPlace::Host {
            return crate::models::deltanet::mix_on_host(self, p, x, segments);
        }
        let w = match uploaded {
            Some(w) => w,
            None => &deltanet::weights(p)?,
        };
        deltanet::mix(self, p, w, x, segments)
    }

    fn sigmoid_gate(&self, x: &Array, gate: &Array, shape: (usize, usize)) -> Result<Array> {
        let (rows, cols) = shape;
        let fits = |a: &Array| a.shape() == [rows as i32, cols as i32];
        if !fits(x) || !fits(gate) {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: format!(
                    "sigmoid_gate: {:?} and {:?} for {rows}x{cols}",
                    x.shape(),
                    gate.shape()
                ),
            });
        }
        self.stream.sigmoid_gate(x, gate).map_err(mlx_err)
    }

    fn attention(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        segments: &mut [AttentionSegment<'_, MlxKvLayer>],
        params: &AttentionParams,
    ) -> Result<Array> {
        attention::attend(&self.stream, q, k, v, segments, params, Reach::CAUSAL)
    }

    fn attention_to(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        segments: &mut [AttentionSegment<'_, MlxKvLayer>],
        params: &AttentionParams,
        ends: &[usize],
    ) -> Result<Array> {
        check_ends("attention_to", q, Some(ends))?;
        // The masked path of `attend`: the rows of an image see each other both ways.
        let reach = Reach {
            evict: true,
            ends: Some(ends),
        };
        attention::attend(&self.stream, q, k, v, segments, params, reach)
    }

    fn attention_shared(
        &self,
        q: &Array,
        new_kv: Option<(&Array, &Array)>,
        segments: &mut [AttentionSegment<'_, MlxKvLayer>],
        params: &AttentionParams,
        evict: bool,
        ends: Option<&[usize]>,
    ) -> Result<Array> {
        check_ends("attention_shared", q, ends)?;
        let reach = Reach { evict, ends };
        let s = &self.stream;
        match new_kv {
            Some((k, v)) => attention::attend(s, q, k, v, segments, params, reach),
            None => attention::attend_cached(s, q, segments, params, reach),
        }
    }

    fn tensor_from_host(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Array> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: format!("{} host values for a {rows}x{cols} tensor", data.len()),
            });
        }
        let a = Array::from_slice(&data, &[rows as i32, cols as i32]).map_err(mlx_err)?;
        self.stream.astype(&a, self.dtype).map_err(mlx_err)
    }

    fn add_rows(&self, y: &Array, rows: &[usize], d: &Array) -> Result<Array> {
        // Row r of the full delta is row pos[r] of d with a zero row appended: a gather,
        // then one add (MLX has no scatter-add the shim exposes).
        let n = y.shape().first().copied().unwrap_or(0) as usize;
        if rows.iter().any(|&r| r >= n) {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: format!("add_rows past the {n} rows of the tensor"),
            });
        }
        let s = &self.stream;
        let zero = s.zeros(&[1, Self::cols(d)], d.dtype()).map_err(mlx_err)?;
        let padded = s.concatenate(&[d, &zero], 0).map_err(mlx_err)?;
        let mut pos = vec![rows.len() as u32; n];
        for (i, &r) in rows.iter().enumerate() {
            pos[r] = i as u32;
        }
        let pos = Array::from_slice(&pos, &[n as i32]).map_err(mlx_err)?;
        let full = s.take(&padded, &pos, 0).map_err(mlx_err)?;
        s.add(y, &full).map_err(mlx_err)
    }
}

/// Writes one byte per token of `row` (1: `mask` allows it), a word at a time: a grammar's
/// mask is mostly whole words of allowed or refused tokens.
fn expand_mask(mask: &[u32], row: &mut [u8]) {
    for (w, out) in row.chunks_mut(32).enumerate() {
        match mask.get(w).copied().unwrap_or(0) {
            0 => out.fill(0),
            u32::MAX => out.fill(1),
            bits => {
                for (b, a) in out.iter_mut().enumerate() {
                    *a = ((bits >> b) & 1) as u8;
                }
            }
        }
    }
}
