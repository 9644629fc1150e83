//! OpenAI's Responses API wire types (`POST /v1/responses`): the request and its conversion
//! into the chat path's message list, so validation, templates and tool parsing are shared.
//! Output items and events are built in [`crate::encoders::responses`].
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chat::ChatCompletionRequest;
use super::custom_tools;
use super::SamplingFields;
use crate::error::ApiError;
use crate::extract::{struct_fields, typed, RequestBody};
use crate::media::parts::{from_responses_part, ContentBuilder};

/// Separator of a namespace tool's flattened function names (`namespace__function`).
pub const NAMESPACE_SEPARATOR: &str = "__";

/// A Responses request. Unknown fields (`include`, `truncation`, `user`, …) are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    /// The model the client asked for (ignored).
    pub model: Option<String>,
    /// Keeps the conversation's prompt-cache entry pinned (as chat completions' field).
    pub prompt_cache_key: Option<String>,
    /// A string or a list of items.
    pub input: Option<Value>,
    /// The system prompt of this turn (not carried over by `previous_response_id`).
    pub instructions: Option<String>,
    /// Offered tools (`function`, `namespace`, `custom`; other types are not offered).
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or a function object.
    pub tool_choice: Option<Value>,
    /// Whether the model may call several tools.
    pub parallel_tool_calls: Option<bool>,
    /// Tokens to generate at most.
    pub max_output_tokens: Option<i64>,
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// `{effort}`: `none` turns thinking off.
    pub reasoning: Option<Value>,
    /// Keep the response for `previous_response_id` and `GET` (default true).
    pub store: Option<bool>,
    /// Continue the conversation of a stored response.
    pub previous_response_id: Option<String>,
    /// `{format: {type: text | json_schema | json_object}}`.
    pub text: Option<Value>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Echoed back.
    pub metadata: Option<Value>,
    /// Non-standard (vLLM's extension): generate past end-of-sequence tokens, for benchmarks.
    pub ignore_eos: Option<bool>,
    /// `false` opts out of speculative decoding when the server runs it (`--spec`).
    pub speculative: Option<bool>,
    /// Non-standard: the LoRA adapters to run with (as chat completions' `adapter`).
    pub adapter: Option<String>,
}

impl RequestBody for ResponsesRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        let mut fields = struct_fields::<ResponsesRequest>().to_vec();
        fields.extend(["include", "truncation", "user", "service_tier"]);
        fields
    }
}

/// The text of a message item's content: a string or `input_text` / `output_text` parts.
fn content_text(at: &str, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text") => {
                        text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default())
                    }
                    Some("refusal") => {}
                    Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(ApiError::unsupported(
                            format!("{at}.content[{j}].type"),
                            format!("'{kind}' is not supported here: only message content carries images and audio"),
                        ))
                    }
                    other => {
                        return Err(ApiError::field(
                            format!("{at}.content[{j}].type"),
                            format!("unknown content part type {other:?}"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        None | Some(Value::Null) => Ok(String::new()),
        Some(_) => Err(ApiError::field(
            format!("{at}.content"),
            "must be a string or a list of content parts",
        )),
    }
}

/// A message item's content for the chat path: a string, or a list of chat parts when it
/// holds `input_image` / `input_audio` parts (text parts joined as [`content_text`] does).
fn message_content(at: &str, content: Option<&Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(parts)) = content else {
        return content_text(at, content).map(Value::String);
    };
    let mut built = ContentBuilder::new("");
    for (j, part) in parts.iter().enumerate() {
        match part.get("type").and_then(Value::as_str) {
            Some("input_image" | "input_audio") => {
                built.push_media(from_responses_part(&format!("{at}.content[{j}]"), part)?)
            }
            _ => {
                let text = content_text(at, Some(&Value::Array(vec![part.clone()])))
                    .map_err(|e| renumber(e, j))?;
                built.push_text(&text);
            }
        }
    }
    Ok(built.take())
}

/// An error about part `[0]` of a one-part list, pointed at part `[j]` of the real list.
fn renumber(e: ApiError, j: usize) -> ApiError {
    match e {
        ApiError::InvalidField { param, message } => ApiError::InvalidField {
            param: param.replacen(".content[0]", &format!(".content[{j}]"), 1),
            message,
        },
        ApiError::Unsupported { param, message } => ApiError::Unsupported {
            param: param.replacen(".content[0]", &format!(".content[{j}]"), 1),
            message,
        },
        other => other,
    }
}

/// Appends a function call to the assistant turn in progress (or starts one).
fn push_call(out: &mut Vec<Value>, call: Value) {
    if let Some(last) = out.last_mut() {
        if last.get("role").and_then(Value::as_str) == Some("assistant") {
            if let Some(obj) = last.as_object_mut() {
                let calls = obj.entry("tool_calls").or_insert_with(|| json!([]));
                if let Some(list) = calls.as_array_mut() {
                    list.push(call);
                    return;
                }
            }
        }
    }
    out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
}

/// Converts input items into chat messages, appended to `out`.
pub fn input_messages(input: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::field(
                "input",
                "must be a string or a list of items",
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            Some("message") | None if item.get("role").is_some() => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some(r @ ("user" | "assistant" | "system" | "developer")) => r,
                    _ => {
                        return Err(ApiError::field(
                            format!("{at}.role"),
                            "must be 'user', 'assistant', 'system' or 'developer'",
                        ))
                    }
                };
                let content = message_content(&at, item.get("content"))?;
                out.push(json!({"role": role, "content": content}));
            }
            Some("function_call") => {
                let name = match item.get("name").and_then(Value::as_str) {
                    Some(n) if !n.is_empty() => n.to_string(),
                    _ => {
                        return Err(ApiError::field(
                            format!("{at}.name"),
                            "must be a non-empty string",
                        ))
                    }
                };
                let name = match item.get("namespace").and_then(Value::as_str) {
                    Some(ns) => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
                    None => name,
                };
                let call_id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let arguments = match item.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => "{}".into(),
                };
                push_call(
                    out,
                    json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}),
                );
            }
            Some("custom_tool_call") => push_custom_call(&at, item, out)?,
            Some("function_call_output" | "custom_tool_call_output") => {
                let call_id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(&format!("{at}.output"), Some(v))?,
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            // Reasoning of earlier turns is accepted; the templates drop it from history.
            Some("reasoning") => {}
            Some(other) => {
                tracing::warn!(item = %other, "input item type not supported by wick: ignored");
            }
            None => {
                return Err(ApiError::field(
                    at,
                    "must be an item with a 'type' or a 'role'",
                ));
            }
        }
    }
    Ok(())
}

