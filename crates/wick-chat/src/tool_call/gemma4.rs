//! Gemma 4 calls `<|tool_call>call:NAME{k:<|"|>str<|"|>,n:1}<tool_call|>` and its reasoning
//! channel `<|channel>thought\n…<channel|>`.
//!
//! The markers are special tokens; the parser works on text decoded with specials kept. Keys
//! are bare (or `<|"|>`-quoted), strings are delimited by `<|"|>`, everything else is JSON-like
//! (numbers, `true`, nested `{k:v}` with bare keys, arrays). Each top-level argument is complete
//! at the `,` or `}` that follows it, so arguments stream one by one. A call cut off by the end
//! of the text is closed (open string, then braces) and tagged `unbalanced_braces`.

use serde_json::Value;

use super::grammar::{reject_through, ArgText, BodyGrammar, BodyStep, Opening};
use super::repair::{strip_trailing_commas, RepairKind};
use super::scan::{leading_ws, prefix_of, Prefix};
use super::schema::ToolBox;
use super::ToolCallError;

/// Opens a call (special token 48).
pub(crate) const CALL_OPEN: &str = "<|tool_call>";
/// Closes a call (special token 49).
pub(crate) const CALL_CLOSE: &str = "<tool_call|>";
/// Opens the reasoning channel (special token 100).
pub(crate) const CHANNEL_OPEN: &str = "<|channel>";
/// Closes the reasoning channel (special token 101).
pub(crate) const CHANNEL_CLOSE: &str = "<channel|>";
/// The channel's name line, stripped from reasoning.
pub(crate) const CHANNEL_NAME: &str = "thought\n";
/// The string delimiter token.
pub(crate) const QUOTE: &str = "<|\"|>";
const CALL_PREFIX: &str = "call:";

fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.')
}

/// Opens a `<|tool_call>call:NAME{` header at `text`.
pub(crate) fn open_call(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let reject = |reason: &str| {
        reject_through(
            text,
            CALL_CLOSE,
            at_end,
            ToolCallError::UnsupportedPayload {
                format: "gemma4",
                reason: reason.to_string(),
            },
        )
    };
    let at = CALL_OPEN.len() + leading_ws(&text[CALL_OPEN.len()..]);
    match prefix_of(&text[at..], CALL_PREFIX) {
        Prefix::Full => {}
        Prefix::Partial if !at_end => return Opening::NeedMore,
        _ if at == text.len() && !at_end => return Opening::NeedMore,
        _ => return reject("expected `call:NAME{`"),
    }
    let name_at = at + CALL_PREFIX.len();
    let name_len = text.as_bytes()[name_at..]
        .iter()
        .position(|&b| !is_name_byte(b))
        .unwrap_or(text.len() - name_at);
    let brace_at = name_at + name_len;
    if brace_at == text.len() {
        return if at_end {
            reject("unterminated call header")
        } else {
            Opening::NeedMore
        };
    }
    if name_len == 0 || text.as_bytes()[brace_at] != b'{' {
        return reject("expected `call:NAME{`");
    }
    let name = &text[name_at..brace_at];
    if let Err(error) = tools.check(name) {
        return reject_through(text, CALL_CLOSE, at_end, error);
    }
    Opening::Call {
        name: name.to_string(),
        body: brace_at + 1,
        grammar: BodyGrammar::Gemma4,
    }
}

/// Where a value ends.
enum ValueEnd {
    /// At `len`, before a `,` or `}` at depth 0 or before a `<tool_call|>`.
    At { len: usize },
    /// The text ran out: inside a `<|"|>` string, a `"` string, with these brackets open.
    Open {
        gemma_string: bool,
        json_string: bool,
        brackets: Vec<u8>,
    },
}

