//! OpenAI's wire types: what clients send and what wick answers, one file per endpoint
//! family; the fields both request kinds share live here.
pub mod chat;
pub mod completions;
pub mod custom_tools;
pub mod lark_regex;
pub mod models;
pub mod responses;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// `"stop": "\n"`.
    One(String),
    /// `"stop": ["\n", "User:"]`.
    Many(Vec<String>),
}

impl Stop {
    /// The non-empty stop strings.
    pub fn strings(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with empty `choices` and the `usage`.
    pub include_usage: Option<bool>,
}

/// Sampling and limit fields shared by chat and text completions (flattened into both).
///
/// Integers that OpenAI bounds are read as `i64` so that a negative value is a range error
/// naming the field, not a type error.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Tokens to generate at most.
    pub max_tokens: Option<i64>,
    /// The newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature; 0 = greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass; 0 and 1 are off.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; 0 (or -1) is off.
    pub top_k: Option<i64>,
    /// Drop tokens below `min_p` × the top probability.
    pub min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    pub repetition_penalty: Option<f32>,
    /// Window of the repetition penalty (0 = whole history).
    pub repetition_context_size: Option<i64>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Window of the presence penalty.
    pub presence_context_size: Option<i64>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Window of the frequency penalty.
    pub frequency_context_size: Option<i64>,
    /// XTC probability.
    pub xtc_probability: Option<f32>,
    /// XTC threshold.
    pub xtc_threshold: Option<f32>,
    /// Seed of the random draws (any integer).
    pub seed: Option<serde_json::Number>,
    /// `{"token id": bias}`.
    pub logit_bias: Option<Map<String, Value>>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Choices to generate; only 1 is supported.
    pub n: Option<i64>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Generate past end-of-sequence tokens (vLLM's extension; for benchmarks).
    pub ignore_eos: Option<bool>,
    /// `false` opts out of speculative decoding when the server runs it (`--spec`).
    pub speculative: Option<bool>,
    /// vLLM's structured output: `{"json" | "regex" | "choice" | "grammar": …}`.
    pub structured_outputs: Option<Value>,
    /// vLLM's older spelling: a JSON Schema (object or JSON text).
    pub guided_json: Option<Value>,
    /// vLLM's older spelling: a regular expression.
    pub guided_regex: Option<Value>,
    /// vLLM's older spelling: a list of strings.
    pub guided_choice: Option<Value>,
    /// vLLM's older spelling: a Lark grammar (llguidance's dialect).
    pub guided_grammar: Option<Value>,
    /// The LoRA adapters to run with: a mounted id, ids joined by `+` (stacked, deltas
    /// summed in order) or `none` (the base model); absent: the default adapter, if any.
    pub adapter: Option<String>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
    /// Prompt details.
    pub prompt_tokens_details: PromptTokensDetails,
    /// Non-standard: drafted and kept tokens, only when the reply was decoded
    /// speculatively (`wick serve --spec`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<wick_engine::speculative::SpeculationUsage>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens that came from a cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage from the counts.
    pub fn new(prompt: usize, cached: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            speculation: None,
        }
    }
}

/// A random response id: `prefix` + 24 alphanumerics.
pub fn response_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!(
        "{prefix}{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filters_empty_strings() {
        let stop: Stop = serde_json::from_str(r#"["", "\n", "x"]"#).unwrap();
        assert_eq!(stop.strings(), vec!["\n".to_string(), "x".to_string()]);
        let stop: Stop = serde_json::from_str(r#""""#).unwrap();
        assert!(stop.strings().is_empty());
    }

    #[test]
    fn ids_are_unique_and_prefixed() {
        let a = response_id("chatcmpl-");
        let b = response_id("chatcmpl-");
        assert!(a.starts_with("chatcmpl-") && a.len() == 33);
        assert_ne!(a, b);
    }
}
