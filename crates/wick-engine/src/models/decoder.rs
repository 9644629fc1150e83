//! The decoder-only transformer every supported architecture runs, generic over the
//! compute backend, with a forward pass over a flattened batch of sequences.
use std::borrow::Cow;
use std::ops::Range;

use wick_gguf::GgmlType;

use crate::adapters::{LoraBatch, LoraWeights, Target};
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

/// Where the new tokens of a forward pass come from.
enum Input<'a, B: Backend> {
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

/// The MLP's gate and up projections, separate or fused like [`QkvProjection`].
enum GateUpProjection<B: Backend> {
    Separate { gate: B::Matrix, up: B::Matrix },
    Fused { gate_up: B::Matrix, width: usize },
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    qkv: QkvProjection<B>,
    o: B::Matrix,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    post_attn_norm: Option<B::Tensor>,
    ffn_norm: B::Tensor,
    gate_up: GateUpProjection<B>,
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

/// The configuration's layer count must be the number of layers the weights hold: the last
/// layer's norm present and none after it. Checked before anything is sized by the count.
fn check_layer_count(cfg: &ModelConfig, src: &dyn WeightSource) -> Result<()> {
    let norm = |i: usize| format!("blk.{i}.attn_norm.weight");
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
                qkv: ld.qkv(i, q_dim, kv_dim)?,
                o: ld.matrix(&n("attn_output.weight"), h, q_dim)?,
                q_norm: ld.norm(&n("attn_q_norm.weight"), hd)?,
                k_norm: ld.norm(&n("attn_k_norm.weight"), hd)?,
                post_attn_norm: if cfg.sandwich_norms {
                    Some(ld.required_norm(&n("post_attention_norm.weight"), h)?)
                } else {
                    None
                },
                ffn_norm: ld.required_norm(&n("ffn_norm.weight"), h)?,
                gate_up: ld.gate_up(i)?,
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
        let mut ids = Vec::new();
        for item in batch.iter() {
            ids.extend_from_slice(item.tokens);
        }
        let counts: Vec<usize> = batch.iter().map(|i| i.tokens.len()).collect();
        let requests: Vec<LogitsRequest> = batch.iter().map(|i| i.logits).collect();
        let mut caches: Vec<&mut SequenceCache<B>> =
            batch.iter_mut().map(|i| &mut *i.cache).collect();
        let (logits, rows) = self.run(Input::Host(&ids), &mut caches, &counts, &requests, lora)?;
        let Some(logits) = logits else {
            return Ok(vec![None; batch.len()]);
        };
        let vocab = self.cfg.vocab_size;
        let data = self.backend.rows_to_host(&logits, &rows)?;
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
        let mut ids = Vec::new();
        for item in batch.iter() {
            ids.extend_from_slice(item.tokens);
        }
        let counts: Vec<usize> = batch.iter().map(|i| i.tokens.len()).collect();
        let requests: Vec<LogitsRequest> = batch.iter().map(|i| i.logits).collect();
        let mut caches: Vec<&mut SequenceCache<B>> =
            batch.iter_mut().map(|i| &mut *i.cache).collect();
        let (logits, _) = self.run(Input::Host(&ids), &mut caches, &counts, &requests, lora)?;
        let logits =
            logits.ok_or_else(|| EngineError::InvalidInput("no item asks for a token".into()))?;
        self.backend.argmax(&logits)
    }