/// Scans a value (JSON-like with `<|"|>` strings) from the start of `text`.
fn value_end(text: &str) -> ValueEnd {
    let bytes = text.as_bytes();
    let mut brackets: Vec<u8> = Vec::new();
    let mut index = 0;
    while index < bytes.len() {
        // Markup starts with `<` (ASCII), so slicing there is on a character boundary.
        if bytes[index] == b'<' {
            let rest = &text[index..];
            if let Some(inner) = rest.strip_prefix(QUOTE) {
                match inner.find(QUOTE) {
                    Some(close) => index += QUOTE.len() + close + QUOTE.len(),
                    None => {
                        return ValueEnd::Open {
                            gemma_string: true,
                            json_string: false,
                            brackets,
                        }
                    }
                }
                continue;
            }
            if rest.starts_with(CALL_CLOSE) {
                // A call close token ends the value even inside brackets (they were never closed).
                return ValueEnd::At { len: index };
            }
        }
        match bytes[index] {
            b'"' => {
                let mut escaped = false;
                let mut close = None;
                for (offset, &b) in bytes[index + 1..].iter().enumerate() {
                    if escaped {
                        escaped = false;
                    } else if b == b'\\' {
                        escaped = true;
                    } else if b == b'"' {
                        close = Some(index + 1 + offset);
                        break;
                    }
                }
                match close {
                    Some(close) => index = close + 1,
                    None => {
                        return ValueEnd::Open {
                            gemma_string: false,
                            json_string: true,
                            brackets,
                        }
                    }
                }
                continue;
            }
            b'{' | b'[' => brackets.push(bytes[index]),
            b'}' | b']' if !brackets.is_empty() => {
                brackets.pop();
            }
            b',' | b'}' if brackets.is_empty() => return ValueEnd::At { len: index },
            _ => {}
        }
        index += 1;
    }
    ValueEnd::Open {
        gemma_string: false,
        json_string: false,
        brackets,
    }
}

/// Converts a Gemma value to JSON text: `<|"|>` strings become JSON strings and bare object
/// keys are quoted.
fn to_json_text(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 8);
    let mut last_significant = b'{';
    let mut index = 0;
    while index < bytes.len() {
        let rest = &text[index..];
        if let Some(inner) = rest.strip_prefix(QUOTE) {
            let close = inner.find(QUOTE).unwrap_or(inner.len());
            out.push_str(&Value::String(inner[..close].to_string()).to_string());
            index += QUOTE.len() + (close + QUOTE.len()).min(inner.len());
            last_significant = b'"';
            continue;
        }
        let byte = bytes[index];
        if byte == b'"' {
            let mut end = index + 1;
            let mut escaped = false;
            while end < bytes.len() {
                let b = bytes[end];
                end += 1;
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    break;
                }
            }
            out.push_str(&text[index..end]);
            index = end;
            last_significant = b'"';
            continue;
        }
        if is_name_byte(byte) {
            let end = index
                + bytes[index..]
                    .iter()
                    .position(|&b| !is_name_byte(b))
                    .unwrap_or(bytes.len() - index);
            let word = &text[index..end];
            let is_key = matches!(last_significant, b'{' | b',')
                && text[end..].trim_start().starts_with(':');
            if is_key {
                out.push_str(&Value::String(word.to_string()).to_string());
            } else {
                out.push_str(word);
            }
            index = end;
            last_significant = b'w';
            continue;
        }
        if !byte.is_ascii_whitespace() {
            last_significant = byte;
        }
        // Copy one whole character.
        let char_len = rest.chars().next().map(char::len_utf8).unwrap_or(1);
        out.push_str(&rest[..char_len]);
        index += char_len;
    }
    out
}

/// Decodes a complete value: JSON-like, else with trailing commas removed, else raw text.
fn decode(text: &str, repairs: &mut Vec<RepairKind>) -> ArgText {
    let json = to_json_text(text.trim());
    if let Ok(value) = serde_json::from_str::<Value>(&json) {
        return ArgText::Json(value);
    }
    if let Some(value) = strip_trailing_commas(&json).and_then(|t| serde_json::from_str(&t).ok()) {
        repairs.push(RepairKind::TrailingCommas);
        return ArgText::Json(value);
    }
    repairs.push(RepairKind::BareValue);
    ArgText::Raw(text.trim().to_string())
}

