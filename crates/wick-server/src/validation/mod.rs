//! Turning a parsed request into checked generation settings: every field's range, and the
//! defaulting precedence request → server flag → `generation_config.json` → built-in.
pub mod adapter;
pub mod chat;
pub mod completion;
pub mod structured;

use serde_json::{Map, Value};
use wick_engine::sampler::{fresh_seed, SamplingParams, DEFAULT_PENALTY_CONTEXT};
use wick_engine::GenerationDefaults;

use crate::config::{SamplingDefaults, BUILTIN_TEMPERATURE};
use crate::error::ApiError;
use crate::openai::SamplingFields;

/// Largest `|bias|` of a `logit_bias` entry (OpenAI's bound).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// Where `max_tokens` came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokens {
    /// The client asked for this many: a prompt that leaves less room is refused.
    Requested(usize),
    /// Nobody asked: this many, capped to what the context leaves after the prompt.
    Default(usize),
}

impl MaxTokens {
    /// The tokens to generate after a prompt of `prompt` tokens in a context of `context`;
    /// `param` names the prompt field in errors. Never truncates a requested value.
    pub fn resolve(
        self,
        prompt: usize,
        context: usize,
        param: &'static str,
    ) -> Result<usize, ApiError> {
        let overflow = |max_tokens: usize| ApiError::ContextOverflow {
            param,
            prompt,
            max_tokens,
            needed: prompt + max_tokens,
            limit: context,
        };
        match self {
            MaxTokens::Requested(n) if prompt + n > context => Err(overflow(n)),
            MaxTokens::Requested(n) => Ok(n),
            MaxTokens::Default(_) if prompt >= context => Err(overflow(1)),
            MaxTokens::Default(n) => Ok(n.min(context - prompt)),
        }
    }

    /// [`MaxTokens::resolve`], then a default is also capped to what the KV memory budget
    /// holds for one sequence (`kv_limit` tokens, prompt included), so a request that
    /// names no limit is not refused for memory. A requested value is never cut: the
    /// engine refuses it if it cannot fit.
    pub fn resolve_within(
        self,
        prompt: usize,
        context: usize,
        kv_limit: usize,
        param: &'static str,
    ) -> Result<usize, ApiError> {
        let n = self.resolve(prompt, context, param)?;
        Ok(match self {
            MaxTokens::Default(_) => n.min(kv_limit.saturating_sub(prompt)).max(1),
            MaxTokens::Requested(_) => n,
        })
    }
}

/// Checked generation settings shared by both endpoints.
#[derive(Debug, Clone)]
pub struct ValidGeneration {
    /// Sampling parameters (seed resolved).
    pub sampling: SamplingParams,
    /// The token limit.
    pub max_tokens: MaxTokens,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Streams end with a usage chunk.
    pub include_usage: bool,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// May be decoded speculatively (`speculative`, default true).
    pub speculative: bool,
    /// The LoRA adapters (resolved by the endpoint, which knows the mounted ones).
    pub adapters: wick_engine::adapters::AdapterStack,
}

/// What the endpoint-specific validation hands to [`resolve_generation`].
#[derive(Debug, Clone, Copy)]
pub struct GenerationContext<'a> {
    /// Server flags.
    pub flags: &'a SamplingDefaults,
    /// The model's `generation_config.json`.
    pub model: &'a GenerationDefaults,
    /// `max_tokens` when neither the request nor a flag sets it.
    pub builtin_max_tokens: usize,
    /// Log-probabilities asked for (`Some(k)`: the token's and `k` alternatives).
    pub logprobs: Option<usize>,
    /// Thinking resolved to off: a model default temperature is capped at the built-in.
    pub thinking_off: bool,
    /// Vocabulary size, for `logit_bias` ids.
    pub vocab_size: usize,
}

fn non_negative(param: &str, value: Option<i64>) -> Result<Option<usize>, ApiError> {
    match value {
        Some(v) if v < 0 => Err(ApiError::field(param, format!("must be >= 0, got {v}"))),
        Some(v) => Ok(Some(v as usize)),
        None => Ok(None),
    }
}

