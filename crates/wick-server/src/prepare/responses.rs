//! A Responses request as a chat request: continued from the stored response its
//! `previous_response_id` names, its custom tools' grammars checked, and the conversation
//! to store with the reply.
use serde_json::Value;

use crate::error::ApiError;
use crate::openai::chat::ChatCompletionRequest;
use crate::openai::responses::{input_messages, to_chat, ResponsesRequest};
use crate::state::AppState;
use crate::validation::structured;

/// A Responses request converted for the chat path.
#[derive(Debug, Clone)]
pub struct ResponsesChat {
    /// The chat request to [`super::chat::start`].
    pub chat: ChatCompletionRequest,
    /// The conversation so far (history and this input), when the response is stored.
    pub store: Option<Vec<Value>>,
}

fn not_found(id: &str) -> ApiError {
    ApiError::field(
        "previous_response_id",
        format!("no stored response '{id}' (responses are kept in memory for a while, and only with store: true)"),
    )
}

/// Converts `req`, after the conversation of the response it continues.
pub fn convert(state: &AppState, req: &ResponsesRequest) -> Result<ResponsesChat, ApiError> {
    let history = match &req.previous_response_id {
        Some(id) => {
            state
                .responses()
                .get(id)
                .ok_or_else(|| not_found(id))?
                .conversation
        }
        None => Vec::new(),
    };
    let chat = to_chat(req, history.clone())?;
    let tools = req.tools.as_deref().unwrap_or_default();
    structured::check_custom_grammars(state.model(), tools)?;
    let store = match req.store.unwrap_or(true) {
        true => {
            let mut conversation = history;
            if let Some(input) = &req.input {
                input_messages(input, &mut conversation)?;
            }
            Some(conversation)
        }
        false => None,
    };
    Ok(ResponsesChat { chat, store })
}
