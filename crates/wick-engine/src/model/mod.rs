//! [`Model`]: a loaded model with its tokenizer, chat template and generation defaults —
//! the engine's public entry point.
//!
//! - this file: the facade (what a loaded model offers);
//! - `dispatch.rs`: the decoder and caches on whichever backend the model runs on;
//! - `kv_cache.rs`: [`KvCache`], one sequence's cache and its charge to the KV pool;
//! - `loading.rs`: reading GGUF files and Hugging Face directories;
//! - `execute.rs`: [`Model::execute`], the one entry point of a forward pass;
//! - `adapters.rs`: loading adapters onto the model's backend;
//! - `generate.rs`: checking a request and running it alone;
//! - `fingerprint.rs`: what a saved KV cache must match to be reused.
mod adapters;
mod dispatch;
mod execute;
mod fingerprint;
mod generate;
mod kv_cache;
mod loading;

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use wick_chat::chat_template::{ChatInput, ChatTemplate};
use wick_chat::tokenizer::Tokenizer;

pub(crate) use self::dispatch::PeakBlocks;
use self::dispatch::{with_cache, with_decoder, wrap_cache, AnyCache, AnyDecoder};
pub use self::execute::{StepPlan, StepRow};
pub use self::kv_cache::KvCache;
use crate::backend::candle::KvDtype;
use crate::backend::capability::{Capabilities, Capability, Support};
use crate::backend::{BackendKind, KvLayerSnapshot};
use crate::config::ModelConfig;
use crate::models::decoder::LogitsRequest;
use crate::models::greedy::{self, GreedyRun};
use crate::models::Arch;
use crate::{EngineError, Result};

/// The file format a model was loaded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// A single GGUF file (weights, tokenizer and template inside).
    Gguf,
    /// A Hugging Face directory (config.json, safetensors, tokenizer files).
    HuggingFace,
}

/// Facts about a loaded model, for logs, `/v1/models` and `/stats`.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Display name (file stem or directory name).
    pub name: String,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// File format.
    pub format: ModelFormat,
    /// Architecture.
    pub arch: Arch,
    /// Context limit requests are checked against.
    pub context_length: usize,
    /// Bytes of weights on the backend.
    pub weight_bytes: usize,
    /// Compute backend name.
    pub backend: &'static str,
    /// How the KV cache stores numbers (`f16`, `f32`; the MLX backend keeps the
    /// checkpoint's compute type, `mlx`).
    pub kv_type: &'static str,
    /// The media towers that loaded (none for a text model).
    pub media: crate::media::MediaCaps,
}

/// Sampling defaults from `generation_config.json` (absent fields are `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Default temperature.
    pub temperature: Option<f32>,
    /// Default nucleus mass.
    pub top_p: Option<f32>,
    /// Default top-k.
    pub top_k: Option<usize>,
    /// Default repetition penalty.
    pub repetition_penalty: Option<f32>,
}

/// Options for [`Model::load`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Overrides the context limit (never above what the model was trained for).
    pub context_length: Option<usize>,
    /// The compute backend (candle unless asked otherwise).
    pub backend: BackendKind,
    /// How the CPU backend's KV cache stores numbers. Default: f16 for GGUF files (as
    /// llama.cpp does; it halves the memory batched decode streams), f32 for Hugging Face
    /// directories (the checkpoint's reference numerics).
    pub kv_dtype: Option<KvDtype>,
}

/// An accelerator's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// All of it.
    pub total: u64,
    /// What could still be allocated now.
    pub free: u64,
}

/// One sequence's part of a batched [`Model::forward`].
pub struct Step<'a> {
    /// New tokens.
    pub tokens: &'a [u32],
    /// The sequence's cache.
    pub cache: &'a mut KvCache,
    /// Which logits to return.
    pub logits: LogitsRequest,
}

/// A loaded model: weights on a backend, tokenizer, chat template, defaults.
///
/// ```no_run
/// use wick_engine::{Model, LoadOptions, GenerationRequest};
/// let model = Model::load("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), &LoadOptions::default())?;
/// let prompt = model.render_chat(&[serde_json::json!({"role": "user", "content": "Hi!"})], None, &Default::default())?;
/// let request = GenerationRequest::new(model.tokenize(&prompt)?).max_tokens(32);
/// let out = model.generate(&request, |token| {
///     print!("{}", token.text);
///     std::ops::ControlFlow::Continue(())
/// })?;
/// println!("\n{:?} after {} tokens", out.finish_reason, out.tokens.len());
/// # Ok::<(), wick_engine::EngineError>(())
/// ```
pub struct Model {
    decoder: AnyDecoder,
    tokenizer: Tokenizer,
    template: Option<Arc<ChatTemplate>>,
    template_source: Option<String>,
    info: ModelInfo,
    defaults: GenerationDefaults,
    eos: Vec<u32>,
    /// Structured output's token trie and parser factory, built on first use.
    pub(crate) grammars: crate::constraint::GrammarsSlot,
    /// How adapters mounted from now on keep their factors.
    adapter_dtype: crate::adapters::AdapterDtype,
    /// Whether the base computes on f32 weights (the adapter factor rule's input).
    base_precision: crate::adapters::BasePrecision,
}