/// A `custom_tool_call` input item as a call in the assistant turn, its `input` as the
/// arguments `{"input": …}` the model wrote it with.
fn push_custom_call(at: &str, item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let name = match item.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => n,
        _ => {
            return Err(ApiError::field(
                format!("{at}.name"),
                "must be a non-empty string",
            ))
        }
    };
    let input = match item.get("input") {
        Some(Value::String(s)) => s.as_str(),
        None | Some(Value::Null) => "",
        Some(_) => return Err(ApiError::field(format!("{at}.input"), "must be a string")),
    };
    let call_id = item
        .get("call_id")
        .and_then(Value::as_str)
        .unwrap_or_default();
    push_call(
        out,
        json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": custom_tools::arguments_of(input)}}),
    );
    Ok(())
}

/// Offered tools as chat function tools: `function` as is, a `namespace`'s functions as
/// `namespace__name`, a `custom` tool as a function of one string `input`
/// ([`custom_tools`]); other types (`web_search`, …) are not offered.
pub fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => out.push(function_tool(&format!("tools[{i}]"), tool, None)?),
            Some("custom") => out.push(custom_tools::chat_tool(&format!("tools[{i}]"), tool)?),
            Some("namespace") => {
                let ns = tool.get("name").and_then(Value::as_str).unwrap_or_default();
                let inner = tool
                    .get("tools")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for (j, f) in inner.iter().enumerate() {
                    out.push(function_tool(
                        &format!("tools[{i}].tools[{j}]"),
                        f,
                        Some(ns),
                    )?);
                }
            }
            other => {
                tracing::warn!(tool = ?other, "tool type not supported by wick: not offered to the model");
            }
        }
    }
    Ok(out)
}

fn function_tool(at: &str, tool: &Value, namespace: Option<&str>) -> Result<Value, ApiError> {
    let name = match tool.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => n,
        _ => {
            return Err(ApiError::field(
                format!("{at}.name"),
                "must be a non-empty string",
            ))
        }
    };
    let mut function = Map::new();
    function.insert(
        "name".into(),
        json!(match namespace {
            Some(ns) => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
            None => name.to_string(),
        }),
    );
    if let Some(d) = tool.get("description") {
        function.insert("description".into(), d.clone());
    }
    // `strict: true` constrains the arguments of a call the model opens (chat's rule).
    if let Some(strict) = tool.get("strict").filter(|s| s.is_boolean()) {
        function.insert("strict".into(), strict.clone());
    }
    function.insert(
        "parameters".into(),
        tool.get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"})),
    );
    Ok(json!({"type": "function", "function": function}))
}

