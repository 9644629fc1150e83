//! Property tests: calls written the way each family's chat template writes them parse back to
//! the same names and arguments with no repair, whatever prose comes before and however the
//! text is chunked; and any mix of markup fragments parses without panic, with streaming
//! agreeing with whole-text parsing.

mod support;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use support::check::check_text;
use wick_chat::tool_call::{ToolFormat, ToolSpec};

/// A generated argument value.
#[derive(Debug, Clone)]
enum Arg {
    Text(String),
    Int(i64),
    Bool(bool),
    Object(Vec<(String, i64)>),
}

impl Arg {
    fn json(&self) -> Value {
        match self {
            Arg::Text(text) => json!(text),
            Arg::Int(n) => json!(n),
            Arg::Bool(b) => json!(b),
            Arg::Object(fields) => {
                Value::Object(fields.iter().map(|(k, v)| (k.clone(), json!(v))).collect())
            }
        }
    }

    fn schema_type(&self) -> &'static str {
        match self {
            Arg::Text(_) => "string",
            Arg::Int(_) => "integer",
            Arg::Bool(_) => "boolean",
            Arg::Object(_) => "object",
        }
    }
}

/// A generated call.
#[derive(Debug, Clone)]
struct Call {
    name: String,
    args: Vec<(String, Arg)>,
}

impl Call {
    fn arguments(&self) -> Value {
        Value::Object(
            self.args
                .iter()
                .map(|(k, v)| (k.clone(), v.json()))
                .collect::<Map<_, _>>(),
        )
    }
}

fn text_strategy() -> impl Strategy<Value = String> {
    // No `<` (so no markup of any format) and no `]]>`-prone brackets pairs matter: `]` alone
    // cannot form `]]>` without `>`.
    "[a-zA-Z0-9 ,.:;!?'\"{}\\[\\]()/\\\\_é東🌧\n-]{0,24}"
}

fn arg_strategy() -> impl Strategy<Value = Arg> {
    prop_oneof![
        text_strategy().prop_map(Arg::Text),
        any::<i32>().prop_map(|n| Arg::Int(n as i64)),
        any::<bool>().prop_map(Arg::Bool),
        proptest::collection::vec(("[a-z]{1,6}", any::<i16>()), 0..3).prop_map(|fields| {
            let mut seen = Vec::new();
            Arg::Object(
                fields
                    .into_iter()
                    .filter(|(k, _)| {
                        let fresh = !seen.contains(k);
                        seen.push(k.clone());
                        fresh
                    })
                    .map(|(k, v)| (k, v as i64))
                    .collect(),
            )
        }),
    ]
}

fn call_strategy() -> impl Strategy<Value = Call> {
    (
        "[a-z][a-z_]{0,10}",
        proptest::collection::vec(("[a-z][a-z_]{0,7}", arg_strategy()), 0..4),
    )
        .prop_map(|(name, args)| {
            let mut seen: Vec<String> = Vec::new();
            let args = args
                .into_iter()
                .filter(|(k, _)| {
                    let fresh = !seen.contains(k);
                    seen.push(k.clone());
                    fresh
                })
                .collect();
            Call { name, args }
        })
}

/// Values the template of `format` writes as they are, adjusted for what the format cannot
/// carry (GLM values are trimmed XML text).
fn fit(format: ToolFormat, mut call: Call) -> Call {
    if format == ToolFormat::Glm {
        for (_, arg) in &mut call.args {
            if let Arg::Text(text) = arg {
                *text = text.trim().to_string();
            }
        }
    }
    call
}

fn spec(call: &Call) -> ToolSpec {
    let properties: Map<String, Value> = call
        .args
        .iter()
        .map(|(k, v)| (k.clone(), json!({"type": v.schema_type()})))
        .collect();
    ToolSpec::from_openai(
        0,
        &json!({"type": "function", "function": {"name": call.name, "parameters": {
            "type": "object", "properties": properties}}}),
    )
    .expect("spec")
}

