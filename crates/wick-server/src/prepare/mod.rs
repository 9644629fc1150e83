//! Preparing a checked request for the engine: the stage between a handler and the reply.
//!
//! A handler extracts its protocol's body, calls one function here and encodes what comes
//! back. A chat request (OpenAI chat, Anthropic Messages converted by [`crate::anthropic`],
//! OpenAI Responses converted by [`crate::openai::responses`]) goes [`chat::start`]:
//! validation into a [`crate::validation::chat::ValidChat`] (ranges, defaults, adapters,
//! the compiled grammar), the media parts fetched and decoded ([`crate::media`]), the
//! template rendered and tokenized on blocking workers ([`prompt`]), the token limit
//! resolved against the context, and the request queued as a [`crate::reply::Reply`]. A
//! text completion goes [`completion::start`] the same way without the template. The
//! render and `count_tokens` endpoints stop after preparing ([`chat::prepare`],
//! [`completion::prepare`]).
//!
//! Nothing here knows HTTP or a wire format's output: imports point down to validation,
//! media, prompt building and the reply pipeline.
pub mod chat;
pub mod completion;
pub mod prompt;
pub mod responses;

use crate::error::ApiError;
use crate::state::AppState;
use crate::validation::MaxTokens;

/// The tokens to generate after a prompt of `prompt_tokens`: `limit` resolved against the
/// model's context and the KV memory one sequence may hold; `param` names the prompt field
/// in errors.
pub fn max_tokens(
    state: &AppState,
    limit: MaxTokens,
    prompt_tokens: usize,
    param: &'static str,
) -> Result<usize, ApiError> {
    let context = state.model().info().context_length;
    let kv_limit = state.engine().max_sequence_tokens();
    limit.resolve_within(prompt_tokens, context, kv_limit, param)
}
