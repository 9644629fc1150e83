//! The dense layer stack: one flat loop of attention and MLP blocks whose switches
//! (biases, Q/K norms, sandwich norms, LayerNorm, ungated MLP, multipliers, sliding windows,
//! NoPE layers) come from [`ModelConfig`]. Every family but Gemma 4 and Qwen 3.5 runs it.
use std::borrow::Cow;
use std::ops::Range;

use wick_gguf::GgmlType;

use super::cache::SequenceCache;
use super::loader::{Loader, Norm};
use crate::adapters::{LoraBatch, Target};
use crate::backend::capability::{Capability, Need, Part, Requirement};
use crate::backend::{AttentionParams, AttentionSegment, Backend, HostWeight};
use crate::config::{MlpKind, ModelConfig, NormKind};
use crate::{EngineError, Result};

/// What a dense model needs of its backend beyond the core ops.
pub(crate) fn needs(cfg: &ModelConfig) -> Vec<Need> {
    let scaled_rope = std::iter::once(&cfg.rope)
        .chain(&cfg.rope_local)
        .any(|r| r.spec(cfg.rope_style, cfg.rotary_dims).attention_factor != 1.0);
    let mut needs = vec![Need::new(
        Requirement::HeadDim(cfg.head_dim),
        Part::Text,
        "its attention",
    )];
    if cfg.features.norm == NormKind::Layer {
        needs.push(Need::op(Capability::LayerNorm, Part::Text, "its norms"));
    }
    if cfg.features.mlp == MlpKind::Plain {
        needs.push(Need::op(
            Capability::Activation,
            Part::Text,
            "its ungated MLP",
        ));
    }
    if scaled_rope {
        needs.push(Need::op(
            Capability::RopeAttentionFactor,
            Part::Text,
            "its long-context rotary scaling",
        ));
    }
    needs.push(Need::op(
        Capability::RowDeltas,
        Part::Adapters,
        "a batch whose sequences use different adapters",
    ));
    needs.push(Need::op(
        Capability::Speculation,
        Part::Speculation,
        "verifying drafts",
    ));
    if cfg.layer_windows.iter().any(Option::is_some) {
        needs.push(Need::new(
            Requirement::NotBuilt("trimming rejected drafts off a sliding-window cache"),
            Part::Speculation,
            "its sliding-window layers",
        ));
    }
    needs
}

/// The attention's input projections: three products, or one over stacked rows where
/// the backend prefers that ([`Backend::can_fuse`]).
enum QkvProjection<B: Backend> {
    Separate {
        q: B::Matrix,
        k: B::Matrix,
        v: B::Matrix,
        q_bias: Option<B::Tensor>,
        k_bias: Option<B::Tensor>,
        v_bias: Option<B::Tensor>,
    },
    Fused {
        qkv: B::Matrix,
        bias: Option<B::Tensor>,
        widths: [usize; 3],
    },
}

/// The MLP's gate and up projections, separate or fused like [`QkvProjection`], or the
/// single input projection of an ungated MLP.
enum GateUpProjection<B: Backend> {
    Separate {
        gate: B::Matrix,
        up: B::Matrix,
    },
    Fused {
        gate_up: B::Matrix,
        width: usize,
    },
    Plain {
        up: B::Matrix,
        bias: Option<B::Tensor>,
    },
}

/// One dense layer.
struct Layer<B: Backend> {
    attn_norm: Option<Norm<B>>,
    qkv: QkvProjection<B>,
    o: B::Matrix,
    o_bias: Option<B::Tensor>,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    post_attn_norm: Option<Norm<B>>,
    ffn_norm: Option<Norm<B>>,
    gate_up: GateUpProjection<B>,
    down: B::Matrix,
    down_bias: Option<B::Tensor>,
    post_ffw_norm: Option<Norm<B>>,
    attention: AttentionParams,
    local_rope: bool,
    use_rope: bool,
}

/// The rotary tables of a dense or hybrid pass: the global one and, for models with a
/// second base on their sliding layers, the local one.
pub(crate) struct Ropes<B: Backend> {
    pub(crate) global: B::Rope,
    pub(crate) local: Option<B::Rope>,
}