fn gemma_value(value: &Value) -> String {
    match value {
        Value::String(s) => format!("<|\"|>{s}<|\"|>"),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{k}:{}", gemma_value(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

/// `call` written the way `format`'s chat template writes an assistant tool call.
fn render(format: ToolFormat, call: &Call) -> String {
    let raw = |arg: &Arg| match arg {
        Arg::Text(text) => text.clone(),
        other => other.json().to_string(),
    };
    match format {
        ToolFormat::HermesJson => format!(
            "<tool_call>\n{}\n</tool_call>",
            json!({"name": call.name, "arguments": call.arguments()})
        ),
        ToolFormat::QwenXml => {
            let mut out = format!("<tool_call>\n<function={}>\n", call.name);
            for (k, v) in &call.args {
                out.push_str(&format!("<parameter={k}>\n{}\n</parameter>\n", raw(v)));
            }
            out + "</function>\n</tool_call>"
        }
        ToolFormat::Glm => {
            let mut out = format!("<tool_call>{}\n", call.name);
            for (k, v) in &call.args {
                out.push_str(&format!(
                    "<arg_key>{k}</arg_key>\n<arg_value>{}</arg_value>\n",
                    raw(v)
                ));
            }
            out + "</tool_call>"
        }
        ToolFormat::MiniCpm => {
            let mut out = format!("<function name=\"{}\">", call.name);
            for (k, v) in &call.args {
                let value = match v {
                    Arg::Text(text) => format!("<![CDATA[{text}]]>"),
                    other => other.json().to_string(),
                };
                out.push_str(&format!("<param name=\"{k}\">{value}</param>"));
            }
            out + "</function>"
        }
        ToolFormat::Gemma4 => format!(
            "<|tool_call>call:{}{{{}}}<tool_call|>",
            call.name,
            call.args
                .iter()
                .map(|(k, v)| format!("{k}:{}", gemma_value(&v.json())))
                .collect::<Vec<_>>()
                .join(",")
        ),
        ToolFormat::Llama3Json => {
            json!({"name": call.name, "parameters": call.arguments()}).to_string()
        }
        ToolFormat::Mistral => format!("[TOOL_CALLS]{}[ARGS]{}", call.name, call.arguments()),
    }
}

fn format_strategy() -> impl Strategy<Value = ToolFormat> {
    proptest::sample::select(ToolFormat::all().to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, .. ProptestConfig::default() })]

    #[test]
    fn template_written_calls_parse_back(
        format in format_strategy(),
        first in call_strategy(),
        second in proptest::option::of(call_strategy()),
        prose in "([A-Z][a-zA-Z ,.]{0,20}\n)?",
        seed in any::<u64>(),
    ) {
        let calls: Vec<Call> = std::iter::once(first)
            .chain(second)
            .map(|call| fit(format, call))
            .collect();
        let separator = if format == ToolFormat::Llama3Json { "; " } else { "\n" };
        let prose = if format == ToolFormat::Llama3Json { String::new() } else { prose };
        let text = prose.clone()
            + &calls.iter().map(|call| render(format, call)).collect::<Vec<_>>().join(separator);
        let mut tools: Vec<ToolSpec> = Vec::new();
        for call in &calls {
            if !tools.iter().any(|t| t.name == call.name) {
                tools.push(spec(call));
            }
        }
        // Two calls of one name must share its schema: keep the first call's types.
        if calls.len() == 2 && calls[0].name == calls[1].name {
            let first_types: Vec<(String, &str)> =
                calls[0].args.iter().map(|(k, v)| (k.clone(), v.schema_type())).collect();
            for (k, v) in &calls[1].args {
                if let Some((_, t)) = first_types.iter().find(|(key, _)| key == k) {
                    prop_assume!(*t == v.schema_type());
                }
            }
            let mut merged = calls[0].clone();
            merged.args.extend(calls[1].args.iter().filter(|(k, _)| !calls[0].args.iter().any(|(k0, _)| k0 == k)).cloned());
            tools = vec![spec(&merged)];
        }
        let outcome = check_text(format, &text, &tools, false, 3, seed)
            .map_err(|e| TestCaseError::fail(format!("{format} {text:?}: {e}")))?;
        prop_assert_eq!(outcome.calls.len(), calls.len(), "{} {:?}: {:?}", format, text, outcome);
        for (got, want) in outcome.calls.iter().zip(&calls) {
            prop_assert_eq!(&got.name, &want.name);
            prop_assert_eq!(&got.arguments, &want.arguments(), "{} {:?}", format, text);
            prop_assert!(got.repairs.is_empty(), "{} {:?}: {:?}", format, text, got.repairs);
        }
        prop_assert_eq!(outcome.content, prose.trim_end());
        prop_assert!(outcome.failures.is_empty());
    }

    #[test]
    fn any_markup_soup_parses_consistently(
        format in format_strategy(),
        pieces in proptest::collection::vec(proptest::sample::select(vec![
            "<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>", "</function>",
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<function name=\"", "<param name=\"",
            "</param>", "<![CDATA[", "]]>", "<|tool_call>", "<tool_call|>", "call:", "<|\"|>", "<|channel>",
            "<channel|>", "thought\n", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "```json\n",
            "```", "{", "}", "[", "]", "\"", "'", ",", ":", ";", "\"name\"", "\"arguments\"", "\"parameters\"",
            "\"function\"", "get_weather", "city", "\"Paris\"", "True", "None", " ", "\n", "é", "🌧", "\\", "1",
            ">", "<", "=", "x",
        ]), 0..48),
        with_tools in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let text: String = pieces.concat();
        let tools = if with_tools {
            vec![ToolSpec::from_openai(0, &json!({"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}})).expect("spec")]
        } else {
            Vec::new()
        };
        check_text(format, &text, &tools, false, 3, seed)
            .map_err(|e| TestCaseError::fail(format!("{format} {text:?}: {e}")))?;
    }
}
