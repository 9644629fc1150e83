//! [`Model`]: a loaded model with its tokenizer, chat template and generation defaults —
//! the engine's public entry point.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use wick_chat::chat_template::{ChatInput, ChatTemplate, TemplateTokens};
use wick_chat::tokenizer::Tokenizer;
use wick_gguf::GgufFile;

use crate::backend::candle::block_pool::BlockPool;
use crate::backend::candle::{CandleBackend, CpuKvLayer, KvDtype};
#[cfg(feature = "mlx")]
use crate::backend::mlx::MlxBackend;
use crate::backend::{Backend, BackendKind, KvLayerSnapshot};
use crate::config::ModelConfig;
use crate::models::decoder::{BatchItem, Decoder, Logits, LogitsRequest, SequenceCache};
use crate::models::greedy::{self, GreedyRun};
use crate::models::Arch;
use crate::weights::{GgufWeights, MlxQuantization, SafetensorsWeights, WeightSource};
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

/// The decoder on the backend the model was loaded onto.
enum AnyDecoder {
    Candle(Decoder<CandleBackend>),
    #[cfg(feature = "mlx")]
    Mlx(Decoder<MlxBackend>),
}

impl AnyDecoder {
    /// How the CPU backend's KV cache stores numbers; `None` on MLX, which keeps the
    /// checkpoint's compute type.
    fn kv_dtype(&self) -> Option<KvDtype> {
        match self {
            AnyDecoder::Candle(d) => Some(d.backend().kv_dtype()),
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(_) => None,
        }
    }

    /// Bytes of one number of the KV cache: the CPU backend's KV type, or on MLX the
    /// activation type the caches keep.
    fn kv_number_bytes(&self) -> usize {
        match self {
            AnyDecoder::Candle(d) => d.backend().kv_dtype().bytes(),
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(d) => d.backend().dtype().size(),
        }
    }

    /// The accelerator memory the KV cache lives in, when it is not host RAM: `None` on
    /// the CPU (candle, or MLX on its CPU device).
    fn device_memory(&self) -> Option<DeviceMemory> {
        match self {
            AnyDecoder::Candle(_) => None,
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(d) => {
                if d.backend().device() != crate::backend::mlx::MlxDevice::Gpu {
                    return None;
                }
                // Buffers MLX cached while loading are free for the KV cache to take.
                if let Err(e) = wick_mlx::clear_cache() {
                    tracing::warn!("MLX clear_cache: {e}");
                }
                match wick_mlx::gpu_memory() {
                    Ok(m) => m.map(|m| DeviceMemory {
                        total: m.total as u64,
                        free: m.free as u64,
                    }),
                    Err(e) => {
                        tracing::warn!("cannot read the GPU's memory: {e}");
                        None
                    }
                }
            }
        }
    }
}

/// An accelerator's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// All of it.
    pub total: u64,
    /// What could still be allocated now.
    pub free: u64,
}

/// A cache of one of the backends.
#[derive(Clone)]
enum AnyCache {
    Candle(SequenceCache<CandleBackend>),
    #[cfg(feature = "mlx")]
    Mlx(SequenceCache<MlxBackend>),
}

/// Runs `$body` with `$d` bound to the decoder, whatever its backend.
macro_rules! with_decoder {
    ($any:expr, $d:ident => $body:expr) => {
        match $any {
            AnyDecoder::Candle($d) => $body,
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx($d) => $body,
        }
    };
}

/// Runs `$body` with `$c` bound to the cache, whatever its backend.
macro_rules! with_cache {
    ($any:expr, $c:ident => $body:expr) => {
        match $any {
            AnyCache::Candle($c) => $body,
            #[cfg(feature = "mlx")]
            AnyCache::Mlx($c) => $body,
        }
    };
}

/// Backend-specific cache access for the generic paths of [`Model`].
trait CacheOf: Backend + Sized {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache;
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>>;
}

