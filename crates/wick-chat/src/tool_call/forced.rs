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

/// One arm of the lazy grammar of strict tools under `tool_choice: auto`: the model writes
/// free text, and once it writes `trigger` the rest of the call is constrained by `grammar`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyCallGrammar {
    /// The text that opens a call.
    pub trigger: String,
    /// The Lark grammar of what follows it, to the end of the call.
    pub grammar: String,
}

/// The arms that constrain calls in `format` once the model opens one:
///
/// - the family's opening tag (`<tool_call>` for Hermes/Qwen, `[TOOL_CALLS]` for Mistral):
///   the rest of the call, the JSON envelope of an offered tool and the closing tag; `strict`
///   says which tools' `parameters` bind the arguments, the others take any JSON object, so a
///   call to them still parses;
/// - for each strict tool, the name of a bare envelope naming it, as Qwen2.5-Coder (often
///   in a fence, over several lines) and Llama 3 write calls: `"name": "get_weather"` (with
///   or without the space), then the arguments and the closing brace.
///
/// Empty when no tool is strict or the format has neither (the XML-style formats).
pub fn lazy_call_grammar(
    format: ToolFormat,
    tools: &[ToolSpec],
    strict: &dyn Fn(&ToolSpec) -> bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> Vec<LazyCallGrammar> {
    if !tools.iter().any(strict) {
        return Vec::new();
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
    let mut arms = Vec::new();
    let bare_key = match format {
        ToolFormat::HermesJson => {
            arms.push(LazyCallGrammar {
                trigger: "<tool_call>".into(),
                grammar: format!(
                    "start: ws? body ws? {}\nws: {ws}\nbody: {}\n",
                    marker("</tool_call>"),
                    bodies("arguments")
                ),
            });
            Some("arguments")
        }
        ToolFormat::Llama3Json => Some("parameters"),
        ToolFormat::Mistral => {
            arms.push(LazyCallGrammar {
                trigger: "[TOOL_CALLS]".into(),
                grammar: format!(
                    "start: ws? {} body ({} ws? body)* {}\nws: {ws}\nbody: {}\n",
                    literal("["),
                    literal(","),
                    literal("]"),
                    bodies("arguments")
                ),
            });
            None
        }
        _ => None,
    };
    if let Some(key) = bare_key {
        for tool in tools.iter().filter(|t| strict(t)) {
            let name = Value::String(tool.name.clone()).to_string();
            let rest = format!(
                "start: ws? {} ws? {} ws? {} ws? %json {} ws? {}\nws: {ws}\n",
                literal(","),
                literal(&Value::String(key.into()).to_string()),
                literal(":"),
                arguments_schema(tool),
                literal("}")
            );
            for gap in [" ", ""] {
                arms.push(LazyCallGrammar {
                    trigger: format!("\"name\":{gap}{name}"),
                    grammar: rest.clone(),
                });
            }
        }
    }
    arms
}

/// A tool's `parameters` as the schema of its arguments alone (an empty or missing one:
/// any object), whitespace bounded as in [`envelope`].
fn arguments_schema(tool: &ToolSpec) -> Value {
    let mut parameters = match &tool.parameters {
        Value::Object(p) if !p.is_empty() => p.clone(),
        _ => {
            let mut p = Map::new();
            p.insert("type".into(), json!("object"));
            p
        }
    };
    parameters
        .entry("x-guidance")
        .or_insert_with(|| json!({"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}));
    Value::Object(parameters)
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
        let arms = lazy_call_grammar(ToolFormat::HermesJson, &tools, &strict, &|t| {
            (t == "</tool_call>").then_some(7)
        });
        let triggers: Vec<&str> = arms.iter().map(|a| a.trigger.as_str()).collect();
        assert_eq!(
            triggers,
            [
                "<tool_call>",
                r#""name": "get_weather""#,
                r#""name":"get_weather""#
            ]
        );
        let tagged = &arms[0].grammar;
        assert!(
            tagged.starts_with("start: ws? body ws? <[7]>\n"),
            "{tagged}"
        );
        assert!(tagged.contains(r#""city":{"type":"string"}"#), "{tagged}");
        assert!(!tagged.contains(r#""x":{"type":"integer"}"#), "{tagged}");
        assert!(tagged.contains(r#""name":{"const":"loose"}"#), "{tagged}");
        // A bare call's rest: the arguments after the name, then the closing brace.
        let bare = &arms[1].grammar;
        assert!(
            bare.starts_with(r#"start: ws? "," ws? "\"arguments\"" ws? ":" ws? %json {"#),
            "{bare}"
        );
        assert!(bare.contains(r#""city":{"type":"string"}"#), "{bare}");
        // Llama 3 calls are bare, with `parameters`; no strict tool, no arms.
        let llama = lazy_call_grammar(ToolFormat::Llama3Json, &tools, &strict, &|_| None);
        assert_eq!(llama.len(), 2);
        assert!(
            llama[0].grammar.contains(r#""\"parameters\"""#),
            "{}",
            llama[0].grammar
        );
        assert!(
            lazy_call_grammar(ToolFormat::HermesJson, &tools, &|_| false, &|_| None).is_empty()
        );
        assert!(lazy_call_grammar(ToolFormat::QwenXml, &tools, &strict, &|_| None).is_empty());
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
