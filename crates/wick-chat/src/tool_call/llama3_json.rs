//! Llama 3.1/3.2/3.3 JSON calls: `{"name": "f", "parameters": {…}}` as the whole reply,
//! optionally after `<|python_tag|>`, several separated by `;`.
//!
//! The object must have a tool envelope's shape (`parameters`/`arguments` object or string, or a
//! `function` object), so a reply that merely is JSON stays content. Each object is decided when
//! its brackets balance; one cut off by the end of the text is repaired like any JSON payload.

use super::grammar::Opening;
use super::hermes_json::{calls_from_json, Envelope};
use super::scan::{json_value_len, leading_ws};
use super::schema::ToolBox;
use super::ToolCallError;

/// The tag Llama 3 writes before a call (built-in tools, and some custom-tool replies).
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";

/// Opens a call at `text`: a `{` or `<|python_tag|>`.
pub(crate) fn open(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let start = match text.strip_prefix(PYTHON_TAG) {
        Some(after) => PYTHON_TAG.len() + leading_ws(after),
        None => 0,
    };
    if start == text.len() {
        return if at_end {
            Opening::Reject {
                len: text.len(),
                error: ToolCallError::UnsupportedPayload {
                    format: "llama3-json",
                    reason: "nothing after <|python_tag|>".to_string(),
                },
            }
        } else {
            Opening::NeedMore
        };
    }
    if !text[start..].starts_with('{') {
        return Opening::Reject {
            len: start.max(1),
            error: ToolCallError::UnsupportedPayload {
                format: "llama3-json",
                reason: "expected a JSON object after <|python_tag|>".to_string(),
            },
        };
    }
    let value_len = match json_value_len(&text[start..]) {
        Some(len) => len,
        None if at_end => text.len() - start,
        None => return Opening::NeedMore,
    };
    let value_end = start + value_len;
    // Calls may be separated by `;`: it belongs to the call before it.
    let gap = leading_ws(&text[value_end..]);
    let len = if text[value_end + gap..].starts_with(';') {
        value_end + gap + 1
    } else if value_end + gap == text.len() && !at_end {
        return Opening::NeedMore;
    } else {
        value_end
    };
    match calls_from_json(&text[start..value_end], tools, Envelope::Bare) {
        Ok(calls) => Opening::Calls { calls, len },
        Err(error) => Opening::Reject { len, error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_and_separators() {
        let tools = ToolBox::new(&[]);
        let text =
            "{\"name\": \"f\", \"parameters\": {\"x\": 1}}; {\"name\": \"g\", \"parameters\": {}}";
        match open(text, false, tools) {
            Opening::Calls { calls, len } => {
                assert_eq!(len, text.find(';').unwrap() + 1);
                assert_eq!(calls[0].name, "f");
                assert_eq!(
                    serde_json::Value::Object(calls[0].arguments.clone()),
                    json!({"x": 1})
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open("{\"name\": \"f\", \"parameters\": {}}", false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open("{\"name\": \"f\", \"parameters\": {}}", true, tools),
            Opening::Calls { .. }
        ));
        assert!(matches!(
            open(
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}\nok",
                false,
                tools
            ),
            Opening::Calls { .. }
        ));
    }

    #[test]
    fn plain_json_is_not_a_call() {
        let tools = ToolBox::new(&[]);
        assert!(matches!(
            open("{\"answer\": 42} ok", false, tools),
            Opening::Reject { len: 14, .. }
        ));
        assert!(matches!(
            open("<|python_tag|>print(1)", false, tools),
            Opening::Reject { len: 14, .. }
        ));
    }
}