/// Checks the shared fields and resolves every default.
pub fn resolve_generation(
    f: &SamplingFields,
    ctx: GenerationContext<'_>,
) -> Result<ValidGeneration, ApiError> {
    match f.n {
        None | Some(1) => {}
        Some(n) if n < 1 => return Err(ApiError::field("n", format!("must be >= 1, got {n}"))),
        Some(n) => {
            return Err(ApiError::unsupported(
                "n",
                format!("only one choice per request is supported (n = 1), got {n}; send {n} requests instead"),
            ))
        }
    }
    let (max_param, requested) = match (f.max_completion_tokens, f.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let max_tokens = match requested {
        Some(n) if n < 1 => {
            return Err(ApiError::field(max_param, format!("must be >= 1, got {n}")))
        }
        Some(n) => MaxTokens::Requested(n as usize),
        None => MaxTokens::Default(ctx.flags.max_tokens.unwrap_or(ctx.builtin_max_tokens)),
    };

    let model_temperature = ctx.model.temperature.map(|t| {
        if ctx.thinking_off {
            t.min(BUILTIN_TEMPERATURE)
        } else {
            t
        }
    });
    let temperature = f
        .temperature
        .or(ctx.flags.temperature)
        .or(model_temperature)
        .unwrap_or(BUILTIN_TEMPERATURE);
    // 0 and 1 both mean "off" for top_p (the sampler's off value is 1).
    let top_p = f
        .top_p
        .or(ctx.flags.top_p)
        .or(ctx.model.top_p)
        .map(|p| if p == 0.0 { 1.0 } else { p })
        .unwrap_or(1.0);
    let top_k = match f.top_k {
        Some(k) if k < -1 => {
            return Err(ApiError::field(
                "top_k",
                format!("must be >= 0 (or -1 for off), got {k}"),
            ))
        }
        Some(k) => Some(k.max(0) as usize),
        None => None,
    }
    .or(ctx.flags.top_k)
    .or(ctx.model.top_k)
    .unwrap_or(0);
    let min_p = f.min_p.or(ctx.flags.min_p).unwrap_or(0.0);
    let repetition_penalty = f
        .repetition_penalty
        .or(ctx.flags.repetition_penalty)
        .or(ctx.model.repetition_penalty)
        .unwrap_or(1.0);

    let seed = match &f.seed {
        None => fresh_seed(),
        Some(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => {
                return Err(ApiError::field(
                    "seed",
                    format!("must be an integer, got {n}"),
                ))
            }
        },
    };

    let sampling = SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        xtc_probability: f.xtc_probability.unwrap_or(0.0),
        xtc_threshold: f.xtc_threshold.unwrap_or(0.0),
        repetition_penalty,
        repetition_context_size: non_negative(
            "repetition_context_size",
            f.repetition_context_size,
        )?
        .unwrap_or(DEFAULT_PENALTY_CONTEXT),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        presence_context_size: non_negative("presence_context_size", f.presence_context_size)?
            .unwrap_or(DEFAULT_PENALTY_CONTEXT),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        frequency_context_size: non_negative("frequency_context_size", f.frequency_context_size)?
            .unwrap_or(DEFAULT_PENALTY_CONTEXT),
        logit_bias: logit_bias(f.logit_bias.as_ref())?,
        seed,
        logprobs: ctx.logprobs,
        constraint: None,
    };
    sampling.validate_for_vocab(ctx.vocab_size)?;

    Ok(ValidGeneration {
        sampling,
        max_tokens,
        stop: f.stop.as_ref().map(|s| s.strings()).unwrap_or_default(),
        stream: f.stream.unwrap_or(false),
        include_usage: f
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        speculative: f.speculative.unwrap_or(true),
        adapters: wick_engine::adapters::AdapterStack::none(),
    })
}

