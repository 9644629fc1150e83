//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the request,
//! its conversion into the OpenAI-style message list the chat path takes (so validation,
//! templates and tool parsing are shared), and the error shape ([`error`]).
pub mod error;

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::extract::{struct_fields, typed, RequestBody};
use crate::media::parts::{from_anthropic_image, ContentBuilder};
use crate::openai::chat::{CacheBreakpoint, ChatCompletionRequest, DEFAULT_CACHE_TTL};
use crate::openai::{SamplingFields, Stop};

/// A Messages request. Unknown fields (`metadata`, `service_tier`, …) are ignored;
/// `cache_control` on system blocks, tools and message blocks are prompt-cache
/// breakpoints ([`CacheBreakpoint`]); `model` is not checked.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MessagesRequest {
    /// The model the client asked for (ignored: the served model answers).
    pub model: Option<String>,
    /// Tokens to generate at most; required (as Anthropic's API has it).
    pub max_tokens: Option<i64>,
    /// The conversation: `{role, content}` with string or block content.
    pub messages: Option<Vec<Value>>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    /// `{name, description, input_schema}`.
    pub tools: Option<Vec<Value>>,
    /// `{type: auto|any|tool|none, disable_parallel_tool_use}`.
    pub tool_choice: Option<Value>,
    /// Stop strings.
    pub stop_sequences: Option<Vec<String>>,
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k.
    pub top_k: Option<i64>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// `{type: enabled|adaptive|disabled}`: the template's thinking switch.
    pub thinking: Option<Value>,
    /// Accepted and ignored.
    pub metadata: Option<Value>,
    /// `{effort, format}`: `format` `{type: json_schema, schema}` constrains the answer to
    /// the schema; `effort` is accepted.
    pub output_config: Option<Value>,
    /// The older (beta) place of `output_config.format`.
    pub output_format: Option<Value>,
    /// Non-standard (vLLM's extension): generate past end-of-sequence tokens, for benchmarks.
    pub ignore_eos: Option<bool>,
    /// `false` opts out of speculative decoding when the server runs it (`--spec`).
    pub speculative: Option<bool>,
    /// Non-standard: the LoRA adapters to run with (as chat completions' `adapter`).
    pub adapter: Option<String>,
}

impl RequestBody for MessagesRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        let mut fields = struct_fields::<MessagesRequest>().to_vec();
        fields.extend([
            "cache_control",
            "service_tier",
            "container",
            "mcp_servers",
            "diagnostics",
            "speed",
            "inference_geo",
            "user_profile_id",
            "workspace_id",
        ]);
        fields
    }
}

/// What `count_tokens` needs to know: whether the request is a count (no `max_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A message to generate: `max_tokens` is required.
    Generate,
    /// `count_tokens`: nothing is generated.
    Count,
}

