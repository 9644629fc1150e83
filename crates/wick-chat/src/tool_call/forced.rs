//! Grammars that force a reply to be tool calls in a family's own wire format (for
//! `tool_choice: "required"` or a named function), so the format's parser reads them back.
//!
//! The grammar is Lark in llguidance's dialect: the format's markers as literals (or as a
//! token reference `<[id]>` when the vocabulary has the marker as one special token, so the
//! model writes it the way it was trained to) around `%json{…}` bodies, one JSON schema per
//! tool that fixes the name and constrains the arguments to the tool's `parameters`.

use serde_json::{json, Map, Value};

use super::{ToolCallError, ToolFormat, ToolSpec};

/// A Lark grammar whose sentences are one call (or, with `parallel`, one or more calls) of
/// the `tools` in `format`'s wire format. `special_id` gives the id of a marker that is a
/// single special token of the vocabulary.
///
/// Formats whose arguments are not a JSON body (the XML-style ones, Gemma 4) are refused
/// with [`ToolCallError::UnsupportedForcedFormat`].
pub fn forced_call_grammar(
    format: ToolFormat,
    tools: &[ToolSpec],
    parallel: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> Result<String, ToolCallError> {
    if tools.is_empty() {
        return Err(ToolCallError::InvalidToolSpec {
            index: 0,
            reason: "forcing a tool call needs at least one tool".into(),
        });
    }
    let marker = |text: &str| match special_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => literal(text),
    };
    let bodies = |arguments_key: &str| -> String {
        tools
            .iter()
            .map(|tool| format!("%json {}", envelope(tool, arguments_key)))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let repeat = |call: &str, separator: &str| {
        if parallel {
            format!("start: {call} ({separator} {call})*\n")
        } else {
            format!("start: {call}\n")
        }
    };
    let grammar = match format {
        ToolFormat::HermesJson => {
            let mut g = repeat("call", &literal("\n"));
            g.push_str(&format!(
                "call: {} {} body {} {}\nbody: {}\n",
                marker("<tool_call>"),
                literal("\n"),
                literal("\n"),
                marker("</tool_call>"),
                bodies("arguments")
            ));
            g
        }
        ToolFormat::Llama3Json => {
            let mut g = repeat("body", &literal("; "));
            g.push_str(&format!("body: {}\n", bodies("parameters")));
            g
        }
        ToolFormat::Mistral => {
            let calls = if parallel {
                format!("body ({} body)*", literal(", "))
            } else {
                "body".to_string()
            };
            format!(
                "start: {} {} {calls} {}\nbody: {}\n",
                marker("[TOOL_CALLS]"),
                literal("["),
                literal("]"),
                bodies("arguments")
            )
        }
        other => {
            return Err(ToolCallError::UnsupportedForcedFormat {
                format: other.name(),
            })
        }
    };
    Ok(grammar)
}

/// The grammar of one call after its opening tag, for strict tools under `tool_choice: auto`:
/// the model writes free text, and once it opens a call (`trigger`, the family's opening tag
/// or special token) the rest of the call — the JSON envelope of an offered tool and the
/// closing tag — is constrained. `strict` says which tools' `parameters` bind the arguments;
/// the others take any JSON object, so a call to them still parses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyCallGrammar {
    /// The text that opens a call.
    pub trigger: String,
    /// The Lark grammar of what follows it, up to and including the closing tag.
    pub grammar: String,
}

/// [`LazyCallGrammar`] of `format`, or `None` for a format whose calls have no opening tag
/// to trigger on (bare JSON, as Llama 3 writes) or that is not supported yet.
pub fn lazy_call_grammar(
    format: ToolFormat,
    tools: &[ToolSpec],
    strict: &dyn Fn(&ToolSpec) -> bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> Option<LazyCallGrammar> {
    if tools.is_empty() {
        return None;
    }
    let marker = |text: &str| match special_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => literal(text),
    };
    let bodies = |arguments_key: &str| -> String {
        tools
            .iter()
            .map(|tool| {
                let envelope = if strict(tool) {
                    envelope(tool, arguments_key)
                } else {
                    let open = ToolSpec {
                        parameters: json!({"type": "object"}),
                        ..tool.clone()
                    };
                    envelope(&open, arguments_key)
                };
                format!("%json {envelope}")
            })
            .collect::<Vec<_>>()
            .join(" | ")
    };
    // Whitespace the model may put around the body (a newline in the templates).
    let ws = r"/[ \t\r\n]{1,8}/";
    match format {
        ToolFormat::HermesJson => Some(LazyCallGrammar {
            trigger: "<tool_call>".into(),
            grammar: format!(
                "start: ws? body ws? {}\nws: {ws}\nbody: {}\n",
                marker("</tool_call>"),
                bodies("arguments")
            ),
        }),
        ToolFormat::Mistral => Some(LazyCallGrammar {
            trigger: "[TOOL_CALLS]".into(),
            grammar: format!(
                "start: ws? {} body ({} ws? body)* {}\nws: {ws}\nbody: {}\n",
                literal("["),
                literal(","),
                literal("]"),
                bodies("arguments")
            ),
        }),
        _ => None,
    }
}