/// `{"50256": -100}` → `[(50256, -100.0)]`.
fn logit_bias(map: Option<&Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    let shape = || ApiError::field("logit_bias", "must be a dict of int to float");
    map.iter()
        .map(|(key, value)| {
            let id: u32 = key.trim().parse().map_err(|_| shape())?;
            let bias = value.as_f64().ok_or_else(shape)?;
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
                return Err(ApiError::field(
                    "logit_bias",
                    format!("bias for token {id} must be in [-100, 100], got {bias}"),
                ));
            }
            Ok((id, bias as f32))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    fn ctx<'a>(
        flags: &'a SamplingDefaults,
        model: &'a GenerationDefaults,
    ) -> GenerationContext<'a> {
        GenerationContext {
            flags,
            model,
            builtin_max_tokens: 512,
            logprobs: None,
            thinking_off: false,
            vocab_size: 1000,
        }
    }

    #[test]
    fn request_beats_flag_beats_model_beats_builtin() {
        let flags = SamplingDefaults {
            temperature: Some(0.3),
            top_k: Some(5),
            ..SamplingDefaults::default()
        };
        let model = GenerationDefaults {
            temperature: Some(0.9),
            top_p: Some(0.8),
            top_k: Some(40),
            repetition_penalty: Some(1.1),
        };
        let v =
            resolve_generation(&fields(r#"{"temperature": 0.0}"#), ctx(&flags, &model)).unwrap();
        assert_eq!(v.sampling.temperature, 0.0);
        assert_eq!(v.sampling.top_k, 5);
        assert_eq!(v.sampling.top_p, 0.8);
        assert_eq!(v.sampling.repetition_penalty, 1.1);
        let v = resolve_generation(&fields("{}"), ctx(&flags, &model)).unwrap();
        assert_eq!(v.sampling.temperature, 0.3);
        let none = SamplingDefaults::default();
        let v = resolve_generation(&fields("{}"), ctx(&none, &model)).unwrap();
        assert_eq!(v.sampling.temperature, 0.9);
        let v = resolve_generation(
            &fields("{}"),
            GenerationContext {
                thinking_off: true,
                ..ctx(&none, &model)
            },
        )
        .unwrap();
        assert_eq!(v.sampling.temperature, BUILTIN_TEMPERATURE);
        let bare = GenerationDefaults::default();
        let v = resolve_generation(&fields("{}"), ctx(&none, &bare)).unwrap();
        assert_eq!(v.sampling.temperature, BUILTIN_TEMPERATURE);
        assert_eq!(v.sampling.top_p, 1.0);
        assert_eq!(v.max_tokens, MaxTokens::Default(512));
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let flags = SamplingDefaults::default();
        let model = GenerationDefaults::default();
        let cases = [
            (r#"{"n": 2}"#, "n"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (
                r#"{"max_tokens": 5, "max_completion_tokens": -1}"#,
                "max_completion_tokens",
            ),
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"seed": 1.5}"#, "seed"),
            (r#"{"logit_bias": {"x": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"1": "a"}}"#, "logit_bias"),
            (r#"{"logit_bias": {"1": 101}}"#, "logit_bias"),
            (r#"{"logit_bias": {"5000": 1}}"#, "logit_bias"),
            (
                r#"{"repetition_context_size": -1}"#,
                "repetition_context_size",
            ),
        ];
        for (json, param) in cases {
            let e = resolve_generation(&fields(json), ctx(&flags, &model)).unwrap_err();
            assert_eq!(e.param(), Some(param), "{json}: {e}");
            assert!(e.status().is_client_error());
        }
    }

    #[test]
    fn seeds_stop_and_bias_parse() {
        let flags = SamplingDefaults::default();
        let model = GenerationDefaults::default();
        let v = resolve_generation(
            &fields(r#"{"seed": -1, "stop": ["", "\n"], "logit_bias": {"7": -100}, "top_p": 0}"#),
            ctx(&flags, &model),
        )
        .unwrap();
        assert_eq!(v.sampling.seed, u64::MAX);
        assert_eq!(v.stop, vec!["\n".to_string()]);
        assert_eq!(v.sampling.logit_bias, vec![(7, -100.0)]);
        assert_eq!(v.sampling.top_p, 1.0);
    }

    #[test]
    fn max_tokens_never_truncates_a_request() {
        assert_eq!(MaxTokens::Requested(10).resolve(90, 100, "prompt"), Ok(10));
        let e = MaxTokens::Requested(11)
            .resolve(90, 100, "prompt")
            .unwrap_err();
        assert_eq!(e.code(), "context_length_exceeded");
        assert_eq!(MaxTokens::Default(512).resolve(90, 100, "prompt"), Ok(10));
        assert!(MaxTokens::Default(512).resolve(100, 100, "prompt").is_err());
    }
}
