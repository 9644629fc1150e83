//! JSON as Python's `json.dumps` writes it: the `tojson` filter of Hugging Face templates, and
//! `from_json` for templates written for llama.cpp.
//!
//! transformers replaces jinja2's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`: no HTML escaping, `", "` and `": "` between items unless an
//! indent is given (then `","`), keys in insertion order, floats as Python prints them.

use std::fmt::Write;

use minijinja::value::{Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind};

use super::filters::bind_arguments;
use super::python_str::float_repr;

/// How `json.dumps` lays out its output.
#[derive(Debug, Clone)]
pub(crate) struct JsonStyle {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub(crate) ensure_ascii: bool,
    /// The text repeated per nesting level, when pretty-printing.
    pub(crate) indent: Option<String>,
    /// Between items of a list or an object.
    pub(crate) item_separator: String,
    /// Between a key and its value.
    pub(crate) key_separator: String,
    /// Write object keys in sorted order.
    pub(crate) sort_keys: bool,
}

impl Default for JsonStyle {
    fn default() -> Self {
        JsonStyle {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// The `tojson` filter: `tojson(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, arguments by position or by name, as transformers defines it.
pub(crate) fn tojson_filter(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let given = bind_arguments(
        "tojson",
        args,
        &["ensure_ascii", "indent", "separators", "sort_keys"],
    )?;
    let [ensure_ascii, indent, separators, sort_keys]: [Option<Value>; 4] = given
        .try_into()
        .map_err(|_| Error::from(ErrorKind::InvalidOperation))?;

    let mut style = JsonStyle {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonStyle::default()
    };
    style.indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(indent_text(&v)?),
    };
    if style.indent.is_some() {
        style.item_separator = ",".to_string();
    }
    if let Some(separators) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                style.item_separator = item.as_str().unwrap_or_default().to_string();
                style.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings (item_separator, key_separator)",
                ))
            }
        }
    }
    let mut out = String::new();
    dump(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

/// The `from_json` filter: parses JSON text into template values (llama.cpp's templates for
/// DeepSeek V3.2 and V4 use it on tool-call arguments).
pub(crate) fn from_json_filter(text: &str) -> Result<Value, Error> {
    let parsed: serde_json::Value = serde_json::from_str(text).map_err(|err| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("from_json: not valid JSON: {err}"),
        )
    })?;
    Ok(template_value(&parsed))
}

/// A JSON value as a template value, numbers keeping their int/float type and objects their key
/// order.
pub(crate) fn template_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => items.iter().map(template_value).collect(),
        serde_json::Value::Object(fields) => Value::from_pairs(
            fields
                .iter()
                .map(|(k, v)| (Value::from(k.as_str()), template_value(v))),
        ),
    }
}

/// Python accepts an integer (that many spaces; zero or less means newlines only) or a string.
fn indent_text(indent: &Value) -> Result<String, Error> {
    if let Some(text) = indent.as_str() {
        return Ok(text.to_string());
    }
    if indent.kind() == ValueKind::Bool {
        return Ok(if indent.is_true() { " " } else { "" }.to_string());
    }
    match indent.as_i64() {
        Some(width) => Ok(" ".repeat(width.clamp(0, 1024) as usize)),
        None => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: indent must be an integer or a string, not {}",
                indent.kind()
            ),
        )),
    }
}