/// The layers of a dense model.
pub(crate) struct DenseLayers<B: Backend> {
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Loader<'_, B> {
    /// Layer `i`'s Q/K/V projections, fused when the backend prefers one product (the
    /// biases, if any, then joined on the host).
    fn qkv(&mut self, i: usize, q_dim: usize, kv_dim: usize) -> Result<QkvProjection<B>> {
        let h = self.cfg.hidden_size;
        let n = |s: &str| format!("blk.{i}.{s}");
        if self.src.contains(&n("attn_qkv.weight")) {
            // Stored fused (Phi-3): one product, split after it.
            return Ok(QkvProjection::Fused {
                qkv: self.matrix(&n("attn_qkv.weight"), q_dim + 2 * kv_dim, h)?,
                bias: self.vector(&n("attn_qkv.bias"), q_dim + 2 * kv_dim)?,
                widths: [q_dim, kv_dim, kv_dim],
            });
        }
        let q = self.matrix(&n("attn_q.weight"), q_dim, h)?;
        let k = self.matrix(&n("attn_k.weight"), kv_dim, h)?;
        let v = self.matrix(&n("attn_v.weight"), kv_dim, h)?;
        let bias_names = [
            (n("attn_q.bias"), q_dim),
            (n("attn_k.bias"), kv_dim),
            (n("attn_v.bias"), kv_dim),
        ];
        if self.backend.can_fuse(&[&q, &k, &v]) {
            let qkv = self.backend.fuse_matrices(vec![q, k, v])?;
            return Ok(QkvProjection::Fused {
                qkv,
                bias: self.joined_vector(&bias_names)?,
                widths: [q_dim, kv_dim, kv_dim],
            });
        }
        let [(qb, ql), (kb, kl), (vb, vl)] = &bias_names;
        Ok(QkvProjection::Separate {
            q,
            k,
            v,
            q_bias: self.vector(qb, *ql)?,
            k_bias: self.vector(kb, *kl)?,
            v_bias: self.vector(vb, *vl)?,
        })
    }

    /// Layer `i`'s gate and up projections, fused when the backend prefers it.
    fn gate_up(&mut self, i: usize) -> Result<GateUpProjection<B>> {
        let (h, f) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        if self.cfg.features.mlp == MlpKind::Plain {
            return Ok(GateUpProjection::Plain {
                up: self.matrix(&format!("blk.{i}.ffn_up.weight"), f, h)?,
                bias: self.vector(&format!("blk.{i}.ffn_up.bias"), f)?,
            });
        }
        let fused = format!("blk.{i}.ffn_gate_up.weight");
        if self.src.contains(&fused) {
            // Stored fused (Phi-3, GLM-4): gate rows first, then up.
            let gate_up = self.matrix(&fused, 2 * f, h)?;
            return Ok(GateUpProjection::Fused { gate_up, width: f });
        }
        let gate = self.matrix(&format!("blk.{i}.ffn_gate.weight"), f, h)?;
        let up = self.matrix(&format!("blk.{i}.ffn_up.weight"), f, h)?;
        if self.backend.can_fuse(&[&gate, &up]) {
            let gate_up = self.backend.fuse_matrices(vec![gate, up])?;
            return Ok(GateUpProjection::Fused { gate_up, width: f });
        }
        Ok(GateUpProjection::Separate { gate, up })
    }

    /// The 1-D weights `names` end to end (zeros for absent ones), or `None` when none
    /// of them exists.
    fn joined_vector(&mut self, names: &[(String, usize)]) -> Result<Option<B::Tensor>> {
        let mut values = Vec::new();
        let mut any = false;
        for (name, len) in names {
            match self.src.get(name)? {
                Some(w) => {
                    self.check(&w, &[*len])?;
                    values.extend(w.float_values("norm weight")?);
                    any = true;
                }
                None => values.extend(std::iter::repeat_n(0.0f32, *len)),
            }
        }
        if !any {
            return Ok(None);
        }
        self.bytes += values.len() * 4;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let w = HostWeight {
            name: names.first().map(|(n, _)| n.clone()).unwrap_or_default(),
            dtype: GgmlType::F32,
            shape: vec![values.len()],
            bytes: Cow::Owned(bytes),
        };
        Ok(Some(self.backend.vector(w)?))
    }
}

