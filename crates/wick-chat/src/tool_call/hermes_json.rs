//! The OpenAI-style JSON call envelope (Hermes, Qwen2.5, Qwen3) and the bare-JSON last resort.
//!
//! Accepted envelopes: `{"name": N, "arguments": A}` (`parameters` is read as `arguments`),
//! `{"function": {"name": N, "arguments": A}}` (also with `"type": "function"`), a JSON array of
//! envelopes, or several envelopes one after another. `A` is an object, a JSON string holding an
//! object (repaired like the payload when needed), or absent/`null` for no arguments.

use serde_json::{Map, Value};

use super::grammar::{JsonStart, Opening, ParsedCall};
use super::repair::{record, repair_json, RepairKind};
use super::scan::{json_value_len, prefix_of, Prefix};
use super::schema::{json_type_name, ToolBox};
use super::ToolCallError;

/// How strict the envelope check is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Envelope {
    /// Inside call markup: any object with a name (or a name in its arguments) is a call.
    Tagged,
    /// Untagged JSON: only an object with a `function` object or an `arguments`/`parameters`
    /// object or string is a call, so a reply that merely looks like JSON stays content.
    Bare,
}

/// Parses a JSON payload into calls. Strict JSON first (one value, or several in a row), then
/// the repair pipeline; each call carries the payload's repairs and its own.
pub(crate) fn calls_from_json(
    text: &str,
    tools: ToolBox<'_>,
    rule: Envelope,
) -> Result<Vec<ParsedCall>, ToolCallError> {
    let (values, repairs) = parse_values(text)?;
    let mut envelopes = Vec::new();
    for value in values {
        match value {
            Value::Object(object) => envelopes.push(object),
            Value::Array(items) if !items.is_empty() => {
                for item in items {
                    match item {
                        Value::Object(object) => envelopes.push(object),
                        other => {
                            return Err(ToolCallError::NotAnEnvelope {
                                reason: format!("array item is {}", json_type_name(&other)),
                            })
                        }
                    }
                }
            }
            other => {
                return Err(ToolCallError::NotAnEnvelope {
                    reason: format!("payload is {}", json_type_name(&other)),
                })
            }
        }
    }
    envelopes
        .into_iter()
        .map(|envelope| call_from_envelope(envelope, tools, rule, &repairs))
        .collect()
}

/// One JSON value, or several separated by whitespace, strictly; else one repaired value.
fn parse_values(text: &str) -> Result<(Vec<Value>, Vec<RepairKind>), ToolCallError> {
    let trimmed = text.trim();
    if let Ok(value) = serde_json::from_str::<Value>(trimmed) {
        return Ok((vec![value], Vec::new()));
    }
    let several: Result<Vec<Value>, _> = serde_json::Deserializer::from_str(trimmed)
        .into_iter::<Value>()
        .collect();
    if let Ok(values) = several {
        if values.len() > 1 {
            return Ok((values, Vec::new()));
        }
    }
    repair_json(text)
        .map(|repaired| (vec![repaired.value], repaired.repairs))
        .map_err(|error| ToolCallError::InvalidJson {
            reason: error.to_string(),
        })
}

/// Whether an object has a tool envelope's shape (see [`Envelope::Bare`]).
fn looks_like_envelope(object: &Map<String, Value>) -> bool {
    matches!(object.get("function"), Some(Value::Object(_)))
        || matches!(
            object.get("arguments").or_else(|| object.get("parameters")),
            Some(Value::Object(_)) | Some(Value::String(_))
        )
}

fn call_from_envelope(
    object: Map<String, Value>,
    tools: ToolBox<'_>,
    rule: Envelope,
    payload_repairs: &[RepairKind],
) -> Result<ParsedCall, ToolCallError> {
    if rule == Envelope::Bare && !looks_like_envelope(&object) {
        return Err(ToolCallError::NotAnEnvelope {
            reason: "no `function` object and no `arguments` object or string".to_string(),
        });
    }
    let mut repairs = payload_repairs.to_vec();
    let (name, arguments) = match object.get("function") {
        Some(Value::Object(function)) => (
            function.get("name").cloned(),
            function
                .get("arguments")
                .or_else(|| function.get("parameters"))
                .cloned(),
        ),
        _ => (
            object
                .get("name")
                .or_else(|| object.get("function").filter(|f| f.is_string()))
                .cloned(),
            object
                .get("arguments")
                .or_else(|| object.get("parameters"))
                .cloned(),
        ),
    };
    let label = match &name {
        Some(Value::String(name)) => name.trim().to_string(),
        _ => String::new(),
    };
    let mut arguments = arguments_object(arguments, &label, &mut repairs)?;
    let name = match name {
        Some(Value::String(name)) if !name.trim().is_empty() => name.trim().to_string(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            let promoted = ["name", "function"].into_iter().find(
                |key| matches!(arguments.get(*key), Some(Value::String(s)) if !s.trim().is_empty()),
            );
            match promoted.and_then(|key| arguments.shift_remove(key)) {
                Some(Value::String(name)) => {
                    record(&mut repairs, RepairKind::NameInArgs);
                    name.trim().to_string()
                }
                _ => return Err(ToolCallError::MissingName),
            }
        }
        Some(other) => {
            return Err(ToolCallError::InvalidName {
                name: other.to_string(),
            })
        }
    };
    // Untagged JSON naming a tool that was not offered is data, not a call.
    match rule {
        Envelope::Bare => tools.strict().check(&name)?,
        Envelope::Tagged => tools.check(&name)?,
    }
    Ok(ParsedCall {
        name,
        arguments,
        repairs,
    })
}