/// Writes `value` as `json.dumps` would at nesting `level`.
pub(crate) fn dump(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), style, level, |out, idx| {
                dump(out, &items[idx], style, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = Vec::new();
            if let Some(iter) = value.as_object().and_then(|obj| obj.try_iter_pairs()) {
                for (key, item) in iter {
                    pairs.push((key_text(&key)?, item));
                }
            }
            if style.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', pairs.len(), style, level, |out, idx| {
                let (key, item) = &pairs[idx];
                write_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_separator);
                dump(out, item, style, level + 1)
            })?;
        }
        other => {
            let type_name = match other {
                ValueKind::Undefined => "Undefined".to_string(),
                other => other.to_string(),
            };
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {type_name} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    style: &JsonStyle,
    level: usize,
    mut write_item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline_indent = style
        .indent
        .as_ref()
        .map(|indent| format!("\n{}", indent.repeat(level + 1)));
    if let Some(newline_indent) = &newline_indent {
        out.push_str(newline_indent);
    }
    for idx in 0..len {
        if idx > 0 {
            out.push_str(&style.item_separator);
            if let Some(newline_indent) = &newline_indent {
                out.push_str(newline_indent);
            }
        }
        write_item(out, idx)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(level));
    }
    out.push(close);
    Ok(())
}

/// Python converts non-string keys: `1` → `"1"`, `True` → `"true"`, `None` → `"null"`.
fn key_text(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => {
            let mut text = String::new();
            write_number(&mut text, key);
            Ok(text)
        }
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {other}"),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(number) if number.is_nan() => out.push_str("NaN"),
        Ok(number) if number.is_infinite() => out.push_str(if number < 0.0 {
            "-Infinity"
        } else {
            "Infinity"
        }),
        Ok(number) => out.push_str(&float_repr(number)),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control
/// characters as `\u00XX`; with `ensure_ascii` also everything outside printable ASCII, characters
/// above U+FFFF as a surrogate pair.
fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(json: serde_json::Value, style: &JsonStyle) -> String {
        let mut out = String::new();
        dump(&mut out, &template_value(&json), style, 0).unwrap();
        out
    }

    #[test]
    fn default_style_matches_python() {
        let value =
            serde_json::json!({"b": 1, "a": [1.5, true, null, "é<&>'\""], "c": {}, "d": []});
        assert_eq!(
            dumps(value, &JsonStyle::default()),
            r#"{"b": 1, "a": [1.5, true, null, "é<&>'\""], "c": {}, "d": []}"#
        );
    }

    #[test]
    fn indent_uses_comma_without_space_and_nests() {
        let style = JsonStyle {
            indent: Some("  ".to_string()),
            item_separator: ",".to_string(),
            ..JsonStyle::default()
        };
        let value = serde_json::json!({"a": [1, {"b": 2}], "e": []});
        assert_eq!(
            dumps(value, &style),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"e\": []\n}"
        );
    }

    #[test]
    fn ensure_ascii_escapes_like_python() {
        let style = JsonStyle {
            ensure_ascii: true,
            ..JsonStyle::default()
        };
        assert_eq!(
            dumps(serde_json::json!("é🎉\u{7f}\u{1}"), &style),
            r#""\u00e9\ud83c\udf89\u007f\u0001""#
        );
        assert_eq!(
            dumps(serde_json::json!("é\u{7f}\u{1}"), &JsonStyle::default()),
            "\"é\u{7f}\\u0001\""
        );
    }

    #[test]
    fn sort_keys_and_floats() {
        let style = JsonStyle {
            sort_keys: true,
            ..JsonStyle::default()
        };
        assert_eq!(
            dumps(serde_json::json!({"z": 1e-7, "a": 1e16, "m": -0.5}), &style),
            r#"{"a": 1e+16, "m": -0.5, "z": 1e-07}"#
        );
    }

    #[test]
    fn undefined_is_not_serializable() {
        let mut out = String::new();
        let err = dump(&mut out, &Value::UNDEFINED, &JsonStyle::default(), 0).unwrap_err();
        assert!(err
            .to_string()
            .contains("Object of type Undefined is not JSON serializable"));
    }

    #[test]
    fn from_json_parses_and_rejects() {
        let value = from_json_filter(r#"{"city": "Paris", "n": [1, 2]}"#).unwrap();
        assert_eq!(value.get_attr("city").unwrap().as_str(), Some("Paris"));
        assert!(from_json_filter("{not json").is_err());
    }
}
