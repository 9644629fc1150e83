//! Jinja type tests (`is string`, `is mapping`, `is sequence` …) with jinja2's answers.
//!
//! jinja2 asks Python: a string or a dict *is* a sequence (both have `len` and `[]`), an undefined
//! value is iterable and a sequence, `true` is a number but not an integer. Templates branch on
//! these (`content is string` / `content is iterable`), so the answers must be the same.

use minijinja::value::{Value, ValueKind};

/// `is string`: a Python `str`.
pub(crate) fn is_string(value: &Value) -> bool {
    value.kind() == ValueKind::String
}

/// `is mapping`: a dict.
pub(crate) fn is_mapping(value: &Value) -> bool {
    value.kind() == ValueKind::Map
}

/// `is iterable`: anything `iter()` accepts, which includes strings, dicts and undefined values.
pub(crate) fn is_iterable(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
            | ValueKind::Undefined
    )
}

/// `is sequence`: anything with `len()` and `[]`: strings, lists, dicts, undefined values; not a
/// one-shot iterator.
pub(crate) fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Undefined
    )
}

/// `is number`: an int, a float or a bool (Python's `bool` is an `int`).
pub(crate) fn is_number(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::Number | ValueKind::Bool)
}

/// `is integer`: an int that is not a bool.
pub(crate) fn is_integer(value: &Value) -> bool {
    value.kind() == ValueKind::Number && value.is_integer()
}

/// `is float`: a float.
pub(crate) fn is_float(value: &Value) -> bool {
    value.kind() == ValueKind::Number && !value.is_integer()
}

/// `is boolean`: `true` or `false`.
pub(crate) fn is_boolean(value: &Value) -> bool {
    value.kind() == ValueKind::Bool
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_match_jinja2() {
        let text = Value::from("a");
        let list = Value::from(vec![1]);
        let map = crate::chat_template::json::template_value(&serde_json::json!({"a": 1}));
        let truth = Value::from(true);
        let float = Value::from(1.5);
        let undefined = Value::UNDEFINED;
        assert!(is_sequence(&text) && is_sequence(&map) && is_sequence(&undefined));
        assert!(is_iterable(&undefined) && is_iterable(&list) && !is_iterable(&truth));
        assert!(is_number(&truth) && !is_integer(&truth) && is_boolean(&truth));
        assert!(is_float(&float) && !is_integer(&float));
        assert!(is_mapping(&map) && !is_mapping(&list) && is_string(&text));
    }
}
