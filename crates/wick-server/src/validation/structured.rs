//! Structured output requests — OpenAI's `response_format` (and the Responses API's
//! `text.format`), vLLM's `structured_outputs` and `guided_*` fields, forced tool calls — into
//! one compiled [`Constraint`] that rides in the request's sampling parameters.
//!
//! Every function here is endpoint-neutral, so the chat, completions, Responses and
//! Anthropic endpoints share them: [`response_format_spec`], [`vllm_spec`],
//! [`forced_tool_spec`] and [`compile`].
use serde_json::{Map, Value};
use wick_chat::tool_call::{forced_call_grammar, lazy_call_grammar, ToolFormat, ToolSpec};
use wick_engine::constraint::{Constraint, ConstraintError, ConstraintSpec};
use wick_engine::Model;

use crate::error::ApiError;
use crate::openai::custom_tools::{self, CustomFormat};
use crate::openai::SamplingFields;

/// The reasoning block a constraint waits out (when the prompt leaves it open).
const THINK: (&str, &str) = ("<think>", "</think>");

/// What `response_format` (or a Responses `text.format`) asks for: `None` for plain text.
/// Takes both OpenAI's `{type: json_schema, json_schema: {name, schema, strict}}` and the
/// Responses API's flat `{type: json_schema, name, schema, strict}`.
pub fn response_format_spec(
    param: &str,
    format: &Value,
) -> Result<Option<ConstraintSpec>, ApiError> {
    let Some(object) = format.as_object() else {
        return Err(ApiError::field(param, "must be an object with a 'type'"));
    };
    match object.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let (at, body) = match object.get("json_schema") {
                Some(Value::Object(inner)) => (format!("{param}.json_schema"), inner),
                Some(_) => {
                    return Err(ApiError::field(
                        format!("{param}.json_schema"),
                        "must be an object with a 'schema'",
                    ))
                }
                None => (param.to_string(), object),
            };
            let schema = match body.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                // OpenAI: a missing schema allows any JSON.
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(_) => {
                    return Err(ApiError::field(
                        format!("{at}.schema"),
                        "must be a JSON Schema object",
                    ))
                }
            };
            let strict = body.get("strict").and_then(Value::as_bool).unwrap_or(false);
            Ok(Some(ConstraintSpec::JsonSchema(if strict {
                strict_schema(schema)
            } else {
                schema
            })))
        }
        Some(other) => Err(ApiError::field(
            format!("{param}.type"),
            format!("must be 'text', 'json_object' or 'json_schema', got '{other}'"),
        )),
        None => Err(ApiError::field(param, "must be an object with a 'type'")),
    }
}

/// OpenAI's `strict` rule (as vLLM applies it): every object schema without
/// `additionalProperties` gets `false`, at every depth.
pub fn strict_schema(mut schema: Value) -> Value {
    make_strict(&mut schema);
    schema
}

fn make_strict(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            let is_object = map.get("type").is_some_and(|t| {
                t == "object"
                    || t.as_array()
                        .is_some_and(|a| a.iter().any(|t| t == "object"))
            }) || map.contains_key("properties");
            if is_object && !map.contains_key("additionalProperties") {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (key, value) in map.iter_mut() {
                match key.as_str() {
                    "properties" | "$defs" | "definitions" | "patternProperties" => {
                        if let Value::Object(children) = value {
                            children.values_mut().for_each(make_strict);
                        }
                    }
                    "items"
                    | "additionalProperties"
                    | "not"
                    | "contains"
                    | "if"
                    | "then"
                    | "else"
                    | "unevaluatedProperties"
                    | "propertyNames" => make_strict(value),
                    "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                        if let Value::Array(list) = value {
                            list.iter_mut().for_each(make_strict);
                        }
                    }
                    _ => {}
                }
            }
        }
        Value::Array(_) | Value::Bool(_) | Value::Null | Value::Number(_) | Value::String(_) => {}
    }
}