/// Claude Code's attribution line carries `cch=<hash>`, different on every request; the
/// value is blanked so that the prompt (and its cache) stays the same from turn to turn.
pub fn normalize_attribution(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("cch=") {
        let (head, tail) = rest.split_at(at + 4);
        out.push_str(head);
        let end = tail
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(tail.len());
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// The text of a `system` field: a string or a list of text blocks (joined by newlines).
fn system_text(system: &Value) -> Result<String, ApiError> {
    match system {
        Value::String(s) => Ok(normalize_attribution(s)),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                match (block.get("type").and_then(Value::as_str), block.get("text")) {
                    (Some("text"), Some(Value::String(t))) => parts.push(normalize_attribution(t)),
                    _ => {
                        return Err(ApiError::field(
                            format!("system[{i}]"),
                            "must be a text block {\"type\": \"text\", \"text\": …}",
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::field(
            "system",
            "must be a string or a list of text blocks",
        )),
    }
}

/// The text of a `tool_result`'s content: a string or text blocks.
fn tool_result_text(at: &str, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (j, block) in blocks.iter().enumerate() {
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(
                        block
                            .get("text")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                    ),
                    Some("image" | "document") => {
                        return Err(no_images(&format!("{at}.content[{j}]")))
                    }
                    _ => {
                        return Err(ApiError::field(
                            format!("{at}.content[{j}]"),
                            "must be a text block",
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        Some(_) => Err(ApiError::field(
            format!("{at}.content"),
            "must be a string or a list of blocks",
        )),
    }
}

fn no_images(at: &str) -> ApiError {
    ApiError::unsupported(
        format!("{at}.type"),
        "document blocks, and image blocks outside user turns, are not supported",
    )
}

/// Converts one Anthropic message into OpenAI-style messages (a user turn with tool
/// results becomes `tool` messages, in order, and a user message for its text).
fn convert_message(i: usize, message: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let Some(fields) = message.as_object() else {
        return Err(ApiError::field(at, "must be an object"));
    };
    let role = match fields.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r,
        Some(other) => {
            return Err(ApiError::field(
                format!("{at}.role"),
                format!("must be 'user' or 'assistant'; got '{other}'"),
            ))
        }
        None => {
            return Err(ApiError::Missing {
                param: format!("{at}.role"),
            })
        }
    };
    let blocks = match fields.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(blocks)) => blocks.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::Missing {
                param: format!("{at}.content"),
            })
        }
        Some(_) => {
            return Err(ApiError::field(
                format!("{at}.content"),
                "must be a string or a list of content blocks",
            ))
        }
    };
    let mut text = ContentBuilder::new("\n");
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    let flush = |text: &mut ContentBuilder, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": role, "content": text.take()}));
        }
    };
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let kind = block.get("type").and_then(Value::as_str);
        match (role, kind) {
            (_, Some("text")) => match block.get("text") {
                Some(Value::String(t)) => {
                    text.push_text(&if role == "system" {
                        normalize_attribution(t)
                    } else {
                        t.clone()
                    });
                }
                _ => return Err(ApiError::field(format!("{at}.text"), "must be a string")),
            },
            ("user", Some("image")) => text.push_media(from_anthropic_image(&at, block)?),
            (_, Some("image" | "document")) => return Err(no_images(&at)),
            ("assistant", Some("thinking")) => {
                if let Some(t) = block.get("thinking").and_then(Value::as_str) {
                    reasoning.push_str(t);
                }
            }
            ("assistant", Some("redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => {
                let name = match block.get("name").and_then(Value::as_str) {
                    Some(n) if !n.is_empty() => n,
                    _ => {
                        return Err(ApiError::field(
                            format!("{at}.name"),
                            "must be a non-empty string",
                        ))
                    }
                };
                let id = block.get("id").and_then(Value::as_str).unwrap_or_default();
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": input.to_string()},
                }));
            }
            ("user", Some("tool_result")) => {
                flush(&mut text, out);
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let mut content = tool_result_text(&at, block.get("content"))?;
                if block.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, Some(other)) => {
                return Err(ApiError::field(
                    format!("{at}.type"),
                    format!("'{other}' blocks are not allowed in a {role} message"),
                ))
            }
            (_, None) => {
                return Err(ApiError::field(at, "must be an object with a 'type'"));
            }
        }
    }
    if role == "assistant" {
        let mut m = Map::new();
        m.insert("role".into(), json!("assistant"));
        m.insert("content".into(), text.take());
        if !reasoning.is_empty() {
            m.insert("reasoning_content".into(), json!(reasoning));
        }
        if !calls.is_empty() {
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(m));
    } else {
        flush(&mut text, out);
    }
    Ok(())
}

/// An Anthropic tool as an OpenAI function tool; `None` for server tools (`web_search_…`,
/// `bash_…`) that have no schema wick could offer.
fn convert_tool(i: usize, tool: &Value) -> Result<Option<Value>, ApiError> {
    let name = match tool.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => n,
        _ => {
            return Err(ApiError::field(
                format!("tools[{i}].name"),
                "must be a non-empty string",
            ))
        }
    };
    let Some(schema) = tool.get("input_schema") else {
        if tool
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "custom")
        {
            tracing::warn!(tool = %name, "server tool not supported by wick: not offered to the model");
            return Ok(None);
        }
        return Err(ApiError::Missing {
            param: format!("tools[{i}].input_schema"),
        });
    };
    let mut function = Map::new();
    function.insert("name".into(), json!(name));
    if let Some(d) = tool.get("description") {
        function.insert("description".into(), d.clone());
    }
    function.insert("parameters".into(), schema.clone());
    Ok(Some(json!({"type": "function", "function": function})))
}

/// Where a converted message carries its breakpoint's time to live until [`breakpoints`]
/// takes it off (message order may still change before then).
const BREAKPOINT_KEY: &str = "__wick_cache_control_ttl";