/// The arguments as an object: absent/`null`/`""` is `{}`, a string is parsed (with repairs).
pub(crate) fn arguments_object(
    arguments: Option<Value>,
    name: &str,
    repairs: &mut Vec<RepairKind>,
) -> Result<Map<String, Value>, ToolCallError> {
    match arguments {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(object)) => Ok(object),
        Some(Value::String(text)) if text.trim().is_empty() => Ok(Map::new()),
        Some(Value::String(text)) => {
            let repaired = repair_json(&text).map_err(|error| ToolCallError::ArgumentsNotJson {
                name: name.to_string(),
                reason: error.to_string(),
            })?;
            for kind in repaired.repairs {
                record(repairs, kind);
            }
            match repaired.value {
                Value::Object(object) => Ok(object),
                other => Err(ToolCallError::ArgumentsNotObject {
                    name: name.to_string(),
                    found: json_type_name(&other),
                }),
            }
        }
        Some(other) => Err(ToolCallError::ArgumentsNotObject {
            name: name.to_string(),
            found: json_type_name(&other),
        }),
    }
}

/// The fence openers a bare JSON call may start with.
pub(crate) const FENCE_JSON: &str = "```json";
/// A fence without a language tag (only at the very start of a reply).
pub(crate) const FENCE_PLAIN: &str = "```\n";

/// What the text at the start of a reply (or right after a call) opens under `policy`:
/// `Some(Some(block))` a bare-JSON block, `Some(None)` nothing, `None` undecided yet.
pub(crate) fn json_start_block(
    text: &str,
    policy: JsonStart,
    at_end: bool,
) -> Option<Option<super::grammar::Block>> {
    use super::grammar::Block;
    if policy == JsonStart::Off {
        return Some(None);
    }
    match text.as_bytes().first() {
        None => return if at_end { Some(None) } else { None },
        Some(b'{') if policy == JsonStart::Llama3 => return Some(Some(Block::Llama3)),
        Some(b'{') | Some(b'[') => return Some(Some(Block::BareJson)),
        _ => {}
    }
    let fences = [prefix_of(text, FENCE_JSON), prefix_of(text, FENCE_PLAIN)];
    if fences.contains(&Prefix::Full) {
        Some(Some(Block::BareJson))
    } else if fences.contains(&Prefix::Partial) && !at_end {
        None
    } else {
        Some(None)
    }
}