/// vLLM's fields: `structured_outputs: {json | regex | choice | grammar}` or the older
/// `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one may be set.
/// Returns the field's name with the spec, for errors.
pub fn vllm_spec(f: &SamplingFields) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    let mut found: Vec<(String, &Value)> = Vec::new();
    match &f.structured_outputs {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for key in ["json", "regex", "choice", "grammar", "json_object"] {
                if let Some(v) = map.get(key).filter(|v| !v.is_null()) {
                    found.push((format!("structured_outputs.{key}"), v));
                }
            }
            if found.is_empty() {
                return Err(ApiError::field(
                    "structured_outputs",
                    "must set one of json, regex, choice, grammar, json_object",
                ));
            }
        }
        Some(_) => {
            return Err(ApiError::field(
                "structured_outputs",
                "must be an object such as {\"json\": {...}}",
            ))
        }
    }
    for (key, value) in [
        ("guided_json", &f.guided_json),
        ("guided_regex", &f.guided_regex),
        ("guided_choice", &f.guided_choice),
        ("guided_grammar", &f.guided_grammar),
    ] {
        if let Some(v) = value.as_ref().filter(|v| !v.is_null()) {
            found.push((key.to_string(), v));
        }
    }
    let Some((param, value)) = found.first() else {
        return Ok(None);
    };
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(p, _)| p.as_str()).collect();
        return Err(ApiError::field(
            param.clone(),
            format!(
                "only one structured-output constraint may be given, got {}",
                names.join(", ")
            ),
        ));
    }
    let kind = param.rsplit(['.', '_']).next().unwrap_or_default();
    let text = |what: &str| {
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| ApiError::field(param.clone(), format!("must be a {what} string")))
    };
    let spec = match kind {
        "json" => match value {
            Value::String(s) => {
                ConstraintSpec::JsonSchema(serde_json::from_str(s).map_err(|e| {
                    ApiError::field(param.clone(), format!("is not valid JSON: {e}"))
                })?)
            }
            Value::Object(_) | Value::Bool(_) => ConstraintSpec::JsonSchema((*value).clone()),
            _ => {
                return Err(ApiError::field(
                    param.clone(),
                    "must be a JSON Schema object",
                ))
            }
        },
        "object" => match value {
            Value::Bool(true) => ConstraintSpec::JsonObject,
            _ => return Err(ApiError::field(param.clone(), "must be true")),
        },
        "regex" => ConstraintSpec::Regex(text("regular expression")?),
        "grammar" => ConstraintSpec::Lark(text("Lark grammar")?),
        _ => {
            let choices = value
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|c| c.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .filter(|c| !c.is_empty())
                .ok_or_else(|| {
                    ApiError::field(param.clone(), "must be a non-empty list of strings")
                })?;
            ConstraintSpec::Choice(choices)
        }
    };
    Ok(Some((param.clone(), spec)))
}

/// Which call a tool choice forces, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedTool {
    /// Any of the offered tools (`"required"`, Anthropic `any`).
    Any,
    /// This tool (`{type: function, function: {name}}`, Responses `{type: function, name}`,
    /// Anthropic `{type: tool, name}`).
    Named(String),
}

/// The grammar of a reply that is only calls of `tools` (all, or the named one) in `format`.
/// `param` names the field in errors.
pub fn forced_tool_spec(
    param: &str,
    forced: &ForcedTool,
    tools: &[ToolSpec],
    format: ToolFormat,
    parallel: bool,
    model: &Model,
) -> Result<ConstraintSpec, ApiError> {
    if tools.is_empty() {
        return Err(ApiError::field(
            param,
            "forcing a tool call needs a non-empty 'tools' list",
        ));
    }
    let chosen: Vec<ToolSpec> = match forced {
        ForcedTool::Any => tools.to_vec(),
        ForcedTool::Named(name) => match tools.iter().find(|t| &t.name == name) {
            Some(t) => vec![t.clone()],
            None => {
                return Err(ApiError::field(
                    param,
                    format!("names the function '{name}', which is not in 'tools'"),
                ))
            }
        },
    };
    let tokenizer = model.tokenizer();
    let special_id = |text: &str| {
        tokenizer
            .token_id(text)
            .filter(|&id| tokenizer.is_special(id))
    };
    let lark = forced_call_grammar(format, &chosen, parallel, &special_id)
        .map_err(|e| ApiError::unsupported(param, e.to_string()))?;
    Ok(ConstraintSpec::Lark(lark))
}

/// [`forced_tool_spec`] then [`compile`]: the constraint of a forced tool call, for any
/// endpoint (chat's `tool_choice`, Anthropic's `any` / `tool`, the Responses API's).
pub fn forced_tool_constraint(
    model: &Model,
    param: &str,
    forced: &ForcedTool,
    tools: &[ToolSpec],
    format: ToolFormat,
    parallel: bool,
    reasoning: bool,
) -> Result<Constraint, ApiError> {
    let spec = forced_tool_spec(param, forced, tools, format, parallel, model)?;
    compile(model, param, &spec, reasoning)
}

