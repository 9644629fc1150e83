//! jinja2's filters where minijinja's differ or are missing: `string`, `join`, `trim`, `indent`,
//! `escape`, `int`, `float`, `wordcount`, `center`.
//!
//! jinja2 turns values into text with Python's `str()` (`True`, `None`, `['a']`, `1e-07`) and
//! escapes HTML the way markupsafe does (`&#34;`, `&#39;`); minijinja's builtins do neither.

use minijinja::value::{Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind};

use super::python_methods::{pad, python_splitlines, python_strip, StripSide};
use super::python_str::{python_str, write_str};

/// `value|string`: Python's `str(value)`.
pub(crate) fn string(value: &Value) -> Value {
    if value.is_safe() {
        return value.clone();
    }
    Value::from(python_str(value))
}

/// `items|join(separator='', attribute=None)`: `separator.join(str(item) for item in items)`.
pub(crate) fn join(
    value: &Value,
    separator: Option<Value>,
    attribute: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let separator = match (separator, kwargs.get::<Option<Value>>("d")?) {
        (Some(_), Some(_)) => {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                "join: got multiple values for argument 'd'",
            ))
        }
        (a, b) => a.or(b),
    };
    let attribute = match (attribute, kwargs.get::<Option<Value>>("attribute")?) {
        (Some(_), Some(_)) => {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                "join: got multiple values for argument 'attribute'",
            ))
        }
        (a, b) => a.or(b),
    };
    kwargs.assert_all_used()?;
    let separator = separator.map(|s| python_str(&s)).unwrap_or_default();
    let attribute = attribute.filter(|a| !a.is_none());
    let mut out = String::new();
    let items = if value.is_undefined() {
        Vec::new()
    } else if let Some(text) = value.as_str() {
        text.chars().map(Value::from).collect()
    } else {
        value.try_iter()?.collect()
    };
    for (idx, item) in items.iter().enumerate() {
        if idx > 0 {
            out.push_str(&separator);
        }
        match &attribute {
            Some(attribute) => write_str(&mut out, &attribute_of(item, attribute)?),
            None => write_str(&mut out, item),
        }
    }
    Ok(Value::from(out))
}

/// jinja2's attribute paths: `"a.b"` looks up `a` then `b`; integer parts index lists.
fn attribute_of(item: &Value, path: &Value) -> Result<Value, Error> {
    if let Some(path) = path.as_str() {
        let mut current = item.clone();
        for part in path.split('.') {
            current = match part.parse::<i64>() {
                Ok(idx) => current.get_item(&Value::from(idx))?,
                Err(_) => current.get_attr(part)?,
            };
        }
        Ok(current)
    } else {
        item.get_item(path)
    }
}

/// `value|trim(chars=None)`: `str(value).strip(chars)` with Python's whitespace.
pub(crate) fn trim(value: &Value, chars: Option<Value>) -> Value {
    let text = python_str(value);
    let chars = chars.filter(|c| !c.is_none()).map(|c| python_str(&c));
    Value::from(python_strip(&text, chars.as_deref(), StripSide::Both))
}

/// `text|indent(width=4, first=False, blank=False)`: jinja2's indent, including its quirk of
/// keeping a trailing newline (`'{\n'|indent(4, first=true)` is `'    {\n'`). `width` may be a
/// string to indent with.
pub(crate) fn indent(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let given = bind_arguments("indent", args, &["width", "first", "blank"])?;
    let indention = match given.first().cloned().flatten() {
        None => "    ".to_string(),
        Some(width) if width.kind() == ValueKind::String => python_str(&width),
        Some(width) => match width.as_i64() {
            Some(n) => " ".repeat(n.clamp(0, 1024) as usize),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "indent: width must be an integer or a string",
                ))
            }
        },
    };
    let flag = |idx: usize| {
        given
            .get(idx)
            .cloned()
            .flatten()
            .is_some_and(|v| v.is_true())
    };
    let (first, blank) = (flag(1), flag(2));
    let mut text = python_str(value);
    text.push('\n');
    let lines = python_splitlines(&text, false);
    let mut out = String::new();
    if blank {
        out = lines.join(&format!("\n{indention}"));
    } else if let Some((head, rest)) = lines.split_first() {
        out.push_str(head);
        for line in rest {
            out.push('\n');
            if !line.is_empty() {
                out.push_str(&indention);
            }
            out.push_str(line);
        }
    }
    if first {
        out.insert_str(0, &indention);
    }
    Ok(Value::from(out))
}

