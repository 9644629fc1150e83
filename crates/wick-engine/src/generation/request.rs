//! What a generation is asked to do and what it reports back.
use std::time::Duration;

use crate::adapters::AdapterStack;
use crate::model::KvCache;
use crate::sampler::SamplingParams;

/// Prompt tokens fed per forward pass while prefilling, by default.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Most prompt tokens per forward pass of a request that scores its prompt (every row's
/// logits come back to the host: `rows × vocab` floats).
pub const PROMPT_SCORE_CHUNK: usize = 128;

/// The score of one prompt token (from the second on).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// Its log-probability given the tokens before it.
    pub logprob: f32,
    /// The most likely tokens at its position `(id, logprob)`, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One generation: prompt, limits, sampling, stop strings.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling parameters (greedy by default).
    pub sampling: SamplingParams,
    /// Stop strings, matched on decoded text; nothing of a match is emitted.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass.
    pub prefill_chunk: usize,
    /// Decode special tokens into the text (tool-call markers are special tokens in
    /// some vocabularies); end-of-sequence tokens are never decoded.
    pub keep_special_text: bool,
    /// Prompt-cache namespace: KV computed under one namespace never seeds another. `""`
    /// ([`wick_cache::namespace::BASE`]) for the base model.
    pub cache_namespace: String,
    /// Score the prompt: the log-probability of every prompt token after the first under
    /// the model (raw logits), with this many alternatives per position. The whole prompt
    /// is then computed (a cached prefix has no logits to give), in chunks of at most
    /// [`PROMPT_SCORE_CHUNK`] tokens; `max_tokens` may be 0.
    pub prompt_logprobs: Option<usize>,
    /// LoRA adapters the generation runs with, deltas summed in order (none: the base
    /// model). The prompt cache keeps their KV in a namespace of their own.
    pub adapters: AdapterStack,
    /// Whether the engine may decode this request speculatively when it is set up to
    /// ([`crate::scheduler::EngineConfig::speculative`]); `false` opts out.
    pub speculative: bool,
    /// Images and audio clips whose embeddings replace their soft tokens' rows in the
    /// prompt (sorted by position, not overlapping; empty for text).
    pub media: Vec<crate::media::MediaSpan>,
    /// Prompt positions where the prompt cache keeps the KV computed so far: where the
    /// next request of the conversation is expected to part from this prompt (the end of
    /// the last complete message: the next turn renders the generation prompt and this
    /// turn's reply its own way), and `cache_control` breakpoints. Caches that cannot be
    /// cut back (recurrent states, sliding windows that wrapped) are reusable only at an
    /// entry's exact length, so an agent's next turn finds its prefix only here.
    pub cache_points: Vec<CachePoint>,
}

/// A prompt position the prompt cache keeps ([`GenerationRequest::cache_points`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePoint {
    /// Tokens of the prompt before the point.
    pub at: usize,
    /// Keep the entry in RAM before unpinned ones for this long after each use (an
    /// Anthropic `cache_control` breakpoint's time to live); `None`: an ordinary entry.
    pub pin: Option<std::time::Duration>,
}

impl GenerationRequest {
    /// Greedy generation of up to 256 tokens after `prompt`.
    pub fn new(prompt: Vec<u32>) -> Self {
        GenerationRequest {
            prompt,
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            keep_special_text: true,
            cache_namespace: String::new(),
            prompt_logprobs: None,
            adapters: AdapterStack::none(),
            speculative: true,
            media: Vec::new(),
            cache_points: Vec::new(),
        }
    }

    /// Sets the token limit.
    pub fn max_tokens(mut self, n: usize) -> Self {
        self.max_tokens = n;
        self
    }

    /// Sets the sampling parameters.
    pub fn sampling(mut self, p: SamplingParams) -> Self {
        self.sampling = p;
        self
    }

    /// Sets the adapters.
    pub fn adapters(mut self, adapters: AdapterStack) -> Self {
        self.adapters = adapters;
        self
    }

    /// The prompt-cache namespace the generation's KV lives in: [`Self::cache_namespace`]
    /// joined with the adapters' ([`AdapterStack::cache_namespace`]).
    pub fn effective_namespace(&self) -> String {
        match (self.cache_namespace.is_empty(), self.adapters.is_empty()) {
            (_, true) => self.cache_namespace.clone(),
            (true, false) => format!("lora:{}", self.adapters.cache_namespace()),
            (false, false) => format!(
                "{}|lora:{}",
                self.cache_namespace,
                self.adapters.cache_namespace()
            ),
        }
    }

    /// Sets the stop strings.
    pub fn stop(mut self, stop: Vec<String>) -> Self {
        self.stop = stop;
        self
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was sampled.
    EndOfSequence,
    /// A stop string matched.
    StopString(String),
    /// `max_tokens` were generated.
    Length,
    /// The caller stopped it.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI `finish_reason` value (`stop` or `length`).
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

/// One sampled token and the text it released.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The token id.
    pub id: u32,
    /// Text that became stable with this token (may be empty: an incomplete UTF-8
    /// sequence, or text held back because it may start a stop string).
    pub text: String,
    /// Log-probability of the token (NaN unless logprobs were requested).
    pub logprob: f32,
    /// Top alternatives `(id, logprob)`, most likely first (when requested).
    pub top_logprobs: Vec<(u32, f32)>,
    /// Whether this token ended the generation (an end-of-sequence token, a stop string,
    /// or the length limit).
    pub last: bool,
    /// Prompt tokens that came from a cache (the same on every token of a request), so a
    /// reply that ends before the engine's `Done` still reports them.
    pub cached_tokens: usize,
    /// The prompt's scores (one per prompt token after the first) on the first token of a
    /// request that asked for them ([`GenerationRequest::prompt_logprobs`]); empty
    /// otherwise.
    pub prompt_logprobs: Vec<PromptLogprob>,
}

/// Token counts and timings of a generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens that came from a cache instead of being computed.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Time spent computing the prompt.
    pub prefill_time: Duration,
    /// Time spent generating after the first token.
    pub decode_time: Duration,
    /// Drafted and kept tokens, when the request was decoded speculatively.
    pub speculation: Option<crate::speculative::SpeculationUsage>,
}

impl Usage {
    /// Prompt tokens computed per second.
    pub fn prefill_tps(&self) -> f64 {
        let n = self.prompt_tokens - self.cached_tokens;
        n as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Tokens generated per second after the first.
    pub fn decode_tps(&self) -> f64 {
        self.completion_tokens.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Everything a finished generation produced.
pub struct GenerationOutput {
    /// Generated token ids (the end-of-sequence token included when one ended it).
    pub tokens: Vec<u32>,
    /// The text (stop string and everything after it removed).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Counts and timings.
    pub usage: Usage,
    /// The cache after the generation (prompt + generated tokens that were fed).
    pub cache: KvCache,
    /// The prompt's scores when asked ([`GenerationRequest::prompt_logprobs`]).
    pub prompt_logprobs: Vec<PromptLogprob>,
}