/// The JSON schema of one call's envelope: `{"name": <the name>, <key>: <parameters>}`.
/// `$defs` / `definitions` of the parameters move to the envelope's root, so their
/// `#/$defs/…` references still resolve.
pub fn envelope(tool: &ToolSpec, arguments_key: &str) -> Value {
    let mut parameters = match &tool.parameters {
        Value::Object(p) if !p.is_empty() => p.clone(),
        _ => {
            let mut p = Map::new();
            p.insert("type".into(), json!("object"));
            p
        }
    };
    let mut root = Map::new();
    for key in ["$defs", "definitions"] {
        if let Some(defs) = parameters.remove(key) {
            root.insert(key.into(), defs);
        }
    }
    root.insert("type".into(), json!("object"));
    root.insert(
        "properties".into(),
        json!({
            "name": {"const": tool.name},
            arguments_key: Value::Object(parameters),
        }),
    );
    root.insert("required".into(), json!(["name", arguments_key]));
    root.insert("additionalProperties".into(), json!(false));
    // llguidance's options: whitespace between tokens bounded, so a model cannot fill its
    // budget with blank lines.
    root.insert(
        "x-guidance".into(),
        json!({"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}),
    );
    Value::Object(root)
}

/// A Lark string literal (JSON's escapes are Lark's).
fn literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Value) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: None,
            parameters,
        }
    }

    #[test]
    fn hermes_grammar_wraps_each_tool_envelope_in_tags() {
        let tools = [
            tool(
                "get_weather",
                json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            ),
            tool("now", Value::Null),
        ];
        let g = forced_call_grammar(ToolFormat::HermesJson, &tools, false, &|_| None).unwrap();
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(
            g.contains(r#"call: "<tool_call>" "\n" body "\n" "</tool_call>""#),
            "{g}"
        );
        assert!(g.contains(r#""name":{"const":"get_weather"}"#), "{g}");
        assert!(g.contains(r#""name":{"const":"now"}"#), "{g}");
        assert_eq!(g.matches("%json").count(), 2);
        let parallel =
            forced_call_grammar(ToolFormat::HermesJson, &tools, true, &|_| None).unwrap();
        assert!(
            parallel.starts_with(r#"start: call ("\n" call)*"#),
            "{parallel}"
        );
    }

    #[test]
    fn lazy_grammars_bind_strict_tools_and_leave_the_others_open() {
        let tools = [
            tool(
                "get_weather",
                json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            ),
            tool(
                "loose",
                json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
            ),
        ];
        let strict = |t: &ToolSpec| t.name == "get_weather";
        let g = lazy_call_grammar(ToolFormat::HermesJson, &tools, &strict, &|t| {
            (t == "</tool_call>").then_some(7)
        })
        .unwrap();
        assert_eq!(g.trigger, "<tool_call>");
        assert!(g.grammar.starts_with("start: ws? body ws? <[7]>\n"), "{}", g.grammar);
        assert!(g.grammar.contains(r#""city":{"type":"string"}"#), "{}", g.grammar);
        assert!(!g.grammar.contains(r#""x":{"type":"integer"}"#), "{}", g.grammar);
        assert!(g.grammar.contains(r#""name":{"const":"loose"}"#), "{}", g.grammar);
        assert!(lazy_call_grammar(ToolFormat::Llama3Json, &tools, &strict, &|_| None).is_none());
        assert!(lazy_call_grammar(ToolFormat::HermesJson, &[], &strict, &|_| None).is_none());
    }

    #[test]
    fn special_markers_become_token_references() {
        let tools = [tool("f", Value::Null)];
        let ids = |t: &str| (t == "[TOOL_CALLS]").then_some(9);
        let g = forced_call_grammar(ToolFormat::Mistral, &tools, false, &ids).unwrap();
        assert!(g.starts_with(r#"start: <[9]> "[" body "]""#), "{g}");
        assert!(g.contains(r#""arguments":{"type":"object"}"#), "{g}");
        let parallel = forced_call_grammar(ToolFormat::Mistral, &tools, true, &ids).unwrap();
        assert!(
            parallel.starts_with(r#"start: <[9]> "[" body (", " body)* "]""#),
            "{parallel}"
        );
    }

    #[test]
    fn definitions_move_to_the_envelope_root() {
        let t = tool(
            "f",
            json!({"$defs": {"P": {"type": "integer"}}, "type": "object",
                   "properties": {"p": {"$ref": "#/$defs/P"}}}),
        );
        let e = envelope(&t, "arguments");
        assert_eq!(e["$defs"]["P"]["type"], "integer");
        assert!(e["properties"]["arguments"].get("$defs").is_none());
        assert_eq!(
            e["properties"]["arguments"]["properties"]["p"]["$ref"],
            "#/$defs/P"
        );
    }

    #[test]
    fn formats_without_json_bodies_are_refused() {
        let tools = [tool("f", Value::Null)];
        let e = forced_call_grammar(ToolFormat::QwenXml, &tools, false, &|_| None).unwrap_err();
        assert!(e.to_string().contains("qwen-xml"), "{e}");
        assert!(forced_call_grammar(ToolFormat::HermesJson, &[], false, &|_| None).is_err());
    }
}
