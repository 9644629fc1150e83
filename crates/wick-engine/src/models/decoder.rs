//! The decoder-only transformer every supported architecture runs, generic over the
//! compute backend, with a forward pass over a flattened batch of sequences.
use std::borrow::Cow;
use std::ops::Range;

use wick_gguf::GgmlType;

use crate::adapters::{LoraBatch, LoraWeights, Target};
use crate::backend::{
    AttentionParams, AttentionSegment, Backend, HostWeight, KvLayer, KvLayerSnapshot, OptionalOp,
    RopeSpec,
};
use crate::config::{MlpKind, ModelConfig, NormKind};
use crate::models::audio::gemma4::Gemma4Audio;
use crate::models::qwen35::Hybrid;
use crate::models::recurrent::{RecurrentCache, RecurrentSnapshot};
use crate::models::vision::qwen::QwenVision;
use crate::models::vision::siglip::Gemma3Vision;
use crate::models::vision::{ImageRows, PassMedia};
use crate::weights::WeightSource;
use crate::{EngineError, Result};

/// Which positions of a sequence need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRequest {
    /// None (a non-final prefill chunk).
    None,
    /// The last position only (generation).
    Last,
    /// Every position (scoring, teacher forcing, speculative verification).
    All,
}

/// Where the new tokens of a forward pass come from.
pub(super) enum Input<'a, B: Backend> {
    /// Ids on the host, flattened over the batch.
    Host(&'a [u32]),
    /// One id per sequence, held by the backend.
    Backend(&'a B::Ids),
}

/// One sequence's part of a batched forward pass.
pub struct BatchItem<'a, B: Backend> {
    /// New tokens, appended after what the cache holds.
    pub tokens: &'a [u32],
    /// The sequence's cache; grows by `tokens.len()`.
    pub cache: &'a mut SequenceCache<B>,
    /// Which logits to return.
    pub logits: LogitsRequest,
}

/// Logits for some positions of one sequence, row-major `[rows][vocab]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    /// Rows returned.
    pub rows: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// The values.
    pub data: Vec<f32>,
}

impl Logits {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.rows.saturating_sub(1))
    }

    /// The last row, to rewrite.
    pub fn last_mut(&mut self) -> &mut [f32] {
        let i = self.rows.saturating_sub(1);
        &mut self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// The KV cache of one sequence: one backend cache per layer.
pub struct SequenceCache<B: Backend> {
    layers: Vec<B::KvLayer>,
    /// The recurrent states of a hybrid model's linear-attention layers (Qwen 3.5);
    /// `layers` then holds its full-attention layers only.
    recurrent: Option<RecurrentCache>,
    /// The projected rows of the sequence's images, placed by the passes that reach them.
    images: Vec<ImageRows>,
}

impl<B: Backend> Clone for SequenceCache<B> {
    fn clone(&self) -> Self {
        SequenceCache {
            layers: self.layers.clone(),
            recurrent: self.recurrent.clone(),
            images: self.images.clone(),
        }
    }
}

impl<B: Backend> SequenceCache<B> {
    /// Tokens the cache holds (the next position).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the cache can be cut back to `len` tokens.
    pub fn can_trim_to(&self, len: usize) -> bool {
        self.layers.iter().all(|l| l.can_trim_to(len))
            && self.recurrent.as_ref().is_none_or(|r| r.can_trim_to(len))
    }

    /// Forgets everything from position `len` on.
    pub fn trim(&mut self, len: usize) -> Result<()> {
        if !self.can_trim_to(len) {
            return Err(EngineError::Cache(format!(
                "cannot trim {} cached tokens to {len}",
                self.len()
            )));
        }
        self.layers.iter_mut().try_for_each(|l| l.trim(len))
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        self.layers.iter().map(|l| l.byte_size()).sum::<usize>()
            + self.recurrent.as_ref().map_or(0, RecurrentCache::byte_size)
    }

    /// Host copies of every layer.
    pub fn snapshot(&self) -> Vec<KvLayerSnapshot> {
        self.layers.iter().map(|l| l.snapshot()).collect()
    }

    /// The recurrent states, for a hybrid model.
    pub fn recurrent(&self) -> Option<&RecurrentCache> {
        self.recurrent.as_ref()
    }

    /// The recurrent states, mutably.
    pub fn recurrent_mut(&mut self) -> Option<&mut RecurrentCache> {
        self.recurrent.as_mut()
    }

    /// The sequence's images (their projected rows and prompt positions).
    pub fn images(&self) -> &[ImageRows] {
        &self.images
    }

    /// Sets the sequence's images (see [`Decoder::embed_images`]).
    pub fn set_images(&mut self, images: Vec<ImageRows>) {
        self.images = images;
    }

    /// The per-layer caches (for backend bookkeeping such as KV block leases).
    pub fn layers(&self) -> &[B::KvLayer] {
        &self.layers
    }

    /// The per-layer caches, mutably.
    pub fn layers_mut(&mut self) -> &mut [B::KvLayer] {
        &mut self.layers
    }
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

/// A norm's scale, and its bias where a LayerNorm has one.
struct Norm<B: Backend> {
    weight: B::Tensor,
    bias: Option<B::Tensor>,
}

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

/// A loaded decoder-only transformer.
pub struct Decoder<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed: B::Matrix,
    output: Option<B::Matrix>,
    norm: Norm<B>,
    layers: Vec<Layer<B>>,
    rope: RopeSpec,
    rope_local: Option<RopeSpec>,
    weight_bytes: usize,
    /// Gemma 4's layers, which run their own forward pass ([`super::gemma4`]).
    gemma4: Option<super::gemma4::Gemma4Model<B>>,
    /// The layers of a hybrid model (Qwen 3.5), which then has no plain `layers`.
    hybrid: Option<Hybrid<B>>,
    /// The vision tower, when the checkpoint has one and the backend can run it.
    vision: Option<Gemma3Vision<B>>,
    /// The audio tower (runs on the host), when the checkpoint has one.
    audio: Option<Gemma4Audio>,
    /// Qwen 3.5's vision tower, likewise.
    qwen_vision: Option<QwenVision<B>>,
}

pub(super) struct Loader<'a, B: Backend> {
    pub(super) backend: &'a B,
    pub(super) src: &'a dyn WeightSource,
    cfg: &'a ModelConfig,
    pub(super) bytes: usize,
}

