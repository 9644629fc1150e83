//! `POST /v1/chat/completions` wire types: the request, the response, the stream chunks.
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{SamplingFields, Usage};
use crate::error::ApiError;
use crate::extract::{struct_fields, typed, RequestBody};

/// A chat completion request. Unknown fields are ignored; `model` is not checked (the served
/// model answers and its id is echoed back).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model the client asked for (ignored).
    pub model: Option<String>,
    /// The conversation (checked field by field in `validation`, so errors name the message).
    pub messages: Option<Vec<Value>>,
    /// Offered tools.
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Whether the model may call several tools in one reply (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Return log-probabilities of the generated tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token to return with `logprobs`.
    pub top_logprobs: Option<i64>,
    /// `none` turns thinking off; any other level turns it on.
    pub reasoning_effort: Option<String>,
    /// Extra variables for the chat template (`enable_thinking` …).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `{"type": "text"}` only, until constrained decoding exists.
    pub response_format: Option<Value>,
    /// OpenAI's cache key: a request that carries one keeps the prompt cache's entry of
    /// its conversation (up to its last complete message) pinned, as a `cache_control`
    /// breakpoint would, so the next request with the same history finds it.
    pub prompt_cache_key: Option<String>,
    /// Sampling, limits, streaming (read from the same object).
    #[serde(skip)]
    pub sampling: SamplingFields,
    /// Prompt-cache breakpoints (Anthropic `cache_control`), set by the Messages
    /// conversion.
    #[serde(skip)]
    pub cache_breakpoints: Vec<CacheBreakpoint>,
}

/// A prompt-cache breakpoint: the prefix through the first `messages` messages (with the
/// tools and system prompt) stays cached, pinned for `ttl` after each use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBreakpoint {
    /// Messages the prefix holds.
    pub messages: usize,
    /// How long the pin lasts after each use.
    pub ttl: std::time::Duration,
}

/// Anthropic's default time to live of a `cache_control` breakpoint (also used for
/// `prompt_cache_key`).
pub const DEFAULT_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(300);

impl RequestBody for ChatCompletionRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        let mut request: ChatCompletionRequest = typed(value)?;
        request.sampling = typed(value)?;
        Ok(request)
    }

    fn known_fields() -> Vec<&'static str> {
        [
            struct_fields::<ChatCompletionRequest>(),
            struct_fields::<SamplingFields>(),
        ]
        .concat()
    }
}

/// A whole chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-…`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// `choices[i]` of a whole completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: usize,
    /// The reply.
    pub message: AssistantMessage,
    /// Token log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The answer; `null` when the reply is only tool calls.
    pub content: Option<String>,
    /// Reasoning (`<think>` text), when the model wrote any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Parsed tool calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// One tool call of a reply.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    /// `call_` + 8 hex digits.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Name and arguments.
    pub function: FunctionOut,
    /// Non-standard: the repairs wick applied to parse this call (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub wick_repairs: Vec<&'static str>,
}

/// `tool_calls[i].function`.
#[derive(Debug, Clone, Serialize)]
pub struct FunctionOut {
    /// The tool name.
    pub name: String,
    /// The arguments as a JSON string.
    pub arguments: String,
}

/// `logprobs` of a chat choice or chunk.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
}

/// One token's log-probability and its most likely alternatives.
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    /// Non-standard: the token id (usable as a `logit_bias` key).
    pub id: u32,
    /// The token's text (invalid UTF-8 replaced).
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The token's exact bytes.
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative of [`TokenLogprob::top_logprobs`].
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    /// Non-standard: the token id.
    pub id: u32,
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Option<Vec<u8>>,
}

/// One server-sent event of a chat stream.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    /// Same id on every chunk of a stream.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Only in the last chunk, with `stream_options.include_usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Non-standard, in the finish chunk only: the repairs wick applied to parse the calls
    /// (absent when none). A top-level field, so no client reads it as a call delta.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub wick_repairs: Vec<CallRepairs>,
}

/// The repairs one streamed call needed.
#[derive(Debug, Clone, Serialize)]
pub struct CallRepairs {
    /// The call's `index`.
    pub index: usize,
    /// Repair kinds, in order.
    pub repairs: Vec<&'static str>,
}

/// `choices[i]` of a chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What is new.
    pub delta: Delta,
    /// Log-probabilities of the tokens behind this chunk.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last choice chunk.
    pub finish_reason: Option<&'static str>,
}

/// The new part of the reply.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Answer text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Reasoning text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool-call pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a tool call in a stream: the first carries id, type and name, later ones
/// argument text.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    /// The call's position in the reply.
    pub index: usize,
    /// The call id (first piece).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first piece).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name (first piece) or arguments text; every piece has it.
    pub function: Option<FunctionDelta>,
}

/// `tool_calls[i].function` of a chunk.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FunctionDelta {
    /// The tool name (first piece).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Argument text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}
