//! The markup of a chat prompt that only the chat template may write.
//!
//! Client strings (messages, names, tool arguments, results and definitions) are rendered into
//! the prompt beside the template's markup. A token that ends a turn, opens a tool call or a
//! reasoning block must come from the template, never from a client string, or a tool result
//! quoting an attacker's page could forge a tool call or close a reasoning block. Control tokens
//! are protected by any [`UserTextGuard`]; [`client_text_guard`] adds the user-defined tokens
//! (added tokens not flagged special, as Qwen's `<tool_call>` and `<think>` and Gemma 4's
//! `<|tool_call>` are) that matter here:
//!
//! - every literal a tool-call parser acts on ([`ToolFormat::markup`], all formats, whichever
//!   the model uses) and the reasoning tags `<think>`/`</think>` ([`parser_markers`]);
//! - every user-defined token the chat template writes (`<tool_response>`, Command-R's turn
//!   tokens, Gemma 3's `<start_of_image>` …).
//!
//! The parser markers are also marked where they are not tokens, so that
//! [`starts_in_thinking_marked`](crate::chat_template::starts_in_thinking_marked) can tell a
//! client's `<think>` from the template's.
use crate::chat_template::{THINK_CLOSE, THINK_OPEN};
use crate::tokenizer::{Tokenizer, UserTextGuard};
use crate::tool_call::ToolFormat;

/// Every literal a tool-call or reasoning parser acts on, each once.
pub fn parser_markers() -> Vec<&'static str> {
    let mut markers: Vec<&'static str> = ToolFormat::all()
        .iter()
        .flat_map(|f| f.markup().iter().copied())
        .chain([THINK_OPEN, THINK_CLOSE])
        .collect();
    markers.sort_unstable();
    markers.dedup();
    markers
}

/// The guard that marks client strings for a prompt of `template_source` (the chat template in
/// force, when there is one) and encodes it: no client string can produce a control token, a
/// parser marker or a user-defined token the template writes.
pub fn client_text_guard(tokenizer: &Tokenizer, template_source: Option<&str>) -> UserTextGuard {
    tokenizer.user_text_guard(template_source, &parser_markers())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_cover_every_format_and_the_reasoning_tags() {
        let markers = parser_markers();
        for m in [
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
            "<|tool_call>",
            "<tool_call|>",
            "<|channel>",
            "<channel|>",
            "<|\"|>",
            "<arg_key>",
            "</arg_value>",
            "<|python_tag|>",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[CALL_ID]",
            "<function=",
            "<parameter=",
            "<function name=",
        ] {
            assert!(markers.contains(&m), "{m} missing from {markers:?}");
        }
        assert!(!markers.iter().any(|m| m.is_empty() || *m == "```json"));
    }
}
