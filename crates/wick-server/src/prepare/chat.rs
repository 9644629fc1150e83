//! A chat request from validation to a running reply: every chat protocol (OpenAI chat,
//! Anthropic Messages, OpenAI Responses) is converted into a [`ChatCompletionRequest`] and
//! goes through [`prepare`] (validate, load media, render and tokenize) and [`start`] (the
//! token limit, the reply's parsing options, the queue).
use std::sync::Arc;
use std::time::Instant;

use wick_chat::tool_call::ToolSpec;
use wick_engine::GenerationRequest;

use super::prompt::{self, ChatPrompt};
use crate::anthropic::{merge_system_turns, to_chat, MessagesRequest, Purpose};
use crate::error::ApiError;
use crate::media;
use crate::openai::chat::ChatCompletionRequest;
use crate::reply::{ReasoningMode, Reply, ReplyOptions};
use crate::state::AppState;
use crate::validation::chat::{validate, ValidChat};
use crate::validation::{MaxTokens, ValidGeneration};

/// A validated chat request with its rendered prompt, ready to start.
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

/// A chat reply under way, with what its encoder needs from the request.
pub struct StartedChat {
    /// The reply, read event by event (dropping it cancels the generation).
    pub reply: Reply,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Log-probabilities asked for.
    pub logprobs: Option<usize>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// A stream ends with a usage chunk.
    pub include_usage: bool,
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
pub async fn prepare(
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
        media::load_all(items, caps.clone(), Arc::new(policy.clone())).await?
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

/// Prepares an Anthropic Messages request: converted into chat messages, then
/// [`prepare`]d; a template that refuses a `system` turn after the first message gets
/// those turns merged into the system prompt instead.
pub async fn prepare_messages(
    state: &AppState,
    req: MessagesRequest,
    purpose: Purpose,
) -> Result<PreparedChat, ApiError> {
    let chat = to_chat(req, purpose)?;
    let merged = merge_system_turns(&chat);
    match prepare(state, chat).await {
        Err(ApiError::PromptBuild(reason)) => match merged {
            Some(merged) => {
                tracing::debug!(%reason, "template refused a late system turn: merged into the system prompt");
                prepare(state, merged).await
            }
            None => Err(ApiError::PromptBuild(reason)),
        },
        other => other,
    }
}

/// Prepares a chat request (arrived at `arrived`) and queues it.
pub async fn start(
    state: &AppState,
    req: ChatCompletionRequest,
    arrived: Instant,
    policy: LimitPolicy,
) -> Result<StartedChat, ApiError> {
    let chat = prepare(state, req).await?;
    launch(state, chat, arrived, policy)
}

/// Prepares an Anthropic Messages request ([`prepare_messages`]) and queues it; a
/// `max_tokens` past the context is a cap ([`LimitPolicy::Cap`]).
pub async fn start_messages(
    state: &AppState,
    req: MessagesRequest,
    arrived: Instant,
) -> Result<StartedChat, ApiError> {
    let chat = prepare_messages(state, req, Purpose::Generate).await?;
    launch(state, chat, arrived, LimitPolicy::Cap)
}

/// Resolves the token limit of a prepared chat and queues it.
fn launch(
    state: &AppState,
    chat: PreparedChat,
    arrived: Instant,
    policy: LimitPolicy,
) -> Result<StartedChat, ApiError> {
    let PreparedChat {
        mut prompt,
        tool_specs,
        parallel_tool_calls,
        logprobs,
        generation,
    } = chat;
    let limit = match (policy, generation.max_tokens) {
        (LimitPolicy::Cap, MaxTokens::Requested(n)) => MaxTokens::Default(n),
        (_, limit) => limit,
    };
    let prompt_tokens = prompt.ids.len();
    let max_tokens = super::max_tokens(state, limit, prompt_tokens, "messages")?;
    let options = reply_options(state, &prompt, tool_specs, parallel_tool_calls);
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
    Ok(StartedChat {
        reply: Reply::start(state, request, options, arrived)?,
        prompt_tokens,
        logprobs,
        stream: generation.stream,
        include_usage: generation.include_usage,
    })
}

/// How a chat reply is parsed: `<think>` split as the template (or the reply itself) says,
/// tool calls in the model's format when tools were offered.
fn reply_options(
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