/// Opens a bare-JSON block at `text` (a `{`, a `[` or a fence): a fenced block ends at its
/// closing fence, an unfenced one where its brackets balance; a truncated one runs to the end.
pub(crate) fn open_bare(text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    let len = if text.starts_with("```") {
        let body = text.find('\n').map(|at| at + 1).unwrap_or(text.len());
        text[body..].find("```").map(|close| body + close + 3)
    } else {
        json_value_len(text)
    };
    let len = match len {
        Some(len) => len,
        None if at_end => text.len(),
        None => return Opening::NeedMore,
    };
    match calls_from_json(&text[..len], tools, Envelope::Bare) {
        Ok(mut calls) => {
            for call in &mut calls {
                call.repairs.insert(0, RepairKind::BareJson);
            }
            Opening::Calls { calls, len }
        }
        Err(error) => Opening::Reject { len, error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_call::ToolSpec;
    use serde_json::json;

    /// A call as (name, arguments, repair names).
    type Named = (String, Value, Vec<&'static str>);

    fn names(text: &str, rule: Envelope) -> Result<Vec<Named>, String> {
        calls_from_json(text, ToolBox::new(&[]), rule)
            .map(|calls| {
                calls
                    .into_iter()
                    .map(|c| {
                        (
                            c.name,
                            Value::Object(c.arguments),
                            c.repairs.iter().map(|r| r.as_str()).collect(),
                        )
                    })
                    .collect()
            })
            .map_err(|e| e.kind().to_string())
    }

    #[test]
    fn envelope_shapes() {
        let one = |t| names(t, Envelope::Tagged).unwrap().remove(0);
        assert_eq!(
            one(r#"{"name":"f","arguments":{"a":1}}"#).1,
            json!({"a": 1})
        );
        assert_eq!(
            one(r#"{"name":"f","arguments":"{\"a\":1}"}"#).1,
            json!({"a": 1})
        );
        assert_eq!(
            one(r#"{"name":"f","parameters":{"a":1}}"#).1,
            json!({"a": 1})
        );
        assert_eq!(
            one(r#"{"type":"function","function":{"name":"f","arguments":{"a":1}}}"#).1,
            json!({"a": 1})
        );
        assert_eq!(one(r#"{"name":"f"}"#).1, json!({}));
        assert_eq!(one(r#"{"name":"f","arguments":null}"#).1, json!({}));
        let (name, args, repairs) = one(r#"{"arguments":{"name":"f","x":2}}"#);
        assert_eq!(
            (name.as_str(), args, repairs),
            ("f", json!({"x": 2}), vec!["name_in_args"])
        );
        let (_, args, repairs) = one(r#"{"name":"f","arguments":"{'a': True,}"}"#);
        assert_eq!(args, json!({"a": true}));
        assert_eq!(
            repairs,
            vec!["python_literals", "trailing_commas", "single_quotes"]
        );
    }

    #[test]
    fn several_calls_in_one_payload() {
        let calls = names(r#"[{"name":"a"},{"name":"b"}]"#, Envelope::Tagged).unwrap();
        assert_eq!(calls.len(), 2);
        let calls = names("{\"name\":\"a\"}\n{\"name\":\"b\"}", Envelope::Tagged).unwrap();
        assert_eq!(calls[1].0, "b");
    }

    #[test]
    fn bad_envelopes() {
        assert_eq!(
            names(r#"{"name":"f"}"#, Envelope::Bare).unwrap_err(),
            "not_an_envelope"
        );
        assert_eq!(
            names("[]", Envelope::Tagged).unwrap_err(),
            "not_an_envelope"
        );
        assert_eq!(
            names("[1]", Envelope::Tagged).unwrap_err(),
            "not_an_envelope"
        );
        assert_eq!(
            names(r#"{"arguments":{}}"#, Envelope::Tagged).unwrap_err(),
            "missing_name"
        );
        assert_eq!(
            names(r#"{"name":"f","arguments":[1]}"#, Envelope::Tagged).unwrap_err(),
            "arguments_not_object"
        );
        assert_eq!(
            names(r#"{"name":"f","arguments":"x y"}"#, Envelope::Tagged).unwrap_err(),
            "arguments_not_json"
        );
        assert_eq!(
            names("nothing", Envelope::Tagged).unwrap_err(),
            "invalid_json"
        );
        assert_eq!(
            names(r#"{"name":3}"#, Envelope::Tagged).unwrap_err(),
            "invalid_name"
        );
    }

    #[test]
    fn unknown_tools_are_refused() {
        let specs = [ToolSpec::from_openai(0, &json!({"name": "g"})).unwrap()];
        let err = calls_from_json(r#"{"name":"f"}"#, ToolBox::new(&specs), Envelope::Tagged);
        assert_eq!(err.unwrap_err().kind(), "unknown_tool");
    }

    #[test]
    fn bare_blocks_end_where_the_json_ends() {
        let text = "{\"name\":\"f\",\"arguments\":{}}\nthanks";
        match open_bare(text, false, ToolBox::new(&[])) {
            Opening::Calls { calls, len } => {
                assert_eq!(len, text.find('\n').unwrap());
                assert_eq!(calls[0].repairs, vec![RepairKind::BareJson]);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open_bare(
                "```json\n{\"name\":\"f\",\"arguments\":{}}",
                false,
                ToolBox::new(&[])
            ),
            Opening::NeedMore
        ));
        match open_bare(
            "```json\n{\"name\":\"f\",\"arguments\":{}}\n```\nok",
            false,
            ToolBox::new(&[]),
        ) {
            Opening::Calls { calls, .. } => assert_eq!(
                calls[0].repairs,
                vec![RepairKind::BareJson, RepairKind::FencedWrapper]
            ),
            other => panic!("{other:?}"),
        }
    }
}
