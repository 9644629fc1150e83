//! Qwen 3.5 text (`qwen3_5_text`, and the text model of `qwen3_5`): a hybrid of gated
//! DeltaNet linear-attention layers ([`super::deltanet`]) and full-attention layers with an
//! output gate, per-head Q/K norms and partial rotary embeddings; `(1 + w)` RMS norms.
//!
//! The decoder runs it through [`Hybrid`]: full-attention layers keep their K/V in the
//! sequence cache's paged KV layers (so the KV pool charges them as for any model), and
//! linear-attention layers keep their state in its [`RecurrentCache`].
use std::borrow::Cow;
use std::ops::Range;

use wick_gguf::GgmlType;

use super::deltanet::DeltaParams;
use super::recurrent::RecurrentCache;
use crate::adapters::{LoraBatch, Target};
use crate::backend::capability::{Capability, Need, Part, Requirement};
use crate::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, DeltaInputs, DeltaSegment,
    DeltaTensors, HostWeight, KvLayer,
};
use crate::config::qwen35::{DeltaShape, Qwen35Config};
use crate::config::{HfKeys, ModelConfig};
use crate::models::decoder::cache::SequenceCache;
use crate::models::mlp::GateUp;
use crate::models::{llama, Arch};
use crate::weights::WeightSource;
use crate::{EngineError, Result};

/// What a Qwen 3.5 model needs of its backend beyond the core ops.
pub(crate) fn needs(cfg: &ModelConfig) -> Vec<Need> {
    vec![
        Need::new(
            Requirement::HeadDim(cfg.head_dim),
            Part::Text,
            "its full-attention layers",
        ),
        Need::op(Capability::DeltaNet, Part::Text, "its DeltaNet layers"),
        Need::op(
            Capability::SigmoidGate,
            Part::Text,
            "its full-attention layers' output gate",
        ),
        Need::op(
            Capability::RowDeltas,
            Part::Adapters,
            "a batch whose sequences use different adapters",
        ),
        Need::new(
            Requirement::NotBuilt("trimming a recurrent state"),
            Part::Speculation,
            "its DeltaNet layers",
        ),
    ]
}

pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let bad = |reason: String| EngineError::Config {
        source_name: keys.source.to_string(),
        reason,
    };
    let mut cfg = llama::base_from_hf(keys, Arch::Qwen35, 10_000_000.0, false)?;
    if keys.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(bad("attention_bias is not supported for qwen3_5".into()));
    }
    let factor = keys
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(serde_json::Value::as_f64)
        .or(keys.opt_f64("partial_rotary_factor")?)
        .unwrap_or(0.25);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(bad(format!(
            "partial_rotary_factor {factor} must be in (0, 1]"
        )));
    }
    cfg.rotary_dims = (cfg.head_dim as f64 * factor) as usize;
    cfg.norm_weight_offset = true;
    let layers = cfg.num_layers;
    let linear_layers: Vec<bool> = match keys.get("layer_types") {
        Some(serde_json::Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(bad(format!(
                    "layer_types entry {t} is not linear_attention or full_attention"
                ))),
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(bad("'layer_types' must be a list".into())),
        None => {
            let every = keys
                .opt_usize("full_attention_interval")?
                .unwrap_or(4)
                .max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if linear_layers.len() != layers {
        return Err(bad(format!(
            "{} layer_types for {layers} layers",
            linear_layers.len()
        )));
    }
    if linear_layers.iter().all(|&l| l) {
        return Err(bad(
            "a Qwen 3.5 model needs at least one full_attention layer".into(),
        ));
    }
    let dim = |key: &str, default: usize| -> Result<usize> {
        let v = keys.opt_usize(key)?.unwrap_or(default);
        if v == 0 || v > 1 << 14 {
            return Err(bad(format!("'{key}' is {v}; it must be in 1..=16384")));
        }
        Ok(v)
    };
    let delta = DeltaShape {
        k_heads: dim("linear_num_key_heads", 16)?,
        v_heads: dim("linear_num_value_heads", 32)?,
        k_dim: dim("linear_key_head_dim", 128)?,
        v_dim: dim("linear_value_head_dim", 128)?,
        conv_kernel: dim("linear_conv_kernel_dim", 4)?,
    };
    if delta.conv_kernel > 64 {
        return Err(bad(format!(
            "linear_conv_kernel_dim {} is above the supported 64",
            delta.conv_kernel
        )));
    }
    if !delta.v_heads.is_multiple_of(delta.k_heads) {
        return Err(bad(format!(
            "{} linear value heads are not a multiple of {} key heads",
            delta.v_heads, delta.k_heads
        )));
    }
    cfg.qwen35 = Some(Qwen35Config {
        linear_layers,
        delta,
    });
    Ok(cfg)
}

/// Products of one input by several matrices: one matrix of their stacked rows whose
/// output is split again where the backend prefers it ([`Backend::can_fuse`]), else one
/// product each.
enum Products<B: Backend> {
    Fused { m: B::Matrix, widths: Vec<usize> },
    Separate(Vec<B::Matrix>),
}

impl<B: Backend> Products<B> {
    fn new(be: &B, parts: Vec<B::Matrix>) -> Result<Self> {
        if be.can_fuse(&parts.iter().collect::<Vec<_>>()) {
            let widths = parts.iter().map(|m| be.matrix_shape(m).0).collect();
            return Ok(Products::Fused {
                m: be.fuse_matrices(parts)?,
                widths,
            });
        }
        Ok(Products::Separate(parts))
    }

    /// The products of `x`, in the order the matrices were given.
    fn run(&self, be: &B, x: &B::Tensor) -> Result<Vec<B::Tensor>> {
        match self {
            Products::Fused { m, widths } => be.split_columns(&be.linear(x, m, None)?, widths),
            Products::Separate(ms) => {
                let ws: Vec<_> = ms.iter().map(|m| (m, None)).collect();
                be.linear_many(x, &ws)
            }
        }
    }
}

/// Four products of one input, or the backend's error.
fn four<B: Backend>(be: &B, v: Vec<B::Tensor>) -> Result<[B::Tensor; 4]> {
    <[B::Tensor; 4]>::try_from(v).map_err(|v| EngineError::Backend {
        backend: be.name(),
        message: format!("{} products where 4 were asked for", v.len()),
    })
}

/// The token mixer of one layer.
enum Mixer<B: Backend> {
    Full {
        /// Queries, output gate, keys, values.
        proj: Products<B>,
        o: B::Matrix,
        q_norm: B::Tensor,
        k_norm: B::Tensor,
        attention: AttentionParams,
        /// Index among the cache's KV layers.
        kv: usize,
    },
    Linear {
        /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
        proj: Products<B>,
        out: B::Matrix,
        conv: Vec<f32>,
        neg_a: Vec<f32>,
        dt_bias: Vec<f32>,
        norm: Vec<f32>,
        /// The vectors above as the backend's [`Backend::delta_net`] reads them.
        uploaded: Option<DeltaTensors<B::Tensor>>,
        /// Index among the cache's recurrent layers.
        state: usize,
    },
}

struct HybridLayer<B: Backend> {
    attn_norm: B::Tensor,
    mixer: Mixer<B>,
    ffn_norm: B::Tensor,
    mlp: GateUp<B>,
    down: B::Matrix,
}

/// The layers of a Qwen 3.5 model (the decoder holds embeddings, final norm and head).
pub struct Hybrid<B: Backend> {
    layers: Vec<HybridLayer<B>>,
    delta: DeltaShape,
    full: Vec<AttentionParams>,
    linear: usize,
    eps: f32,
}

struct Loader<'a, B: Backend> {
    backend: &'a B,
    src: &'a dyn WeightSource,
    bytes: usize,
}

fn f32_weight(name: String, shape: Vec<usize>, values: &[f32]) -> HostWeight<'static> {
    HostWeight {
        name,
        dtype: GgmlType::F32,
        shape,
        bytes: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

impl<B: Backend> Loader<'_, B> {
    fn missing(&self, name: &str) -> EngineError {
        EngineError::MissingTensor {
            source_name: self.src.source_name(),
            tensor: name.into(),
        }
    }

    fn shape_error(&self, name: &str, expected: &[usize], found: &[usize]) -> EngineError {
        EngineError::ShapeMismatch {
            source_name: self.src.source_name(),
            tensor: name.into(),
            expected: expected.to_vec(),
            found: found.to_vec(),
        }
    }

    /// The values of `name` as f32, checked to hold `len` numbers in shape `shape`
    /// (dimensions of size 1 aside), dequantized if it is stored MLX-quantized.
    fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if let Some(w) = self.src.affine(name)? {
            if squeeze(&[w.rows, w.cols]) != squeeze(shape) {
                return Err(self.shape_error(name, shape, &[w.rows, w.cols]));
            }
            return w.dequantize();
        }
        let w = self.src.get(name)?.ok_or_else(|| self.missing(name))?;
        if squeeze(&w.shape) != squeeze(shape) {
            return Err(self.shape_error(name, shape, &w.shape));
        }
        w.dequantize()
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        let m = if let Some(w) = self.src.affine(name)? {
            if [w.rows, w.cols] != [rows, cols] {
                return Err(self.shape_error(name, &[rows, cols], &[w.rows, w.cols]));
            }
            self.backend.affine_matrix(w)?
        } else {
            let w = self.src.get(name)?.ok_or_else(|| self.missing(name))?;
            if w.shape != [rows, cols] {
                return Err(self.shape_error(name, &[rows, cols], &w.shape));
            }
            self.backend.matrix(w)?
        };
        self.bytes += self.backend.matrix_bytes(&m);
        Ok(m)
    }

    fn host_matrix(
        &mut self,
        name: String,
        rows: usize,
        cols: usize,
        v: &[f32],
    ) -> Result<B::Matrix> {
        let m = self.backend.matrix(f32_weight(name, vec![rows, cols], v))?;
        self.bytes += self.backend.matrix_bytes(&m);
        Ok(m)
    }

    /// The query and output-gate halves of `attn_q.weight` (per head, the query rows then
    /// the gate's), each `[heads * hd, cols]`: in the file's type (whole rows move, so GGUF
    /// quantized blocks too), or dequantized to f32 from an MLX affine matrix.
    fn query_and_gate(
        &mut self,
        name: &str,
        heads: usize,
        hd: usize,
        cols: usize,
    ) -> Result<(B::Matrix, B::Matrix)> {
        let q_dim = heads * hd;
        if self.src.affine(name)?.is_none() {
            let w = self.src.get(name)?.ok_or_else(|| self.missing(name))?;
            let row = w.dtype.bytes_for(cols as u64).map(|b| b as usize);
            let Some(row) = row.filter(|&r| w.bytes.len() == 2 * q_dim * r) else {
                return Err(self.shape_error(name, &[2 * q_dim, cols], &w.shape));
            };
            if w.shape != [2 * q_dim, cols] {
                return Err(self.shape_error(name, &[2 * q_dim, cols], &w.shape));
            }
            let (mut q, mut g) = (
                Vec::with_capacity(q_dim * row),
                Vec::with_capacity(q_dim * row),
            );
            for head in w.bytes.chunks_exact(2 * hd * row) {
                let (qh, gh) = head.split_at(hd * row);
                q.extend_from_slice(qh);
                g.extend_from_slice(gh);
            }
            let mut half = |bytes: Vec<u8>| -> Result<B::Matrix> {
                let m = self.backend.matrix(HostWeight {
                    name: name.to_string(),
                    dtype: w.dtype,
                    shape: vec![q_dim, cols],
                    bytes: Cow::Owned(bytes),
                })?;
                self.bytes += self.backend.matrix_bytes(&m);
                Ok(m)
            };
            return Ok((half(q)?, half(g)?));
        }
        let both = self.floats(name, &[2 * q_dim, cols])?;
        let (mut qw, mut gw) = (
            Vec::with_capacity(q_dim * cols),
            Vec::with_capacity(q_dim * cols),
        );
        for head in both.chunks_exact(2 * hd * cols) {
            let (qh, gh) = head.split_at(hd * cols);
            qw.extend_from_slice(qh);
            gw.extend_from_slice(gh);
        }
        Ok((
            self.host_matrix(name.to_string(), q_dim, cols, &qw)?,
            self.host_matrix(name.to_string(), q_dim, cols, &gw)?,
        ))
    }

    /// A `(1 + w)` norm weight of `len`.
    fn norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        let v: Vec<f32> = self.floats(name, &[len])?.iter().map(|w| 1.0 + w).collect();
        self.bytes += len * 4;
        self.backend.vector(f32_weight(name.into(), vec![len], &v))
    }
}