    /// One decode step of several sequences whose new token each is an id the backend
    /// holds (`ids[i]` for `caches[i]`), typically the previous step's argmax: the step is
    /// built without waiting for those ids. Returns the next ids, scheduled.
    pub fn decode_ids(&self, ids: &B::Ids, caches: &mut [&mut SequenceCache<B>]) -> Result<B::Ids> {
        let counts = vec![1; caches.len()];
        let requests = vec![LogitsRequest::Last; caches.len()];
        let (logits, _) = self.run(Input::Backend(ids), caches, &counts, &requests, &[])?;
        let logits = logits.ok_or_else(|| EngineError::InvalidInput("empty batch".into()))?;
        let next = self.backend.argmax(&logits)?;
        self.backend.schedule(&next)?;
        Ok(next)
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
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<(Option<B::Tensor>, Vec<usize>)> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let mut positions = Vec::new();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(caches.len());
        let mut total = 0;
        for (cache, &n) in caches.iter().zip(counts) {
            if n == 0 {
                return Err(EngineError::InvalidInput(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            if cache.layers.len() != self.layers.len() {
                return Err(EngineError::Cache("cache belongs to another model".into()));
            }
            let start = cache.len();
            ranges.push(total..total + n);
            total += n;
            positions.extend(start..start + n);
        }
        let lora = LoraBatch::new(lora, &ranges);
        let rope = be.rope_table(&positions, &self.rope)?;
        let rope_local = self
            .rope_local
            .as_ref()
            .map(|s| be.rope_table(&positions, s))
            .transpose()?;

        let mut x = match input {
            Input::Host(ids) => be.embed(&self.embed, ids)?,
            Input::Backend(ids) => be.embed_ids(&self.embed, ids)?,
        };
        if cfg.scale_embeddings {
            x = be.scale(&x, (cfg.hidden_size as f32).sqrt())?;
        }
        let mut h = match self.layers.first() {
            Some(first) => be.rms_norm(&x, &first.attn_norm, cfg.rms_eps)?,
            None => x.clone(),
        };
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
            let (mut q, mut k, v) = if lora.is_empty() {
                (q, k, v)
            } else {
                (
                    lora.apply(be, li, Target::Q, &h, q)?,
                    lora.apply(be, li, Target::K, &h, k)?,
                    lora.apply(be, li, Target::V, &h, v)?,
                )
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
            let q = be.rope(&q, layer.attention.heads, table)?;
            let k = be.rope(&k, layer.attention.kv_heads, table)?;
            let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = caches
                .iter_mut()
                .zip(&ranges)
                .map(|(cache, r)| AttentionSegment {
                    rows: r.clone(),
                    cache: &mut cache.layers[li],
                })
                .collect();
            let attn = be.attention(&q, &k, &v, &mut segments, &layer.attention)?;
            let mut o = be.linear(&attn, &layer.o, None)?;
            o = lora.apply(be, li, Target::O, &attn, o)?;
            if let Some(w) = &layer.post_attn_norm {
                o = be.rms_norm(&o, w, cfg.rms_eps)?;
            }
            let (sum, hf) = be.add_rms_norm(&x, &o, &layer.ffn_norm, cfg.rms_eps)?;
            x = sum;
            let act = match &layer.gate_up {
                GateUpProjection::Separate { gate, up } => {
                    let [gate, up] = two(be.linear_many(&hf, &[(gate, None), (up, None)])?)?;
                    let gate = lora.apply(be, li, Target::Gate, &hf, gate)?;
                    let up = lora.apply(be, li, Target::Up, &hf, up)?;
                    be.glu(&gate, &up, cfg.activation)?
                }
                GateUpProjection::Fused { gate_up, width } => {
                    let both = be.linear(&hf, gate_up, None)?;
                    match be.split_columns(&both, &[*width, *width])?.as_slice() {
                        [gate, up] if !lora.is_empty() => {
                            let gate = lora.apply(be, li, Target::Gate, &hf, gate.clone())?;
                            let up = lora.apply(be, li, Target::Up, &hf, up.clone())?;
                            be.glu(&gate, &up, cfg.activation)?
                        }
                        [gate, up] => be.glu(gate, up, cfg.activation)?,
                        _ => {
                            return Err(EngineError::Backend {
                                backend: be.name(),
                                message: "split_columns returned too few parts".into(),
                            })
                        }
                    }
                }
            };
            let mut m = be.linear(&act, &layer.down, None)?;
            m = lora.apply(be, li, Target::Down, &act, m)?;
            if let Some(w) = &layer.post_ffw_norm {
                m = be.rms_norm(&m, w, cfg.rms_eps)?;
            }
            match self.layers.get(li + 1) {
                Some(next) => {
                    let (sum, hn) = be.add_rms_norm(&x, &m, &next.attn_norm, cfg.rms_eps)?;
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
        let x = be.rms_norm(&x, &self.norm, cfg.rms_eps)?;
        let mut logits = be.linear(&x, self.output.as_ref().unwrap_or(&self.embed), None)?;
        if let Some(cap) = cfg.final_softcap {
            logits = be.softcap(&logits, cap)?;
        }
        Ok((Some(logits), per_item))
    }
}