/// `value|int(default=0, base=10)`: a string is read as an integer in `base`, else as a float
/// and truncated; floats truncate, booleans count as 0/1; anything unreadable gives `default`.
pub(crate) fn int(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let given = bind_arguments("int", args, &["default", "base"])?;
    let default = given[0].clone().unwrap_or(Value::from(0));
    let base = match &given[1] {
        Some(base) => base.as_i64().ok_or_else(|| {
            Error::new(ErrorKind::InvalidOperation, "int: base must be an integer")
        })?,
        None => 10,
    };
    let parsed = match value.kind() {
        ValueKind::Bool => Some(i128::from(value.is_true())),
        ValueKind::Number if value.is_integer() => i128::try_from(value.clone()).ok(),
        ValueKind::Number => f64::try_from(value.clone())
            .ok()
            .filter(|f| f.is_finite())
            .map(|f| f.trunc() as i128),
        ValueKind::String => {
            let text = python_strip(value.as_str().unwrap_or_default(), None, StripSide::Both);
            parse_python_int(text, base).or_else(|| {
                parse_python_float(text)
                    .filter(|f| f.is_finite())
                    .map(|f| f.trunc() as i128)
            })
        }
        _ => None,
    };
    Ok(parsed.map_or(default, Value::from))
}

/// `value|float(default=0.0)`: Python's `float(value)`, or `default` when that fails.
pub(crate) fn float(value: &Value, default: Option<Value>) -> Value {
    let parsed = match value.kind() {
        ValueKind::Bool => Some(if value.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(value.clone()).ok(),
        ValueKind::String => parse_python_float(python_strip(
            value.as_str().unwrap_or_default(),
            None,
            StripSide::Both,
        )),
        _ => None,
    };
    match parsed {
        Some(number) => Value::from(number),
        None => default.unwrap_or(Value::from(0.0)),
    }
}

/// `text|wordcount`: how many runs of word characters (`\w+`) the text holds.
pub(crate) fn wordcount(value: &Value) -> Value {
    let text = python_str(value);
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut count = 0;
    let mut in_word = false;
    for ch in text.chars() {
        if is_word(ch) && !in_word {
            count += 1;
        }
        in_word = is_word(ch);
    }
    Value::from(count)
}

/// `text|center(width=80)`: `str(text).center(width)`.
pub(crate) fn center(value: &Value, width: Option<usize>) -> Value {
    Value::from(pad(&python_str(value), width.unwrap_or(80), ' ', "center"))
}

/// Python's `int(text, base)`: optional sign, `_` between digits, a `0x`/`0o`/`0b` prefix that
/// matches the base (base 0 reads the prefix).
fn parse_python_int(text: &str, base: i64) -> Option<i128> {
    let (negative, digits) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let lower = digits.to_ascii_lowercase();
    let prefixed = |p: &str| lower.strip_prefix(p).map(str::to_string);
    let (radix, body) = match base {
        0 | 16 if lower.starts_with("0x") => (16, prefixed("0x")?),
        0 | 8 if lower.starts_with("0o") => (8, prefixed("0o")?),
        0 | 2 if lower.starts_with("0b") => (2, prefixed("0b")?),
        0 => (10, lower.clone()),
        2..=36 => (base as u32, lower.clone()),
        _ => return None,
    };
    let body = body.strip_prefix('_').unwrap_or(&body);
    if body.is_empty() || body.starts_with('_') || body.ends_with('_') || body.contains("__") {
        return None;
    }
    let magnitude = i128::from_str_radix(&body.replace('_', ""), radix).ok()?;
    Some(if negative { -magnitude } else { magnitude })
}

/// Python's `float(text)` for the forms chat data has: decimal and exponent notation, `_`
/// between digits, `inf`/`infinity`/`nan` in any case.
fn parse_python_float(text: &str) -> Option<f64> {
    if text.is_empty() || text.starts_with('_') || text.ends_with('_') || text.contains("__") {
        return None;
    }
    text.replace('_', "").parse::<f64>().ok()
}

/// Binds a Python-style call's arguments to parameter `names`: by position or by keyword, each at
/// most once, no unknown keyword.
pub(crate) fn bind_arguments(
    callee: &str,
    args: Rest<ValueOrKwargs>,
    names: &[&str],
) -> Result<Vec<Option<Value>>, Error> {
    let mut positional: Vec<Value> = Vec::new();
    let mut kwargs = None;
    for arg in args.into_values() {
        if arg.is_kwargs() {
            kwargs = Some(Kwargs::try_from(arg)?);
        } else {
            positional.push(arg);
        }
    }
    if positional.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{callee} takes at most {} arguments", names.len()),
        ));
    }
    let mut bound = Vec::with_capacity(names.len());
    for (idx, name) in names.iter().enumerate() {
        let named: Option<Value> = match &kwargs {
            Some(kwargs) => kwargs.get(name)?,
            None => None,
        };
        match (positional.get(idx), named) {
            (Some(_), Some(_)) => {
                return Err(Error::new(
                    ErrorKind::TooManyArguments,
                    format!("{callee}: got multiple values for argument '{name}'"),
                ))
            }
            (Some(value), None) => bound.push(Some(value.clone())),
            (None, named) => bound.push(named),
        }
    }
    if let Some(kwargs) = kwargs {
        kwargs.assert_all_used()?;
    }
    Ok(bound)
}

