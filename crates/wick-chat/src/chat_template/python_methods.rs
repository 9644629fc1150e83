//! Python methods on strings, dicts and lists that chat templates call (`content.strip()`,
//! `message.get('name')`, `text.split('</think>')[-1]`, `key.startswith(('a', 'b'))` …).
//!
//! The methods whose Python semantics minijinja-contrib's `pycompat` does not reproduce exactly
//! (whitespace per `str.isspace`, `split` with `maxsplit`, `rsplit`, `splitlines`) and the ones it
//! lacks are implemented here; the rest are handed to `pycompat`.

use minijinja::value::{from_args, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

/// The environment's unknown-method callback: Python methods on primitive values.
pub(crate) fn call_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let handled = match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args)?,
        ValueKind::Seq => sequence_method(value, method, args)?,
        ValueKind::Map => map_method(value, method, args)?,
        _ => None,
    };
    match handled {
        Some(result) => Ok(result),
        None => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Python's `str.isspace` for one character: Unicode whitespace plus the ASCII separators
/// U+001C..U+001F, which Rust's `char::is_whitespace` leaves out.
pub(crate) fn is_python_space(ch: char) -> bool {
    ch.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&ch)
}

/// Which ends of a string `strip` trims.
#[derive(Clone, Copy)]
pub(crate) enum StripSide {
    Both,
    Start,
    End,
}

/// Python's `str.strip(chars)` / `lstrip` / `rstrip`: whitespace, or any of `chars`.
pub(crate) fn python_strip<'a>(text: &'a str, chars: Option<&str>, side: StripSide) -> &'a str {
    let matches = |ch: char| match chars {
        Some(chars) => chars.contains(ch),
        None => is_python_space(ch),
    };
    match side {
        StripSide::Both => text.trim_matches(matches),
        StripSide::Start => text.trim_start_matches(matches),
        StripSide::End => text.trim_end_matches(matches),
    }
}

fn string_method(text: &str, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    let result = match method {
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<Value>,) = from_args(args)?;
            let chars = optional_str(chars.as_ref(), method)?;
            let side = match method {
                "lstrip" => StripSide::Start,
                "rstrip" => StripSide::End,
                _ => StripSide::Both,
            };
            Value::from(python_strip(text, chars, side))
        }
        "split" | "rsplit" => {
            let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
            let sep = optional_str(sep.as_ref(), method)?;
            let maxsplit = maxsplit.filter(|n| *n >= 0).map(|n| n as usize);
            let parts = split(text, sep, maxsplit, method == "rsplit")?;
            Value::from(parts)
        }
        "splitlines" => {
            let (keepends,): (Option<bool>,) = from_args(args)?;
            Value::from(python_splitlines(text, keepends.unwrap_or(false)))
        }
        "partition" | "rpartition" => {
            let (sep,): (&str,) = from_args(args)?;
            if sep.is_empty() {
                return Err(invalid("empty separator"));
            }
            let found = if method == "partition" {
                text.find(sep)
            } else {
                text.rfind(sep)
            };
            let parts = match found {
                Some(at) => [&text[..at], sep, &text[at + sep.len()..]],
                None if method == "partition" => [text, "", ""],
                None => ["", "", text],
            };
            Value::from(minijinja::value::Tuple::from(parts.map(Value::from)))
        }
        "removeprefix" => {
            let (prefix,): (&str,) = from_args(args)?;
            Value::from(text.strip_prefix(prefix).unwrap_or(text))
        }
        "removesuffix" => {
            let (suffix,): (&str,) = from_args(args)?;
            Value::from(text.strip_suffix(suffix).unwrap_or(text))
        }
        "index" | "rindex" => {
            let (needle,): (&str,) = from_args(args)?;
            let found = if method == "index" {
                text.find(needle)
            } else {
                text.rfind(needle)
            };
            match found {
                Some(at) => Value::from(text[..at].chars().count()),
                None => return Err(invalid("substring not found")),
            }
        }
        "casefold" => {
            let () = from_args(args)?;
            Value::from(text.to_lowercase())
        }
        "zfill" => {
            let (width,): (usize,) = from_args(args)?;
            let len = text.chars().count();
            if len >= width {
                Value::from(text)
            } else {
                let (sign, digits) = match text.chars().next() {
                    Some(c @ ('+' | '-')) => (Some(c), &text[1..]),
                    _ => (None, text),
                };
                let mut out: String = sign.into_iter().collect();
                out.extend(std::iter::repeat_n('0', width - len));
                out.push_str(digits);
                Value::from(out)
            }
        }
        "ljust" | "rjust" | "center" => {
            let (width, fill): (usize, Option<&str>) = from_args(args)?;
            let fill = match fill.map(|f| f.chars().collect::<Vec<_>>()) {
                None => ' ',
                Some(chars) if chars.len() == 1 => chars[0],
                Some(_) => {
                    return Err(invalid(
                        "the fill character must be exactly one character long",
                    ))
                }
            };
            Value::from(pad(text, width, fill, method))
        }
        _ => return Ok(None),
    };
    Ok(Some(result))
}

fn sequence_method(value: &Value, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    match method {
        "index" => {
            let (needle,): (&Value,) = from_args(args)?;
            for (idx, item) in value.try_iter()?.enumerate() {
                if item == *needle {
                    return Ok(Some(Value::from(idx)));
                }
            }
            Err(invalid("value is not in list"))
        }
        "copy" => {
            let () = from_args(args)?;
            Ok(Some(value.try_iter()?.collect()))
        }
        _ => Ok(None),
    }
}

