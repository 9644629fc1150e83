//! The decoder-only transformer every supported architecture runs, generic over the
//! compute backend, with a forward pass over a flattened batch of sequences.
use std::borrow::Cow;
use std::ops::Range;

use wick_gguf::GgmlType;

use crate::backend::{
    AttentionParams, AttentionSegment, Backend, HostWeight, KvLayer, KvLayerSnapshot, RopeSpec,
};
use crate::config::ModelConfig;
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
}

/// The KV cache of one sequence: one backend cache per layer.
pub struct SequenceCache<B: Backend> {
    layers: Vec<B::KvLayer>,
}

impl<B: Backend> Clone for SequenceCache<B> {
    fn clone(&self) -> Self {
        SequenceCache {
            layers: self.layers.clone(),
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
        self.layers.iter().map(|l| l.byte_size()).sum()
    }

    /// Host copies of every layer.
    pub fn snapshot(&self) -> Vec<KvLayerSnapshot> {
        self.layers.iter().map(|l| l.snapshot()).collect()
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

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    q: B::Matrix,
    k: B::Matrix,
    v: B::Matrix,
    o: B::Matrix,
    q_bias: Option<B::Tensor>,
    k_bias: Option<B::Tensor>,
    v_bias: Option<B::Tensor>,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    post_attn_norm: Option<B::Tensor>,
    ffn_norm: B::Tensor,
    gate: B::Matrix,
    up: B::Matrix,
    down: B::Matrix,
    post_ffw_norm: Option<B::Tensor>,
    attention: AttentionParams,
    local_rope: bool,
}

/// A loaded decoder-only transformer.
pub struct Decoder<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed: B::Matrix,
    output: Option<B::Matrix>,
    norm: B::Tensor,
    layers: Vec<Layer<B>>,
    rope: RopeSpec,
    rope_local: Option<RopeSpec>,
    weight_bytes: usize,
}

struct Loader<'a, B: Backend> {
    backend: &'a B,
    src: &'a dyn WeightSource,
    cfg: &'a ModelConfig,
    bytes: usize,
}

