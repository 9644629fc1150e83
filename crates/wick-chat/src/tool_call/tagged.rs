//! The `<tool_call>…</tool_call>` block shared by Hermes JSON, Qwen XML and GLM: which body it
//! holds is decided from the body's first characters.
//!
//! - `<function=` → Qwen XML (so JSON inside a parameter is never taken for an envelope);
//! - a `NAME` (no spaces or brackets) followed by `<arg_key>` or `</tool_call>` → GLM;
//! - anything else → a JSON envelope, read whole up to `</tool_call>` (outside JSON strings) and
//!   repaired when needed.

use super::grammar::{Opening, ParsedCall};
use super::hermes_json::{calls_from_json, Envelope};
use super::scan::{find_outside_json_strings, leading_ws, prefix_of, Prefix};
use super::schema::ToolBox;
use super::{glm, qwen_xml, ToolCallError};

/// The opening tag.
pub(crate) const OPEN: &str = "<tool_call>";
/// The closing tag.
pub(crate) const CLOSE: &str = "</tool_call>";

/// Opens a `<tool_call>` block at `text`.
pub(crate) fn open(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let body_at = OPEN.len() + leading_ws(&text[OPEN.len()..]);
    let body = &text[body_at..];
    if body.is_empty() && !at_end {
        return Opening::NeedMore;
    }
    match prefix_of(body, qwen_xml::FUNCTION_OPEN) {
        Prefix::Full => return qwen_xml::open(text, body_at, at_end, tools),
        Prefix::Partial if !at_end => return Opening::NeedMore,
        _ => {}
    }
    match glm::open(text, body_at, at_end, tools) {
        Some(Some(opening)) => return opening,
        Some(None) => {}
        None => return Opening::NeedMore,
    }
    open_json(text, at_end, tools)
}

/// A JSON body: read whole, then parsed (and repaired) as an envelope.
fn open_json(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let body = &text[OPEN.len()..];
    let close = find_outside_json_strings(body, CLOSE).or_else(|| {
        // A broken string (an unmatched quote) must not swallow the rest of the reply.
        at_end.then(|| body.find(CLOSE)).flatten()
    });
    let (payload, len) = match close {
        Some(at) => (&body[..at], OPEN.len() + at + CLOSE.len()),
        None if at_end => (body, text.len()),
        None => return Opening::NeedMore,
    };
    if payload.trim().is_empty() {
        return Opening::Reject {
            len,
            error: ToolCallError::UnsupportedPayload {
                format: "tool_call",
                reason: "empty <tool_call> block".to_string(),
            },
        };
    }
    match calls_from_json(payload, tools, Envelope::Tagged) {
        Ok(mut calls) => {
            if close.is_none() {
                for call in &mut calls {
                    mark_unclosed(call);
                }
            }
            Opening::Calls { calls, len }
        }
        Err(error) => Opening::Reject { len, error },
    }
}

/// A block whose `</tool_call>` never came: the JSON may have parsed anyway.
fn mark_unclosed(call: &mut ParsedCall) {
    super::repair::record(&mut call.repairs, super::RepairKind::UnclosedBlock);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_call::grammar::BodyGrammar;

    fn open_all(text: &str) -> Opening {
        open(text, true, ToolBox::new(&[]))
    }

    #[test]
    fn body_dispatch() {
        assert!(matches!(
            open_all("<tool_call>\n<function=f>\n"),
            Opening::Call {
                grammar: BodyGrammar::QwenXml,
                ..
            }
        ));
        assert!(matches!(
            open_all("<tool_call>f\n<arg_key>a</arg_key>"),
            Opening::Call {
                grammar: BodyGrammar::Glm,
                ..
            }
        ));
        assert!(matches!(
            open_all("<tool_call>\n{\"name\": \"f\"}\n</tool_call>"),
            Opening::Calls { len: 38, .. }
        ));
        assert!(matches!(
            open_all("<tool_call>Sure: {\"name\": \"f\"}</tool_call>"),
            Opening::Calls { .. }
        ));
    }

    #[test]
    fn close_tag_inside_a_json_string_does_not_end_the_block() {
        let text =
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"</tool_call>\"}}</tool_call>";
        match open(text, false, ToolBox::new(&[])) {
            Opening::Calls { calls, len } => {
                assert_eq!(len, text.len());
                assert_eq!(calls[0].arguments["s"], "</tool_call>");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn undecided_until_the_close_tag() {
        assert!(matches!(
            open("<tool_call>{\"name\": \"f\"}", false, ToolBox::new(&[])),
            Opening::NeedMore
        ));
        assert!(matches!(
            open("<tool_call>", false, ToolBox::new(&[])),
            Opening::NeedMore
        ));
        assert!(matches!(
            open_all("<tool_call>"),
            Opening::Reject { len: 11, .. }
        ));
    }
}
