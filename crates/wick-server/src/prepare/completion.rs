//! A text completion from validation to a running reply: the prompt tokenized as-is (no
//! chat template) or its token ids checked, the token limit resolved, the request queued.
use std::time::Instant;

use wick_engine::GenerationRequest;

use super::prompt;
use crate::encoders::completions::Echo;
use crate::error::ApiError;
use crate::openai::completions::CompletionRequest;
use crate::reply::{Reply, ReplyOptions};
use crate::state::AppState;
use crate::validation::completion::{validate, PromptInput, ValidCompletion};
use crate::validation::ValidGeneration;

/// A validated completion with its prompt tokenized and its token limit resolved.
#[derive(Debug, Clone)]
pub struct PreparedCompletion {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The prompt as the client sent it, when it was text.
    pub text: Option<String>,
    /// Prepend the prompt to the returned text.
    pub echo: bool,
    /// Log-probabilities: `Some(k)` = the token's and `k` alternatives.
    pub logprobs: Option<usize>,
    /// Sampling and limits.
    pub generation: ValidGeneration,
    /// Tokens to generate at most.
    pub max_tokens: usize,
}

/// A completion under way, with what its encoder needs from the request.
pub struct StartedCompletion {
    /// The reply, read event by event (dropping it cancels the generation).
    pub reply: Reply,
    /// The prompt to put before the completion (`echo`).
    pub echo: Option<Echo>,
    /// Log-probabilities asked for.
    pub logprobs: Option<usize>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// A stream ends with a usage chunk.
    pub include_usage: bool,
}

/// Validates a completion request, tokenizes its prompt and resolves its token limit.
pub async fn prepare(
    state: &AppState,
    req: CompletionRequest,
) -> Result<PreparedCompletion, ApiError> {
    let ValidCompletion {
        prompt: input,
        echo,
        logprobs,
        generation,
    } = validate(req, state)?;
    let (ids, text) = match input {
        PromptInput::Text(text) => (prompt::tokenize(state, text.clone()).await?, Some(text)),
        PromptInput::Tokens(ids) => (ids, None),
    };
    let max_tokens = super::max_tokens(state, generation.max_tokens, ids.len(), "prompt")?;
    Ok(PreparedCompletion {
        ids,
        text,
        echo,
        logprobs,
        generation,
        max_tokens,
    })
}

/// Prepares a completion request (arrived at `arrived`) and queues it.
pub async fn start(
    state: &AppState,
    req: CompletionRequest,
    arrived: Instant,
) -> Result<StartedCompletion, ApiError> {
    let PreparedCompletion {
        ids,
        text,
        echo,
        logprobs,
        generation,
        max_tokens,
    } = prepare(state, req).await?;
    let echo = match (echo, text) {
        (false, _) => None,
        (true, Some(text)) => Some(Echo {
            text,
            ids: ids.clone(),
        }),
        (true, None) => Some(Echo {
            text: prompt::detokenize(state, ids.clone()).await?,
            ids: ids.clone(),
        }),
    };
    let mut request = GenerationRequest::new(ids)
        .max_tokens(max_tokens)
        .sampling(generation.sampling)
        .stop(generation.stop)
        .adapters(generation.adapters);
    request.ignore_eos = generation.ignore_eos;
    request.speculative = generation.speculative;
    if echo.is_some() {
        // The echoed prompt's tokens get their log-probabilities too (the engine scores
        // the whole prompt, bypassing the prompt cache for this request).
        request.prompt_logprobs = logprobs;
    }
    Ok(StartedCompletion {
        reply: Reply::start(state, request, ReplyOptions::plain(), arrived)?,
        echo,
        logprobs,
        stream: generation.stream,
        include_usage: generation.include_usage,
    })
}