impl Model {
    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Whether a long cache of this model can always be cut back to a shorter prefix. Sliding
    /// windows that wrap and recurrent layers (Qwen 3.5) cannot: an entry of theirs serves
    /// only its own length, so the prompt cache keeps entries where turns part.
    pub fn caches_can_be_cut_back(&self) -> bool {
        let c = self.config();
        !c.layer_windows.iter().any(Option::is_some) && c.qwen35.is_none()
    }

    /// The architecture configuration.
    pub fn config(&self) -> &ModelConfig {
        with_decoder!(&self.decoder, d => d.config())
    }

    /// The ids the model reads and produces: its tokenizer's, at most the embedding's
    /// rows. Less than [`ModelConfig::vocab_size`] when the checkpoint pads its embedding
    /// and output head (Qwen's 151,936 rows for 151,665 tokens): the padded ids are never
    /// generated, and prompts and `logit_bias` may not name them.
    pub fn vocab_size(&self) -> usize {
        with_decoder!(&self.decoder, d => d.vocab_size())
    }

    /// What of the model its backend runs: the text model (it loaded, so yes), images,
    /// audio, adapters and speculative decoding, each with the reason where it cannot
    /// ([`crate::backend::capability`]).
    pub fn support(&self) -> &Support {
        with_decoder!(&self.decoder, d => d.support())
    }