/// The time to live of a `cache_control` object: `ttl` `"5m"` (the default) or `"1h"`.
fn cache_ttl(at: &str, control: &Value) -> Result<Duration, ApiError> {
    match control.get("ttl") {
        None | Some(Value::Null) => Ok(DEFAULT_CACHE_TTL),
        Some(Value::String(t)) if t == "5m" => Ok(Duration::from_secs(300)),
        Some(Value::String(t)) if t == "1h" => Ok(Duration::from_secs(3600)),
        Some(_) => Err(ApiError::field(
            format!("{at}.cache_control.ttl"),
            "must be \"5m\" or \"1h\"",
        )),
    }
}

/// The longest time to live of the `cache_control` objects on `blocks` (a list of blocks
/// or tools), if any carries one.
fn blocks_ttl(at: &str, blocks: Option<&Value>) -> Result<Option<Duration>, ApiError> {
    let mut ttl = None;
    if let Some(Value::Array(blocks)) = blocks {
        for (j, block) in blocks.iter().enumerate() {
            if let Some(control) = block.get("cache_control").filter(|c| !c.is_null()) {
                ttl = ttl.max(Some(cache_ttl(&format!("{at}[{j}]"), control)?));
            }
        }
    }
    Ok(ttl)
}

/// Marks the last message of `messages` as ending a breakpoint of `ttl`.
fn mark_breakpoint(messages: &mut [Value], ttl: Duration) {
    if let Some(Value::Object(m)) = messages.last_mut() {
        let old = m.get(BREAKPOINT_KEY).and_then(Value::as_u64).unwrap_or(0);
        m.insert(BREAKPOINT_KEY.into(), json!(old.max(ttl.as_secs())));
    }
}

/// Takes the breakpoint marks off `messages`: each marked message ends a breakpoint's
/// prefix.
fn breakpoints(messages: &mut [Value]) -> Vec<CacheBreakpoint> {
    let mut out = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        if let Some(ttl) = m
            .as_object_mut()
            .and_then(|m| m.remove(BREAKPOINT_KEY))
            .and_then(|v| v.as_u64())
        {
            out.push(CacheBreakpoint {
                messages: i + 1,
                ttl: Duration::from_secs(ttl),
            });
        }
    }
    out
}

/// Converts `req` into the chat request the shared chat path validates and renders.
pub fn to_chat(req: MessagesRequest, purpose: Purpose) -> Result<ChatCompletionRequest, ApiError> {
    if purpose == Purpose::Generate && req.max_tokens.is_none() {
        return Err(ApiError::Missing {
            param: "max_tokens".into(),
        });
    }
    let response_format = output_format(&req)?;
    let mut messages = Vec::new();
    if let Some(system) = &req.system {
        let text = system_text(system)?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
            // The tools render before or inside the system prompt: a breakpoint on either
            // keeps the system prompt's end.
            let ttl = blocks_ttl("system", Some(system))?.max(blocks_ttl(
                "tools",
                req.tools.as_ref().map(|t| json!(t)).as_ref(),
            )?);
            if let Some(ttl) = ttl {
                mark_breakpoint(&mut messages, ttl);
            }
        }
    }
    let given = match req.messages {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::Missing {
                param: "messages".into(),
            })
        }
    };
    for (i, message) in given.iter().enumerate() {
        let before = messages.len();
        convert_message(i, message, &mut messages)?;
        let ttl = blocks_ttl(&format!("messages[{i}].content"), message.get("content"))?;
        if let (Some(ttl), true) = (ttl, messages.len() > before) {
            mark_breakpoint(&mut messages, ttl);
        }
    }
    hoist_first_turn_system(&mut messages);
    let cache_breakpoints = breakpoints(&mut messages);
    let mut tools = Vec::new();
    for (i, tool) in req.tools.unwrap_or_default().iter().enumerate() {
        if let Some(t) = convert_tool(i, tool)? {
            tools.push(t);
        }
    }
    let mut parallel = None;
    let tool_choice = match &req.tool_choice {
        None | Some(Value::Null) => None,
        Some(choice) => {
            if choice
                .get("disable_parallel_tool_use")
                .and_then(Value::as_bool)
                == Some(true)
            {
                parallel = Some(false);
            }
            match choice.get("type").and_then(Value::as_str) {
                Some("auto") => Some(json!("auto")),
                Some("none") => Some(json!("none")),
                // Forced calls: the chat validation constrains decoding to a call.
                Some("any") => Some(json!("required")),
                Some("tool") => match choice.get("name").and_then(Value::as_str) {
                    Some(name) => Some(json!({"type": "function", "function": {"name": name}})),
                    None => {
                        return Err(ApiError::field(
                            "tool_choice.name",
                            "a tool_choice of type 'tool' names the tool",
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::field(
                        "tool_choice",
                        "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                    ))
                }
            }
        }
    };
    let mut kwargs = Map::new();
    if let Some(thinking) = &req.thinking {
        match thinking.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive" | "between_tools") => {
                kwargs.insert("enable_thinking".into(), Value::Bool(true));
            }
            Some("disabled") => {
                kwargs.insert("enable_thinking".into(), Value::Bool(false));
            }
            _ => {
                return Err(ApiError::field(
                    "thinking.type",
                    "must be 'enabled', 'adaptive', 'between_tools' or 'disabled'",
                ))
            }
        }
    }
    let sampling = SamplingFields {
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.map(Stop::Many),
        stream: req.stream,
        ignore_eos: req.ignore_eos,
        speculative: req.speculative,
        adapter: req.adapter,
        ..SamplingFields::default()
    };
    Ok(ChatCompletionRequest {
        model: req.model,
        messages: Some(messages),
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice,
        parallel_tool_calls: parallel,
        chat_template_kwargs: Some(kwargs),
        response_format,
        sampling,
        cache_breakpoints,
        ..ChatCompletionRequest::default()
    })
}

/// `output_config.format` (or the older `output_format`) `{type: json_schema, schema}` as
/// the Responses-style `response_format` chat's constrained decoding takes.
fn output_format(req: &MessagesRequest) -> Result<Option<Value>, ApiError> {
    let (param, format) = match req.output_config.as_ref().and_then(|c| c.get("format")) {
        Some(f) if !f.is_null() => ("output_config.format", f),
        _ => match &req.output_format {
            Some(f) if !f.is_null() => ("output_format", f),
            _ => return Ok(None),
        },
    };
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => match format.get("schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(json!({
                "type": "json_schema",
                "name": "output",
                "schema": schema,
                "strict": true,
            }))),
            _ => Err(ApiError::field(
                format!("{param}.schema"),
                "a json_schema format needs a JSON Schema object in 'schema'",
            )),
        },
        _ => Err(ApiError::field(
            format!("{param}.type"),
            "must be 'json_schema'",
        )),
    }
}