impl<B: Backend> DenseLayers<B> {
    /// Loads `cfg.num_layers` layers through `ld`.
    pub(crate) fn load(ld: &mut Loader<'_, B>, cfg: &ModelConfig) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let pre = cfg.features.pre_norms;
        let (q_norm_len, k_norm_len) = if cfg.features.qk_norm_full {
            (q_dim, kv_dim)
        } else {
            (hd, hd)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let window = cfg.layer_windows[i];
            layers.push(Layer {
                attn_norm: pre.then(|| ld.full_norm(&n("attn_norm"), h)).transpose()?,
                qkv: ld.qkv(i, q_dim, kv_dim)?,
                o: ld.matrix(&n("attn_output.weight"), h, q_dim)?,
                o_bias: ld.vector(&n("attn_output.bias"), h)?,
                q_norm: ld.norm(&n("attn_q_norm.weight"), q_norm_len)?,
                k_norm: ld.norm(&n("attn_k_norm.weight"), k_norm_len)?,
                post_attn_norm: if cfg.sandwich_norms {
                    Some(ld.full_norm(&n("post_attention_norm"), h)?)
                } else {
                    None
                },
                ffn_norm: pre.then(|| ld.full_norm(&n("ffn_norm"), h)).transpose()?,
                gate_up: ld.gate_up(i)?,
                down: ld.matrix(&n("ffn_down.weight"), h, cfg.intermediate_size)?,
                down_bias: ld.vector(&n("ffn_down.bias"), h)?,
                post_ffw_norm: if cfg.sandwich_norms {
                    Some(ld.full_norm(&n("post_ffw_norm"), h)?)
                } else {
                    None
                },
                attention: AttentionParams {
                    heads: cfg.num_heads,
                    kv_heads: cfg.num_kv_heads,
                    head_dim: hd,
                    scale: cfg.attn_scale,
                    window,
                    softcap: cfg.attn_softcap,
                },
                local_rope: window.is_some() && cfg.rope_local.is_some(),
                use_rope: cfg.features.rope_layers.get(i).copied().unwrap_or(true),
            });
        }
        Ok(DenseLayers { layers })
    }

    /// `(kv_heads, head_dim, window)` of each layer cache of a sequence.
    pub(crate) fn len(&self) -> usize {
        self.layers.len()
    }

    pub(crate) fn cache_layout(&self) -> Vec<(usize, usize, Option<usize>)> {
        self.layers
            .iter()
            .map(|l| {
                let a = &l.attention;
                (a.kv_heads, a.head_dim, a.window)
            })
            .collect()
    }

