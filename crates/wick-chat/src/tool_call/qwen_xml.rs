//! Qwen3-Coder / Qwen3.5 XML calls: `<tool_call><function=NAME><parameter=K>V</parameter>…`.
//!
//! Values are raw text: exactly one framing newline is removed at each end, indentation, XML
//! entities and backslashes are kept (mlx-lm `qwen3_coder` parity); the parameter's schema then
//! decides between string and JSON. A parameter missing its `</parameter>` ends at the next
//! `<parameter=`, `</function>` or `</tool_call>`.

use super::grammar::{reject_through, valid_name, ArgText, BodyGrammar, BodyStep, Opening};
use super::repair::RepairKind;
use super::scan::{find_first, leading_ws, prefix_of, stray_len, Prefix};
use super::schema::ToolBox;
use super::tagged::CLOSE as TOOL_CALL_CLOSE;
use super::ToolCallError;

/// Opens a function inside a `<tool_call>` block.
pub(crate) const FUNCTION_OPEN: &str = "<function=";
pub(crate) const FUNCTION_CLOSE: &str = "</function>";
pub(crate) const PARAMETER_OPEN: &str = "<parameter=";
pub(crate) const PARAMETER_CLOSE: &str = "</parameter>";

/// Reads the `<function=NAME>` header at `function_at` of the block `text`.
pub(crate) fn open(text: &str, function_at: usize, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let name_at = function_at + FUNCTION_OPEN.len();
    let reject = |reason: String| {
        reject_through(
            text,
            TOOL_CALL_CLOSE,
            at_end,
            ToolCallError::UnsupportedPayload {
                format: "qwen-xml",
                reason,
            },
        )
    };
    let Some(end) = text[name_at..].find(['>', '<', '\n']) else {
        return if at_end {
            reject("unterminated <function=…> tag".to_string())
        } else {
            Opening::NeedMore
        };
    };
    if text.as_bytes()[name_at + end] != b'>' {
        return reject("malformed <function=…> tag".to_string());
    }
    let name = text[name_at..name_at + end].trim();
    if !valid_name(name) {
        return reject(format!("invalid function name {name:?}"));
    }
    if let Err(error) = tools.check(name) {
        return reject_through(text, TOOL_CALL_CLOSE, at_end, error);
    }
    Opening::Call {
        name: name.to_string(),
        body: name_at + end + 1,
        grammar: BodyGrammar::QwenXml,
    }
}

/// Removes exactly one leading and one trailing `\n`.
fn unframe(value: &str) -> &str {
    let value = value.strip_prefix('\n').unwrap_or(value);
    value.strip_suffix('\n').unwrap_or(value)
}

/// The body items this grammar knows, as (tag, whether it is complete).
const ITEMS: [&str; 3] = [PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE];

/// Reads the next parameter or the end of the function.
pub(crate) fn step(text: &str, at_end: bool) -> BodyStep {
    let ws = leading_ws(text);
    let rest = &text[ws..];
    let unclosed = BodyStep::End {
        len: text.len(),
        repair: Some(RepairKind::UnclosedBlock),
    };
    if rest.is_empty() {
        return if at_end { unclosed } else { BodyStep::NeedMore };
    }
    let matches = ITEMS.map(|item| prefix_of(rest, item));
    if matches[0] == Prefix::Full {
        return parameter(text, ws, at_end);
    }
    if matches[1] == Prefix::Full {
        let after = ws + FUNCTION_CLOSE.len();
        let gap = leading_ws(&text[after..]);
        return match prefix_of(&text[after + gap..], TOOL_CALL_CLOSE) {
            Prefix::Full => BodyStep::End {
                len: after + gap + TOOL_CALL_CLOSE.len(),
                repair: None,
            },
            Prefix::Partial if !at_end => BodyStep::NeedMore,
            _ if after + gap == text.len() && !at_end => BodyStep::NeedMore,
            _ => BodyStep::End {
                len: after,
                repair: Some(RepairKind::UnclosedBlock),
            },
        };
    }
    if matches[2] == Prefix::Full {
        return BodyStep::End {
            len: ws + TOOL_CALL_CLOSE.len(),
            repair: Some(RepairKind::UnclosedBlock),
        };
    }
    if matches.contains(&Prefix::Partial) {
        return if at_end { unclosed } else { BodyStep::NeedMore };
    }
    let stray = stray_len(rest);
    BodyStep::Skip {
        len: ws + stray,
        repair: Some(RepairKind::StrayText),
    }
}

