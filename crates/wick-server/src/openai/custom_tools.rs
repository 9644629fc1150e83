//! Custom tools of the Responses API (Codex CLI's `apply_patch`): `{type: "custom", name,
//! description, format?}` where `format` is `{type: "text"}` or `{type: "grammar", syntax:
//! "lark" | "regex", definition}`. The input of such a call is free text, not JSON arguments.
//!
//! The model sees a custom tool as a function with one string parameter, `input` (the
//! grammar, when there is one, quoted in the description), so every template and tool-call
//! parser works unchanged; a call to it comes back as a `custom_tool_call` item with that
//! string as its `input`, and `custom_tool_call` items in the input go back into the prompt
//! as calls with `{"input": …}` arguments.
//!
//! Constraints: a `regex` format becomes the `pattern` of the `input` string and the tool is
//! strict, so once the model opens a call (or is forced to) its input matches the expression
//! (llguidance matches a pattern against the string's unescaped text). A `lark` grammar is
//! compiled to check it (a syntax error is a 400 with llguidance's message); when it is
//! regular (no recursion, as Codex's `apply_patch` grammar) it is turned into one expression
//! ([`lark_to_regex`]) and enforced the same way, otherwise it is shown to the model but not
//! enforced: a context-free grammar over the raw text cannot bind the JSON-escaped string the
//! model writes inside its call.
use serde_json::{json, Map, Value};

use super::lark_regex::lark_to_regex;
use crate::error::ApiError;

/// A custom tool's input format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CustomFormat {
    /// Free text (no `format`, or `{type: "text"}`).
    Text,
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// A regular expression the whole input matches.
    Regex(String),
}

/// Reads a custom tool's `format`; `at` names the tool in errors (`tools[2]`).
pub fn custom_format(at: &str, tool: &Value) -> Result<CustomFormat, ApiError> {
    let format = match tool.get("format") {
        None | Some(Value::Null) => return Ok(CustomFormat::Text),
        Some(Value::Object(f)) => f,
        Some(_) => return Err(ApiError::field(format!("{at}.format"), "must be an object")),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(CustomFormat::Text),
        Some("grammar") => {
            let definition = match format.get("definition") {
                Some(Value::String(d)) if !d.trim().is_empty() => d.clone(),
                _ => {
                    return Err(ApiError::field(
                        format!("{at}.format.definition"),
                        "must be a non-empty grammar string",
                    ))
                }
            };
            match format.get("syntax").and_then(Value::as_str) {
                Some("lark") => Ok(CustomFormat::Lark(definition)),
                Some("regex") => Ok(CustomFormat::Regex(definition)),
                other => Err(ApiError::field(
                    format!("{at}.format.syntax"),
                    format!("must be 'lark' or 'regex', got {other:?}"),
                )),
            }
        }
        other => Err(ApiError::field(
            format!("{at}.format.type"),
            format!("must be 'text' or 'grammar', got {other:?}"),
        )),
    }
}

/// A custom tool as the chat function tool the model is offered.
pub fn chat_tool(at: &str, tool: &Value) -> Result<Value, ApiError> {
    let name = match tool.get("name").and_then(Value::as_str) {
        Some(n) if !n.trim().is_empty() => n.trim(),
        _ => {
            return Err(ApiError::field(
                format!("{at}.name"),
                "must be a non-empty string",
            ))
        }
    };
    let format = custom_format(at, tool)?;
    let mut description = tool
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let mut input = Map::new();
    input.insert("type".into(), json!("string"));
    let strict = match &format {
        CustomFormat::Text => false,
        CustomFormat::Lark(grammar) => {
            description.push_str(&format!(
                "\n\nThe input must follow this Lark grammar:\n```\n{grammar}\n```"
            ));
            match lark_to_regex(grammar) {
                Some(rx) => {
                    input.insert("pattern".into(), json!(rx));
                    true
                }
                None => {
                    tracing::debug!(
                        tool = name,
                        "custom tool grammar is not regular: shown to the model, not enforced"
                    );
                    false
                }
            }
        }
        CustomFormat::Regex(rx) => {
            description.push_str(&format!(
                "\n\nThe input must match this regular expression: {rx}"
            ));
            input.insert("pattern".into(), json!(anchored(rx)));
            true
        }
    };
    Ok(json!({
        "type": "function",
        "function": {
            "name": name,
            "description": description.trim_start(),
            "parameters": {
                "type": "object",
                "properties": {"input": input},
                "required": ["input"],
                "additionalProperties": false,
            },
            "strict": strict,
        }
    }))
}