impl<B: Backend> Loader<'_, B> {
    pub(super) fn required(&self, name: &str) -> Result<HostWeight<'_>> {
        self.src
            .get(name)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    pub(super) fn check(&self, w: &HostWeight<'_>, expected: &[usize]) -> Result<()> {
        if w.shape != expected {
            return Err(EngineError::ShapeMismatch {
                source_name: self.src.source_name(),
                tensor: w.name.clone(),
                expected: expected.to_vec(),
                found: w.shape.clone(),
            });
        }
        Ok(())
    }

    pub(super) fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        if let Some(w) = self.src.affine(name)? {
            if [w.rows, w.cols] != [rows, cols] {
                return Err(EngineError::ShapeMismatch {
                    source_name: self.src.source_name(),
                    tensor: w.name.clone(),
                    expected: vec![rows, cols],
                    found: vec![w.rows, w.cols],
                });
            }
            let m = self.backend.affine_matrix(w)?;
            self.bytes += self.backend.matrix_bytes(&m);
            return Ok(m);
        }
        let w = self.required(name)?;
        self.check(&w, &[rows, cols])?;
        let m = self.backend.matrix(w)?;
        self.bytes += self.backend.matrix_bytes(&m);
        Ok(m)
    }

    /// The 1-D weight `name`, which must exist.
    pub(super) fn required_vector(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.vector(name, len)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        let Some(w) = self.src.get(name)? else {
            return Ok(None);
        };
        self.check(&w, &[len])?;
        self.bytes += len * 4;
        Ok(Some(self.backend.vector(w)?))
    }

    fn norm(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        let Some(w) = self.src.get(name)? else {
            return Ok(None);
        };
        self.check(&w, &[len])?;
        self.bytes += len * 4;
        if !self.cfg.norm_weight_offset {
            return Ok(Some(self.backend.vector(w)?));
        }
        // Stored as an offset from one: upload 1 + w as f32.
        let values = w.float_values("norm weight")?;
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| (v + 1.0).to_le_bytes())
            .collect();
        let w = HostWeight {
            name: w.name,
            dtype: GgmlType::F32,
            shape: w.shape,
            bytes: Cow::Owned(bytes),
        };
        Ok(Some(self.backend.vector(w)?))
    }

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

    pub(super) fn required_norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.norm(name, len)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    /// The norm `<prefix>.weight` (and `<prefix>.bias` for a LayerNorm).
    fn full_norm(&mut self, prefix: &str, len: usize) -> Result<Norm<B>> {
        let weight = self.required_norm(&format!("{prefix}.weight"), len)?;
        let bias = match self.cfg.features.norm {
            NormKind::Rms => None,
            NormKind::Layer => self.vector(&format!("{prefix}.bias"), len)?,
        };
        Ok(Norm { weight, bias })
    }
}

/// The optional backend ops `cfg` needs, each with what it is for.
pub(crate) fn needed_ops(cfg: &ModelConfig) -> Vec<(OptionalOp, &'static str)> {
    let scaled_rope = std::iter::once(&cfg.rope)
        .chain(&cfg.rope_local)
        .any(|r| r.spec(cfg.rope_style, cfg.rotary_dims).attention_factor != 1.0);
    [
        (
            cfg.features.norm == NormKind::Layer,
            OptionalOp::LayerNorm,
            "LayerNorm",
        ),
        (
            cfg.features.mlp == MlpKind::Plain,
            OptionalOp::Activation,
            "an ungated MLP",
        ),
        (
            scaled_rope,
            OptionalOp::RopeAttentionFactor,
            "rotary cos/sin scaling (yarn, longrope)",
        ),
    ]
    .into_iter()
    .filter(|(needed, _, _)| *needed)
    .map(|(_, op, what)| (op, what))
    .collect()
}