/// Moves `system` turns that come after the first user message but before any assistant
/// turn to just after the leading system prompt, keeping their order. Claude Code sends
/// such a turn (its list of agent types, the same in every session) after the first user
/// message: left there, a new session's prompt matches the cached prompt of the previous
/// one only up to the user's words, and the system turn behind them is computed again.
/// Moved, everything but the user's words is a shared prefix. Later system turns (after an
/// assistant turn) stay in place, so a continued conversation keeps its prefix too.
fn hoist_first_turn_system(messages: &mut Vec<Value>) {
    let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_owned);
    let lead = messages
        .iter()
        .take_while(|m| role(m).as_deref() == Some("system"))
        .count();
    let end = messages
        .iter()
        .position(|m| role(m).as_deref() == Some("assistant"))
        .unwrap_or(messages.len());
    if end <= lead {
        return;
    }
    let (mut moved, mut kept) = (Vec::new(), Vec::new());
    for m in messages.drain(lead..end) {
        if role(&m).as_deref() == Some("system") {
            moved.push(m);
        } else {
            kept.push(m);
        }
    }
    if !moved.is_empty() {
        tracing::debug!(
            moved = moved.len(),
            "system turns of the first user turn moved before it"
        );
    }
    let tail: Vec<Value> = messages.drain(lead..).collect();
    messages.extend(moved);
    messages.extend(kept);
    messages.extend(tail);
}

