//! Text scanning shared by the grammars: markers seen only in part, XML text values, JSON spans.
//!
//! Every function here is *prefix-stable*: an answer given on a prefix of the text is the same
//! on every longer text. That is what lets the streaming parser decide early and still agree
//! with a parse of the whole text.

/// How the start of a text compares with a marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prefix {
    /// The text starts with the whole marker.
    Full,
    /// The text is a non-empty proper prefix of the marker: more text may complete it.
    Partial,
    /// The text cannot start the marker.
    No,
}

/// Compares the start of `text` with `marker`.
pub(crate) fn prefix_of(text: &str, marker: &str) -> Prefix {
    if text.starts_with(marker) {
        Prefix::Full
    } else if !text.is_empty() && marker.starts_with(text) {
        Prefix::Partial
    } else {
        Prefix::No
    }
}

/// Length of the leading whitespace of `text`.
pub(crate) fn leading_ws(text: &str) -> usize {
    text.len() - text.trim_start().len()
}

/// Length of stray text at the start of `text`: its first character and everything up to the
/// next `<` (where markup may resume).
pub(crate) fn stray_len(text: &str) -> usize {
    let first = text.chars().next().map_or(0, char::len_utf8);
    text[first..].find('<').map_or(text.len(), |at| first + at)
}

/// Where a tag ends a region: the offset of the earliest of `tags` in `text`, with the index of
/// the tag found. Prefix-stable as long as no tag contains another tag's first byte after its
/// own first byte (true for the `<…>` tags used here).
pub(crate) fn find_first(text: &str, tags: &[&str]) -> Option<(usize, usize)> {
    tags.iter()
        .enumerate()
        .filter_map(|(which, tag)| text.find(tag).map(|at| (at, which)))
        .min()
}

/// Offset of the first `needle` in `text` that is not inside a JSON `"…"` string.
pub(crate) fn find_outside_json_strings(text: &str, needle: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let first = *needle.as_bytes().first()?;
    let mut in_string = false;
    let mut escaped = false;
    for (index, &byte) in bytes.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
        } else if byte == b'"' {
            in_string = true;
        } else if byte == first && bytes[index..].starts_with(needle.as_bytes()) {
            return Some(index);
        }
    }
    None
}

/// Length of the JSON string (quotes included) that starts `text` with `"`; `None` while open.
pub(crate) fn json_string_len(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (index, &byte) in text.as_bytes().iter().enumerate().skip(1) {
        if escaped {
            escaped = false;
        } else if byte == b'\\' {
            escaped = true;
        } else if byte == b'"' {
            return Some(index + 1);
        }
    }
    None
}

/// Length of the JSON value that starts `text` with `{` or `[`, found by bracket depth outside
/// `"…"` strings; `None` while the value is still open.
pub(crate) fn json_value_len(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (index, &byte) in text.as_bytes().iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(index + 1);
                }
            }
            _ => {}
        }
        if depth == 0 {
            // The text does not start with a bracket.
            return Some(index + 1);
        }
    }
    None
}

/// Decodes the five XML entities (`&quot; &apos; &lt; &gt; &amp;`) in one pass.
pub(crate) fn decode_entities(text: &str) -> String {
    if !text.contains('&') {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let entity = [
            ("&quot;", '"'),
            ("&apos;", '\''),
            ("&lt;", '<'),
            ("&gt;", '>'),
            ("&amp;", '&'),
        ]
        .into_iter()
        .find(|(name, _)| rest.starts_with(name));
        match entity {
            Some((name, c)) => {
                out.push(c);
                rest = &rest[name.len()..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

const CDATA_OPEN: &str = "<![CDATA[";
const CDATA_CLOSE: &str = "]]>";

/// Decodes an XML text value (GLM, MiniCPM): a value that is exactly one CDATA section is taken
/// verbatim; otherwise CDATA sections are unwrapped, entities outside them are decoded, and the
/// result is trimmed.
pub(crate) fn decode_xml_value(text: &str) -> String {
    let trimmed = text.trim();
    if let Some(inner) = trimmed
        .strip_prefix(CDATA_OPEN)
        .and_then(|rest| rest.strip_suffix(CDATA_CLOSE))
    {
        if !inner.contains(CDATA_CLOSE) {
            return inner.to_string();
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find(CDATA_OPEN) {
        out.push_str(&decode_entities(&rest[..open]));
        let inner = &rest[open + CDATA_OPEN.len()..];
        match inner.find(CDATA_CLOSE) {
            Some(close) => {
                out.push_str(&inner[..close]);
                rest = &inner[close + CDATA_CLOSE.len()..];
            }
            None => {
                out.push_str(inner);
                rest = "";
            }
        }
    }
    out.push_str(&decode_entities(rest));
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_markers() {
        assert_eq!(prefix_of("<tool_call>x", "<tool_call>"), Prefix::Full);
        assert_eq!(prefix_of("<tool_", "<tool_call>"), Prefix::Partial);
        assert_eq!(prefix_of("", "<tool_call>"), Prefix::No);
        assert_eq!(prefix_of("<tool_box>", "<tool_call>"), Prefix::No);
    }

    #[test]
    fn json_spans_skip_strings() {
        assert_eq!(json_value_len(r#"{"a": "}"} tail"#), Some(10));
        assert_eq!(json_value_len(r#"[{"a": "\"]"}], x"#), Some(14));
        assert_eq!(json_value_len(r#"{"a": {"#), None);
        assert_eq!(
            find_outside_json_strings(r#"{"s": "</tool_call>"}</tool_call>"#, "</tool_call>"),
            Some(21)
        );
    }

    #[test]
    fn xml_values() {
        assert_eq!(decode_xml_value("  a &lt;b&gt; &amp;amp; "), "a <b> &amp;");
        assert_eq!(
            decode_xml_value("<![CDATA[\n  if a < b && c\n]]>"),
            "\n  if a < b && c\n"
        );
        assert_eq!(decode_xml_value("x <![CDATA[&lt;]]> &lt;"), "x &lt; <");
        assert_eq!(decode_entities("&unknown; &#39;"), "&unknown; &#39;");
    }

    #[test]
    fn stray_text_runs_to_the_next_tag() {
        // Found by fuzzing: the first character may be multi-byte.
        assert_eq!(stray_len("東京 <x"), 7);
        assert_eq!(stray_len("<a<b"), 2);
        assert_eq!(stray_len("abc"), 3);
        assert_eq!(stray_len(""), 0);
    }

    #[test]
    fn earliest_tag_wins() {
        assert_eq!(
            find_first(
                "a</function>b</parameter>",
                &["</parameter>", "</function>"]
            ),
            Some((1, 1))
        );
        assert_eq!(find_first("abc", &["</x>"]), None);
    }
}
