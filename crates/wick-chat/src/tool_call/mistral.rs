//! Mistral calls after the `[TOOL_CALLS]` token, in both generations of the format:
//!
//! - v3 (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": "f", "arguments": {…}, "id": "…"}, …]`;
//! - v11+ (Small 3.2, Devstral, Ministral 3): `[TOOL_CALLS]f[CALL_ID]abc123def[ARGS]{…}` (the
//!   `[CALL_ID]` part is optional), repeated per call.
//!
//! Each call is decided when its JSON brackets balance; a truncated one is repaired.

use super::grammar::{valid_name, Opening, ParsedCall};
use super::hermes_json::{arguments_object, calls_from_json, Envelope};
use super::scan::{json_value_len, leading_ws, prefix_of, Prefix};
use super::schema::ToolBox;
use super::ToolCallError;

/// The token that opens calls.
pub(crate) const TOOL_CALLS: &str = "[TOOL_CALLS]";
pub(crate) const CALL_ID: &str = "[CALL_ID]";
pub(crate) const ARGS: &str = "[ARGS]";

fn unsupported(reason: &str) -> ToolCallError {
    ToolCallError::UnsupportedPayload {
        format: "mistral",
        reason: reason.to_string(),
    }
}

/// The JSON value starting at `at` of `text`: its end, or `None` while open (the end of the
/// text when `at_end`).
fn json_end(text: &str, at: usize, at_end: bool) -> Option<usize> {
    match json_value_len(&text[at..]) {
        Some(len) => Some(at + len),
        None if at_end => Some(text.len()),
        None => None,
    }
}

/// Opens the calls after a `[TOOL_CALLS]` token at `text`.
pub(crate) fn open(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let at = TOOL_CALLS.len() + leading_ws(&text[TOOL_CALLS.len()..]);
    if at == text.len() {
        return if at_end {
            Opening::Reject {
                len: text.len(),
                error: unsupported("nothing after [TOOL_CALLS]"),
            }
        } else {
            Opening::NeedMore
        };
    }
    if text[at..].starts_with(['[', '{']) {
        let Some(end) = json_end(text, at, at_end) else {
            return Opening::NeedMore;
        };
        return match calls_from_json(&text[at..end], tools, Envelope::Tagged) {
            Ok(calls) => Opening::Calls { calls, len: end },
            Err(error) => Opening::Reject { len: end, error },
        };
    }
    named_call(text, at, at_end, tools)
}

/// `NAME[CALL_ID]ID[ARGS]{…}` at `at` of `text`.
fn named_call(text: &str, at: usize, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let reject = |reason: &str| Opening::Reject {
        len: at.max(TOOL_CALLS.len()),
        error: unsupported(reason),
    };
    let name_len = text[at..].find(['[', '{']).unwrap_or(text.len() - at);
    let name = text[at..at + name_len].trim();
    let mut cursor = at + name_len;
    if cursor == text.len() {
        return if at_end {
            reject("unterminated call name")
        } else {
            Opening::NeedMore
        };
    }
    if !valid_name(name) {
        return reject("invalid call name");
    }
    match prefix_of(&text[cursor..], CALL_ID) {
        Prefix::Full => {
            cursor += CALL_ID.len();
            let id_len = text[cursor..].find('[').unwrap_or(text.len() - cursor);
            cursor += id_len;
            if cursor == text.len() {
                return if at_end {
                    reject("unterminated call id")
                } else {
                    Opening::NeedMore
                };
            }
        }
        Prefix::Partial if !at_end => return Opening::NeedMore,
        _ => {}
    }
    match prefix_of(&text[cursor..], ARGS) {
        Prefix::Full => cursor += ARGS.len(),
        Prefix::Partial if !at_end => return Opening::NeedMore,
        _ if text[cursor..].starts_with('{') => {}
        _ => return reject("expected [ARGS] after the call name"),
    }
    cursor += leading_ws(&text[cursor..]);
    if cursor == text.len() {
        return if at_end {
            reject("no arguments after [ARGS]")
        } else {
            Opening::NeedMore
        };
    }
    let end = if text[cursor..].starts_with(['{', '[']) {
        match json_end(text, cursor, at_end) {
            Some(end) => end,
            None => return Opening::NeedMore,
        }
    } else if text[cursor..].starts_with('"') {
        match super::scan::json_string_len(&text[cursor..]) {
            Some(len) => cursor + len,
            None if at_end => text.len(),
            None => return Opening::NeedMore,
        }
    } else {
        return reject("arguments are not JSON");
    };
    let mut repairs = Vec::new();
    let arguments = match super::repair::repair_json(&text[cursor..end]) {
        Ok(repaired) => {
            repairs = repaired.repairs;
            arguments_object(Some(repaired.value), name, &mut repairs)
        }
        Err(error) => Err(ToolCallError::ArgumentsNotJson {
            name: name.to_string(),
            reason: error.to_string(),
        }),
    };
    let call = arguments.and_then(|arguments| {
        tools.check(name)?;
        Ok(ParsedCall {
            name: name.to_string(),
            arguments,
            repairs,
        })
    });
    match call {
        Ok(call) => Opening::Calls {
            calls: vec![call],
            len: end,
        },
        Err(error) => Opening::Reject { len: end, error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn calls(text: &str) -> Vec<(String, Value)> {
        match open(text, true, ToolBox::new(&[])) {
            Opening::Calls { calls, .. } => calls
                .into_iter()
                .map(|c| (c.name, Value::Object(c.arguments)))
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn both_generations() {
        assert_eq!(
            calls("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"abcdefghi\"}, {\"name\": \"g\", \"arguments\": {}}]"),
            vec![("f".to_string(), json!({"a": 1})), ("g".to_string(), json!({}))]
        );
        assert_eq!(
            calls("[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{\"a\": 1}"),
            vec![("f".to_string(), json!({"a": 1}))]
        );
        assert_eq!(
            calls("[TOOL_CALLS]f[ARGS]{\"a\": [1, 2"),
            vec![("f".to_string(), json!({"a": [1, 2]}))]
        );
    }

    #[test]
    fn waits_for_the_whole_call() {
        let tools = ToolBox::new(&[]);
        assert!(matches!(
            open("[TOOL_CALLS]f[AR", false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open("[TOOL_CALLS]f[ARGS]{\"a\": 1", false, tools),
            Opening::NeedMore
        ));
        match open("[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]", false, tools) {
            Opening::Calls { len, .. } => assert_eq!(len, 27),
            other => panic!("{other:?}"),
        }
    }
}