/// Whether an entry of a `tools` list asks for strict arguments: chat's
/// `{type: function, function: {strict: true}}` or a flat `{strict: true}`.
pub fn is_strict_tool(tool: &Value) -> bool {
    tool.get("function")
        .and_then(|f| f.get("strict"))
        .or_else(|| tool.get("strict"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// The lazy constraint of `tools` under `tool_choice: auto` when one of them is strict: text
/// stays free, and a call the model opens (the format's opening tag, or a bare envelope
/// naming a strict tool) is constrained: an offered tool's envelope, the strict tools'
/// arguments to their `parameters` under OpenAI's `strict` rule ([`strict_schema`]). `raw` is
/// the request's `tools` list (for `strict`), `specs` its parsed form, in the same order.
/// `None` when no tool is strict or the format has nothing to trigger on (a debug log says
/// so).
pub fn strict_tools_constraint(
    model: &Model,
    raw: &[Value],
    specs: &[ToolSpec],
    format: ToolFormat,
    reasoning: bool,
) -> Result<Option<Constraint>, ApiError> {
    let strict: Vec<&str> = raw
        .iter()
        .zip(specs)
        .filter(|(r, _)| is_strict_tool(r))
        .map(|(_, s)| s.name.as_str())
        .collect();
    if strict.is_empty() {
        return Ok(None);
    }
    let specs: Vec<ToolSpec> = specs
        .iter()
        .map(|t| match strict.contains(&t.name.as_str()) {
            true => ToolSpec {
                parameters: strict_schema(t.parameters.clone()),
                ..t.clone()
            },
            false => t.clone(),
        })
        .collect();
    let tokenizer = model.tokenizer();
    let special_id = |text: &str| {
        tokenizer
            .token_id(text)
            .filter(|&id| tokenizer.is_special(id))
    };
    let is_strict = |t: &ToolSpec| strict.contains(&t.name.as_str());
    let arms = lazy_call_grammar(format, &specs, &is_strict, &special_id);
    let mut compiled: Vec<(String, Constraint)> = Vec::new();
    let mut lazy: Option<Constraint> = None;
    for arm in arms {
        let grammar = match compiled.iter().find(|(g, _)| *g == arm.grammar) {
            Some((_, c)) => c.clone(),
            None => {
                let c = compile(
                    model,
                    "tools",
                    &ConstraintSpec::Lark(arm.grammar.clone()),
                    false,
                )?;
                compiled.push((arm.grammar.clone(), c.clone()));
                c
            }
        };
        lazy = Some(match lazy {
            None => grammar.triggered_by(&arm.trigger),
            Some(l) => l.or_triggered(&arm.trigger, &grammar),
        });
    }
    let Some(lazy) = lazy else {
        tracing::debug!(
            format = format.name(),
            "strict tools: this tool-call format has nothing to constrain calls from"
        );
        return Ok(None);
    };
    Ok(Some(if reasoning {
        lazy.after_reasoning(THINK.0, THINK.1)
    } else {
        lazy
    }))
}

/// Compiles `spec` for the served model; a grammar that does not compile, or whose first
/// step already fails ([`ApiError::GrammarFailed`]), is a 400 naming `param`, with
/// llguidance's message. With `reasoning`, a prompt that ends inside a
/// `<think>` block gets its constraint after `</think>`.
pub fn compile(
    model: &Model,
    param: &str,
    spec: &ConstraintSpec,
    reasoning: bool,
) -> Result<Constraint, ApiError> {
    let grammars = model
        .grammars()
        .map_err(|e| ApiError::unsupported(param, e.to_string()))?;
    let constraint = grammars.compile(spec).map_err(|e| match e {
        ConstraintError::Invalid(message) => ApiError::field(param, message),
        other => ApiError::unsupported(param, other.to_string()),
    })?;
    // A grammar whose first step already hits one of llguidance's limits, or that no token
    // can start, can never be served: refused now rather than failing the reply.
    constraint.first_mask_allowed().map_err(|e| match e {
        ConstraintError::Failed(message) => ApiError::grammar_failed(Some(param.into()), &message),
        other => ApiError::unsupported(param, other.to_string()),
    })?;
    tracing::debug!(
        kind = constraint.kind(),
        compile_us = constraint.compile_time().as_micros() as u64,
        "structured output"
    );
    Ok(if reasoning {
        constraint.after_reasoning(THINK.0, THINK.1)
    } else {
        constraint
    })
}

/// Compiles the grammars of the custom tools in a Responses request's `tools`, so a syntax
/// error is a 400 with llguidance's message (a `regex` one constrains the call's input; see
/// [`custom_tools`]).
pub fn check_custom_grammars(model: &Model, tools: &[Value]) -> Result<(), ApiError> {
    for (param, format) in custom_tools::grammars(tools)? {
        let spec = match format {
            CustomFormat::Lark(g) => ConstraintSpec::Lark(g),
            CustomFormat::Regex(rx) => ConstraintSpec::Regex(rx),
            CustomFormat::Text => continue,
        };
        compile(model, &param, &spec, false)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_closes_every_object() {
        let s = strict_schema(json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"type": "string"}}},
                "c": {"type": "array", "items": {"type": "object"}},
                "d": {"anyOf": [{"type": "object", "additionalProperties": true}, {"type": "null"}]}
            },
            "$defs": {"E": {"type": "object"}}
        }));
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["a"]["additionalProperties"], false);
        assert!(s["properties"]["a"]["properties"]["b"]
            .get("additionalProperties")
            .is_none());
        assert_eq!(s["properties"]["c"]["items"]["additionalProperties"], false);
        assert_eq!(
            s["properties"]["d"]["anyOf"][0]["additionalProperties"],
            true
        );
        assert_eq!(s["$defs"]["E"]["additionalProperties"], false);
    }

    #[test]
    fn response_formats_map_to_specs() {
        let text = response_format_spec("response_format", &json!({"type": "text"})).unwrap();
        assert_eq!(text, None);
        let obj = response_format_spec("response_format", &json!({"type": "json_object"}));
        assert_eq!(obj.unwrap(), Some(ConstraintSpec::JsonObject));
        let nested = response_format_spec(
            "response_format",
            &json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true,
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}),
        )
        .unwrap();
        let Some(ConstraintSpec::JsonSchema(schema)) = nested else {
            panic!("{nested:?}")
        };
        assert_eq!(schema["additionalProperties"], false);
        let flat = response_format_spec(
            "text.format",
            &json!({"type": "json_schema", "name": "x", "schema": {"type": "object"}}),
        )
        .unwrap();
        assert_eq!(
            flat,
            Some(ConstraintSpec::JsonSchema(json!({"type": "object"})))
        );
        for (bad, param) in [
            (json!({"type": "xml"}), "response_format.type"),
            (json!("json"), "response_format"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "response_format.json_schema.schema",
            ),
        ] {
            let e = response_format_spec("response_format", &bad).unwrap_err();
            assert_eq!(e.param(), Some(param), "{bad}: {e}");
        }
    }

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn vllm_fields_map_to_specs() {
        let cases = [
            (
                r#"{"structured_outputs": {"regex": "a+"}}"#,
                ConstraintSpec::Regex("a+".into()),
            ),
            (
                r#"{"guided_regex": "a+"}"#,
                ConstraintSpec::Regex("a+".into()),
            ),
            (
                r#"{"structured_outputs": {"choice": ["x", "y"]}}"#,
                ConstraintSpec::Choice(vec!["x".into(), "y".into()]),
            ),
            (
                r#"{"guided_choice": ["x"]}"#,
                ConstraintSpec::Choice(vec!["x".into()]),
            ),
            (
                r#"{"guided_grammar": "start: \"a\""}"#,
                ConstraintSpec::Lark("start: \"a\"".into()),
            ),
            (
                r#"{"guided_json": "{\"type\": \"integer\"}"}"#,
                ConstraintSpec::JsonSchema(json!({"type": "integer"})),
            ),
            (
                r#"{"structured_outputs": {"json": {"type": "integer"}}}"#,
                ConstraintSpec::JsonSchema(json!({"type": "integer"})),
            ),
        ];
        for (json, want) in cases {
            let (_, spec) = vllm_spec(&fields(json)).unwrap().unwrap();
            assert_eq!(spec, want, "{json}");
        }
        assert_eq!(vllm_spec(&fields("{}")).unwrap(), None);
        let (param, _) = vllm_spec(&fields(r#"{"structured_outputs": {"regex": "a"}}"#))
            .unwrap()
            .unwrap();
        assert_eq!(param, "structured_outputs.regex");
        for (json, param) in [
            (
                r#"{"guided_regex": "a", "guided_choice": ["b"]}"#,
                "guided_regex",
            ),
            (r#"{"structured_outputs": {}}"#, "structured_outputs"),
            (r#"{"guided_choice": []}"#, "guided_choice"),
            (r#"{"guided_json": "{nope"}"#, "guided_json"),
            (
                r#"{"structured_outputs": {"regex": 3}}"#,
                "structured_outputs.regex",
            ),
        ] {
            let e = vllm_spec(&fields(json)).unwrap_err();
            assert_eq!(e.param(), Some(param), "{json}: {e}");
        }
    }
}
