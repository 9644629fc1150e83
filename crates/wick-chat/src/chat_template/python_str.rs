//! Python's `str()` and `repr()` of template values, which is what jinja2 prints.
//!
//! minijinja prints lists and maps in Rust's debug style (`["a"]`) and floats without an
//! exponent; Python prints `['a']`, `{'k': 1.5}` and `1e-07`. The chat template's formatter and
//! the `string` and `join` filters go through here so that output matches jinja2 byte for byte.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};

/// Python's `str(value)`: strings as they are, everything else as Python would show it.
pub(crate) fn python_str(value: &Value) -> String {
    let mut out = String::new();
    write_str(&mut out, value);
    out
}

/// Appends Python's `str(value)` to `out`.
pub(crate) fn write_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => write_repr(out, value),
    }
}

/// Appends Python's `repr(value)` to `out`.
pub(crate) fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Bytes => {
            out.push('b');
            write_string_repr(
                out,
                &String::from_utf8_lossy(value.as_bytes().unwrap_or_default()),
            );
        }
        ValueKind::Seq | ValueKind::Iterable => write_sequence(out, value),
        ValueKind::Map => write_map(out, value),
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

fn write_sequence(out: &mut String, value: &Value) {
    let Ok(items) = value.try_iter() else {
        let _ = write!(out, "{value}");
        return;
    };
    let items: Vec<Value> = items.collect();
    let (open, close) = if value.is_tuple() {
        ("(", ")")
    } else {
        ("[", "]")
    };
    out.push_str(open);
    for (idx, item) in items.iter().enumerate() {
        if idx > 0 {
            out.push_str(", ");
        }
        write_repr(out, item);
    }
    if value.is_tuple() && items.len() == 1 {
        out.push(',');
    }
    out.push_str(close);
}

fn write_map(out: &mut String, value: &Value) {
    out.push('{');
    if let Some(pairs) = value.as_object().and_then(|obj| obj.try_iter_pairs()) {
        for (idx, (key, item)) in pairs.enumerate() {
            if idx > 0 {
                out.push_str(", ");
            }
            write_repr(out, &key);
            out.push_str(": ");
            write_repr(out, &item);
        }
    }
    out.push('}');
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else {
        match f64::try_from(value.clone()) {
            Ok(number) => out.push_str(&float_repr(number)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }
}

/// Python's `repr(float)`: the shortest digits that read back to the same number, positional for
/// exponents from -4 to 15 (`0.0001`, `18.5`, `1e+16`, `1e-05`), always with a fraction or an
/// exponent (`3.0`), and `nan`, `inf`, `-inf`.
pub(crate) fn float_repr(number: f64) -> String {
    if number.is_nan() {
        return "nan".to_string();
    }
    if number.is_infinite() {
        return if number < 0.0 { "-inf" } else { "inf" }.to_string();
    }
    // `{:e}` gives the shortest round-trip digits with a decimal exponent, e.g. "-1.25e-7".
    let scientific = format!("{number:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let int_len = exponent as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    }
    out
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote,
/// backslash escapes for the quote, backslash and control characters, `\xNN`/`\uNNNN` for
/// characters Python does not consider printable.
fn write_string_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_printable(c) => {
                let code = c as u32;
                let _ = if code <= 0xff {
                    write!(out, "\\x{code:02x}")
                } else if code <= 0xffff {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, for the characters chat content meets: control
/// characters, separators other than the space, format characters and private-use characters are
/// not printable. (Unassigned code points, which Python also escapes, are printed as they are.)
fn is_printable(ch: char) -> bool {
    let code = ch as u32;
    !matches!(code,
        0x00..=0x1f
        | 0x7f..=0xa0
        | 0xad
        | 0x600..=0x605
        | 0x61c
        | 0x6dd
        | 0x70f
        | 0x890..=0x891
        | 0x8e2
        | 0x1680
        | 0x180e
        | 0x2000..=0x200f
        | 0x2028..=0x202f
        | 0x205f..=0x2064
        | 0x2066..=0x206f
        | 0x3000
        | 0xd800..=0xf8ff
        | 0xfeff
        | 0xfff9..=0xfffb
        | 0xfffe..=0xffff
        | 0x110bd
        | 0x110cd
        | 0x13430..=0x1343f
        | 0x1bca0..=0x1bca3
        | 0x1d173..=0x1d17a
        | 0xe0001
        | 0xe0020..=0xe007f
        | 0xf0000..=0x10ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (18.5, "18.5"),
            (3.0, "3.0"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e-7, "1e-07"),
            (-1.5e-7, "-1.5e-07"),
            (123456789012345.0, "123456789012345.0"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (2.5e-300, "2.5e-300"),
            (1.0 / 3.0, "0.3333333333333333"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (number, expected) in cases {
            assert_eq!(float_repr(number), expected, "{number:e}");
        }
    }

    #[test]
    fn containers_print_like_python() {
        let value = crate::chat_template::json::template_value(&serde_json::json!({
            "a": [1, 2.5, true, null, "it's"],
            "b": {"c": "x\ny"},
        }));
        assert_eq!(
            python_str(&value),
            r#"{'a': [1, 2.5, True, None, "it's"], 'b': {'c': 'x\ny'}}"#
        );
        let tuple = Value::from(minijinja::value::Tuple::from([Value::from("k")]));
        assert_eq!(python_str(&tuple), "('k',)");
    }

    #[test]
    fn string_repr_picks_quotes_and_escapes() {
        let mut out = String::new();
        write_string_repr(&mut out, "a'b\"c\\\t\u{7}\u{a0}é🎉");
        assert_eq!(out, r#"'a\'b"c\\\t\x07\xa0é🎉'"#);
    }

    #[test]
    fn scalars_print_like_python() {
        assert_eq!(python_str(&Value::from(())), "None");
        assert_eq!(python_str(&Value::from(false)), "False");
        assert_eq!(python_str(&Value::UNDEFINED), "");
        assert_eq!(python_str(&Value::from(-12)), "-12");
        assert_eq!(python_str(&Value::from("plain")), "plain");
    }
}