/// `value|escape` (`|e`): markupsafe's HTML escaping of `str(value)`; safe strings pass through.
pub(crate) fn escape(value: &Value) -> Value {
    if value.is_safe() {
        return value.clone();
    }
    let text = python_str(value);
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    Value::from_safe_string(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_and_escape_follow_python() {
        assert_eq!(string(&Value::from(true)).as_str(), Some("True"));
        assert_eq!(string(&Value::from(vec!["a"])).as_str(), Some("['a']"));
        assert_eq!(
            escape(&Value::from("<a href=\"x\">'&'</a>")).as_str(),
            Some("&lt;a href=&#34;x&#34;&gt;&#39;&amp;&#39;&lt;/a&gt;")
        );
    }

    #[test]
    fn indent_keeps_jinja2_quirks() {
        let call = |text: &str, args: Vec<Value>| {
            let args: Vec<ValueOrKwargs> = args.into_iter().map(ValueOrKwargs::from).collect();
            indent(&Value::from(text), Rest(args)).unwrap().to_string()
        };
        assert_eq!(
            call("{\n", vec![Value::from(4), Value::from(true)]),
            "    {\n"
        );
        assert_eq!(call("a\n\nb", vec![Value::from(2)]), "a\n\n  b");
        assert_eq!(
            call(
                "a\n\nb",
                vec![Value::from("> "), Value::from(false), Value::from(true)]
            ),
            "a\n> \n> b"
        );
    }

    #[test]
    fn numbers_parse_like_jinja2() {
        let int_of = |v: Value, args: Vec<Value>| {
            let args: Vec<ValueOrKwargs> = args.into_iter().map(ValueOrKwargs::from).collect();
            int(&v, Rest(args)).unwrap().to_string()
        };
        assert_eq!(int_of(Value::from(" 42 "), vec![]), "42");
        assert_eq!(int_of(Value::from("-3.9"), vec![]), "-3");
        assert_eq!(int_of(Value::from("1_000"), vec![]), "1000");
        assert_eq!(
            int_of(Value::from("0x1A"), vec![Value::from(0), Value::from(16)]),
            "26"
        );
        assert_eq!(int_of(Value::from("1e3"), vec![]), "1000");
        assert_eq!(int_of(Value::from("x"), vec![Value::from(7)]), "7");
        assert_eq!(int_of(Value::from(()), vec![]), "0");
        assert_eq!(int_of(Value::from(3.99), vec![]), "3");
        assert_eq!(float(&Value::from(" 2 "), None).to_string(), "2.0");
        assert_eq!(
            float(&Value::from("x"), Some(Value::from(1.5))).to_string(),
            "1.5"
        );
        assert_eq!(float(&Value::from(true), None).to_string(), "1.0");
        assert_eq!(
            wordcount(&Value::from("héllo wörld_1 two-three")).to_string(),
            "4"
        );
    }

    #[test]
    fn trim_uses_python_strip() {
        assert_eq!(trim(&Value::from("\u{1f} x \n"), None).as_str(), Some("x"));
        assert_eq!(
            trim(&Value::from("--x--"), Some(Value::from("-"))).as_str(),
            Some("x")
        );
        assert_eq!(trim(&Value::from(()), None).as_str(), Some("None"));
    }
}