/// A flattened tool name back as `(namespace, name)`, for names the request offered inside
/// a namespace.
pub fn split_namespace<'a>(name: &'a str, tools: &[Value]) -> (Option<&'a str>, &'a str) {
    if let Some((ns, inner)) = name.split_once(NAMESPACE_SEPARATOR) {
        let offered = tools.iter().any(|t| {
            t.get("type").and_then(Value::as_str) == Some("namespace")
                && t.get("name").and_then(Value::as_str) == Some(ns)
        });
        if offered {
            return (Some(ns), inner);
        }
    }
    (None, name)
}

/// Converts `req` (after `history`, the messages of the response it continues) into the
/// chat request the shared chat path validates and renders.
pub fn to_chat(
    req: &ResponsesRequest,
    history: Vec<Value>,
) -> Result<ChatCompletionRequest, ApiError> {
    let mut messages = Vec::new();
    if let Some(instructions) = req.instructions.as_deref().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(history);
    match &req.input {
        Some(input) => input_messages(input, &mut messages)?,
        None => {
            return Err(ApiError::Missing {
                param: "input".into(),
            })
        }
    }
    let tools = chat_tools(req.tools.as_deref().unwrap_or_default())?;
    let tool_choice = match &req.tool_choice {
        Some(Value::Object(o))
            if matches!(
                o.get("type").and_then(Value::as_str),
                Some("function" | "custom")
            ) =>
        {
            Some(json!({"type": "function", "function": {"name": o.get("name")}}))
        }
        Some(Value::Object(o))
            if o.get("type").and_then(Value::as_str) == Some("allowed_tools") =>
        {
            None
        }
        other => other.clone(),
    };
    let effort = req
        .reasoning
        .as_ref()
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let response_format = req.text.as_ref().and_then(|t| t.get("format")).cloned();
    Ok(ChatCompletionRequest {
        model: req.model.clone(),
        messages: Some(messages),
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        reasoning_effort: effort,
        response_format,
        prompt_cache_key: req.prompt_cache_key.clone(),
        sampling: SamplingFields {
            max_tokens: req.max_output_tokens,
            temperature: req.temperature,
            top_p: req.top_p,
            stream: req.stream,
            ignore_eos: req.ignore_eos,
            speculative: req.speculative,
            adapter: req.adapter.clone(),
            ..SamplingFields::default()
        },
        ..ChatCompletionRequest::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_messages() {
        let req = ResponsesRequest {
            instructions: Some("Be brief.".into()),
            input: Some(json!([
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
                {"type": "web_search_call", "id": "ws_1"},
            ])),
            tools: Some(vec![
                json!({"type": "function", "name": "get_weather", "parameters": {"type": "object"}}),
                json!({"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "ls"}]}),
                json!({"type": "web_search"}),
            ]),
            ..ResponsesRequest::default()
        };
        let chat = to_chat(&req, Vec::new()).unwrap();
        let m = chat.messages.unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1]["role"], "developer");
        assert_eq!(m[2]["content"], "weather?");
        assert_eq!(m[3]["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m[4],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "22 C"})
        );
        assert_eq!(m.len(), 5);
        let tools = chat.tools.unwrap();
        assert_eq!(tools.len(), 2);
        assert_eq!(tools[1]["function"]["name"], "mcp__ls");
        let offered = req.tools.unwrap();
        assert_eq!(split_namespace("mcp__ls", &offered), (Some("mcp"), "ls"));
        assert_eq!(
            split_namespace("get_weather", &offered),
            (None, "get_weather")
        );
    }

    #[test]
    fn files_and_missing_input_are_400_naming_the_field() {
        let req = ResponsesRequest {
            input: Some(json!([{"role": "user", "content": [
                {"type": "input_text", "text": "see"},
                {"type": "input_file", "file_id": "f"},
            ]}])),
            ..ResponsesRequest::default()
        };
        let err = to_chat(&req, Vec::new()).unwrap_err();
        assert_eq!(err.param(), Some("input[0].content[1].type"));
        let err = to_chat(&ResponsesRequest::default(), Vec::new()).unwrap_err();
        assert_eq!(err.param(), Some("input"));
    }

    #[test]
    fn images_become_chat_parts_in_order() {
        let content = message_content(
            "input[0]",
            Some(&json!([
                {"type": "input_text", "text": "what is "},
                {"type": "input_text", "text": "this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
            ])),
        )
        .unwrap();
        assert_eq!(
            content,
            json!([
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="},
                 "_wick_origin": "input[0].content[2]"},
            ])
        );
    }
}
