//! The decoder-only transformer every supported architecture runs, generic over the
//! compute backend, with one forward entry point over a flattened batch of sequences.
//!
//! A [`Decoder`] is a shared trunk — the token embedding, the final norm and the output head
//! — around one [`LayerStack`] (the dense stack most families run, Gemma 4's, or Qwen 3.5's
//! hybrid of DeltaNet and attention layers) and the model's media [`Towers`]. A step
//! ([`Decoder::execute`]) says per sequence what it wants back ([`Want`]); the pass embeds
//! the new tokens (placing media rows), runs the stack, and returns each sequence's output
//! by one [`execute::Route`].
//!
//! - `cache.rs`: [`SequenceCache`], one sequence's KV layers, recurrent states and media rows;
//! - `loader.rs`: reading weights onto the backend, checked;
//! - `dense.rs`: the dense layer stack;
//! - `towers.rs`: the vision and audio towers;
//! - `execute.rs`: wants, outputs and routes;
//! - `vocab_mask.rs`: the output head's padded rows, never produced.
use std::borrow::Cow;
use std::ops::Range;

pub(crate) mod cache;
pub(crate) mod dense;
mod execute;
pub(crate) mod loader;
pub(crate) mod towers;
mod vocab_mask;

pub use cache::SequenceCache;
pub use execute::{RowOutput, StepMasks, Want};
pub(crate) use loader::{Loader, Norm};

use self::dense::{DenseLayers, Ropes};
use self::execute::Route;
use self::towers::Towers;
use self::vocab_mask::VocabMask;
use crate::adapters::{LoraBatch, LoraWeights, Target};
use crate::backend::capability::{self, Support};
use crate::backend::{Backend, KvLayer, KvLayerSnapshot, RopeSpec};
use crate::config::ModelConfig;
use crate::models::gemma4::{Gemma4Model, Prelude, TokenIds};
use crate::models::qwen35::Hybrid;
use crate::models::recurrent::RecurrentSnapshot;
use crate::models::vision::{ImageRows, PassMedia};
use crate::weights::WeightSource;
use crate::{EngineError, Result};

/// Which positions of a sequence a pass reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRequest {
    /// None (a non-final prefill chunk).
    None,
    /// The last position only (generation).
    Last,
    /// Every position (scoring, teacher forcing, speculative verification).
    All,
}

/// Which rows of a pass get logits: per sequence, by request; or picked rows of the
/// flattened batch (a training pass's loss rows).
#[derive(Clone, Copy)]
enum Pick<'a> {
    Requests(&'a [LogitsRequest]),
    Rows(&'a [usize]),
}

/// Where the new tokens of a forward pass come from.
pub enum Input<'a, B: Backend> {
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
    /// What the sequence wants back.
    pub want: Want,
    /// The adapters it runs with, their deltas summed in order (empty: the base model).
    pub adapters: Vec<&'a LoraWeights<B>>,
}

impl<'a, B: Backend> BatchItem<'a, B> {
    /// An item of `tokens` on the base model, wanting `want`.
    pub fn new(tokens: &'a [u32], cache: &'a mut SequenceCache<B>, want: Want) -> Self {
        BatchItem {
            tokens,
            cache,
            want,
            adapters: Vec::new(),
        }
    }
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

/// The layers between the embedding and the final norm, by family layout.
// One per loaded model: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum LayerStack<B: Backend> {
    /// One flat loop of attention and MLP blocks (every family but the two below).
    Dense(DenseLayers<B>),
    /// Gemma 4: per-layer inputs, KV shared between layers, per-kind head sizes, experts.
    Gemma4(Gemma4Model<B>),
    /// Qwen 3.5: gated DeltaNet layers between full-attention layers.
    Hybrid(Hybrid<B>),
}

/// The output head of a decoder ([`Decoder::output_head`]): logits are
/// `softcap(multiplier · (x·Wᵀ + bias))` of the final-normed hidden states `x`.
pub struct OutputHead<'a, B: Backend> {
    /// `W`, `[vocab, hidden]` (the tied embedding where the head is tied).
    pub matrix: &'a B::Matrix,
    /// `[vocab]`: 0 for the tokenizer's ids, `-inf` for padded rows of the head.
    pub bias: Option<&'a B::Tensor>,
    /// The family's logit multiplier.
    pub multiplier: Option<f32>,
    /// The final soft cap.
    pub softcap: Option<f32>,
}

/// The per-pass state of a training pass run in stages ([`Decoder::staged_pass`]): the
/// sequences' tokens, their (empty) caches, row ranges and what every layer reads besides
/// the residual stream.
pub struct StagedPass<B: Backend> {
    ids: Vec<u32>,
    pub(crate) caches: Vec<SequenceCache<B>>,
    pub(crate) ranges: Vec<Range<usize>>,
    stage: Stage<B>,
}