impl CacheOf for CandleBackend {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache {
        AnyCache::Candle(cache)
    }
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>> {
        match cache {
            AnyCache::Candle(c) => Ok(c),
            #[cfg(feature = "mlx")]
            _ => Err(other_backend()),
        }
    }
}

#[cfg(feature = "mlx")]
impl CacheOf for MlxBackend {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache {
        AnyCache::Mlx(cache)
    }
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>> {
        match cache {
            AnyCache::Mlx(c) => Ok(c),
            _ => Err(other_backend()),
        }
    }
}

#[cfg(feature = "mlx")]
fn other_backend() -> EngineError {
    EngineError::Cache("cache belongs to a model on another backend".into())
}

/// A sequence's KV cache, whatever the backend.
#[derive(Clone)]
pub struct KvCache {
    inner: AnyCache,
}

impl KvCache {
    /// Tokens cached (the next token's position).
    pub fn len(&self) -> usize {
        with_cache!(&self.inner, c => c.len())
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        with_cache!(&self.inner, c => c.is_empty())
    }

    /// Whether the cache can be cut back to `len` tokens (a sliding window that already
    /// dropped keys cannot).
    pub fn can_trim_to(&self, len: usize) -> bool {
        with_cache!(&self.inner, c => c.can_trim_to(len))
    }

    /// Forgets every token from position `len` on.
    pub fn trim(&mut self, len: usize) -> Result<()> {
        with_cache!(&mut self.inner, c => c.trim(len))
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        with_cache!(&self.inner, c => c.byte_size())
    }

    /// Host copies of every layer (for persistence).
    pub fn snapshot(&self) -> Vec<KvLayerSnapshot> {
        with_cache!(&self.inner, c => c.snapshot())
    }

    /// The CPU backend's paged layers; block accounting applies to them only (an MLX
    /// cache has none, so it is never charged to the block pool).
    fn cpu_layers(&self) -> &[CpuKvLayer] {
        match &self.inner {
            AnyCache::Candle(c) => c.layers(),
            #[cfg(feature = "mlx")]
            AnyCache::Mlx(_) => &[],
        }
    }

    fn cpu_layers_mut(&mut self) -> &mut [CpuKvLayer] {
        match &mut self.inner {
            AnyCache::Candle(c) => c.layers_mut(),
            #[cfg(feature = "mlx")]
            AnyCache::Mlx(_) => &mut [],
        }
    }

    /// Charges the blocks this cache holds to `pool` (the caller checked there is room);
    /// from now on its new blocks are charged there too, and dropping the cache gives
    /// them back. A clone is never charged until attached itself.
    pub fn attach(&mut self, pool: &Arc<BlockPool>) {
        for l in self.cpu_layers_mut() {
            l.attach(pool);
        }
    }

    /// Gives the pool charge back (the blocks stay with the cache). On MLX, moves the
    /// cache out of the batch buffer it decoded in, so that a stored cache holds no row of
    /// a running batch.
    pub fn detach(&mut self) {
        match &mut self.inner {
            AnyCache::Candle(c) => c.layers_mut().iter_mut().for_each(CpuKvLayer::detach),
            #[cfg(feature = "mlx")]
            AnyCache::Mlx(c) => c.layers_mut().iter_mut().for_each(|l| l.leave_batch()),
        }
    }

    /// Whether the cache is charged to a pool.
    pub fn is_attached(&self) -> bool {
        self.cpu_layers().iter().any(CpuKvLayer::is_attached)
    }

    /// Blocks held, all layers together.
    pub fn blocks(&self) -> usize {
        self.cpu_layers().iter().map(CpuKvLayer::block_count).sum()
    }

    /// Blocks charged to the pool, all layers together (0 when not attached).
    pub fn charged_blocks(&self) -> usize {
        self.cpu_layers()
            .iter()
            .map(CpuKvLayer::charged_blocks)
            .sum()
    }

    /// Blocks the pool must grant before `tokens` more tokens can be appended.
    pub fn blocks_to_append(&self, tokens: usize) -> usize {
        self.cpu_layers()
            .iter()
            .map(|l| l.extra_blocks_for(tokens))
            .sum()
    }