/// A `<parameter=K>V</parameter>` at `at` of `text`.
fn parameter(text: &str, at: usize, at_end: bool) -> BodyStep {
    let key_at = at + PARAMETER_OPEN.len();
    let Some(key_len) = text[key_at..].find(['>', '<', '\n']) else {
        return if at_end {
            BodyStep::End {
                len: text.len(),
                repair: Some(RepairKind::UnclosedBlock),
            }
        } else {
            BodyStep::NeedMore
        };
    };
    let key = text[key_at..key_at + key_len].trim();
    if text.as_bytes()[key_at + key_len] != b'>' || key.is_empty() {
        return BodyStep::Skip {
            len: key_at,
            repair: Some(RepairKind::StrayText),
        };
    }
    let value_at = key_at + key_len + 1;
    let value = &text[value_at..];
    match find_first(
        value,
        &[
            PARAMETER_CLOSE,
            PARAMETER_OPEN,
            FUNCTION_CLOSE,
            TOOL_CALL_CLOSE,
        ],
    ) {
        Some((end, which)) => BodyStep::Arg {
            key: key.to_string(),
            value: ArgText::Raw(unframe(&value[..end]).to_string()),
            len: if which == 0 {
                value_at + end + PARAMETER_CLOSE.len()
            } else {
                value_at + end
            },
            repairs: if which == 0 {
                Vec::new()
            } else {
                vec![RepairKind::UnclosedBlock]
            },
        },
        None if at_end => BodyStep::End {
            len: text.len(),
            repair: Some(RepairKind::UnclosedBlock),
        },
        None => BodyStep::NeedMore,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg(key: &str, value: &str, len: usize) -> BodyStep {
        BodyStep::Arg {
            key: key.to_string(),
            value: ArgText::Raw(value.to_string()),
            len,
            repairs: vec![],
        }
    }

    #[test]
    fn values_keep_indentation_and_entities() {
        let text = "\n<parameter=code>\n  a &lt; b\n\n</parameter>\n";
        assert_eq!(
            step(text, false),
            arg("code", "  a &lt; b\n", text.len() - 1)
        );
        assert_eq!(step("<parameter=x>1</parameter>", false), arg("x", "1", 26));
    }

    #[test]
    fn ends_and_truncation() {
        assert_eq!(
            step("\n</function>\n</tool_call>tail", false),
            BodyStep::End {
                len: 25,
                repair: None
            }
        );
        assert_eq!(step("</function>\n", false), BodyStep::NeedMore);
        assert_eq!(step("<parameter=x>\nPar", false), BodyStep::NeedMore);
        assert_eq!(
            step("<parameter=x>\nPar", true),
            BodyStep::End {
                len: 17,
                repair: Some(RepairKind::UnclosedBlock)
            }
        );
        assert_eq!(step("<para", false), BodyStep::NeedMore);
    }

    #[test]
    fn missing_parameter_close_ends_at_the_next_tag() {
        assert_eq!(
            step("<parameter=a>\n1\n<parameter=b>2</parameter>", false),
            BodyStep::Arg {
                key: "a".into(),
                value: ArgText::Raw("1".into()),
                len: 16,
                repairs: vec![RepairKind::UnclosedBlock]
            }
        );
    }

    #[test]
    fn header() {
        let tools = ToolBox::new(&[]);
        match open("<tool_call>\n<function=get_weather>\n", 12, false, tools) {
            Opening::Call { name, body, .. } => {
                assert_eq!((name.as_str(), body), ("get_weather", 34))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open("<tool_call><function=get", 11, false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open("<tool_call><function=a b>x</tool_call>", 11, false, tools),
            Opening::Reject { len: 38, .. }
        ));
    }
}