/// What the layers of a staged pass read besides the residual stream.
enum Stage<B: Backend> {
    /// A dense stack's rotary tables.
    Dense(Ropes<B>),
    /// Gemma 4's per-layer inputs and rotary tables.
    Gemma4(Prelude<B>),
    /// Qwen 3.5's rotary tables.
    Hybrid(Ropes<B>),
}

impl<B: Backend> StagedPass<B> {
    /// Rows of the pass (every token of every sequence).
    pub fn rows(&self) -> usize {
        self.ids.len()
    }
}

/// A loaded decoder-only transformer.
pub struct Decoder<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed: B::Matrix,
    output: Option<B::Matrix>,
    norm: Norm<B>,
    stack: LayerStack<B>,
    towers: Towers<B>,
    rope: RopeSpec,
    rope_local: Option<RopeSpec>,
    support: Support,
    weight_bytes: usize,
    /// The output head's rows past the tokenizer's ids, when it has some.
    vocab_mask: Option<VocabMask<B>>,
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

/// What `caps` runs of a model configured as `cfg`: its needs ([`crate::models::needs`])
/// held against the backend's capabilities, in one place.
pub fn support(caps: &capability::Capabilities, cfg: &ModelConfig) -> Support {
    let towers = [
        cfg.vision.is_some()
            || cfg.qwen_vision.is_some()
            || cfg.gemma4.as_ref().is_some_and(|g| g.vision.is_some()),
        cfg.audio.is_some(),
    ];
    capability::check(
        caps,
        &cfg.arch.to_string(),
        &crate::models::needs(cfg),
        towers,
    )
}

