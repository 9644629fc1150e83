//! Building prompts off the async runtime: chat template rendering, tokenization and
//! detokenization run on `spawn_blocking` workers, so a huge prompt never stalls other
//! requests.
use serde_json::{Map, Value};
use wick_chat::chat_template::{normalize_messages, starts_in_thinking, ChatInput};

use crate::error::ApiError;
use crate::state::AppState;

/// A rendered and tokenized chat prompt.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Whether the prompt ends inside an open `<think>` block.
    pub starts_in_thinking: bool,
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
/// and tokenizes the result.
pub async fn chat_prompt(
    state: &AppState,
    messages: Vec<Value>,
    tools: Vec<Value>,
    kwargs: Map<String, Value>,
) -> Result<ChatPrompt, ApiError> {
    let state = state.clone();
    blocking(move || {
        let tools = (!tools.is_empty()).then_some(tools);
        let text = match state.template_override() {
            Some(template) => template
                .render(&ChatInput {
                    messages: normalize_messages(messages),
                    tools,
                    add_generation_prompt: true,
                    kwargs,
                })
                .map_err(|e| ApiError::PromptBuild(e.to_string()))?,
            None => state
                .model()
                .render_chat(&messages, tools.as_deref(), &kwargs)?,
        };
        let ids = state.model().tokenize(&text)?;
        Ok(ChatPrompt {
            starts_in_thinking: starts_in_thinking(&text),
            ids,
        })
    })
    .await
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