/// `rx` matching the whole string (JSON Schema patterns match anywhere).
fn anchored(rx: &str) -> String {
    format!("^(?:{rx})$")
}

/// The grammars of the custom tools in `tools` (the Responses request's list), with the
/// parameter each is named by in errors, to be compiled as a check.
pub fn grammars(tools: &[Value]) -> Result<Vec<(String, CustomFormat)>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) == Some("custom") {
            let at = format!("tools[{i}]");
            let format = custom_format(&at, tool)?;
            if format != CustomFormat::Text {
                out.push((format!("{at}.format.definition"), format));
            }
        }
    }
    Ok(out)
}

/// Whether `name` is a custom tool of `tools`.
pub fn is_custom(name: &str, tools: &[Value]) -> bool {
    tools.iter().any(|t| {
        t.get("type").and_then(Value::as_str) == Some("custom")
            && t.get("name").and_then(Value::as_str).map(str::trim) == Some(name)
    })
}

/// The input of a custom call from the arguments the model wrote: the `input` string, or
/// (a model that wrote something else) the arguments as they are.
pub fn input_of(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(map)) => match map.get("input") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => arguments.to_string(),
        },
        _ => arguments.to_string(),
    }
}

/// The output item of a custom call.
pub fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({
        "type": "custom_tool_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "input": input_of(arguments),
        "status": status,
    })
}

/// The chat arguments of a `custom_tool_call` input item's `input`.
pub fn arguments_of(input: &str) -> String {
    json!({ "input": input }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_custom_tool_is_offered_as_a_function_with_one_string() {
        let lark = json!({"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"x\"+"}});
        let f = chat_tool("tools[0]", &lark).unwrap();
        assert_eq!(f["function"]["name"], "apply_patch");
        assert_eq!(f["function"]["parameters"]["required"], json!(["input"]));
        assert_eq!(
            f["function"]["strict"], true,
            "a regular grammar is enforced"
        );
        assert_eq!(
            f["function"]["parameters"]["properties"]["input"]["pattern"],
            "^(?:(?:x)+)$"
        );
        let recursive = json!({"type": "custom", "name": "p",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"(\" start \")\" | \"x\""}});
        let f2 = chat_tool("tools[0]", &recursive).unwrap();
        assert_eq!(f2["function"]["strict"], false);
        assert!(f2["function"]["parameters"]["properties"]["input"]
            .get("pattern")
            .is_none());
        let description = f["function"]["description"].as_str().unwrap();
        assert!(description.starts_with("Edit files."), "{description}");
        assert!(description.contains("start: \"x\"+"), "{description}");
        let rx = json!({"type": "custom", "name": "code",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}"}});
        let f = chat_tool("tools[1]", &rx).unwrap();
        assert_eq!(f["function"]["strict"], true);
        assert_eq!(
            f["function"]["parameters"]["properties"]["input"]["pattern"],
            "^(?:[A-Z]{3})$"
        );
        let plain = json!({"type": "custom", "name": "note"});
        assert_eq!(custom_format("t", &plain).unwrap(), CustomFormat::Text);
    }

    #[test]
    fn bad_formats_name_their_field() {
        for (tool, param) in [
            (json!({"type": "custom", "name": ""}), "tools[0].name"),
            (
                json!({"type": "custom", "name": "a", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}),
                "tools[0].format.syntax",
            ),
            (
                json!({"type": "custom", "name": "a", "format": {"type": "grammar", "syntax": "lark"}}),
                "tools[0].format.definition",
            ),
            (
                json!({"type": "custom", "name": "a", "format": {"type": "json"}}),
                "tools[0].format.type",
            ),
        ] {
            let e = chat_tool("tools[0]", &tool).unwrap_err();
            assert_eq!(e.param(), Some(param), "{tool}: {e}");
        }
    }

    #[test]
    fn calls_carry_the_input_string_both_ways() {
        let args = arguments_of("*** Begin Patch\n\"quoted\"\n");
        assert_eq!(input_of(&args), "*** Begin Patch\n\"quoted\"\n");
        // A model that wrote something other than {"input": …}: its text is the input.
        assert_eq!(input_of("not json"), "not json");
        let item = call_item("ctc_1", "call_1", "apply_patch", &args, "completed");
        assert_eq!(item["type"], "custom_tool_call");
        assert_eq!(item["input"], "*** Begin Patch\n\"quoted\"\n");
        let tools = [json!({"type": "custom", "name": "apply_patch"})];
        assert!(is_custom("apply_patch", &tools));
        assert!(!is_custom("other", &tools));
    }
}