/// Refuses a model that needs an op `backend` does not implement, before any weight moves.
fn check_backend_ops<B: Backend>(backend: &B, cfg: &ModelConfig) -> Result<()> {
    for (op, what) in needed_ops(cfg) {
        if !backend.supports(op) {
            return Err(EngineError::Backend {
                backend: backend.name(),
                message: format!(
                    "{} models need {what}, which this backend does not implement yet; use --backend cpu",
                    cfg.arch
                ),
            });
        }
    }
    Ok(())
}

/// The rotary spec of a pass whose longest sequence has `longest` tokens: `fixed` unless
/// the scaling depends on the length.
fn spec_for_len<'a>(
    cfg: &ModelConfig,
    rope: &crate::config::RopeConfig,
    fixed: &'a RopeSpec,
    longest: usize,
) -> Cow<'a, RopeSpec> {
    if rope.depends_on_length() {
        Cow::Owned(rope.spec_for_len(cfg.rope_style, cfg.rotary_dims, longest))
    } else {
        Cow::Borrowed(fixed)
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

/// The configuration's layer count must be the number of layers the weights hold: the last
/// layer's norm present and none after it. Checked before anything is sized by the count.
fn check_layer_count(cfg: &ModelConfig, src: &dyn WeightSource) -> Result<()> {
    // OLMo 2 has no pre-attention norm: count its attention outputs instead.
    let probe = if cfg.features.pre_norms {
        "attn_norm"
    } else {
        "attn_output"
    };
    let norm = |i: usize| format!("blk.{i}.{probe}.weight");
    let n = cfg.num_layers;
    let holds_last = n > 0 && src.contains(&norm(n - 1));
    if !holds_last || src.contains(&norm(n)) {
        let held = (0..=crate::config::MAX_LAYERS)
            .take_while(|&i| src.contains(&norm(i)))
            .count();
        return Err(EngineError::Config {
            source_name: src.source_name(),
            reason: format!("the configuration says {n} layers but the weights hold {held}"),
        });
    }
    Ok(())
}

impl<B: Backend> Decoder<B> {
    /// Loads every weight of `cfg`'s architecture from `src` onto `backend`.
    pub fn load(backend: B, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let mut ld = Loader {
            backend: &backend,
            src,
            cfg: &cfg,
            bytes: 0,
        };
        check_layer_count(&cfg, src)?;
        check_backend_ops(&backend, &cfg)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let embed = ld.matrix("token_embd.weight", cfg.vocab_size, h)?;
        let output = if src.contains("output.weight") && !cfg.tie_embeddings {
            Some(ld.matrix("output.weight", cfg.vocab_size, h)?)
        } else if src.contains("output.weight") {
            // A file may carry an untied head even when the config says tied: use it.
            Some(ld.matrix("output.weight", cfg.vocab_size, h)?)
        } else {
            None
        };
        let norm = ld.full_norm("output_norm", h)?;
        let pre = cfg.features.pre_norms;
        let (q_norm_len, k_norm_len) = if cfg.features.qk_norm_full {
            (q_dim, kv_dim)
        } else {
            (hd, hd)
        };
        let gemma4 = match cfg.arch {
            crate::config::Arch::Gemma4 => Some(super::gemma4::Gemma4Model::load(&mut ld, &cfg)?),
            _ => None,
        };
        let hybrid = match cfg.qwen35 {
            Some(_) => {
                let (hybrid, bytes) = Hybrid::load(&backend, &cfg, src)?;
                ld.bytes += bytes;
                Some(hybrid)
            }
            None => None,
        };
        let plain_layers = if gemma4.is_some() || hybrid.is_some() {
            0
        } else {
            cfg.num_layers
        };
        let mut layers = Vec::with_capacity(plain_layers);
        for i in 0..plain_layers {
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
        let vision = match &cfg.vision {
            Some(v) if Gemma3Vision::present(&ld) && Gemma3Vision::backend_can_run(&backend) => {
                Some(Gemma3Vision::load(&mut ld, v, h)?)
            }
            Some(_) => {
                tracing::warn!(
                    backend = backend.name(),
                    "the checkpoint's vision tower is absent or this backend cannot run it: text only"
                );
                None
            }
            None => None,
        };
        let audio = match &cfg.audio {
            Some(a) if Gemma4Audio::present(&ld) => Some(Gemma4Audio::load(&mut ld, a, h)?),
            Some(_) => {
                tracing::warn!("the checkpoint's audio tower is absent: no audio");
                None
            }
            None => None,
        };
        let qwen_vision = match &cfg.qwen_vision {
            Some(v) if QwenVision::present(&ld) && QwenVision::backend_can_run(&backend) => {
                Some(QwenVision::load(&mut ld, v)?)
            }
            Some(_) => {
                tracing::warn!(
                    backend = backend.name(),
                    "the checkpoint's vision tower is absent or this backend cannot run it: text only"
                );
                None
            }
            None => None,
        };
        if let Some(v) = &qwen_vision {
            if v.config().out_hidden_size != h {
                return Err(EngineError::Config {
                    source_name: src.source_name(),
                    reason: format!(
                        "the vision tower's out_hidden_size {} is not the text model's hidden size {h}",
                        v.config().out_hidden_size
                    ),
                });
            }
        }
        let weight_bytes = ld.bytes;
        let rope = cfg.rope.spec(cfg.rope_style, cfg.rotary_dims);
        let rope_local = cfg
            .rope_local
            .as_ref()
            .map(|r| r.spec(cfg.rope_style, cfg.rotary_dims));
        Ok(Decoder {
            backend,
            cfg,
            embed,
            output,
            norm,
            layers,
            rope,
            rope_local,
            weight_bytes,
            gemma4,
            hybrid,
            vision,
            audio,
            qwen_vision,
        })
    }

    /// What the audio tower reads, when one loaded.
    pub fn audio_caps(&self) -> Option<crate::media::AudioCaps> {
        self.audio
            .as_ref()
            .and(self.cfg.audio.as_ref())
            .map(|a| a.caps())
    }

    /// The projected rows of one audio clip (`span.len × hidden`), checked against the
    /// span's length.
    fn embed_clip(&self, span: &crate::media::MediaSpan) -> Result<Vec<f32>> {
        let crate::media::MediaData::Audio(clip) = &span.data else {
            return Err(EngineError::InvalidInput("not an audio clip".into()));
        };
        let Some(tower) = &self.audio else {
            return Err(EngineError::InvalidInput(format!(
                "this {} model has no audio tower in its checkpoint: it cannot read audio",
                self.cfg.arch
            )));
        };
        let tokens = crate::models::audio::soft_tokens(clip.frames);
        if span.len != tokens {
            return Err(EngineError::InvalidInput(format!(
                "an audio span at position {} has {} soft tokens; its {} feature frames make {}",
                span.start, span.len, clip.frames, tokens
            )));
        }
        tower.embed(clip)
    }

    /// What the vision tower reads, when one loaded.
    pub fn vision_caps(&self) -> Option<crate::media::VisionCaps> {
        if let Some(g) = &self.gemma4 {
            return g.vision_caps();
        }
        if let Some(q) = &self.qwen_vision {
            return Some(q.config().caps());
        }
        self.vision
            .as_ref()
            .and(self.cfg.vision.as_ref())
            .map(|v| v.caps())
    }

    /// Runs each item of `spans` through its tower (images through the vision tower,
    /// clips through the audio tower): the rows a sequence's cache keeps, in prompt order.
    /// Spans must be apart and as long as their tower's output.
    pub fn embed_media(&self, spans: &[crate::media::MediaSpan]) -> Result<Vec<ImageRows>> {
        let is_audio =
            |s: &&crate::media::MediaSpan| matches!(s.data, crate::media::MediaData::Audio(_));
        let images: Vec<crate::media::MediaSpan> =
            spans.iter().filter(|s| !is_audio(s)).cloned().collect();
        let mut out = if images.is_empty() {
            Vec::new()
        } else {
            self.embed_images(&images)?
        };
        for span in spans.iter().filter(is_audio) {
            out.push(ImageRows {
                positions: span.start..span.start + span.len,
                rows: self.embed_clip(span)?.into(),
                // A clip's soft tokens attend causally, like text (as transformers' Gemma 4).
                bidirectional: false,
                grid: None,
            });
        }
        out.sort_by_key(|r| r.positions.start);
        if let Some(w) = out
            .windows(2)
            .find(|w| w[0].positions.end > w[1].positions.start)
        {
            return Err(EngineError::InvalidInput(format!(
                "media spans overlap at position {}",
                w[1].positions.start
            )));
        }
        Ok(out)
    }

    /// Runs each image of `spans` through the vision tower: the rows a sequence's cache
    /// keeps ([`SequenceCache::set_images`]) for the passes that reach the spans. Spans
    /// must be in prompt order, apart, and as long as the tower's output.
    pub fn embed_images(&self, spans: &[crate::media::MediaSpan]) -> Result<Vec<ImageRows>> {
        if let Some(g) = &self.gemma4 {
            return g.embed_images(&self.backend, spans);
        }
        if let Some(tower) = &self.qwen_vision {
            return self.embed_images_qwen(tower, spans);
        }
        let (Some(tower), Some(vcfg)) = (&self.vision, &self.cfg.vision) else {
            return Err(EngineError::InvalidInput(format!(
                "this {} model has no vision tower {}: it cannot read images",
                self.cfg.arch,
                if self.cfg.vision.is_some() && !Gemma3Vision::backend_can_run(&self.backend) {
                    format!("on the {} backend (use --backend cpu)", self.backend.name())
                } else {
                    "in its checkpoint".to_string()
                }
            )));
        };
        let mut out: Vec<ImageRows> = Vec::with_capacity(spans.len());
        for span in spans {
            let crate::media::MediaData::Image(pixels) = &span.data else {
                return Err(EngineError::InvalidInput(
                    "this model has no audio tower: it cannot read audio".into(),
                ));
            };
            if span.len != vcfg.tokens_per_image {
                return Err(EngineError::InvalidInput(format!(
                    "an image span at position {} has {} soft tokens; this model's images have {}",
                    span.start, span.len, vcfg.tokens_per_image
                )));
            }
            if out
                .last()
                .is_some_and(|prev| prev.positions.end > span.start)
            {
                return Err(EngineError::InvalidInput(format!(
                    "image spans overlap or are out of order at position {}",
                    span.start
                )));
            }
            let rows = tower.embed(&self.backend, pixels)?;
            out.push(ImageRows {
                positions: span.start..span.start + span.len,
                rows: rows.into(),
                bidirectional: true,
                grid: None,
            });
        }
        Ok(out)
    }

    /// [`Decoder::embed_images`] through Qwen's tower: each span as long as its image's
    /// merged grid, which the rows keep for the M-RoPE positions.
    fn embed_images_qwen(
        &self,
        tower: &QwenVision<B>,
        spans: &[crate::media::MediaSpan],
    ) -> Result<Vec<ImageRows>> {
        let mut out: Vec<ImageRows> = Vec::with_capacity(spans.len());
        for span in spans {
            let crate::media::MediaData::Image(pixels) = &span.data else {
                return Err(EngineError::InvalidInput(
                    "this model has no audio tower: it cannot read audio".into(),
                ));
            };
            let (rows, cols) = tower.config().merged_grid(pixels.height, pixels.width)?;
            if span.len != rows * cols {
                return Err(EngineError::InvalidInput(format!(
                    "an image span at position {} has {} soft tokens; its {}×{} image makes {}",
                    span.start,
                    span.len,
                    pixels.width,
                    pixels.height,
                    rows * cols
                )));
            }
            if out
                .last()
                .is_some_and(|prev| prev.positions.end > span.start)
            {
                return Err(EngineError::InvalidInput(format!(
                    "image spans overlap or are out of order at position {}",
                    span.start
                )));
            }
            let (values, grid) = tower.embed(&self.backend, pixels)?;
            out.push(ImageRows {
                positions: span.start..span.start + span.len,
                rows: values.into(),
                // Qwen's text model attends causally over an image's tokens.
                bidirectional: false,
                grid: Some(grid),
            });
        }
        Ok(out)
    }

    /// `(kv_heads, head_dim, window)` of each layer cache of a sequence.
    fn cache_layout(&self) -> Vec<(usize, usize, Option<usize>)> {
        match &self.gemma4 {
            Some(g) => g.cache_layout(),
            None => self
                .layers
                .iter()
                .map(|l| {
                    let a = &l.attention;
                    (a.kv_heads, a.head_dim, a.window)
                })
                .collect(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bytes the weights occupy on the backend.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> SequenceCache<B> {
        if let Some(h) = &self.hybrid {
            return SequenceCache {
                layers: h
                    .kv_layers()
                    .iter()
                    .map(|a| self.backend.new_kv_layer(a.kv_heads, a.head_dim, a.window))
                    .collect(),
                recurrent: Some(h.new_recurrent()),
                images: Vec::new(),
            };
        }
        SequenceCache {
            layers: self
                .cache_layout()
                .into_iter()
                .map(|(kv_heads, head_dim, window)| {
                    self.backend.new_kv_layer(kv_heads, head_dim, window)
                })
                .collect(),
            recurrent: None,
            images: Vec::new(),
        }
    }

    /// Rebuilds a cache from host copies (as made by [`SequenceCache::snapshot`]).
    pub fn cache_from_snapshot(&self, layers: &[KvLayerSnapshot]) -> Result<SequenceCache<B>> {
        self.cache_from_snapshots(layers, None)
    }

    /// [`Decoder::cache_from_snapshot`] with the recurrent states a hybrid model's cache
    /// also needs (as made by [`RecurrentCache::snapshot`]).
    pub fn cache_from_snapshots(
        &self,
        layers: &[KvLayerSnapshot],
        recurrent: Option<&RecurrentSnapshot>,
    ) -> Result<SequenceCache<B>> {
        if let Some(h) = &self.hybrid {
            return super::qwen35::cache_from_snapshots(&self.backend, h, layers, recurrent).map(
                |(layers, recurrent)| SequenceCache {
                    layers,
                    recurrent: Some(recurrent),
                    images: Vec::new(),
                },
            );
        }
        if recurrent.is_some() {
            return Err(EngineError::Cache(
                "snapshot holds recurrent states; the model has none".into(),
            ));
        }
        let layout = self.cache_layout();
        if layers.len() != layout.len() {
            return Err(EngineError::Cache(format!(
                "snapshot has {} layers, model has {}",
                layers.len(),
                layout.len()
            )));
        }
        for (s, &(kv_heads, head_dim, window)) in layers.iter().zip(&layout) {
            if s.kv_heads != kv_heads || s.head_dim != head_dim || s.window != window {
                return Err(EngineError::Cache(
                    "snapshot layout does not match the model".into(),
                ));
            }
        }
        Ok(SequenceCache {
            layers: layers
                .iter()
                .map(|s| self.backend.kv_layer_from_snapshot(s))
                .collect::<Result<_>>()?,
            recurrent: None,
            images: Vec::new(),
        })
    }

    /// Runs the new tokens of every item through the model, appending to each cache,
    /// and returns the requested logits per item.
    pub fn forward(&self, batch: &mut [BatchItem<'_, B>]) -> Result<Vec<Option<Logits>>> {
        self.forward_lora(batch, &[])
    }

    /// [`Decoder::forward`] with adapters: item `i` runs with the deltas of `lora[i]`
    /// summed in order (items past the end of `lora`, or with an empty list, run the
    /// base model).
    pub fn forward_lora(
        &self,
        batch: &mut [BatchItem<'_, B>],
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<Vec<Option<Logits>>> {
        let items = batch.len();
        let Some((rows, data)) = self.backend.pass(|| {
            let (logits, rows) = self.run_batch(batch, false, lora)?;
            let Some(logits) = logits else {
                return Ok(None);
            };
            let data = self.backend.rows_to_host(&logits, &rows)?;
            Ok(Some((rows, data)))
        })?
        else {
            return Ok(vec![None; items]);
        };
        let vocab = self.cfg.vocab_size;
        Ok(rows
            .into_iter()
            .zip(data)
            .map(|(n, data)| {
                (n > 0).then_some(Logits {
                    rows: n,
                    vocab,
                    data,
                })
            })
            .collect())
    }

    /// Like [`Decoder::forward`], but returns the argmax of the last position of every
    /// item that asks for [`LogitsRequest::Last`] (in order), kept on the backend, without
    /// copying logits to the host. Items ask for `Last` or `None`.
    pub fn forward_argmax(&self, batch: &mut [BatchItem<'_, B>]) -> Result<B::Ids> {
        self.forward_argmax_lora(batch, &[])
    }

    /// [`Decoder::forward_argmax`] with adapters, as [`Decoder::forward_lora`].
    pub fn forward_argmax_lora(
        &self,
        batch: &mut [BatchItem<'_, B>],
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<B::Ids> {
        if batch.iter().any(|i| i.logits == LogitsRequest::All) {
            return Err(EngineError::InvalidInput(
                "an argmax forward pass returns one token per sequence, not every position".into(),
            ));
        }
        self.backend.pass(|| {
            let (logits, _) = self.run_batch(batch, false, lora)?;
            let logits = logits
                .ok_or_else(|| EngineError::InvalidInput("no item asks for a token".into()))?;
            self.backend.argmax(&logits)
        })
    }

    /// [`Decoder::forward_argmax_lora`] for items that may also ask for
    /// [`LogitsRequest::All`] (speculative verification): the argmax of every requested
    /// row, flattened in order, and how many rows each item has.
    pub fn forward_argmax_rows(
        &self,
        batch: &mut [BatchItem<'_, B>],
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<(B::Ids, Vec<usize>)> {
        self.backend.pass(|| {
            let (logits, rows) = self.run_batch(batch, false, lora)?;
            let logits = logits
                .ok_or_else(|| EngineError::InvalidInput("no item asks for a token".into()))?;
            Ok((self.backend.argmax(&logits)?, rows))
        })
    }

    /// [`Decoder::forward_argmax_lora`] with a token mask per item: `masks` is called once
    /// the pass is built and started on the backend (so the host computes the masks while
    /// the device computes the logits) and returns one mask per item (`None`: unmasked);
    /// see [`Backend::masked_argmax`].
    pub fn forward_argmax_masked(
        &self,
        batch: &mut [BatchItem<'_, B>],
        lora: &[Vec<&LoraWeights<B>>],
        masks: impl FnOnce() -> Vec<Option<Vec<u32>>>,
    ) -> Result<B::Ids> {
        if batch.iter().any(|i| i.logits == LogitsRequest::All) {
            return Err(EngineError::InvalidInput(
                "an argmax forward pass returns one token per sequence, not every position".into(),
            ));
        }
        let wants: Vec<bool> = batch
            .iter()
            .map(|i| i.logits == LogitsRequest::Last)
            .collect();
        self.backend.pass(|| {
            let (logits, _) = self.run_batch(batch, false, lora)?;
            let logits = logits
                .ok_or_else(|| EngineError::InvalidInput("no item asks for a token".into()))?;
            self.backend.schedule_tensor(&logits)?;
            // Logits rows are the items that ask for a token, in order.
            let rows: Vec<Option<Vec<u32>>> = masks()
                .into_iter()
                .zip(wants)
                .filter_map(|(m, w)| w.then_some(m))
                .collect();
            self.backend.masked_argmax(&logits, &rows)
        })
    }

    /// One decode step of several sequences whose new token each is an id the backend
    /// holds (`ids[i]` for `caches[i]`), typically the previous step's argmax: the step is
    /// built without waiting for those ids. Returns the next ids, scheduled.
    pub fn decode_ids(&self, ids: &B::Ids, caches: &mut [&mut SequenceCache<B>]) -> Result<B::Ids> {
        let counts = vec![1; caches.len()];
        let requests = vec![LogitsRequest::Last; caches.len()];
        self.backend.pass(|| {
            let (logits, _) =
                self.run(Input::Backend(ids), caches, &counts, &requests, false, &[])?;
            let logits = logits.ok_or_else(|| EngineError::InvalidInput("empty batch".into()))?;
            let next = self.backend.argmax(&logits)?;
            self.backend.schedule(&next)?;
            Ok(next)
        })
    }

    /// Like [`Decoder::forward`], but returns the final-normed hidden states of the
    /// requested positions (row-major `[rows][hidden_size]` per item, empty for
    /// [`LogitsRequest::None`]) instead of logits: what embedding models pool.
    pub fn forward_hidden(&self, batch: &mut [BatchItem<'_, B>]) -> Result<Vec<Vec<f32>>> {
        let items = batch.len();
        self.backend.pass(|| {
            let (hidden, rows) = self.run_batch(batch, true, &[])?;
            match hidden {
                Some(h) => self.backend.rows_to_host(&h, &rows),
                None => Ok(vec![Vec::new(); items]),
            }
        })
    }

    /// [`Decoder::run`] over a batch of host tokens: their ids flattened, each item's count,
    /// logits request and cache.
    fn run_batch(
        &self,
        batch: &mut [BatchItem<'_, B>],
        hidden: bool,
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<(Option<B::Tensor>, Vec<usize>)> {
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        let counts: Vec<usize> = batch.iter().map(|i| i.tokens.len()).collect();
        let requests: Vec<LogitsRequest> = batch.iter().map(|i| i.logits).collect();
        let mut caches: Vec<&mut SequenceCache<B>> =
            batch.iter_mut().map(|i| &mut *i.cache).collect();
        self.run(
            Input::Host(&ids),
            &mut caches,
            &counts,
            &requests,
            hidden,
            lora,
        )
    }

    /// The forward pass: `counts[i]` new tokens of `caches[i]` (flattened in `input`),
    /// returning the logits rows `requests` ask for (or `None` when none is asked) and
    /// how many rows belong to each sequence.
    fn run(
        &self,
        input: Input<'_, B>,
        caches: &mut [&mut SequenceCache<B>],
        counts: &[usize],
        requests: &[LogitsRequest],
        hidden: bool,
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<(Option<B::Tensor>, Vec<usize>)> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let media = {
            let images: Vec<&[ImageRows]> = caches.iter().map(|c| c.images.as_slice()).collect();
            let mut passes = Vec::with_capacity(caches.len());
            let mut flat = Vec::with_capacity(caches.len());
            let mut total = 0;
            for (c, &n) in caches.iter().zip(counts) {
                passes.push(c.len()..c.len() + n);
                flat.push(total..total + n);
                total += n;
            }
            PassMedia::for_pass(&images, &passes, &flat)?
        };
        if media.is_some() && self.hybrid.is_some() && self.qwen_vision.is_none() {
            return Err(EngineError::InvalidInput(format!(
                "{} models do not read images yet",
                cfg.arch
            )));
        }
        if let Some(g) = &self.gemma4 {
            let (embed, output) = (&self.embed, self.output.as_ref());
            return g.run(
                be,
                cfg,
                embed,
                output,
                &self.norm.weight,
                input,
                caches,
                counts,
                requests,
                media.as_ref(),
            );
        }
        let mut positions = Vec::new();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(caches.len());
        let mut total = 0;
        for (cache, &n) in caches.iter().zip(counts) {
            if n == 0 {
                return Err(EngineError::InvalidInput(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            let kv_layers = self
                .hybrid
                .as_ref()
                .map_or(self.layers.len(), |h| h.kv_layers().len());
            if cache.layers.len() != kv_layers {
                return Err(EngineError::Cache("cache belongs to another model".into()));
            }
            let start = cache.len();
            ranges.push(total..total + n);
            total += n;
            positions.extend(start..start + n);
        }
        let lora = LoraBatch::new(lora, &ranges);
        // Dynamic NTK and LongRoPE build their frequencies for the pass's longest sequence.
        let longest = caches
            .iter()
            .zip(counts)
            .map(|(c, &n)| c.len() + n)
            .max()
            .unwrap_or(0);
        // M-RoPE only where a sequence of the pass has images (text alone gives the same
        // angles, so text-only passes keep the plain table).
        let mrope = cfg
            .mrope
            .as_ref()
            .filter(|_| caches.iter().any(|c| !c.images.is_empty()));
        let rope = match mrope {
            Some(m) => {
                let mut triples = Vec::with_capacity(positions.len());
                for (cache, &n) in caches.iter().zip(counts) {
                    let start = cache.len();
                    triples.extend(super::mrope::positions(&cache.images, start..start + n));
                }
                be.rope_table_axes(&triples, &m.axes, &self.rope)?
            }
            None => be.rope_table(
                &positions,
                &spec_for_len(cfg, &cfg.rope, &self.rope, longest),
            )?,
        };
        let rope_local = match (&cfg.rope_local, &self.rope_local) {
            (Some(r), Some(s)) => {
                Some(be.rope_table(&positions, &spec_for_len(cfg, r, s, longest))?)
            }
            _ => None,
        };

        let mut x = match input {
            // Soft tokens take their image's rows below; their id need not be in the
            // table (some checkpoints put the image token past the vocabulary).
            Input::Host(ids) => match &media {
                Some(m) => {
                    let mut ids = ids.to_vec();
                    for (row, _, _) in &m.replace {
                        ids[*row] = 0;
                    }
                    be.embed(&self.embed, &ids)?
                }
                None => be.embed(&self.embed, ids)?,
            },
            Input::Backend(ids) => be.embed_ids(&self.embed, ids)?,
        };
        if cfg.scale_embeddings {
            x = be.scale(&x, (cfg.hidden_size as f32).sqrt())?;
        }
        if let Some(m) = cfg.features.embed_multiplier {
            x = be.scale(&x, m)?;
        }
        if let Some(m) = &media {
            // Image rows replace their soft tokens' embeddings (unscaled: the scale is the
            // text table's).
            let h = cfg.hidden_size;
            let mut host = be.rows_to_host(&x, &[total])?.pop().unwrap_or_default();
            for (row, rows, i) in &m.replace {
                host[row * h..(row + 1) * h].copy_from_slice(&rows[i * h..(i + 1) * h]);
            }
            x = be.tensor_from_host(host, total, h)?;
        }
        let residual = cfg.features.residual_multiplier;
        let mut h = match self.layers.first().and_then(|l| l.attn_norm.as_ref()) {
            Some(norm) => self.norm(&x, norm)?,
            None => x.clone(),
        };
        if let Some(hybrid) = &self.hybrid {
            x = hybrid.run_layers(be, x, caches, &ranges, &rope)?;
        }
        for (li, layer) in self.layers.iter().enumerate() {
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
            if let Some(w) = &layer.q_norm {
                q = be.rms_norm(&q, w, cfg.rms_eps)?;
            }
            if let Some(w) = &layer.k_norm {
                k = be.rms_norm(&k, w, cfg.rms_eps)?;
            }
            let table = match (&rope_local, layer.local_rope) {
                (Some(local), true) => local,
                _ => &rope,
            };
            if layer.use_rope {
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
                .zip(&ranges)
                .map(|(cache, r)| AttentionSegment {
                    rows: r.clone(),
                    cache: &mut cache.layers[li],
                })
                .collect();
            let attn = match media.as_ref().filter(|_| self.qwen_vision.is_none()) {
                Some(m) => be.attention_to(&q, &k, &v, &mut segments, &layer.attention, &m.ends)?,
                None => be.attention(&q, &k, &v, &mut segments, &layer.attention)?,
            };
            let mut o = be.linear(&attn, &layer.o, layer.o_bias.as_ref())?;
            o = lora.apply(be, li, Target::O, &attn, o)?;
            if let Some(w) = &layer.post_attn_norm {
                o = self.norm(&o, w)?;
            }
            if let Some(r) = residual {
                o = be.scale(&o, r)?;
            }
            let (sum, hf) = self.add_norm(&x, &o, layer.ffn_norm.as_ref())?;
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
            if let Some(w) = &layer.post_ffw_norm {
                m = self.norm(&m, w)?;
            }
            if let Some(r) = residual {
                m = be.scale(&m, r)?;
            }
            match self.layers.get(li + 1) {
                Some(next) => {
                    let (sum, hn) = self.add_norm(&x, &m, next.attn_norm.as_ref())?;
                    x = sum;
                    h = hn;
                }
                None => x = be.add(&x, &m)?,
            }
        }

        let mut rows = Vec::new();
        let mut per_item = Vec::with_capacity(caches.len());
        for (request, r) in requests.iter().zip(&ranges) {
            let before = rows.len();
            match request {
                LogitsRequest::None => {}
                LogitsRequest::Last => rows.push(r.end - 1),
                LogitsRequest::All => rows.extend(r.clone()),
            }
            per_item.push(rows.len() - before);
        }
        if rows.is_empty() {
            return Ok((None, per_item));
        }
        let x = be.select_rows(&x, &rows)?;
        let x = self.norm(&x, &self.norm)?;
        if hidden {
            return Ok((Some(x), per_item));
        }
        let mut logits = be.linear(&x, self.output.as_ref().unwrap_or(&self.embed), None)?;
        if let Some(m) = cfg.features.logit_multiplier {
            logits = be.scale(&logits, m)?;
        }
        if let Some(cap) = cfg.final_softcap {
            logits = be.softcap(&logits, cap)?;
        }
        Ok((Some(logits), per_item))
    }

    /// `norm(x)` with the model's kind of norm.
    fn norm(&self, x: &B::Tensor, n: &Norm<B>) -> Result<B::Tensor> {
        let eps = self.cfg.rms_eps;
        match self.cfg.features.norm {
            NormKind::Rms => self.backend.rms_norm(x, &n.weight, eps),
            NormKind::Layer => self.backend.layer_norm(x, &n.weight, n.bias.as_ref(), eps),
        }
    }

    /// `(x + y, norm(x + y))`, the sum itself where the next sublayer has no input norm.
    fn add_norm(
        &self,
        x: &B::Tensor,
        y: &B::Tensor,
        n: Option<&Norm<B>>,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let be = &self.backend;
        match (n, self.cfg.features.norm) {
            (Some(n), NormKind::Rms) => be.add_rms_norm(x, y, &n.weight, self.cfg.rms_eps),
            (Some(n), NormKind::Layer) => {
                let sum = be.add(x, y)?;
                let normed = self.norm(&sum, n)?;
                Ok((sum, normed))
            }
            (None, _) => {
                let sum = be.add(x, y)?;
                Ok((sum.clone(), sum))
            }
        }
    }
}