    /// What the model's backend implements.
    pub fn capabilities(&self) -> &'static Capabilities {
        with_decoder!(&self.decoder, d => crate::backend::Backend::capabilities(d.backend()))
    }

    /// Whether a decode step may feed drafted tokens and cut the rejected ones off again
    /// ([`crate::speculative`]): the family's caches can be trimmed at any length (no
    /// sliding window, no recurrent state as in Qwen 3.5, no KV shared across layers as
    /// in Gemma 4) and the backend verifies drafts ([`Model::support`] says why not).
    pub fn can_speculate(&self) -> bool {
        self.support().speculation.is_ok()
    }

    /// Whether a row may verify drafts while other rows decode beside it. MLX decodes a
    /// batch in one buffer per layer whose rows all end in the same column
    /// (`backend/mlx/arena.rs`); a row that fed several tokens would leave it (its KV
    /// copied out, and back in at its next plain step), so on MLX a sequence drafts
    /// only while it is the one decoding.
    pub fn speculates_in_batches(&self) -> bool {
        self.capabilities().has(Capability::BatchedSpeculation)
    }

    /// Whether structured output's greedy rows are better picked by the backend's masked
    /// argmax ([`crate::Want::MaskedToken`]) than sampled on the host: on a device
    /// backend, where the logits would otherwise cross to the host every step. On the
    /// CPU, checking the sampled token first usually needs no mask at all.
    pub fn prefers_backend_masks(&self) -> bool {
        self.capabilities().device_logits
    }

    /// Tokens a step of prompt chunks alone carries unless configured otherwise: the
    /// backend's preference, never under `step_budget` (the step budget where it has none).
    pub fn lone_prompt_tokens(&self, step_budget: usize) -> usize {
        self.capabilities()
            .lone_prompt_tokens
            .map_or(step_budget, |n| n.max(step_budget))
    }

    /// The default bound on decoding rows' inter-token gap while a prompt arrives, as a
    /// multiple of a decode-only step (`None`: chunks of the step budget).
    pub fn itl_factor(&self) -> Option<f64> {
        self.capabilities().itl_factor
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_deref()
    }

    /// The chat template's Jinja source, if any.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// Defaults from `generation_config.json`.
    pub fn generation_defaults(&self) -> &GenerationDefaults {
        &self.defaults
    }

    /// End-of-sequence ids: the config's ∪ the tokenizer's.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Renders messages (OpenAI shape) through the chat template with a generation prompt.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| EngineError::NoChatTemplate(self.info.name.clone()))?;
        let input = ChatInput {
            messages: wick_chat::chat_template::normalize_messages(messages.to_vec()),
            tools: tools.map(<[Value]>::to_vec),
            add_generation_prompt: true,
            kwargs: kwargs.clone(),
        };
        Ok(template.render(&input)?)
    }

    /// Tokenizes a prompt: special-token text is parsed, BOS added when the model asks for
    /// it, and a BOS the template already wrote is not doubled.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        if let (Some(bos), true) = (self.tokenizer.bos_id(), ids.len() >= 2) {
            if ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        Ok(ids)
    }

    /// Bytes of one KV block of one layer (keys and values of
    /// [`BLOCK_TOKENS`](crate::kv_pool::BLOCK_TOKENS) tokens in the cache's number type),
    /// the unit of the KV pool.
    pub fn kv_block_bytes(&self) -> usize {
        let cfg = self.config();
        crate::kv_pool::block_bytes(
            cfg.num_kv_heads * cfg.head_dim,
            self.decoder.kv_number_bytes(),
        )
    }

    /// How many KV pool blocks a layer holds at most on this model's backend.
    pub(crate) fn kv_peak_blocks(&self) -> dispatch::PeakBlocks {
        self.decoder.kv_peak_blocks()
    }

    /// The GPU memory the model's KV cache would live in (`None` when that is host RAM).
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        self.decoder.device_memory()
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            inner: with_decoder!(&self.decoder, d => wrap_cache(d.new_cache())),
        }
    }

    /// Rebuilds a cache from [`KvCache::snapshot`] output.
    pub fn cache_from_snapshot(&self, layers: &[KvLayerSnapshot]) -> Result<KvCache> {
        Ok(KvCache {
            inner: with_decoder!(&self.decoder, d => wrap_cache(d.cache_from_snapshot(layers)?)),
        })
    }

    /// Rebuilds a cache from [`KvCache::snapshot`] and, for a hybrid model, its
    /// [`KvCache::recurrent_snapshot`].
    pub fn cache_from_snapshots(
        &self,
        layers: &[KvLayerSnapshot],
        recurrent: Option<&crate::models::recurrent::RecurrentSnapshot>,
    ) -> Result<KvCache> {
        Ok(KvCache {
            inner: with_decoder!(&self.decoder, d => wrap_cache(d.cache_from_snapshots(layers, recurrent)?)),
        })
    }

    /// Runs a request's media through the model's towers and keeps the projected rows
    /// with `cache`: the forward passes that reach each span's positions take those rows
    /// instead of the soft tokens' embeddings, and an image's soft tokens see each other
    /// both ways. A pass must hold each span it reaches whole (see
    /// [`KvCache::chunk_end`]). A model without the tower a span needs, or a span whose
    /// length is not the tower's output, is an error.
    pub fn attach_media(
        &self,
        cache: &mut KvCache,
        media: &[crate::media::MediaSpan],
    ) -> Result<()> {
        let images = if media.is_empty() {
            Vec::new()
        } else {
            with_decoder!(&self.decoder, d => d.embed_media(media))?
        };
        with_cache!(&mut cache.inner, c => c.set_images(images));
        Ok(())
    }

    /// The projected rows each media item of `media` puts in the prompt (`len × hidden`
    /// values per span, row-major, in prompt order): what [`Model::attach_media`] keeps,
    /// for checking a tower on its own.
    pub fn media_rows(&self, media: &[crate::media::MediaSpan]) -> Result<Vec<Vec<f32>>> {
        let rows = with_decoder!(&self.decoder, d => d.embed_media(media))?;
        Ok(rows.into_iter().map(|r| r.rows.to_vec()).collect())
    }

    /// Greedy generation of `max_tokens` tokens for every prompt, in lockstep, with the
    /// argmax taken on the backend and each decode step queued before the host reads the
    /// previous step's ids (no logits leave the device). Prompts longer than
    /// `prefill_chunk` are fed in chunks. End-of-sequence ids do not stop a sequence.
    pub fn generate_greedy(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        prefill_chunk: usize,
    ) -> Result<GreedyRun> {
        let limit = self.info.context_length;
        for p in prompts {
            if p.is_empty() {
                return Err(EngineError::InvalidInput("the prompt is empty".into()));
            }
            if p.len() + max_tokens > limit {
                return Err(EngineError::ContextOverflow {
                    needed: p.len() + max_tokens,
                    limit,
                });
            }
        }
        with_decoder!(&self.decoder, d => greedy::run(d, prompts, max_tokens, prefill_chunk))
    }
}

impl Model {
    /// The model's grammar machinery, built on first use (0.4 s for a 49k vocabulary, 1.5 s
    /// for 152k on two cores) and shared by every request after.
    pub fn grammars(
        &self,
    ) -> std::result::Result<Arc<crate::constraint::Grammars>, crate::constraint::ConstraintError>
    {
        self.grammars
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let g = crate::constraint::Grammars::new(self.tokenizer(), self.eos_ids())
                    .map(Arc::new);
                tracing::info!(
                    took_ms = started.elapsed().as_millis() as u64,
                    ok = g.is_ok(),
                    "structured-output token trie built"
                );
                g
            })
            .clone()
    }
}
