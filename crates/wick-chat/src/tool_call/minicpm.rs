//! MiniCPM5 XML-attribute calls: `<function name="N"><param name="K">V</param>…</function>`,
//! with no wrapper.
//!
//! A value is plain XML text (entities decoded, trimmed) or a `<![CDATA[…]]>` section, taken
//! verbatim; a `</param>` inside CDATA does not end the value. Values are then decoded with the
//! parameter's schema.

use super::grammar::{
    reject_through, tagged_entries_step, valid_name, ArgText, BodyGrammar, BodyStep, Opening,
};
use super::repair::RepairKind;
use super::scan::{decode_xml_value, find_first, leading_ws, prefix_of, Prefix};
use super::schema::ToolBox;
use super::ToolCallError;

/// The opening marker (the attribute's quote follows).
pub(crate) const FUNCTION_OPEN: &str = "<function name=";
pub(crate) const FUNCTION_CLOSE: &str = "</function>";
pub(crate) const PARAM_OPEN: &str = "<param name=";
pub(crate) const PARAM_CLOSE: &str = "</param>";
pub(crate) const CDATA_OPEN: &str = "<![CDATA[";
pub(crate) const CDATA_CLOSE: &str = "]]>";

/// A quoted attribute value at the start of `text` followed by `>`: `Ok(Some((value, len)))`,
/// `Ok(None)` while incomplete, `Err(())` when malformed.
fn quoted_attribute(text: &str) -> Result<Option<(&str, usize)>, ()> {
    let Some(quote) = text.chars().next() else {
        return Ok(None);
    };
    if quote != '"' && quote != '\'' {
        return Err(());
    }
    let Some(end) = text[1..].find([quote, '<', '>', '\n']) else {
        return Ok(None);
    };
    if !text[1 + end..].starts_with(quote) {
        return Err(());
    }
    let value = &text[1..1 + end];
    let after = 2 + end;
    let gap = leading_ws(&text[after..]);
    match text[after + gap..].chars().next() {
        None => Ok(None),
        Some('>') => Ok(Some((value, after + gap + 1))),
        Some(_) => Err(()),
    }
}

/// Opens a `<function name="…">` call at `text`.
pub(crate) fn open(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let reject = |reason: &str| {
        reject_through(
            text,
            FUNCTION_CLOSE,
            at_end,
            ToolCallError::UnsupportedPayload {
                format: "minicpm",
                reason: reason.to_string(),
            },
        )
    };
    match quoted_attribute(&text[FUNCTION_OPEN.len()..]) {
        Ok(Some((name, len))) => {
            let name = name.trim();
            if !valid_name(name) {
                return reject("invalid function name");
            }
            if let Err(error) = tools.check(name) {
                return reject_through(text, FUNCTION_CLOSE, at_end, error);
            }
            Opening::Call {
                name: name.to_string(),
                body: FUNCTION_OPEN.len() + len,
                grammar: BodyGrammar::MiniCpm,
            }
        }
        Ok(None) if !at_end => Opening::NeedMore,
        Ok(None) => reject("unterminated <function name=…> tag"),
        Err(()) => reject("malformed <function name=…> tag"),
    }
}

/// Reads the next `<param>` or the end of the function.
pub(crate) fn step(text: &str, at_end: bool) -> BodyStep {
    tagged_entries_step(text, at_end, (PARAM_OPEN, FUNCTION_CLOSE), param)
}

/// `<param name="K">V</param>` at `at` of `text`.
fn param(text: &str, at: usize, at_end: bool) -> BodyStep {
    let attr_at = at + PARAM_OPEN.len();
    let (key, attr_len) = match quoted_attribute(&text[attr_at..]) {
        Ok(Some(found)) => found,
        Ok(None) => return BodyStep::short(text, at_end),
        Err(()) => {
            return BodyStep::Skip {
                len: attr_at,
                repair: Some(RepairKind::StrayText),
            }
        }
    };
    let key = key.trim().to_string();
    let value_at = attr_at + attr_len;
    let value = &text[value_at..];
    let lead = leading_ws(value);
    // A CDATA value: everything up to `]]>` is the value, whatever it contains.
    let search_from = match prefix_of(&value[lead..], CDATA_OPEN) {
        Prefix::Full => match value[lead + CDATA_OPEN.len()..].find(CDATA_CLOSE) {
            Some(close) => lead + CDATA_OPEN.len() + close + CDATA_CLOSE.len(),
            None => return BodyStep::short(text, at_end),
        },
        Prefix::Partial if !at_end => return BodyStep::NeedMore,
        _ => 0,
    };
    let Some((end, which)) = find_first(
        &value[search_from..],
        &[PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE],
    ) else {
        return BodyStep::short(text, at_end);
    };
    let end = search_from + end;
    let len = if which == 0 {
        value_at + end + PARAM_CLOSE.len()
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
    fn header() {
        let tools = ToolBox::new(&[]);
        match open("<function name=\"get_weather\"><param", false, tools) {
            Opening::Call { name, body, .. } => {
                assert_eq!((name.as_str(), body), ("get_weather", 29))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open("<function name=\"get_w", false, tools),
            Opening::NeedMore
        ));
        assert!(matches!(
            open("<function name=get>x</function>", false, tools),
            Opening::Reject { len: 31, .. }
        ));
    }

    #[test]
    fn cdata_protects_close_tags() {
        let text = "<param name=\"code\"><![CDATA[a</param>b]]></param></function>";
        assert_eq!(
            step(text, false),
            BodyStep::Arg {
                key: "code".into(),
                value: ArgText::Raw("a</param>b".into()),
                len: text.len() - FUNCTION_CLOSE.len(),
                repairs: vec![]
            }
        );
        assert_eq!(
            step("<param name=\"code\"><![CDATA[a</param>", false),
            BodyStep::NeedMore
        );
    }

    #[test]
    fn plain_values_are_xml_text() {
        assert_eq!(
            step(" <param name='n'> 5 &amp; 6 </param>", false),
            BodyStep::Arg {
                key: "n".into(),
                value: ArgText::Raw("5 & 6".into()),
                len: 36,
                repairs: vec![]
            }
        );
        assert_eq!(
            step("</function>", false),
            BodyStep::End {
                len: 11,
                repair: None
            }
        );
    }
}