fn map_method(value: &Value, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    match method {
        "copy" => {
            let () = from_args(args)?;
            let pairs = value
                .as_object()
                .and_then(|obj| obj.try_iter_pairs())
                .map(|pairs| pairs.collect::<Vec<_>>())
                .unwrap_or_default();
            Ok(Some(Value::from_pairs(pairs)))
        }
        _ => Ok(None),
    }
}

/// Python's `str.split` / `str.rsplit`. Without a separator, runs of whitespace separate and
/// empty strings are dropped; with one, every occurrence separates. At most `maxsplit` splits,
/// counted from the left (`split`) or the right (`rsplit`).
fn split(
    text: &str,
    sep: Option<&str>,
    maxsplit: Option<usize>,
    from_right: bool,
) -> Result<Vec<String>, Error> {
    let limit = maxsplit.unwrap_or(usize::MAX);
    match sep {
        Some("") => Err(invalid("empty separator")),
        Some(sep) => {
            let mut parts: Vec<String> = if from_right {
                let mut parts: Vec<String> = text
                    .rsplitn(limit.saturating_add(1), sep)
                    .map(str::to_string)
                    .collect();
                parts.reverse();
                parts
            } else {
                text.splitn(limit.saturating_add(1), sep)
                    .map(str::to_string)
                    .collect()
            };
            if parts.is_empty() {
                parts.push(String::new());
            }
            Ok(parts)
        }
        None => Ok(split_whitespace(text, limit, from_right)),
    }
}

fn split_whitespace(text: &str, limit: usize, from_right: bool) -> Vec<String> {
    if from_right {
        let reversed: String = text.chars().rev().collect();
        let mut parts: Vec<String> = split_whitespace(&reversed, limit, false)
            .into_iter()
            .map(|part| part.chars().rev().collect())
            .collect();
        parts.reverse();
        return parts;
    }
    let mut parts = Vec::new();
    let mut rest = python_strip(text, None, StripSide::Start);
    while !rest.is_empty() {
        if parts.len() == limit {
            parts.push(rest.to_string());
            break;
        }
        let end = rest.find(is_python_space).unwrap_or(rest.len());
        parts.push(rest[..end].to_string());
        rest = python_strip(&rest[end..], None, StripSide::Start);
    }
    parts
}

/// Python's `str.splitlines`: every Unicode line boundary, `\r\n` counted once.
pub(crate) fn python_splitlines(text: &str, keepends: bool) -> Vec<String> {
    let is_break = |c: char| {
        matches!(
            c,
            '\n' | '\r'
                | '\u{b}'
                | '\u{c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        )
    };
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((at, ch)) = chars.next() {
        if !is_break(ch) {
            continue;
        }
        let mut end = at + ch.len_utf8();
        if ch == '\r' {
            if let Some((_, '\n')) = chars.peek() {
                chars.next();
                end += 1;
            }
        }
        lines.push(text[start..if keepends { end } else { at }].to_string());
        start = end;
    }
    if start < text.len() {
        lines.push(text[start..].to_string());
    }
    lines
}

/// Python's `str.ljust`/`rjust`/`center` (`method`) with `fill`.
pub(crate) fn pad(text: &str, width: usize, fill: char, method: &str) -> String {
    let len = text.chars().count();
    if len >= width {
        return text.to_string();
    }
    let total = width - len;
    let (left, right) = match method {
        "ljust" => (0, total),
        "rjust" => (total, 0),
        // Python's centre puts the odd extra character on the left when the width is odd.
        _ => {
            let left = total / 2 + (total & width & 1);
            (left, total - left)
        }
    };
    let mut out: String = std::iter::repeat_n(fill, left).collect();
    out.push_str(text);
    out.extend(std::iter::repeat_n(fill, right));
    out
}

fn optional_str<'a>(value: Option<&'a Value>, method: &str) -> Result<Option<&'a str>, Error> {
    match value {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            invalid(&format!(
                "{method} arg must be None or str, not {}",
                v.kind()
            ))
        }),
    }
}

fn invalid(detail: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, detail.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_matches_python() {
        let s = |t: &str, sep: Option<&str>, max: Option<usize>, right: bool| {
            split(t, sep, max, right).unwrap()
        };
        assert_eq!(s("  a  b c ", None, None, false), ["a", "b", "c"]);
        assert_eq!(s("  a  b c ", None, Some(1), false), ["a", "b c "]);
        assert_eq!(s("  a  b c ", None, Some(1), true), ["  a  b", "c"]);
        assert_eq!(s("", None, None, false), Vec::<String>::new());
        assert_eq!(s("", Some(","), None, false), [""]);
        assert_eq!(s("a,,b,", Some(","), None, false), ["a", "", "b", ""]);
        assert_eq!(s("a,b,c", Some(","), Some(1), true), ["a,b", "c"]);
        assert_eq!(s("x</think>y", Some("</think>"), None, false), ["x", "y"]);
        assert!(split("a", Some(""), None, false).is_err());
    }

    #[test]
    fn strip_uses_python_whitespace() {
        assert_eq!(python_strip("\u{1c} a \n", None, StripSide::Both), "a");
        assert_eq!(python_strip("xxaxx", Some("x"), StripSide::Start), "axx");
        assert_eq!(python_strip("\n\nab\n", None, StripSide::End), "\n\nab");
    }

    #[test]
    fn splitlines_and_padding() {
        assert_eq!(python_splitlines("a\r\nb\rc\n", false), ["a", "b", "c"]);
        assert_eq!(python_splitlines("a\r\nb", true), ["a\r\n", "b"]);
        assert_eq!(pad("ab", 5, '*', "center"), "**ab*");
        assert_eq!(pad("abc", 6, '*', "center"), "*abc**");
        assert_eq!(pad("a", 4, ' ', "center"), " a  ");
        assert_eq!(pad("ab", 4, '-', "rjust"), "--ab");
    }
}