impl<B: Backend> Hybrid<B> {
    /// Loads every layer of `cfg` (which must carry a [`Qwen35Config`]).
    pub(crate) fn load(
        backend: &B,
        cfg: &ModelConfig,
        src: &dyn WeightSource,
    ) -> Result<(Self, usize)> {
        let q35 = cfg
            .qwen35
            .as_ref()
            .ok_or_else(|| EngineError::InvalidInput("not a Qwen 3.5 configuration".into()))?;
        let mut ld = Loader {
            backend,
            src,
            bytes: 0,
        };
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let sh = q35.delta;
        let (cd, vd) = (sh.conv_dim(), sh.v_heads * sh.v_dim);
        let f = cfg.intermediate_size;
        let attention = AttentionParams {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            scale: cfg.attn_scale,
            window: None,
            softcap: None,
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let (mut kv, mut state) = (0, 0);
        let mut full = Vec::new();
        for (i, &linear) in q35.linear_layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mixer = if linear {
                let l = |s: &str| n(&format!("linear_attn.{s}"));
                let conv = ld.floats(&l("conv1d.weight"), &[cd, 1, sh.conv_kernel])?;
                let a_log = ld.floats(&l("A_log"), &[sh.v_heads])?;
                let dt_bias = ld.floats(&l("dt_bias"), &[sh.v_heads])?;
                let norm = ld.floats(&l("norm.weight"), &[sh.v_dim])?;
                ld.bytes += (conv.len() + 2 * sh.v_heads + sh.v_dim) * 4;
                let neg_a: Vec<f32> = a_log.iter().map(|x| -x.exp()).collect();
                let uploaded = backend.delta_weights(&DeltaParams {
                    shape: sh,
                    conv: &conv,
                    neg_a: &neg_a,
                    dt_bias: &dt_bias,
                    norm: &norm,
                    eps: cfg.rms_eps,
                })?;
                if uploaded.is_some() {
                    ld.bytes += (conv.len() + 2 * sh.v_heads + sh.v_dim) * 4;
                }
                let parts = vec![
                    ld.matrix(&l("in_proj_qkv.weight"), cd, h)?,
                    ld.matrix(&l("in_proj_z.weight"), vd, h)?,
                    ld.matrix(&l("in_proj_b.weight"), sh.v_heads, h)?,
                    ld.matrix(&l("in_proj_a.weight"), sh.v_heads, h)?,
                ];
                let m = Mixer::Linear {
                    proj: Products::new(backend, parts)?,
                    out: ld.matrix(&l("out_proj.weight"), h, vd)?,
                    conv,
                    neg_a,
                    dt_bias,
                    norm,
                    uploaded,
                    state,
                };
                state += 1;
                m
            } else {
                // q_proj holds, per head, the query rows then the output gate's rows.
                let (q, gate) = ld.query_and_gate(&n("attn_q.weight"), cfg.num_heads, hd, h)?;
                let parts = vec![
                    q,
                    gate,
                    ld.matrix(&n("attn_k.weight"), kv_dim, h)?,
                    ld.matrix(&n("attn_v.weight"), kv_dim, h)?,
                ];
                let m = Mixer::Full {
                    proj: Products::new(backend, parts)?,
                    o: ld.matrix(&n("attn_output.weight"), h, q_dim)?,
                    q_norm: ld.norm(&n("attn_q_norm.weight"), hd)?,
                    k_norm: ld.norm(&n("attn_k_norm.weight"), hd)?,
                    attention: attention.clone(),
                    kv,
                };
                kv += 1;
                full.push(attention.clone());
                m
            };
            let attn_norm = ld.norm(&n("attn_norm.weight"), h)?;
            let ffn_norm = ld.norm(&n("ffn_norm.weight"), h)?;
            let gate = ld.matrix(&n("ffn_gate.weight"), f, h)?;
            let up = ld.matrix(&n("ffn_up.weight"), f, h)?;
            let mlp = GateUp::new(backend, gate, up, f)?;
            layers.push(HybridLayer {
                attn_norm,
                mixer,
                ffn_norm,
                mlp,
                down: ld.matrix(&n("ffn_down.weight"), h, f)?,
            });
        }
        let bytes = ld.bytes;
        Ok((
            Hybrid {
                layers,
                delta: sh,
                full,
                linear: state,
                eps: cfg.rms_eps,
            },
            bytes,
        ))
    }

