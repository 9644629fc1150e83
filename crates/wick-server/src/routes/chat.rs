//! `POST /v1/chat/completions`: validate, render and tokenize the conversation, start the
//! reply, and answer it whole or as a stream of `chat.completion.chunk` frames
//! ([`crate::encoders::chat`]).
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use wick_engine::GenerationRequest;

use crate::encoders::chat::{whole, ChatEncoder, ChatMeta};
use crate::encoders::stream;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::media;
use crate::openai::chat::ChatCompletionRequest;
use crate::openai::{response_id, unix_now};
use crate::prompt::{self, ChatPrompt};
use crate::reply::{ReasoningMode, Reply, ReplyOptions};
use crate::state::AppState;
use crate::validation::chat::{validate, ValidChat};
use crate::validation::{MaxTokens, ValidGeneration};
use wick_chat::tool_call::ToolSpec;

/// Handles a chat completion request.
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let chat = prepare_chat(&state, req).await?;
    let logprobs = chat.logprobs;
    let stream_reply = chat.generation.stream;
    let include_usage = chat.generation.include_usage;
    let reply = start_chat(&state, chat, arrived, LimitPolicy::Refuse)?;
    let meta = ChatMeta {
        id: response_id("chatcmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    if stream_reply {
        let encoder = ChatEncoder::new(meta, state.clone(), logprobs.is_some(), include_usage);
        Ok(stream(reply, encoder))
    } else {
        let collected = reply.collect().await?;
        let body = whole(
            collected,
            meta,
            state.model().tokenizer(),
            logprobs.is_some(),
        );
        Ok(Json(body).into_response())
    }
}

/// A validated chat request with its rendered prompt, ready to start; every chat protocol
/// (OpenAI chat, Anthropic Messages, OpenAI Responses) goes through it.
#[derive(Debug, Clone)]
pub struct PreparedChat {
    /// The prompt.
    pub prompt: ChatPrompt,
    /// The parsed tool list.
    pub tool_specs: Vec<ToolSpec>,
    /// Whether the model may call several tools.
    pub parallel_tool_calls: bool,
    /// Log-probabilities asked for.
    pub logprobs: Option<usize>,
    /// Sampling and limits.
    pub generation: ValidGeneration,
}

/// What a requested `max_tokens` that does not fit after the prompt means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitPolicy {
    /// A 400 (OpenAI: a request is never cut).
    Refuse,
    /// A cap: generate at most what the context leaves (Anthropic clients send a large
    /// `max_tokens` with every request; only a prompt that fills the context is refused).
    Cap,
}

/// Validates a chat request and renders and tokenizes its prompt.
pub async fn prepare_chat(
    state: &AppState,
    req: ChatCompletionRequest,
) -> Result<PreparedChat, ApiError> {
    let ValidChat {
        mut messages,
        tools,
        tool_specs,
        parallel_tool_calls,
        template_kwargs,
        logprobs,
        generation,
    } = validate(req, state)?;
    let items = media::parts::extract(&mut messages)?;
    let loaded = if items.is_empty() {
        Vec::new()
    } else {
        let caps = &state.model().info().media;
        let policy = &state.config().media;
        media::check_towers(&items, caps, &state.config().model_id, policy)?;
        let context = state.model().info().context_length;
        media::load_all(items, caps.clone(), Arc::new(policy.clone()), context).await?
    };
    let prompt = prompt::chat_prompt(state, messages, tools, template_kwargs, loaded).await?;
    Ok(PreparedChat {
        prompt,
        tool_specs,
        parallel_tool_calls,
        logprobs,
        generation,
    })
}

/// Resolves the token limit of a prepared chat and queues it.
pub fn start_chat(
    state: &AppState,
    chat: PreparedChat,
    arrived: Instant,
    policy: LimitPolicy,
) -> Result<Reply, ApiError> {
    let PreparedChat {
        mut prompt,
        tool_specs,
        parallel_tool_calls,
        generation,
        ..
    } = chat;
    let context = state.model().info().context_length;
    let kv_limit = state.engine().max_sequence_tokens();
    let limit = match (policy, generation.max_tokens) {
        (LimitPolicy::Cap, MaxTokens::Requested(n)) => MaxTokens::Default(n),
        (_, limit) => limit,
    };
    let max_tokens = limit.resolve_within(prompt.ids.len(), context, kv_limit, "messages")?;
    let options = chat_reply_options(state, &prompt, tool_specs, parallel_tool_calls);
    let media = std::mem::take(&mut prompt.media);
    let mut request = GenerationRequest::new(prompt.ids)
        .max_tokens(max_tokens)
        .sampling(generation.sampling)
        .stop(generation.stop)
        .adapters(generation.adapters);
    request.media = media;
    request.ignore_eos = generation.ignore_eos;
    request.speculative = generation.speculative;
    request.keep_special_text = options.needs_special_text();
    Reply::start(state, request, options, arrived)
}

/// How a chat reply is parsed: `<think>` split as the template (or the reply itself) says,
/// tool calls in the model's format when tools were offered. Every chat protocol uses it.
pub fn chat_reply_options(
    state: &AppState,
    prompt: &ChatPrompt,
    tool_specs: Vec<ToolSpec>,
    parallel_tool_calls: bool,
) -> ReplyOptions {
    let think_tags = state
        .template_capabilities()
        .is_some_and(|c| c.uses_think_tags);
    let reasoning = if think_tags || prompt.starts_in_thinking {
        ReasoningMode::Template {
            starts_in_thinking: prompt.starts_in_thinking,
        }
    } else {
        ReasoningMode::Detect
    };
    ReplyOptions {
        reasoning,
        tools: (!tool_specs.is_empty()).then(|| (state.tool_format(), tool_specs)),
        parallel_tool_calls,
    }
}