/// The chat request with every `system` turn after the first message merged into the leading
/// system prompt (for templates that refuse a system turn elsewhere); `None` when there is
/// none to merge.
pub fn merge_system_turns(req: &ChatCompletionRequest) -> Option<ChatCompletionRequest> {
    let messages = req.messages.as_ref()?;
    let is_system = |m: &Value| m.get("role").and_then(Value::as_str) == Some("system");
    if !messages.iter().skip(1).any(is_system) {
        return None;
    }
    let mut system = Vec::new();
    let mut rest = Vec::new();
    for m in messages {
        if is_system(m) {
            system.push(
                m.get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            );
        } else {
            rest.push(m.clone());
        }
    }
    let mut merged = vec![json!({"role": "system", "content": system.join("\n\n")})];
    merged.extend(rest);
    let mut out = req.clone();
    // A breakpoint keeps the same turns: the merged system prompt and the others before it.
    for b in &mut out.cache_breakpoints {
        b.messages = 1 + messages[..b.messages.min(messages.len())]
            .iter()
            .filter(|m| !is_system(m))
            .count();
    }
    out.messages = Some(merged);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn cache_control_marks_breakpoints_at_message_ends() {
        let chat = to_chat(
            request(json!({
                "max_tokens": 5,
                "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                "tools": [{"name": "f", "input_schema": {"type": "object"},
                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": [
                        {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}},
                        {"type": "text", "text": "d"}]},
                ],
            })),
            Purpose::Generate,
        )
        .unwrap();
        let b = &chat.cache_breakpoints;
        assert_eq!(
            b.iter()
                .map(|b| (b.messages, b.ttl.as_secs()))
                .collect::<Vec<_>>(),
            vec![(1, 3600), (4, 300)]
        );
        // The marks are gone from the messages the template sees.
        assert!(!serde_json::to_string(&chat.messages)
            .unwrap()
            .contains(BREAKPOINT_KEY));
        let bad = to_chat(
            request(
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "c", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}]}),
            ),
            Purpose::Generate,
        );
        assert!(bad.is_err());
    }

    #[test]
    fn attribution_hash_is_blanked() {
        let a = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch=9f3a1;";
        let b = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch=00c7e;";
        assert_eq!(normalize_attribution(a), normalize_attribution(b));
        assert!(normalize_attribution(a).ends_with("cch=;"));
        assert_eq!(normalize_attribution("no hash here"), "no hash here");
    }

    #[test]
    fn blocks_become_chat_messages() {
        let req = request(json!({
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief. cch=123ab;"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]},
                    {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}]},
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
        }));
        let chat = to_chat(req, Purpose::Generate).unwrap();
        let m = chat.messages.unwrap();
        assert_eq!(
            m[0],
            json!({"role": "system", "content": "Be brief. cch=;"})
        );
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(m[2]["reasoning_content"], "use the tool");
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "22 C"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "thanks"}));
        assert_eq!(chat.tools.unwrap().len(), 1);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (
                json!({"messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (json!({"max_tokens": 5}), "messages"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].source.type",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}),
                "tool_choice.name",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
        ];
        for (body, param) in cases {
            let err = to_chat(request(body.clone()), Purpose::Generate).unwrap_err();
            assert_eq!(err.param(), Some(param), "{body}");
        }
    }

    #[test]
    fn first_turn_system_turns_move_before_the_user_message() {
        let body = |prompt: &str| {
            json!({"max_tokens": 5, "system": "A", "messages": [
                {"role": "user", "content": prompt},
                {"role": "system", "content": "agents"}]})
        };
        let one = to_chat(request(body("2+2?")), Purpose::Generate)
            .unwrap()
            .messages
            .unwrap();
        let roles: Vec<&str> = one.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "system", "user"]);
        assert_eq!(one[1]["content"], "agents");
        // Two sessions differ only in their last message.
        let two = to_chat(request(body("3+3?")), Purpose::Generate)
            .unwrap()
            .messages
            .unwrap();
        assert_eq!(one[..2], two[..2]);
        // A continued conversation renders its first turn as before; a system turn after
        // an assistant turn stays where it is.
        let later = to_chat(
            request(json!({"max_tokens": 5, "system": "A", "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "system", "content": "agents"},
                {"role": "assistant", "content": "4"},
                {"role": "system", "content": "note"},
                {"role": "user", "content": "and 3+3?"}]})),
            Purpose::Generate,
        )
        .unwrap()
        .messages
        .unwrap();
        assert_eq!(later[..3], one[..]);
        let roles: Vec<&str> = later.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(
            roles,
            ["system", "system", "user", "assistant", "system", "user"]
        );
    }

    #[test]
    fn late_system_turns_merge_into_the_first() {
        let chat = to_chat(
            request(json!({"max_tokens": 5, "system": "A", "messages": [
                {"role": "user", "content": "x"}, {"role": "system", "content": "B"}]})),
            Purpose::Generate,
        )
        .unwrap();
        let merged = merge_system_turns(&chat).unwrap().messages.unwrap();
        assert_eq!(merged[0]["content"], "A\n\nB");
        assert_eq!(merged.len(), 2);
    }
}