    /// Attention shapes of the full-attention layers, in order (the cache's KV layers).
    pub(crate) fn kv_layers(&self) -> &[AttentionParams] {
        &self.full
    }

    /// Shapes of the linear-attention layers, in order (the cache's recurrent layers).
    pub(crate) fn delta_shapes(&self) -> Vec<DeltaShape> {
        vec![self.delta; self.linear]
    }

    /// An empty recurrent cache on `be`.
    pub(crate) fn new_recurrent(&self, be: &B) -> RecurrentCache<B::DeltaState> {
        RecurrentCache {
            len: 0,
            layers: (0..self.linear)
                .map(|_| be.new_delta_state(&self.delta))
                .collect(),
        }
    }

    /// Runs the layers over `x` (the embedded new tokens of every sequence, rows
    /// `ranges[i]` for `caches[i]`), appending to each cache; returns the residual stream
    /// after the last layer. `lora` adds the adapters' deltas beside every projection.
    pub(crate) fn run_layers(
        &self,
        be: &B,
        x: B::Tensor,
        caches: &mut [&mut SequenceCache<B>],
        ranges: &[Range<usize>],
        rope: &B::Rope,
        lora: &LoraBatch<'_, B>,
    ) -> Result<B::Tensor> {
        let counts: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
        for cache in caches.iter() {
            match cache.recurrent() {
                Some(r) if r.len == cache.len() && r.layers.len() == self.linear => {}
                _ => return Err(EngineError::Cache("cache belongs to another model".into())),
            }
        }
        let x = self.run_span(be, x, caches, ranges, rope, lora, 0..self.layers.len())?;
        for (cache, n) in caches.iter_mut().zip(&counts) {
            if let Some(r) = cache.recurrent_mut() {
                r.len += n;
            }
        }
        Ok(x)
    }