    /// Runs the layers over `x` (rows `ranges[i]` for `caches[i]`), appending to each
    /// cache; returns the residual stream after the last layer. With `media_ends`, row `i`
    /// attends to the keys before `media_ends[i]` ([`Backend::attention_to`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        be: &B,
        cfg: &ModelConfig,
        ropes: &Ropes<B>,
        mut x: B::Tensor,
        caches: &mut [&mut SequenceCache<B>],
        ranges: &[Range<usize>],
        media_ends: Option<&[usize]>,
        lora: &LoraBatch<'_, B>,
        span: Range<usize>,
    ) -> Result<B::Tensor> {
        let residual = cfg.features.residual_multiplier;
        let layers = crate::models::layer_span(&self.layers, &span)?;
        let mut h = match layers.first().and_then(|l| l.attn_norm.as_ref()) {
            Some(norm) => norm.apply(be, cfg, &x)?,
            None => x.clone(),
        };
        for (li, layer) in layers.iter().enumerate().map(|(i, l)| (span.start + i, l)) {
            let table = match (&ropes.local, layer.local_rope) {
                (Some(local), true) => local,
                _ => &ropes.global,
            };
            // Without adapters or q/k norms between them, the split of a fused product and
            // the rotary embeddings are one op (one pass on the GPU).
            let fused_rope = lora.is_empty()
                && layer.use_rope
                && layer.q_norm.is_none()
                && layer.k_norm.is_none();
            let mut rotated = false;
            let (q, k, v) = match &layer.qkv {
                QkvProjection::Separate {
                    q,
                    k,
                    v,
                    q_bias,
                    k_bias,
                    v_bias,
                } => {
                    let [q, k, v] = three(be.linear_many(
                        &h,
                        &[
                            (q, q_bias.as_ref()),
                            (k, k_bias.as_ref()),
                            (v, v_bias.as_ref()),
                        ],
                    )?)?;
                    (q, k, v)
                }
                QkvProjection::Fused { qkv, bias, widths } if fused_rope => {
                    let all = be.linear(&h, qkv, bias.as_ref())?;
                    rotated = true;
                    be.split_rope_qkv(
                        &all,
                        widths,
                        layer.attention.heads,
                        layer.attention.kv_heads,
                        table,
                    )?
                }
                QkvProjection::Fused { qkv, bias, widths } => {
                    let all = be.linear(&h, qkv, bias.as_ref())?;
                    let mut parts = be.split_columns(&all, widths)?.into_iter();
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(q), Some(k), Some(v)) => (q, k, v),
                        _ => {
                            return Err(EngineError::Backend {
                                backend: be.name(),
                                message: "split_columns returned too few parts".into(),
                            })
                        }
                    }
                }
            };
            let [mut q, mut k, v] = if lora.is_empty() {
                [q, k, v]
            } else {
                lora.apply_many(be, li, [Target::Q, Target::K, Target::V], &h, [q, k, v])?
            };
            match (&layer.q_norm, &layer.k_norm) {
                // Per-head q/k norms and the rotation (Qwen 3, Gemma 3): one launch on a GPU.
                (Some(qw), Some(kw)) if layer.use_rope && !rotated => {
                    let heads = be.norm_rope_qkv(
                        (&q, qw),
                        Some((&k, kw)),
                        None,
                        layer.attention.heads,
                        layer.attention.kv_heads,
                        table,
                        cfg.rms_eps,
                    )?;
                    q = heads.q;
                    k = heads.k.ok_or_else(|| EngineError::Backend {
                        backend: be.name(),
                        message: "norm_rope_qkv returned no keys".into(),
                    })?;
                    rotated = true;
                }
                (q_norm, k_norm) => {
                    if let Some(w) = q_norm {
                        q = be.rms_norm(&q, w, cfg.rms_eps)?;
                    }
                    if let Some(w) = k_norm {
                        k = be.rms_norm(&k, w, cfg.rms_eps)?;
                    }
                }
            }
            if layer.use_rope && !rotated {
                (q, k) = be.rope_qk(
                    &q,
                    layer.attention.heads,
                    &k,
                    layer.attention.kv_heads,
                    table,
                )?;
            }
            let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = caches
                .iter_mut()
                .zip(ranges)
                .map(|(cache, r)| AttentionSegment {
                    rows: r.clone(),
                    cache: &mut cache.layers[li],
                })
                .collect();
            let attn = match media_ends {
                Some(ends) => be.attention_to(&q, &k, &v, &mut segments, &layer.attention, ends)?,
                None => be.attention(&q, &k, &v, &mut segments, &layer.attention)?,
            };
            let mut o = be.linear(&attn, &layer.o, layer.o_bias.as_ref())?;
            o = lora.apply(be, li, Target::O, &attn, o)?;
            let (sum, hf) = post_norm_add(
                be,
                cfg,
                &x,
                o,
                layer.post_attn_norm.as_ref(),
                layer.ffn_norm.as_ref(),
            )?;
            x = sum;
            let act = match &layer.gate_up {
                GateUpProjection::Separate { gate, up } => {
                    let [gate, up] = two(be.linear_many(&hf, &[(gate, None), (up, None)])?)?;
                    let [gate, up] =
                        lora.apply_many(be, li, [Target::Gate, Target::Up], &hf, [gate, up])?;
                    be.glu(&gate, &up, cfg.activation)?
                }
                GateUpProjection::Plain { up, bias } => {
                    let up_out = be.linear(&hf, up, bias.as_ref())?;
                    let up_out = lora.apply(be, li, Target::Up, &hf, up_out)?;
                    be.activation(&up_out, cfg.activation)?
                }
                GateUpProjection::Fused { gate_up, width } if lora.is_empty() => {
                    be.linear_glu(&hf, gate_up, *width, cfg.activation)?
                }
                GateUpProjection::Fused { gate_up, width } => {
                    // Adapters add to the gate and up outputs, so they need them apart.
                    let both = be.linear(&hf, gate_up, None)?;
                    match be.split_columns(&both, &[*width, *width])?.as_slice() {
                        [gate, up] => {
                            let [gate, up] = lora.apply_many(
                                be,
                                li,
                                [Target::Gate, Target::Up],
                                &hf,
                                [gate.clone(), up.clone()],
                            )?;
                            be.glu(&gate, &up, cfg.activation)?
                        }
                        _ => {
                            return Err(EngineError::Backend {
                                backend: be.name(),
                                message: "split_columns returned too few parts".into(),
                            })
                        }
                    }
                }
            };
            let mut m = be.linear(&act, &layer.down, layer.down_bias.as_ref())?;
            m = lora.apply(be, li, Target::Down, &act, m)?;
            // The span's last layer leaves the sum: a span that follows normalizes it
            // itself (the same values as the fused add-and-norm).
            match layers.get(li + 1 - span.start) {
                Some(next) => {
                    let (sum, hn) = post_norm_add(
                        be,
                        cfg,
                        &x,
                        m,
                        layer.post_ffw_norm.as_ref(),
                        next.attn_norm.as_ref(),
                    )?;
                    x = sum;
                    h = hn;
                }
                None => {
                    if let Some(w) = &layer.post_ffw_norm {
                        m = w.apply(be, cfg, &m)?;
                    }
                    if let Some(r) = residual {
                        m = be.scale(&m, r)?;
                    }
                    x = be.add(&x, &m)?;
                }
            }
        }
        Ok(x)
    }
}

