//! Building prompts off the async runtime: chat template rendering, tokenization and
//! detokenization run on `spawn_blocking` workers, so a huge prompt never stalls other
//! requests.
use serde_json::{Map, Value};
use wick_chat::chat_template::{
    normalize_messages, starts_in_thinking, starts_in_thinking_marked, ChatInput, ChatTemplate,
};
use wick_chat::markup::client_text_guard;
use wick_chat::tokenizer::pick_marker;

use wick_engine::media::MediaSpan;

use crate::error::ApiError;
use crate::media::splice::{self, MediaTokens};
use crate::media::LoadedMedia;
use crate::state::AppState;

/// A rendered and tokenized chat prompt.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Whether the prompt ends inside an open `<think>` block.
    pub starts_in_thinking: bool,
    /// The media items, placed on their soft tokens.
    pub media: Vec<MediaSpan>,
}

/// Runs `work` on a blocking worker; a panic inside is an internal error, not a crash.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("prompt worker failed: {e}")))?
}

/// Renders `messages` (with `tools` and template `kwargs`) through the chat template in force
/// and tokenizes the result. Everything the client sent is user text: the text of a control
/// token, a tool-call or reasoning marker or a token the template writes is tokenized as plain
/// text in it ([`wick_chat::markup`]); only the template's own markup becomes those tokens.
/// `media` are the messages' media items in order: each marker the template writes for one
/// is expanded into the item's tokens ([`splice`]) before tokenizing.
pub async fn chat_prompt(
    state: &AppState,
    mut messages: Vec<Value>,
    mut tools: Vec<Value>,
    mut kwargs: Map<String, Value>,
    media: Vec<LoadedMedia>,
) -> Result<ChatPrompt, ApiError> {
    let state = state.clone();
    blocking(move || {
        let model = state.model();
        let tokenizer = model.tokenizer();
        let override_template = state.template_override();
        let template_source = match &override_template {
            Some(t) => Some(t.source()),
            None => model.chat_template().map(ChatTemplate::source),
        };
        let marker = pick_marker(
            messages.iter().chain(&tools).chain(kwargs.values()),
            template_source,
        )
        .ok_or_else(|| {
            ApiError::field(
                "messages",
                "the messages use every Unicode noncharacter; wick needs one free to mark them",
            )
        })?;
        let guard = client_text_guard(tokenizer, template_source);
        let mut marked = false;
        for value in messages.iter_mut().chain(tools.iter_mut()) {
            marked |= guard.mark_json(value, marker);
        }
        for value in kwargs.values_mut() {
            marked |= guard.mark_json(value, marker);
        }
        let tools = (!tools.is_empty()).then_some(tools);
        let text = match override_template {
            Some(template) => template
                .render(&ChatInput {
                    messages: normalize_messages(messages),
                    tools,
                    add_generation_prompt: true,
                    kwargs,
                })
                .map_err(|e| ApiError::PromptBuild(e.to_string()))?,
            None => model.render_chat(&messages, tools.as_deref(), &kwargs)?,
        };
        let media_tokens = if media.is_empty() {
            None
        } else {
            let tokens = MediaTokens::new(&model.info().media, |id| {
                tokenizer.decode(&[id], false).ok()
            })?;
            Some(tokens)
        };
        let text = match &media_tokens {
            Some(tokens) => splice::expand(&text, marked.then_some(marker), &media, tokens)?,
            None => text,
        };
        let (thinking, ids) = if marked {
            let thinking = starts_in_thinking_marked(&text, marker);
            let (_, ids) = guard
                .encode_marked(&text, marker, true)
                .map_err(|e| ApiError::PromptBuild(e.to_string()))?;
            (thinking, drop_doubled_bos(ids, tokenizer.bos_id()))
        } else {
            (starts_in_thinking(&text), model.tokenize(&text)?)
        };
        let media = match &media_tokens {
            Some(tokens) => splice::spans(&ids, media, tokens)?,
            None => Vec::new(),
        };
        Ok(ChatPrompt {
            starts_in_thinking: thinking,
            ids,
            media,
        })
    })
    .await
}

/// A BOS the template wrote after the one the tokenizer added is not doubled (as
/// `Model::tokenize` does).
fn drop_doubled_bos(mut ids: Vec<u32>, bos: Option<u32>) -> Vec<u32> {
    if let (Some(bos), true) = (bos, ids.len() >= 2) {
        if ids[0] == bos && ids[1] == bos {
            ids.remove(0);
        }
    }
    ids
}

/// Tokenizes raw prompt text (special-token text parsed, BOS as the model wants it).
pub async fn tokenize(state: &AppState, text: String) -> Result<Vec<u32>, ApiError> {
    let state = state.clone();
    blocking(move || Ok(state.model().tokenize(&text)?)).await
}

/// Decodes token ids to text (special tokens kept), for echoing a token-array prompt.
pub async fn detokenize(state: &AppState, ids: Vec<u32>) -> Result<String, ApiError> {
    let state = state.clone();
    blocking(move || {
        state
            .model()
            .tokenizer()
            .decode(&ids, false)
            .map_err(|e| ApiError::field("prompt", e.to_string()))
    })
    .await
}