    /// Empties what layers `span` keep in `cache` (their keys and values, their recurrent
    /// states), so that a span run again (a checkpointed layer recomputed in a training
    /// backward) starts where it did the first time: a training pass's empty cache.
    pub(crate) fn reset_span(
        &self,
        be: &B,
        cache: &mut SequenceCache<B>,
        span: Range<usize>,
    ) -> Result<()> {
        for layer in self.layers.get(span).unwrap_or_default() {
            match &layer.mixer {
                Mixer::Full { kv, .. } => {
                    if let Some(l) = cache.layers_mut().get_mut(*kv) {
                        l.trim(0)?;
                    }
                }
                Mixer::Linear { state, .. } => {
                    if let Some(st) = cache
                        .recurrent_mut()
                        .and_then(|rc| rc.layers.get_mut(*state))
                    {
                        *st = be.new_delta_state(&self.delta);
                    }
                }
            }
        }
        Ok(())
    }

    /// Layers `span` over `x` (see [`Hybrid::run_layers`]), the caches' token counts left
    /// as they are.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_span(
        &self,
        be: &B,
        mut x: B::Tensor,
        caches: &mut [&mut SequenceCache<B>],
        ranges: &[Range<usize>],
        rope: &B::Rope,
        lora: &LoraBatch<'_, B>,
        span: Range<usize>,
    ) -> Result<B::Tensor> {
        let eps = self.eps;
        let total: usize = ranges.iter().map(|r| r.len()).sum();
        let layers = crate::models::layer_span(&self.layers, &span)?;
        // A layer's last residual add also makes the next layer's input norm.
        let mut normed_input: Option<B::Tensor> = None;
        for (i, (li, layer)) in span.zip(layers).enumerate() {
            let h = match normed_input.take() {
                Some(h) => h,
                None => be.rms_norm(&x, &layer.attn_norm, eps)?,
            };
            let o = match &layer.mixer {
                Mixer::Full {
                    proj,
                    o,
                    q_norm,
                    k_norm,
                    attention,
                    kv,
                } => {
                    let [qt, gt, kt, vt] = lora.apply_many(
                        be,
                        li,
                        [Target::Q, Target::QGate, Target::K, Target::V],
                        &h,
                        four(be, proj.run(be, &h)?)?,
                    )?;
                    let heads = be.norm_rope_qkv(
                        (&qt, q_norm),
                        Some((&kt, k_norm)),
                        None,
                        attention.heads,
                        attention.kv_heads,
                        rope,
                        eps,
                    )?;
                    let qt = heads.q;
                    let kt = heads.k.ok_or_else(|| EngineError::Backend {
                        backend: be.name(),
                        message: "norm_rope_qkv returned no keys".into(),
                    })?;
                    let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = caches
                        .iter_mut()
                        .zip(ranges)
                        .map(|(cache, r)| AttentionSegment {
                            rows: r.clone(),
                            cache: &mut cache.layers_mut()[*kv],
                        })
                        .collect();
                    let attn = be.attention(&qt, &kt, &vt, &mut segments, attention)?;
                    let cols = attention.heads * attention.head_dim;
                    let gated = be.sigmoid_gate(&attn, &gt, (total, cols))?;
                    lora.apply(be, li, Target::O, &gated, be.linear(&gated, o, None)?)?
                }
                Mixer::Linear {
                    proj,
                    out,
                    conv,
                    neg_a,
                    dt_bias,
                    norm,
                    uploaded,
                    state,
                } => {
                    let [qkv, z, b, a] = lora.apply_many(
                        be,
                        li,
                        [
                            Target::DeltaQkv,
                            Target::DeltaZ,
                            Target::DeltaB,
                            Target::DeltaA,
                        ],
                        &h,
                        four(be, proj.run(be, &h)?)?,
                    )?;
                    let params = DeltaParams {
                        shape: self.delta,
                        conv,
                        neg_a,
                        dt_bias,
                        norm,
                        eps,
                    };
                    let mut segments = caches
                        .iter_mut()
                        .zip(ranges)
                        .map(|(cache, r)| {
                            let st = cache
                                .recurrent_mut()
                                .and_then(|rc| rc.layers.get_mut(*state))
                                .ok_or_else(|| {
                                    EngineError::Cache("cache belongs to another model".into())
                                })?;
                            Ok(DeltaSegment {
                                rows: r.clone(),
                                state: st,
                            })
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let inputs = DeltaInputs {
                        qkv: &qkv,
                        z: &z,
                        b: &b,
                        a: &a,
                    };
                    let mixed = be.delta_net(&params, uploaded.as_ref(), inputs, &mut segments)?;
                    let o = be.linear(&mixed, out, None)?;
                    lora.apply(be, li, Target::DeltaOut, &mixed, o)?
                }
            };
            let (sum, hf) = be.add_rms_norm(&x, &o, &layer.ffn_norm, eps)?;
            let act = layer.mlp.apply(be, lora, li, &hf, Activation::Silu)?;
            let m = be.linear(&act, &layer.down, None)?;
            let m = lora.apply(be, li, Target::Down, &act, m)?;
            match layers.get(i + 1) {
                Some(next) => {
                    let (sum, h) = be.add_rms_norm(&sum, &m, &next.attn_norm, eps)?;
                    x = sum;
                    normed_input = Some(h);
                }
                None => x = be.add(&sum, &m)?,
            }
        }
        Ok(x)
    }
}

/// The KV layers and the recurrent states of a hybrid cache.
pub(crate) type CacheParts<B> = (
    Vec<<B as Backend>::KvLayer>,
    RecurrentCache<<B as Backend>::DeltaState>,
);

/// The KV layers and recurrent states of a hybrid cache rebuilt from host copies, checked
/// against the model's layout.
pub(crate) fn cache_from_snapshots<B: Backend>(
    backend: &B,
    hybrid: &Hybrid<B>,
    layers: &[crate::backend::KvLayerSnapshot],
    recurrent: Option<&super::recurrent::RecurrentSnapshot>,
) -> Result<CacheParts<B>> {
    let recurrent = recurrent.ok_or_else(|| {
        EngineError::Cache("snapshot has no recurrent states; the model needs them".into())
    })?;
    let kv = hybrid.kv_layers();
    if layers.len() != kv.len() {
        return Err(EngineError::Cache(format!(
            "snapshot has {} attention layers, model has {}",
            layers.len(),
            kv.len()
        )));
    }
    for (s, a) in layers.iter().zip(kv) {
        if s.kv_heads != a.kv_heads || s.head_dim != a.head_dim || s.window != a.window {
            return Err(EngineError::Cache(
                "snapshot layout does not match the model".into(),
            ));
        }
        if s.len != recurrent.len {
            return Err(EngineError::Cache(format!(
                "snapshot's attention layers hold {} tokens, its recurrent states {}",
                s.len, recurrent.len
            )));
        }
    }
    let host = RecurrentCache::from_snapshot(recurrent, &hybrid.delta_shapes())?;
    let states = RecurrentCache {
        len: host.len,
        layers: host
            .layers
            .into_iter()
            .map(|s| backend.delta_state_from_host(s))
            .collect::<Result<_>>()?,
    };
    let layers = layers
        .iter()
        .map(|s| backend.kv_layer_from_snapshot(s))
        .collect::<Result<_>>()?;
    Ok((layers, states))
}