impl<B: Backend> Loader<'_, B> {
    fn required(&self, name: &str) -> Result<HostWeight<'_>> {
        self.src
            .get(name)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    fn check(&self, w: &HostWeight<'_>, expected: &[usize]) -> Result<()> {
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

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        let w = self.required(name)?;
        self.check(&w, &[rows, cols])?;
        let m = self.backend.matrix(w)?;
        self.bytes += self.backend.matrix_bytes(&m);
        Ok(m)
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
        let values = floats(&w)?;
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

    fn required_norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.norm(name, len)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
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

/// f32 values of a float weight.
fn floats(w: &HostWeight<'_>) -> Result<Vec<f32>> {
    let b = &w.bytes;
    Ok(match w.dtype {
        GgmlType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(EngineError::UnsupportedDtype {
                source_name: "norm weight".into(),
                tensor: w.name.clone(),
                dtype: other.to_string(),
            })
        }
    })
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
        let norm = ld.required_norm("output_norm.weight", h)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let window = cfg.layer_windows[i];
            layers.push(Layer {
                attn_norm: ld.required_norm(&n("attn_norm.weight"), h)?,
                q: ld.matrix(&n("attn_q.weight"), q_dim, h)?,
                k: ld.matrix(&n("attn_k.weight"), kv_dim, h)?,
                v: ld.matrix(&n("attn_v.weight"), kv_dim, h)?,
                o: ld.matrix(&n("attn_output.weight"), h, q_dim)?,
                q_bias: ld.vector(&n("attn_q.bias"), q_dim)?,
                k_bias: ld.vector(&n("attn_k.bias"), kv_dim)?,
                v_bias: ld.vector(&n("attn_v.bias"), kv_dim)?,
                q_norm: ld.norm(&n("attn_q_norm.weight"), hd)?,
                k_norm: ld.norm(&n("attn_k_norm.weight"), hd)?,
                post_attn_norm: if cfg.sandwich_norms {
                    Some(ld.required_norm(&n("post_attention_norm.weight"), h)?)
                } else {
                    None
                },
                ffn_norm: ld.required_norm(&n("ffn_norm.weight"), h)?,
                gate: ld.matrix(&n("ffn_gate.weight"), cfg.intermediate_size, h)?,
                up: ld.matrix(&n("ffn_up.weight"), cfg.intermediate_size, h)?,
                down: ld.matrix(&n("ffn_down.weight"), h, cfg.intermediate_size)?,
                post_ffw_norm: if cfg.sandwich_norms {
                    Some(ld.required_norm(&n("post_ffw_norm.weight"), h)?)
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
            });
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
        })
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
        SequenceCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    self.backend.new_kv_layer(
                        l.attention.kv_heads,
                        l.attention.head_dim,
                        l.attention.window,
                    )
                })
                .collect(),
        }
    }

    /// Rebuilds a cache from host copies (as made by [`SequenceCache::snapshot`]).
    pub fn cache_from_snapshot(&self, layers: &[KvLayerSnapshot]) -> Result<SequenceCache<B>> {
        if layers.len() != self.layers.len() {
            return Err(EngineError::Cache(format!(
                "snapshot has {} layers, model has {}",
                layers.len(),
                self.layers.len()
            )));
        }
        for (s, l) in layers.iter().zip(&self.layers) {
            let a = &l.attention;
            if s.kv_heads != a.kv_heads || s.head_dim != a.head_dim || s.window != a.window {
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
        })
    }

    /// Runs the new tokens of every item through the model, appending to each cache,
    /// and returns the requested logits per item.
    pub fn forward(&self, batch: &mut [BatchItem<'_, B>]) -> Result<Vec<Option<Logits>>> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(batch.len());
        for item in batch.iter() {
            if item.tokens.is_empty() {
                return Err(EngineError::InvalidInput(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            if item.cache.layers.len() != self.layers.len() {
                return Err(EngineError::Cache("cache belongs to another model".into()));
            }
            let start = item.cache.len();
            ranges.push(ids.len()..ids.len() + item.tokens.len());
            ids.extend_from_slice(item.tokens);
            positions.extend(start..start + item.tokens.len());
        }
        let rope = be.rope_table(&positions, &self.rope)?;
        let rope_local = self
            .rope_local
            .as_ref()
            .map(|s| be.rope_table(&positions, s))
            .transpose()?;

        let mut x = be.embed(&self.embed, &ids)?;
        if cfg.scale_embeddings {
            x = be.scale(&x, (cfg.hidden_size as f32).sqrt())?;
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let [mut q, mut k, v] = three(be.linear_many(
                &h,
                &[
                    (&layer.q, layer.q_bias.as_ref()),
                    (&layer.k, layer.k_bias.as_ref()),
                    (&layer.v, layer.v_bias.as_ref()),
                ],
            )?)?;
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
            let q = be.rope(&q, layer.attention.heads, table)?;
            let k = be.rope(&k, layer.attention.kv_heads, table)?;
            let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = batch
                .iter_mut()
                .zip(&ranges)
                .map(|(item, r)| AttentionSegment {
                    rows: r.clone(),
                    cache: &mut item.cache.layers[li],
                })
                .collect();
            let attn = be.attention(&q, &k, &v, &mut segments, &layer.attention)?;
            let mut o = be.linear(&attn, &layer.o, None)?;
            if let Some(w) = &layer.post_attn_norm {
                o = be.rms_norm(&o, w, cfg.rms_eps)?;
            }
            x = be.add(&x, &o)?;
            let h = be.rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let [gate, up] = two(be.linear_many(&h, &[(&layer.gate, None), (&layer.up, None)])?)?;
            let mut m = be.linear(&be.glu(&gate, &up, cfg.activation)?, &layer.down, None)?;
            if let Some(w) = &layer.post_ffw_norm {
                m = be.rms_norm(&m, w, cfg.rms_eps)?;
            }
            x = be.add(&x, &m)?;
        }

        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(batch.len());
        for (item, r) in batch.iter().zip(&ranges) {
            let before = rows.len();
            match item.logits {
                LogitsRequest::None => {}
                LogitsRequest::Last => rows.push(r.end - 1),
                LogitsRequest::All => rows.extend(r.clone()),
            }
            counts.push(rows.len() - before);
        }
        if rows.is_empty() {
            return Ok(vec![None; batch.len()]);
        }
        let x = be.select_rows(&x, &rows)?;
        let x = be.rms_norm(&x, &self.norm, cfg.rms_eps)?;
        let mut logits = be.linear(&x, self.output.as_ref().unwrap_or(&self.embed), None)?;
        if let Some(cap) = cfg.final_softcap {
            logits = be.softcap(&logits, cap)?;
        }
        let data = be.to_host(&logits)?;
        let vocab = cfg.vocab_size;
        let mut out = Vec::with_capacity(batch.len());
        let mut at = 0;
        for n in counts {
            if n == 0 {
                out.push(None);
            } else {
                out.push(Some(Logits {
                    rows: n,
                    vocab,
                    data: data[at * vocab..(at + n) * vocab].to_vec(),
                }));
                at += n;
            }
        }
        Ok(out)
    }
}
