//! GLM-4.5/4.6/4.7 calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`.
//!
//! The name must match `^[^\s<>]+$` and be followed (after whitespace) by `<arg_key>` or
//! `</tool_call>`; keys and values are XML text (entities decoded, CDATA unwrapped, trimmed) and
//! values are then decoded with the parameter's schema (the template writes strings raw and
//! everything else as JSON).

use super::grammar::{
    reject_through, tagged_entries_step, valid_name, ArgText, BodyGrammar, BodyStep, Opening,
};
use super::repair::RepairKind;
use super::scan::{decode_entities, decode_xml_value, find_first, leading_ws, prefix_of, Prefix};
use super::schema::ToolBox;
use super::tagged::CLOSE as TOOL_CALL_CLOSE;

pub(crate) const KEY_OPEN: &str = "<arg_key>";
pub(crate) const KEY_CLOSE: &str = "</arg_key>";
pub(crate) const VALUE_OPEN: &str = "<arg_value>";
pub(crate) const VALUE_CLOSE: &str = "</arg_value>";

/// Tries the GLM header at `body_at` of a `<tool_call>` block `text`: `None` while undecided,
/// `Some(None)` when the body is not GLM, else the opening.
pub(crate) fn open(
    text: &str,
    body_at: usize,
    at_end: bool,
    tools: ToolBox<'_>,
) -> Option<Option<Opening>> {
    let body = &text[body_at..];
    if body.starts_with(['{', '[', '`']) {
        return Some(None);
    }
    let name_len = body
        .find(|c: char| c.is_whitespace() || c == '<' || c == '>')
        .unwrap_or(body.len());
    if name_len == body.len() {
        return if at_end { Some(None) } else { None };
    }
    let name = &body[..name_len];
    if !valid_name(name) {
        return Some(None);
    }
    let after = name_len + leading_ws(&body[name_len..]);
    let next = &body[after..];
    let follows = [prefix_of(next, KEY_OPEN), prefix_of(next, TOOL_CALL_CLOSE)];
    if !follows.contains(&Prefix::Full) {
        return if (follows.contains(&Prefix::Partial) || next.is_empty()) && !at_end {
            None
        } else {
            Some(None)
        };
    }
    if let Err(error) = tools.check(name) {
        return Some(Some(reject_through(text, TOOL_CALL_CLOSE, at_end, error)));
    }
    Some(Some(Opening::Call {
        name: name.to_string(),
        body: body_at + name_len,
        grammar: BodyGrammar::Glm,
    }))
}

/// Reads the next key/value pair or the end of the call.
pub(crate) fn step(text: &str, at_end: bool) -> BodyStep {
    tagged_entries_step(text, at_end, (KEY_OPEN, TOOL_CALL_CLOSE), pair)
}

/// `<arg_key>K</arg_key> <arg_value>V</arg_value>` at `at` of `text`.
fn pair(text: &str, at: usize, at_end: bool) -> BodyStep {
    let key_at = at + KEY_OPEN.len();
    let Some((key_len, which)) = find_first(
        &text[key_at..],
        &[KEY_CLOSE, KEY_OPEN, VALUE_OPEN, TOOL_CALL_CLOSE],
    ) else {
        return BodyStep::short(text, at_end);
    };
    if which != 0 {
        return BodyStep::Skip {
            len: key_at + key_len,
            repair: Some(RepairKind::StrayText),
        };
    }
    let key = decode_entities(text[key_at..key_at + key_len].trim());
    let after_key = key_at + key_len + KEY_CLOSE.len();
    let value_tag_at = after_key + leading_ws(&text[after_key..]);
    match prefix_of(&text[value_tag_at..], VALUE_OPEN) {
        Prefix::Full => {}
        Prefix::Partial if !at_end => return BodyStep::NeedMore,
        _ if value_tag_at == text.len() => {
            return BodyStep::short(text, at_end);
        }
        _ => {
            return BodyStep::Skip {
                len: after_key,
                repair: Some(RepairKind::StrayText),
            }
        }
    }
    let value_at = value_tag_at + VALUE_OPEN.len();
    let value = &text[value_at..];
    let Some((end, which)) = find_first(value, &[VALUE_CLOSE, KEY_OPEN, TOOL_CALL_CLOSE]) else {
        return BodyStep::short(text, at_end);
    };
    let len = if which == 0 {
        value_at + end + VALUE_CLOSE.len()
    } else {
        value_at + end
    };
    if key.is_empty() {
        return BodyStep::Skip {
            len,
            repair: Some(RepairKind::StrayText),
        };
    }
    BodyStep::Arg {
        key,
        value: ArgText::Raw(decode_xml_value(&value[..end])),
        len,
        repairs: if which == 0 {
            Vec::new()
        } else {
            vec![RepairKind::UnclosedBlock]
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_forms() {
        let tools = ToolBox::new(&[]);
        let text = "<tool_call>get_weather\n<arg_key>city</arg_key>";
        match open(text, 11, false, tools) {
            Some(Some(Opening::Call { name, body, .. })) => {
                assert_eq!((name.as_str(), body), ("get_weather", 22))
            }
            other => panic!("{other:?}"),
        }
        assert!(open("<tool_call>get_wea", 11, false, tools).is_none());
        assert!(open("<tool_call>get_weather\n<arg_", 11, false, tools).is_none());
        assert!(matches!(
            open("<tool_call>Sure, {", 11, false, tools),
            Some(None)
        ));
        assert!(matches!(
            open("<tool_call>{\"a\"", 11, false, tools),
            Some(None)
        ));
        assert!(matches!(
            open("<tool_call>now</tool_call>", 11, false, tools),
            Some(Some(Opening::Call { .. }))
        ));
    }

    #[test]
    fn pairs_decode_xml() {
        let text = "\n<arg_key>q</arg_key>\n<arg_value> a &amp; b </arg_value>\n</tool_call>";
        assert_eq!(
            step(text, false),
            BodyStep::Arg {
                key: "q".into(),
                value: ArgText::Raw("a & b".into()),
                len: text.len() - 13,
                repairs: vec![]
            }
        );
        assert_eq!(
            step("\n</tool_call>", false),
            BodyStep::End {
                len: 13,
                repair: None
            }
        );
        assert_eq!(
            step("<arg_key>q</arg_key><arg_value>1", false),
            BodyStep::NeedMore
        );
        assert_eq!(
            step("<arg_key>q</arg_key>x<arg_key>", false),
            BodyStep::Skip {
                len: 20,
                repair: Some(RepairKind::StrayText)
            }
        );
    }
}