impl<B: Backend> Decoder<B> {
    /// Loads every weight of `cfg`'s architecture from `src` onto `backend`, after holding
    /// the model's needs against what the backend implements ([`support`]).
    pub fn load(backend: B, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let support = support(backend.capabilities(), &cfg);
        if let Err(e) = &support.text {
            return Err(EngineError::Unsupported(e.clone()));
        }
        check_layer_count(&cfg, src)?;
        let mut ld = Loader {
            backend: &backend,
            src,
            cfg: &cfg,
            bytes: 0,
        };
        let h = cfg.hidden_size;
        let embed = ld.matrix("token_embd.weight", cfg.vocab_size, h)?;
        // A file may carry an untied head even when the config says tied: use it. One
        // that says untied must carry it (running tied would be a different model).
        let output = if src.contains("output.weight") {
            Some(ld.matrix("output.weight", cfg.vocab_size, h)?)
        } else if cfg.tie_embeddings {
            None
        } else {
            return Err(EngineError::Config {
                source_name: src.source_name(),
                reason: "the weights hold no output head (lm_head.weight / output.weight) \
                         and the config does not tie it to the embedding \
                         (tie_word_embeddings is false)"
                    .into(),
            });
        };
        let norm = ld.full_norm("output_norm", h)?;
        let stack = if cfg.gemma4.is_some() {
            LayerStack::Gemma4(Gemma4Model::load(&mut ld, &cfg)?)
        } else if cfg.qwen35.is_some() {
            let (hybrid, bytes) = Hybrid::load(&backend, &cfg, src)?;
            ld.bytes += bytes;
            LayerStack::Hybrid(hybrid)
        } else {
            LayerStack::Dense(DenseLayers::load(&mut ld, &cfg)?)
        };
        let towers = Towers::load(&mut ld, &cfg, &support)?;
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
            stack,
            towers,
            rope,
            rope_local,
            support,
            weight_bytes,
            vocab_mask: None,
        })
    }

    /// Keeps the output head to the first `tokens` ids (the tokenizer's): the rows past
    /// them (a padded vocabulary) are never produced by any route of a pass
    /// (`vocab_mask.rs`).
    pub fn mask_vocabulary(&mut self, tokens: usize) -> Result<()> {
        self.vocab_mask = VocabMask::new(&self.backend, self.cfg.vocab_size, tokens)?;
        Ok(())
    }

    /// Ids the model may produce: the tokenizer's (see [`Decoder::mask_vocabulary`]), at
    /// most the output head's rows.
    pub fn vocab_size(&self) -> usize {
        self.vocab_mask
            .as_ref()
            .map_or(self.cfg.vocab_size, VocabMask::tokens)
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

    /// What of the model its backend runs (see [`support`]).
    pub fn support(&self) -> &Support {
        &self.support
    }

    /// What the vision tower reads, when one loaded.
    pub fn vision_caps(&self) -> Option<crate::media::VisionCaps> {
        self.towers.vision_caps()
    }

    /// What the audio tower reads, when one loaded.
    pub fn audio_caps(&self) -> Option<crate::media::AudioCaps> {
        self.towers.audio_caps()
    }

    /// Runs each item of `spans` through its tower (images through the vision tower,
    /// clips through the audio tower): the rows a sequence's cache keeps
    /// ([`SequenceCache::set_images`]), in prompt order, for the passes that reach them.
    /// Spans must be apart and as long as their tower's output.
    pub fn embed_media(&self, spans: &[crate::media::MediaSpan]) -> Result<Vec<ImageRows>> {
        self.towers.embed_media(&self.backend, &self.cfg, spans)
    }

    /// `(kv_heads, head_dim, window)` of each KV layer of a sequence's cache.
    fn cache_layout(&self) -> Vec<(usize, usize, Option<usize>)> {
        match &self.stack {
            LayerStack::Dense(d) => d.cache_layout(),
            LayerStack::Gemma4(g) => g.cache_layout(),
            LayerStack::Hybrid(h) => h
                .kv_layers()
                .iter()
                .map(|a| (a.kv_heads, a.head_dim, a.window))
                .collect(),
        }
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> SequenceCache<B> {
        SequenceCache {
            layers: self
                .cache_layout()
                .into_iter()
                .map(|(kv_heads, head_dim, window)| {
                    self.backend.new_kv_layer(kv_heads, head_dim, window)
                })
                .collect(),
            recurrent: match &self.stack {
                LayerStack::Hybrid(h) => Some(h.new_recurrent(&self.backend)),
                _ => None,
            },
            images: Vec::new(),
        }
    }

    /// Rebuilds a cache from host copies (as made by [`SequenceCache::snapshot`]).
    pub fn cache_from_snapshot(&self, layers: &[KvLayerSnapshot]) -> Result<SequenceCache<B>> {
        self.cache_from_snapshots(layers, None)
    }

    /// [`Decoder::cache_from_snapshot`] with the recurrent states a hybrid model's cache
    /// also needs (as made by [`crate::models::recurrent::RecurrentCache::snapshot`]).
    pub fn cache_from_snapshots(
        &self,
        layers: &[KvLayerSnapshot],
        recurrent: Option<&RecurrentSnapshot>,
    ) -> Result<SequenceCache<B>> {
        if let LayerStack::Hybrid(h) = &self.stack {
            return crate::models::qwen35::cache_from_snapshots(
                &self.backend,
                h,
                layers,
                recurrent,
            )
            .map(|(layers, recurrent)| SequenceCache {
                layers,
                recurrent: Some(recurrent),
                images: Vec::new(),
            });
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

    /// One step: runs the new tokens of every item through the model (each with its
    /// adapters), appending to each cache, and returns what each item wants
    /// ([`RowOutput`]). `masks` gives the token masks of [`Want::MaskedToken`] rows.
    pub fn execute(
        &self,
        batch: &mut [BatchItem<'_, B>],
        masks: Option<StepMasks<'_>>,
    ) -> Result<Vec<RowOutput>> {
        let wants: Vec<Want> = batch.iter().map(|i| i.want).collect();
        let route = Route::of(&wants)?;
        let lora: Vec<Vec<&LoraWeights<B>>> = batch.iter().map(|i| i.adapters.clone()).collect();
        let be = &self.backend;
        let vocab = self.cfg.vocab_size;
        match route {
            Route::Silent | Route::Hidden | Route::Logits => be.pass(|| {
                let (out, rows) = self.run_batch(batch, route == Route::Hidden, &lora)?;
                let Some(out) = out else {
                    return Ok(vec![RowOutput::Nothing; wants.len()]);
                };
                let data = be.rows_to_host(&out, &rows)?;
                Ok(rows
                    .into_iter()
                    .zip(data)
                    .map(|(n, mut data)| match (n, route) {
                        (0, _) => RowOutput::Nothing,
                        (_, Route::Hidden) => RowOutput::Hidden(data),
                        _ => {
                            if let Some(m) = &self.vocab_mask {
                                m.apply_on_host(&mut data, vocab);
                            }
                            RowOutput::Logits(Logits {
                                rows: n,
                                vocab,
                                data,
                            })
                        }
                    })
                    .collect())
            }),
            Route::Argmax | Route::MaskedArgmax | Route::ArgmaxRows => {
                let (ids, rows) = be.pass(|| {
                    let (out, rows) = self.run_batch(batch, false, &lora)?;
                    let logits = out.ok_or_else(|| {
                        EngineError::InvalidInput("no item asks for a token".into())
                    })?;
                    if route != Route::MaskedArgmax {
                        return Ok((be.argmax(&logits)?, rows));
                    }
                    be.schedule_tensor(&logits)?;
                    // Logits rows are the items that read a position, in order.
                    let all = masks.map(|m| m()).unwrap_or_default();
                    let row_masks: Vec<Option<Vec<u32>>> = rows
                        .iter()
                        .enumerate()
                        .filter(|(_, &n)| n > 0)
                        .map(|(i, _)| all.get(i).cloned().flatten())
                        .collect();
                    Ok((be.masked_argmax(&logits, &row_masks)?, rows))
                })?;
                let mut ids = be.ids_to_host(&ids)?.into_iter();
                Ok(rows
                    .into_iter()
                    .zip(&wants)
                    .map(|(n, want)| {
                        let picked: Vec<u32> = ids.by_ref().take(n).collect();
                        match (n, want) {
                            (0, _) => RowOutput::Nothing,
                            (_, Want::Tokens) => RowOutput::Tokens(picked),
                            _ => picked
                                .last()
                                .map_or(RowOutput::Nothing, |&t| RowOutput::Token(t)),
                        }
                    })
                    .collect())
            }
        }
    }

    /// [`Decoder::execute`] for items that each want logits (or nothing): what tests and
    /// reference comparisons read.
    pub fn forward_logits(&self, batch: &mut [BatchItem<'_, B>]) -> Result<Vec<Option<Logits>>> {
        Ok(self
            .execute(batch, None)?
            .into_iter()
            .map(|o| match o {
                RowOutput::Logits(l) => Some(l),
                _ => None,
            })
            .collect())
    }

    /// One greedy decode step of several sequences, one new token each (`ids[i]` for
    /// `caches[i]`), whose argmax stays on the backend: fed the previous step's ids
    /// ([`Input::Backend`]), the step is built without waiting for them, so a lockstep
    /// greedy run queues each step before the host reads the last one's ids. Returns the
    /// next ids, scheduled.
    pub fn decode_ids(
        &self,
        ids: Input<'_, B>,
        caches: &mut [&mut SequenceCache<B>],
    ) -> Result<B::Ids> {
        let counts = vec![1; caches.len()];
        let requests = vec![LogitsRequest::Last; caches.len()];
        self.backend.pass(|| {
            let (logits, _) =
                self.run(ids, caches, &counts, Pick::Requests(&requests), false, &[])?;
            let logits = logits.ok_or_else(|| EngineError::InvalidInput("empty batch".into()))?;
            let next = self.backend.argmax(&logits)?;
            self.backend.schedule(&next)?;
            Ok(next)
        })
    }

    /// [`Decoder::run`] over a batch of host tokens: their ids flattened, each item's count,
    /// positions read and cache.
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
        let requests: Vec<LogitsRequest> = batch.iter().map(|i| i.want.positions()).collect();
        let mut caches: Vec<&mut SequenceCache<B>> =
            batch.iter_mut().map(|i| &mut *i.cache).collect();
        self.run(
            Input::Host(&ids),
            &mut caches,
            &counts,
            Pick::Requests(&requests),
            hidden,
            lora,
        )
    }

    /// A training pass: each of `seqs` from an empty cache, every sequence with
    /// `adapters`, returning the logits of `rows` (indices into the sequences' tokens laid
    /// end to end) as a tensor kept on the backend, for a training backend
    /// ([`crate::backend::tape::TapeBackend`]) to take their gradient back through the
    /// pass.
    pub fn forward_rows(
        &self,
        seqs: &[&[u32]],
        rows: &[usize],
        adapters: &[&LoraWeights<B>],
    ) -> Result<B::Tensor> {
        self.training_pass(seqs, rows, adapters, false)
    }

    /// [`Decoder::forward_rows`] stopped before the output head: the final-normed hidden
    /// states of `rows`, which [`Decoder::output_head`] maps to logits. A trainer takes
    /// the loss rows through the head in chunks of rows rather than holding all their
    /// logits (`[rows, vocab]`) at once.
    pub fn forward_hidden_rows(
        &self,
        seqs: &[&[u32]],
        rows: &[usize],
        adapters: &[&LoraWeights<B>],
    ) -> Result<B::Tensor> {
        self.training_pass(seqs, rows, adapters, true)
    }

    /// The output head: logits are `softcap(multiplier · (x·Wᵀ + bias))` of the final-normed
    /// hidden states `x`, each step where the family has it.
    pub fn output_head(&self) -> OutputHead<'_, B> {
        OutputHead {
            matrix: self.output.as_ref().unwrap_or(&self.embed),
            bias: self.vocab_mask.as_ref().map(VocabMask::bias),
            multiplier: self.cfg.features.logit_multiplier,
            softcap: self.cfg.final_softcap,
        }
    }

    fn training_pass(
        &self,
        seqs: &[&[u32]],
        rows: &[usize],
        adapters: &[&LoraWeights<B>],
        hidden: bool,
    ) -> Result<B::Tensor> {
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        let counts: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let mut owned: Vec<SequenceCache<B>> = seqs.iter().map(|_| self.new_cache()).collect();
        let mut caches: Vec<&mut SequenceCache<B>> = owned.iter_mut().collect();
        let lora: Vec<Vec<&LoraWeights<B>>> = seqs.iter().map(|_| adapters.to_vec()).collect();
        let (out, _) = self.backend.pass(|| {
            self.run(
                Input::Host(&ids),
                &mut caches,
                &counts,
                Pick::Rows(rows),
                hidden,
                &lora,
            )
        })?;
        out.ok_or_else(|| EngineError::InvalidInput("a training pass picked no row".into()))
    }

    /// A training pass cut at layer boundaries, for gradient checkpointing: what
    /// [`Decoder::forward_rows`] runs in one call, in stages a trainer can repeat —
    /// [`Decoder::staged_embed`], [`Decoder::staged_layers`] over any span of layers (a
    /// span's input is the residual stream its first layer reads) and
    /// [`Decoder::staged_head`]. Running every layer in one span gives what
    /// `forward_rows` gives; a span ends on the residual sum, and the next span
    /// normalizes it, so cutting the stack changes no value. Every stack: dense, Qwen 3.5
    /// and Gemma 4 (whose per-layer inputs are computed here, once, with `adapters`; an
    /// adapter of its per-layer model projection is refused, as its gradient would not
    /// reach it).
    pub fn staged_pass(
        &self,
        seqs: &[&[u32]],
        adapters: &[&LoraWeights<B>],
    ) -> Result<StagedPass<B>> {
        let counts: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        if counts.contains(&0) {
            return Err(EngineError::InvalidInput(
                "a sequence in the batch has no new tokens".into(),
            ));
        }
        let mut caches: Vec<SequenceCache<B>> = seqs.iter().map(|_| self.new_cache()).collect();
        let mut ranges = Vec::with_capacity(seqs.len());
        let mut positions = Vec::new();
        let mut total = 0;
        for &n in &counts {
            ranges.push(total..total + n);
            total += n;
            positions.extend(0..n);
        }
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        let stage = match &self.stack {
            LayerStack::Dense(_) => {
                let refs: Vec<&mut SequenceCache<B>> = caches.iter_mut().collect();
                Stage::Dense(self.ropes(&refs, &counts, &positions)?)
            }
            LayerStack::Gemma4(g) => {
                if adapters.iter().any(|a| a.has(0, Target::PleModel)) {
                    return Err(EngineError::InvalidInput(
                        "a staged training pass of an adapter of Gemma 4's per-layer model \
                         projection (its gradient would not reach it)"
                            .into(),
                    ));
                }
                let x = self.embed_rows(Input::Host(&ids), None, total)?.0;
                let lora: Vec<Vec<&LoraWeights<B>>> =
                    ranges.iter().map(|_| adapters.to_vec()).collect();
                let lora = LoraBatch::new(&lora, &ranges);
                let be = &self.backend;
                Stage::Gemma4(be.pass(|| {
                    g.prelude(be, &self.cfg, &x, TokenIds::Host(&ids), &positions, &lora)
                })?)
            }
            LayerStack::Hybrid(_) => {
                let refs: Vec<&mut SequenceCache<B>> = caches.iter_mut().collect();
                Stage::Hybrid(self.ropes(&refs, &counts, &positions)?)
            }
        };
        Ok(StagedPass {
            ids,
            caches,
            ranges,
            stage,
        })
    }

    /// Each layer's cache entry, and whether it reads an earlier layer's keys and values
    /// instead of appending its own (Gemma 4's KV-shared layers); `None` for a model whose
    /// layers each have their own.
    pub fn kv_slots(&self) -> Option<Vec<(usize, bool)>> {
        match &self.stack {
            LayerStack::Gemma4(g) => Some(g.kv_slots()),
            _ => None,
        }
    }

    /// The layers of the stack.
    pub fn num_layers(&self) -> usize {
        match &self.stack {
            LayerStack::Dense(d) => d.len(),
            _ => self.cfg.num_layers,
        }
    }

    /// The embedded tokens of a staged pass, the first span's input.
    pub fn staged_embed(&self, pass: &StagedPass<B>) -> Result<B::Tensor> {
        let total = pass.ids.len();
        Ok(self.embed_rows(Input::Host(&pass.ids), None, total)?.0)
    }

    /// Layers `span` of a staged pass from their input `x` (every sequence with
    /// `adapters`), returning the residual stream after the span's last layer.
    pub fn staged_layers(
        &self,
        pass: &mut StagedPass<B>,
        x: B::Tensor,
        span: Range<usize>,
        adapters: &[&LoraWeights<B>],
    ) -> Result<B::Tensor> {
        if !adapters.is_empty() {
            if let Err(e) = &self.support.adapters {
                return Err(EngineError::Unsupported(e.clone()));
            }
        }
        let lora: Vec<Vec<&LoraWeights<B>>> =
            pass.ranges.iter().map(|_| adapters.to_vec()).collect();
        let lora = LoraBatch::new(&lora, &pass.ranges);
        // A span run again (a checkpointed layer recomputed in the backward) starts from
        // empty caches, as it did the first time: the entries its layers append to (a
        // Gemma 4 layer reading an earlier layer's keys leaves them as they are).
        let own: Vec<usize> = match self.kv_slots() {
            Some(slots) => slots
                .get(span.clone())
                .unwrap_or_default()
                .iter()
                .filter(|(_, reads)| !reads)
                .map(|&(slot, _)| slot)
                .collect(),
            None => span.clone().collect(),
        };
        for cache in &mut pass.caches {
            if let LayerStack::Hybrid(h) = &self.stack {
                h.reset_span(&self.backend, cache, span.clone())?;
                continue;
            }
            for &slot in &own {
                if let Some(layer) = cache.layers_mut().get_mut(slot) {
                    layer.trim(0)?;
                }
            }
        }
        let mut caches: Vec<&mut SequenceCache<B>> = pass.caches.iter_mut().collect();
        let (be, cfg) = (&self.backend, &self.cfg);
        match (&self.stack, &pass.stage) {
            (LayerStack::Dense(d), Stage::Dense(ropes)) => be.pass(|| {
                d.run(
                    be,
                    cfg,
                    ropes,
                    x,
                    &mut caches,
                    &pass.ranges,
                    None,
                    &lora,
                    span,
                )
            }),
            (LayerStack::Hybrid(h), Stage::Hybrid(ropes)) => {
                be.pass(|| h.run_span(be, x, &mut caches, &pass.ranges, &ropes.global, &lora, span))
            }
            (LayerStack::Gemma4(g), Stage::Gemma4(prelude)) => be.pass(|| {
                g.run_span(
                    be,
                    cfg,
                    prelude,
                    x,
                    &mut caches,
                    &pass.ranges,
                    None,
                    &lora,
                    span,
                )
            }),
            _ => Err(EngineError::InvalidInput(
                "a staged pass of another model".into(),
            )),
        }
    }

    /// The logits of `rows` (of the sequences laid end to end) of the last span's output.
    pub fn staged_head(
        &self,
        pass: &StagedPass<B>,
        x: &B::Tensor,
        rows: &[usize],
    ) -> Result<B::Tensor> {
        self.staged_rows(pass, x, rows, false)
    }

    /// The final-normed hidden states of `rows` of the last span's output (the input of
    /// [`Decoder::output_head`]).
    pub fn staged_hidden(
        &self,
        pass: &StagedPass<B>,
        x: &B::Tensor,
        rows: &[usize],
    ) -> Result<B::Tensor> {
        self.staged_rows(pass, x, rows, true)
    }

    fn staged_rows(
        &self,
        pass: &StagedPass<B>,
        x: &B::Tensor,
        rows: &[usize],
        hidden: bool,
    ) -> Result<B::Tensor> {
        let total = pass.rows();
        if rows.is_empty() {
            return Err(EngineError::InvalidInput(
                "a training pass picked no row".into(),
            ));
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= total) {
            return Err(EngineError::InvalidInput(format!(
                "row {bad} picked of a pass of {total}"
            )));
        }
        self.backend.pass(|| self.head(x, rows, hidden))
    }

    /// The forward pass: `counts[i]` new tokens of `caches[i]` (flattened in `input`),
    /// returning the logits rows `requests` ask for — or the final-normed hidden states
    /// with `hidden` — (`None` when none is asked) and how many rows belong to each
    /// sequence.
    fn run(
        &self,
        input: Input<'_, B>,
        caches: &mut [&mut SequenceCache<B>],
        counts: &[usize],
        requests: Pick<'_>,
        hidden: bool,
        lora: &[Vec<&LoraWeights<B>>],
    ) -> Result<(Option<B::Tensor>, Vec<usize>)> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let kv_layers = self.cache_layout().len();
        let mut positions = Vec::new();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(caches.len());
        let mut total = 0;
        for (cache, &n) in caches.iter().zip(counts) {
            if n == 0 {
                return Err(EngineError::InvalidInput(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            if cache.layers.len() != kv_layers {
                return Err(EngineError::Cache("cache belongs to another model".into()));
            }
            let start = cache.len();
            ranges.push(total..total + n);
            total += n;
            positions.extend(start..start + n);
        }
        let media = {
            let images: Vec<&[ImageRows]> = caches.iter().map(|c| c.images.as_slice()).collect();
            let passes: Vec<Range<usize>> = caches
                .iter()
                .zip(counts)
                .map(|(c, &n)| c.len()..c.len() + n)
                .collect();
            PassMedia::for_pass(&images, &passes, &ranges)?
        };
        if media.is_some() && self.towers.is_empty() {
            return Err(EngineError::InvalidInput(format!(
                "{} models do not read media",
                cfg.arch
            )));
        }
        let lora = LoraBatch::new(lora, &ranges);
        if !lora.is_empty() {
            if let Err(e) = &self.support.adapters {
                return Err(EngineError::Unsupported(e.clone()));
            }
        }
        // Gemma 4's per-layer inputs embed the ids the backend holds where its per-layer
        // table covers every id the logits can pick; else they are read on the host (and
        // the step waits for them).
        let host_ids;
        let (input, device_ids) = match (input, &self.stack) {
            (Input::Backend(ids), LayerStack::Gemma4(g))
                if g.embeds_backend_ids(cfg.vocab_size) =>
            {
                (Input::Backend(ids), Some(ids))
            }
            (Input::Backend(ids), LayerStack::Gemma4(_)) => {
                host_ids = be.ids_to_host(ids)?;
                (Input::Host(&host_ids), None)
            }
            (input, _) => (input, None),
        };
        let (x, ids) = self.embed_rows(input, media.as_ref(), total)?;
        let x = match &self.stack {
            LayerStack::Dense(d) => {
                let ropes = self.ropes(caches, counts, &positions)?;
                let ends = media
                    .as_ref()
                    .filter(|_| !self.towers.causal_images())
                    .map(|m| m.ends.as_slice());
                d.run(be, cfg, &ropes, x, caches, &ranges, ends, &lora, 0..d.len())?
            }
            LayerStack::Hybrid(h) => {
                let ropes = self.ropes(caches, counts, &positions)?;
                h.run_layers(be, x, caches, &ranges, &ropes.global, &lora)?
            }
            LayerStack::Gemma4(g) => {
                let ids = match (&ids, device_ids) {
                    (Some(ids), _) => TokenIds::Host(ids),
                    (None, Some(ids)) => TokenIds::Backend(ids),
                    (None, None) => {
                        return Err(EngineError::InvalidInput(
                            "Gemma 4's per-layer inputs got no token ids".into(),
                        ))
                    }
                };
                g.run_layers(
                    be,
                    cfg,
                    x,
                    ids,
                    &positions,
                    caches,
                    &ranges,
                    media.as_ref(),
                    &lora,
                )?
            }
        };

        let mut rows = Vec::new();
        let mut per_item = Vec::with_capacity(caches.len());
        match requests {
            Pick::Requests(requests) => {
                for (request, r) in requests.iter().zip(&ranges) {
                    let before = rows.len();
                    match request {
                        LogitsRequest::None => {}
                        LogitsRequest::Last => rows.push(r.end - 1),
                        LogitsRequest::All => rows.extend(r.clone()),
                    }
                    per_item.push(rows.len() - before);
                }
            }
            Pick::Rows(picked) => {
                if let Some(&bad) = picked.iter().find(|&&r| r >= total) {
                    return Err(EngineError::InvalidInput(format!(
                        "row {bad} picked of a pass of {total}"
                    )));
                }
                rows.extend_from_slice(picked);
                per_item.push(rows.len());
            }
        }
        if rows.is_empty() {
            return Ok((None, per_item));
        }
        Ok((Some(self.head(&x, &rows, hidden)?), per_item))
    }

    /// The final norm of `rows` of the stack's output `x` and, unless `hidden`, their
    /// logits.
    fn head(&self, x: &B::Tensor, rows: &[usize], hidden: bool) -> Result<B::Tensor> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let x = be.select_rows(x, rows)?;
        let x = self.norm.apply(be, cfg, &x)?;
        if hidden {
            return Ok(x);
        }
        let head = self.output.as_ref().unwrap_or(&self.embed);
        let mut logits = be.linear(&x, head, self.vocab_mask.as_ref().map(VocabMask::bias))?;
        if let Some(m) = cfg.features.logit_multiplier {
            logits = be.scale(&logits, m)?;
        }
        if let Some(cap) = cfg.final_softcap {
            logits = be.softcap(&logits, cap)?;
        }
        Ok(logits)
    }

    /// The embedded new tokens `[total, hidden]`: scaled as the family scales them, each
    /// media row in place of its soft token's (unscaled: the scale is the text table's);
    /// and the host ids, with soft tokens standing for the family's placeholder (their
    /// ids need not be in the table), when the input came from the host.
    fn embed_rows(
        &self,
        input: Input<'_, B>,
        media: Option<&PassMedia>,
        total: usize,
    ) -> Result<(B::Tensor, Option<Vec<u32>>)> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let (mut x, ids) = match input {
            Input::Host(ids) => {
                let mut ids = ids.to_vec();
                if let Some(m) = media {
                    let placeholder = match &self.stack {
                        LayerStack::Gemma4(g) => g.pad_id(),
                        _ => 0,
                    };
                    for (row, _, _) in &m.replace {
                        if let Some(id) = ids.get_mut(*row) {
                            *id = placeholder;
                        }
                    }
                }
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
                    return Err(EngineError::InvalidInput(format!(
                        "token id {bad} is outside the vocabulary of {}",
                        cfg.vocab_size
                    )));
                }
                (be.embed(&self.embed, &ids)?, Some(ids))
            }
            Input::Backend(ids) => (be.embed_ids(&self.embed, ids)?, None),
        };
        if cfg.scale_embeddings {
            x = be.scale(&x, (cfg.hidden_size as f32).sqrt())?;
        }
        if let Some(m) = cfg.features.embed_multiplier {
            x = be.scale(&x, m)?;
        }
        if let Some(m) = media {
            x = place_rows(be, x, m, total, cfg.hidden_size)?;
        }
        Ok((x, ids))
    }

    /// The rotary tables of a dense or hybrid pass over `positions`: M-RoPE triples where a
    /// sequence of the pass has images on a model with grid positions (text alone gives
    /// the same angles, so text-only passes keep the plain table); the frequencies of
    /// length-dependent scalings (dynamic NTK, LongRoPE) for the pass's longest sequence.
    fn ropes(
        &self,
        caches: &[&mut SequenceCache<B>],
        counts: &[usize],
        positions: &[usize],
    ) -> Result<Ropes<B>> {
        let be = &self.backend;
        let cfg = &self.cfg;
        let longest = caches
            .iter()
            .zip(counts)
            .map(|(c, &n)| c.len() + n)
            .max()
            .unwrap_or(0);
        let mrope = cfg
            .mrope
            .as_ref()
            .filter(|_| caches.iter().any(|c| !c.images.is_empty()));
        let global = match mrope {
            Some(m) => {
                let mut triples = Vec::with_capacity(positions.len());
                for (cache, &n) in caches.iter().zip(counts) {
                    let start = cache.len();
                    triples.extend(crate::models::mrope::positions(
                        &cache.images,
                        start..start + n,
                    ));
                }
                be.rope_table_axes(&triples, &m.axes, &self.rope)?
            }
            None => be.rope_table(
                positions,
                &spec_for_len(cfg, &cfg.rope, &self.rope, longest),
            )?,
        };
        let local = match (&cfg.rope_local, &self.rope_local) {
            (Some(r), Some(s)) => {
                Some(be.rope_table(positions, &spec_for_len(cfg, r, s, longest))?)
            }
            _ => None,
        };
        Ok(Ropes { global, local })
    }
}

/// `x` `[total, h]` with the media rows of `m` in place of their soft tokens' rows.
fn place_rows<B: Backend>(
    be: &B,
    x: B::Tensor,
    m: &PassMedia,
    total: usize,
    h: usize,
) -> Result<B::Tensor> {
    let mut host = be.rows_to_host(&x, &[total])?.pop().unwrap_or_default();
    for (row, rows, i) in &m.replace {
        let (dst, src) = (row * h..(row + 1) * h, i * h..(i + 1) * h);
        match (host.get_mut(dst), rows.get(src)) {
            (Some(dst), Some(src)) => dst.copy_from_slice(src),
            _ => {
                return Err(EngineError::InvalidInput(format!(
                    "media row {i} does not fit the pass's row {row} of width {h}"
                )))
            }
        }
    }
    be.tensor_from_host(host, total, h)
}