/// A key at the start of `text`: `Ok(Some((key, len)))`, `Ok(None)` when incomplete, `Err(())`
/// when there is no key.
fn key(text: &str) -> Result<Option<(String, usize)>, ()> {
    if let Some(inner) = text.strip_prefix(QUOTE) {
        return Ok(inner
            .find(QUOTE)
            .map(|close| (inner[..close].to_string(), QUOTE.len() * 2 + close)));
    }
    if prefix_of(text, QUOTE) == Prefix::Partial {
        return Ok(None);
    }
    if text.starts_with('"') {
        let Some(len) = super::scan::json_string_len(text) else {
            return Ok(None);
        };
        return serde_json::from_str::<String>(&text[..len])
            .map(|key| Some((key, len)))
            .map_err(|_| ());
    }
    let len = text
        .as_bytes()
        .iter()
        .position(|&b| !is_name_byte(b))
        .unwrap_or(text.len());
    match len {
        0 => Err(()),
        len if len == text.len() => Ok(None),
        len => Ok(Some((text[..len].to_string(), len))),
    }
}

/// Reads the next `key:value` or the end of the call; `args_so_far` decides whether a `,`
/// separator is expected.
pub(crate) fn step(text: &str, at_end: bool, args_so_far: usize) -> BodyStep {
    let ws = leading_ws(text);
    let rest = &text[ws..];
    let truncated = BodyStep::End {
        len: text.len(),
        repair: Some(RepairKind::UnbalancedBraces),
    };
    if rest.is_empty() {
        return if at_end {
            truncated
        } else {
            BodyStep::NeedMore
        };
    }
    if let Some(after_brace) = rest.strip_prefix('}') {
        let gap = leading_ws(after_brace);
        let brace_end = ws + 1;
        return match prefix_of(&after_brace[gap..], CALL_CLOSE) {
            Prefix::Full => BodyStep::End {
                len: brace_end + gap + CALL_CLOSE.len(),
                repair: None,
            },
            Prefix::Partial if !at_end => BodyStep::NeedMore,
            _ if gap == after_brace.len() && !at_end => BodyStep::NeedMore,
            _ => BodyStep::End {
                len: brace_end,
                repair: Some(RepairKind::UnclosedBlock),
            },
        };
    }
    match prefix_of(rest, CALL_CLOSE) {
        Prefix::Full => {
            return BodyStep::End {
                len: ws + CALL_CLOSE.len(),
                repair: Some(RepairKind::UnbalancedBraces),
            }
        }
        Prefix::Partial => {
            return if at_end {
                truncated
            } else {
                BodyStep::NeedMore
            };
        }
        _ => {}
    }
    let mut repairs = Vec::new();
    let mut at = ws;
    if let Some(after_comma) = rest.strip_prefix(',') {
        at += 1 + leading_ws(after_comma);
        match text[at..].chars().next() {
            None => {
                return if at_end {
                    truncated
                } else {
                    BodyStep::NeedMore
                }
            }
            Some('}') => {
                return BodyStep::Skip {
                    len: ws + 1,
                    repair: Some(RepairKind::TrailingCommas),
                }
            }
            Some(_) if args_so_far == 0 => repairs.push(RepairKind::StrayText),
            Some(_) => {}
        }
    } else if args_so_far > 0 {
        repairs.push(RepairKind::StrayText);
    }
    let stray = |from: usize| match value_end(&text[from..]) {
        ValueEnd::At { len } => BodyStep::Skip {
            len: (from + len).max(ws + 1),
            repair: Some(RepairKind::StrayText),
        },
        ValueEnd::Open { .. } if at_end => truncated.clone(),
        ValueEnd::Open { .. } => BodyStep::NeedMore,
    };
    let (key, key_len) = match key(&text[at..]) {
        Ok(Some(found)) => found,
        Ok(None) => {
            return if at_end {
                truncated
            } else {
                BodyStep::NeedMore
            }
        }
        Err(()) => return stray(at),
    };
    let colon_at = at + key_len + leading_ws(&text[at + key_len..]);
    match text[colon_at..].chars().next() {
        None => {
            return if at_end {
                truncated
            } else {
                BodyStep::NeedMore
            }
        }
        Some(':') => {}
        Some(_) => return stray(colon_at),
    }
    let value_at = colon_at + 1;
    match value_end(&text[value_at..]) {
        ValueEnd::At { len } => {
            let raw = &text[value_at..value_at + len];
            if raw.trim().is_empty() {
                return BodyStep::Skip {
                    len: value_at + len,
                    repair: Some(RepairKind::StrayText),
                };
            }
            let value = decode(raw, &mut repairs);
            BodyStep::Arg {
                key,
                value,
                len: value_at + len,
                repairs,
            }
        }
        ValueEnd::Open { .. } if !at_end => BodyStep::NeedMore,
        ValueEnd::Open {
            gemma_string,
            json_string,
            brackets,
        } => {
            // Truncated: close the open string and brackets (the reference's Gemma repair).
            let mut closed = text[value_at..].to_string();
            if gemma_string {
                closed.push_str(QUOTE);
            }
            if json_string {
                closed.push('"');
            }
            for &open in brackets.iter().rev() {
                closed.push(if open == b'{' { '}' } else { ']' });
            }
            repairs.push(RepairKind::UnbalancedBraces);
            if closed.trim().is_empty() {
                return truncated;
            }
            let value = decode(&closed, &mut repairs);
            BodyStep::Arg {
                key,
                value,
                len: text.len(),
                repairs,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn json_arg(key: &str, value: Value, len: usize, repairs: Vec<RepairKind>) -> BodyStep {
        BodyStep::Arg {
            key: key.into(),
            value: ArgText::Json(value),
            len,
            repairs,
        }
    }

    #[test]
    fn header() {
        let tools = ToolBox::new(&[]);
        match open_call("<|tool_call>call:get_weather{location", false, tools) {
            Opening::Call { name, body, .. } => {
                assert_eq!((name.as_str(), body), ("get_weather", 29))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open_call("<|tool_call>cal", false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open_call("<|tool_call>call:get", false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open_call("<|tool_call>hello<tool_call|>", false, tools),
            Opening::Reject { len: 29, .. }
        ));
    }

    #[test]
    fn arguments_one_by_one() {
        let body = "location:<|\"|>Paris, FR<|\"|>,days:3,opts:{unit:<|\"|>C<|\"|>,tags:[1,2]}}<tool_call|>";
        let first = step(body, false, 0);
        assert_eq!(first, json_arg("location", json!("Paris, FR"), 28, vec![]));
        let second = step(&body[28..], false, 1);
        assert_eq!(second, json_arg("days", json!(3), 7, vec![]));
        let third = step(&body[35..], false, 2);
        assert_eq!(
            third,
            json_arg("opts", json!({"unit": "C", "tags": [1, 2]}), 35, vec![])
        );
        assert_eq!(
            step(&body[70..], false, 3),
            BodyStep::End {
                len: 13,
                repair: None
            }
        );
    }

    #[test]
    fn truncated_values_are_closed() {
        assert_eq!(step("city:<|\"|>Par", false, 0), BodyStep::NeedMore);
        assert_eq!(
            step("city:<|\"|>Par", true, 0),
            json_arg("city", json!("Par"), 13, vec![RepairKind::UnbalancedBraces])
        );
        assert_eq!(
            step("o:{a:[1,2", true, 0),
            json_arg(
                "o",
                json!({"a": [1, 2]}),
                9,
                vec![RepairKind::UnbalancedBraces]
            )
        );
    }

    #[test]
    fn non_ascii_values_before_markup() {
        // Found by fuzzing: the value scanner sliced inside a multi-byte character.
        assert_eq!(
            step("city:Ελλάδα <tool_call|>", false, 0),
            BodyStep::Arg {
                key: "city".into(),
                value: ArgText::Raw("Ελλάδα".into()),
                len: 18,
                repairs: vec![RepairKind::BareValue]
            }
        );
    }

    #[test]
    fn malformed_pieces() {
        assert_eq!(
            step(",}", false, 1),
            BodyStep::Skip {
                len: 1,
                repair: Some(RepairKind::TrailingCommas)
            }
        );
        assert_eq!(
            step("city:Paris}", false, 0),
            BodyStep::Arg {
                key: "city".into(),
                value: ArgText::Raw("Paris".into()),
                len: 10,
                repairs: vec![RepairKind::BareValue]
            }
        );
        assert_eq!(
            step("a:1<tool_call|>", false, 0),
            json_arg("a", json!(1), 3, vec![])
        );
        assert_eq!(
            step("<tool_call|>", false, 1),
            BodyStep::End {
                len: 12,
                repair: Some(RepairKind::UnbalancedBraces)
            }
        );
    }
}