    /// Charges, all layers or none, the blocks that appending `tokens` more needs.
    /// Returns false (charging nothing) when the pool has no room. A detached cache
    /// needs no room.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        let need: Vec<usize> = self
            .cpu_layers()
            .iter()
            .map(|l| l.extra_blocks_for(tokens))
            .collect();
        let Some(pool) = self.cpu_layers().iter().find_map(|l| l.pool().cloned()) else {
            return true;
        };
        if !pool.try_charge(need.iter().sum()) {
            return false;
        }
        for (l, n) in self.cpu_layers_mut().iter_mut().zip(need) {
            l.add_reserved(n);
        }
        true
    }
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
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| EngineError::Config {
            source_name: path.display().to_string(),
            reason: format!("not valid JSON: {e}"),
        })
}

impl Model {
    /// Loads a `.gguf` file or a Hugging Face model directory.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        if !opts.backend.available() {
            return Err(EngineError::Backend {
                backend: opts.backend.name(),
                message: "wick was built without the `mlx` cargo feature (build with \
                          `--features mlx` against an MLX runtime; see docs/mlx.md)"
                    .into(),
            });
        }
        let mut model = if meta.is_dir() {
            Self::load_hf(path, opts.backend, opts.kv_dtype.unwrap_or(KvDtype::F32))?
        } else {
            Self::load_gguf(path, opts.backend, opts.kv_dtype.unwrap_or(KvDtype::F16))?
        };
        if let Some(n) = opts.context_length {
            model.info.context_length = n.min(model.info.context_length).max(1);
        }
        tracing::info!(
            model = %model.info.name,
            arch = %model.info.arch,
            backend = model.info.backend,
            weights_mib = model.info.weight_bytes / (1 << 20),
            context = model.info.context_length,
            kv = model.info.kv_type,
            "model loaded"
        );
        Ok(model)
    }

    fn load_gguf(path: &Path, backend: BackendKind, kv: KvDtype) -> Result<Model> {
        let file = GgufFile::open(path)?;
        let source = path.display().to_string();
        let cfg = ModelConfig::from_gguf(file.metadata(), &source)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let template_source = file
            .metadata()
            .opt_str("tokenizer.chat_template")?
            .map(str::to_string);
        // GGUF scales are exact in f32 (see backend::mlx).
        let decoder = load_decoder(backend, cfg, &GgufWeights::new(&file), MlxDtype::F32, kv)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| source.clone());
        Self::assemble(
            decoder,
            tokenizer,
            template_source,
            GenerationDefaults::default(),
            name,
            path,
            ModelFormat::Gguf,
        )
    }

    fn load_hf(dir: &Path, backend: BackendKind, kv: KvDtype) -> Result<Model> {
        let source = dir.display().to_string();
        let config = read_json(&dir.join("config.json"))?.ok_or_else(|| EngineError::Config {
            source_name: source.clone(),
            reason: "no config.json: not a Hugging Face model directory".into(),
        })?;
        let cfg = ModelConfig::from_hf(&config, &dir.join("config.json").display().to_string())?;
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let weights = SafetensorsWeights::open(dir)?;
        let quantization = MlxQuantization::from_config(&config, &source)?;
        // Gemma's sandwich norms use other Hugging Face names.
        let gemma = cfg.arch == Arch::Gemma3;
        let named = weights.canonical(gemma).with_quantization(quantization);
        let dtype = MlxDtype::of_checkpoint(&config, &named);
        let decoder = load_decoder(backend, cfg, &named, dtype, kv)?;
        let template_source = hf_chat_template(dir)?;
        let gen_path = dir.join("generation_config.json");
        let gen = read_json(&gen_path)?.unwrap_or_else(|| Value::Object(Default::default()));
        crate::config::check_generation_config(&gen, &gen_path.display().to_string())?;
        let defaults = GenerationDefaults {
            temperature: gen
                .get("temperature")
                .and_then(Value::as_f64)
                .map(|v| v as f32),
            top_p: gen.get("top_p").and_then(Value::as_f64).map(|v| v as f32),
            top_k: gen.get("top_k").and_then(Value::as_u64).map(|v| v as usize),
            repetition_penalty: gen
                .get("repetition_penalty")
                .and_then(Value::as_f64)
                .map(|v| v as f32),
        };
        let mut model = {
            let name = dir
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| source.clone());
            Self::assemble(
                decoder,
                tokenizer,
                template_source,
                defaults,
                name,
                dir,
                ModelFormat::HuggingFace,
            )?
        };
        // generation_config's eos ids join the set.
        let extra = crate::config::hf_ids(&gen, "eos_token_id");
        for id in extra {
            if !model.eos.contains(&id) {
                model.eos.push(id);
            }
        }
        Ok(model)
    }

    fn assemble(
        decoder: AnyDecoder,
        tokenizer: Tokenizer,
        template_source: Option<String>,
        defaults: GenerationDefaults,
        name: String,
        path: &Path,
        format: ModelFormat,
    ) -> Result<Model> {
        let cfg = with_decoder!(&decoder, d => d.config());
        let weight_bytes = with_decoder!(&decoder, d => d.weight_bytes());
        let backend = with_decoder!(&decoder, d => d.backend().name());
        let kv_type = decoder.kv_dtype().map_or("mlx", KvDtype::name);
        let mut eos: Vec<u32> = cfg.eos_token_ids.clone();
        for &id in tokenizer.eos_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let template = match &template_source {
            Some(src) => {
                let tokens = TemplateTokens {
                    bos_token: tokenizer.bos_token().map(str::to_string),
                    eos_token: tokenizer.eos_token().map(str::to_string),
                    ..TemplateTokens::default()
                };
                Some(Arc::new(ChatTemplate::new(src, tokens)?))
            }
            None => None,
        };
        let info = ModelInfo {
            name,
            path: path.to_path_buf(),
            format,
            arch: cfg.arch,
            context_length: cfg.context_length,
            weight_bytes,
            backend,
            kv_type,
        };
        Ok(Model {
            decoder,
            tokenizer,
            template,
            template_source,
            info,
            defaults,
            eos,
            grammars: Default::default(),
        })
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The architecture configuration.
    pub fn config(&self) -> &ModelConfig {
        with_decoder!(&self.decoder, d => d.config())
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
    /// [`BLOCK_TOKENS`](crate::backend::candle::block_pool::BLOCK_TOKENS) tokens in the
    /// cache's number type), the unit of the block pool.
    pub fn kv_block_bytes(&self) -> usize {
        let cfg = self.config();
        crate::backend::candle::block_pool::block_bytes(
            cfg.num_kv_heads * cfg.head_dim,
            self.decoder.kv_number_bytes(),
        )
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

    /// One batched forward pass over several sequences.
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Vec<Option<Logits>>> {
        with_decoder!(&self.decoder, d => forward_on(d, steps))
    }

    /// [`Model::forward`] returning, for each step that asks for the last position's
    /// logits, their argmax instead: picked on the backend, so only the ids reach the
    /// host. Steps ask for [`LogitsRequest::Last`] or [`LogitsRequest::None`].
    pub fn forward_argmax(&self, steps: &mut [Step<'_>]) -> Result<Vec<Option<u32>>> {
        with_decoder!(&self.decoder, d => argmax_on(d, steps))
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

fn wrap_cache<B: CacheOf>(cache: SequenceCache<B>) -> AnyCache {
    B::wrap(cache)
}

/// The decoder's view of `steps`.
fn batch_of<'a, B: CacheOf>(steps: &'a mut [Step<'_>]) -> Result<Vec<BatchItem<'a, B>>> {
    steps
        .iter_mut()
        .map(|s| {
            Ok(BatchItem {
                tokens: s.tokens,
                cache: B::unwrap(&mut s.cache.inner)?,
                logits: s.logits,
            })
        })
        .collect()
}

fn forward_on<B: CacheOf>(d: &Decoder<B>, steps: &mut [Step<'_>]) -> Result<Vec<Option<Logits>>> {
    d.forward(&mut batch_of(steps)?)
}

fn argmax_on<B: CacheOf>(d: &Decoder<B>, steps: &mut [Step<'_>]) -> Result<Vec<Option<u32>>> {
    let wants: Vec<bool> = steps
        .iter()
        .map(|s| s.logits != LogitsRequest::None)
        .collect();
    if !wants.contains(&true) {
        forward_on(d, steps)?;
        return Ok(vec![None; steps.len()]);
    }
    let ids = d.forward_argmax(&mut batch_of(steps)?)?;
    let mut ids = d.backend().ids_to_host(&ids)?.into_iter();
    Ok(wants
        .into_iter()
        .map(|w| if w { ids.next() } else { None })
        .collect())
}

/// Activation dtype for the MLX backend, chosen from the checkpoint (candle ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MlxDtype {
    F32,
    F16,
    Bf16,
}

impl MlxDtype {
    /// `config.json`'s `torch_dtype`/`dtype`, else the embedding table's scales or
    /// weight type; bf16 when nothing says.
    fn of_checkpoint(config: &Value, weights: &dyn WeightSource) -> MlxDtype {
        let named = config
            .get("torch_dtype")
            .or_else(|| config.get("dtype"))
            .and_then(Value::as_str);
        let from_file = || -> Option<wick_gguf::GgmlType> {
            if let Ok(Some(a)) = weights.affine("token_embd.weight") {
                return Some(a.scales.dtype);
            }
            weights
                .get("token_embd.weight")
                .ok()
                .flatten()
                .map(|w| w.dtype)
        };
        match named {
            Some("float32") => MlxDtype::F32,
            Some("float16") => MlxDtype::F16,
            Some("bfloat16") => MlxDtype::Bf16,
            _ => match from_file() {
                Some(wick_gguf::GgmlType::F32) => MlxDtype::F32,
                Some(wick_gguf::GgmlType::F16) => MlxDtype::F16,
                _ => MlxDtype::Bf16,
            },
        }
    }
}

/// Loads the decoder onto `backend`.
fn load_decoder(
    backend: BackendKind,
    cfg: ModelConfig,
    src: &dyn WeightSource,
    dtype: MlxDtype,
    kv: KvDtype,
) -> Result<AnyDecoder> {
    match backend {
        BackendKind::Candle => Ok(AnyDecoder::Candle(Decoder::load(
            CandleBackend::cpu().with_kv_dtype(kv),
            cfg,
            src,
        )?)),
        #[cfg(feature = "mlx")]
        BackendKind::Mlx => {
            let be = crate::backend::mlx::MlxBackend::for_checkpoint(match dtype {
                MlxDtype::F32 => wick_mlx::Dtype::F32,
                MlxDtype::F16 => wick_mlx::Dtype::F16,
                MlxDtype::Bf16 => wick_mlx::Dtype::BF16,
            })?;
            let d = Decoder::load(be, cfg, src)?;
            d.backend().log_load_report();
            Ok(AnyDecoder::Mlx(d))
        }
        #[cfg(not(feature = "mlx"))]
        BackendKind::Mlx => {
            let _ = dtype;
            Err(EngineError::Backend {
                backend: "mlx",
                message: "wick was built without the `mlx` cargo feature".into(),
            })
        }
    }
}

/// The chat template of a Hugging Face directory: `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates
/// of which `default` is used).
fn hf_chat_template(dir: &Path) -> Result<Option<String>> {
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        return std::fs::read_to_string(&file).map(Some).map_err(io(&file));
    }
    let Some(cfg) = read_json(&dir.join("tokenizer_config.json"))? else {
        return Ok(None);
    };
    Ok(match cfg.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    })
}