/// A sublayer's output `y` joining the residual stream `x` — through its post-norm where it
/// has one (Gemma 2/3's sandwich norms) and scaled by the residual multiplier where the
/// model has one — and the next sublayer's input norm of the sum: `(sum, norm(sum))`.
fn post_norm_add<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    x: &B::Tensor,
    mut y: B::Tensor,
    post: Option<&Norm<B>>,
    next: Option<&Norm<B>>,
) -> Result<(B::Tensor, B::Tensor)> {
    let residual = cfg.features.residual_multiplier;
    if let (Some(post), Some(next), NormKind::Rms, None) = (post, next, cfg.features.norm, residual)
    {
        // One launch on a GPU.
        let (sum, normed) =
            be.add_post_norm(x, &y, &post.weight, cfg.rms_eps, 1.0, Some(&next.weight))?;
        let normed = normed.ok_or_else(|| EngineError::Backend {
            backend: be.name(),
            message: "add_post_norm returned no norm".into(),
        })?;
        return Ok((sum, normed));
    }
    if let Some(w) = post {
        y = w.apply(be, cfg, &y)?;
    }
    if let Some(r) = residual {
        y = be.scale(&y, r)?;
    }
    add_norm(be, cfg, x, &y, next)
}

/// `(x + y, norm(x + y))`, the sum itself where the next sublayer has no input norm.
fn add_norm<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    x: &B::Tensor,
    y: &B::Tensor,
    n: Option<&Norm<B>>,
) -> Result<(B::Tensor, B::Tensor)> {
    match (n, cfg.features.norm) {
        (Some(n), NormKind::Rms) => be.add_rms_norm(x, y, &n.weight, cfg.rms_eps),
        (Some(n), NormKind::Layer) => {
            let sum = be.add(x, y)?;
            let normed = n.apply(be, cfg, &sum)?;
            Ok((sum, normed))
        }
        (None, _) => {
            let sum = be.add(x, y)?;
            Ok((sum.clone(), sum))
        }
    }
}

fn three<T>(v: Vec<T>) -> Result<[T; 3]> {
    <[T; 3]>::try_from(v).map_err(|v| {
        EngineError::InvalidInput(format!("backend returned {} products for 3", v.len()))
    })
}

fn two<T>(v: Vec<T>) -> Result<[T; 2]> {
    <[T; 2]>::try_from(v).map_err(|v| {
        EngineError::InvalidInput(format!("backend returned {} products for 2", v.len()))
    })
}
