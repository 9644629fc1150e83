//! `POST /v1/completions` wire types: raw-text completion (no chat template).
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{SamplingFields, Usage};
use crate::error::ApiError;
use crate::extract::{struct_fields, typed, RequestBody};

/// A text completion request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    /// The model the client asked for (ignored).
    pub model: Option<String>,
    /// A string, a token-id array, or a one-element list of either.
    pub prompt: Option<Value>,
    /// Prepend the prompt to the returned text.
    pub echo: Option<bool>,
    /// Return the log-probabilities of this many most likely tokens per position (0 = only
    /// the chosen token's).
    pub logprobs: Option<i64>,
    /// Text after the completion (insertion); not supported.
    pub suffix: Option<String>,
    /// Server-side best-of sampling; only 1 is supported.
    pub best_of: Option<i64>,
    /// Sampling, limits, streaming (read from the same object).
    #[serde(skip)]
    pub sampling: SamplingFields,
}

impl RequestBody for CompletionRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        let mut request: CompletionRequest = typed(value)?;
        request.sampling = typed(value)?;
        Ok(request)
    }

    fn known_fields() -> Vec<&'static str> {
        [
            struct_fields::<CompletionRequest>(),
            struct_fields::<SamplingFields>(),
        ]
        .concat()
    }
}

/// A whole text completion.
#[derive(Debug, Clone, Serialize)]
pub struct TextCompletion {
    /// `cmpl-…`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// One choice.
    pub choices: Vec<TextChoice>,
    /// Token counts; in streams only on the last chunk with `stream_options.include_usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `choices[i]` of a text completion (whole or chunk).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice {
    /// The text (echoed prompt included when asked).
    pub text: String,
    /// Always 0.
    pub index: usize,
    /// Legacy log-probabilities, when asked for.
    pub logprobs: Option<LegacyLogprobs>,
    /// `stop` or `length`; `null` in stream chunks before the last.
    pub finish_reason: Option<&'static str>,
}

/// The completions API's column-wise log-probabilities.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LegacyLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities (`null` for echoed prompt tokens).
    pub token_logprobs: Vec<Option<f32>>,
    /// Most likely alternatives per position (`null` for echoed prompt tokens).
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    /// Byte offset of each token in the returned text.
    pub text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    /// Appends `other`'s columns.
    pub fn extend(&mut self, other: LegacyLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}
