//! Checking a chat request: messages (roles, content shapes, tool calls), tools and
//! `tool_choice`, reasoning switches, log-probabilities — into a [`ValidChat`].
use serde_json::{Map, Value};
use wick_chat::tool_call::{ToolCallError, ToolSpec};
use wick_engine::sampler::MAX_TOP_LOGPROBS;

use super::structured::{
    compile, forced_tool_spec, response_format_spec, strict_tools_constraint, vllm_spec, ForcedTool,
};
use super::{resolve_generation, GenerationContext, ValidGeneration};
use crate::config::BUILTIN_CHAT_MAX_TOKENS;
use crate::error::ApiError;
use crate::openai::chat::ChatCompletionRequest;
use crate::state::AppState;

/// Roles a message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A checked chat request.
#[derive(Debug, Clone)]
pub struct ValidChat {
    /// The messages, as sent (the template layer normalizes them).
    pub messages: Vec<Value>,
    /// Tools to render into the prompt and parse calls of (empty: none).
    pub tools: Vec<Value>,
    /// The parsed tool list (names and schemas), when tools are active.
    pub tool_specs: Vec<ToolSpec>,
    /// Whether the model may call more than one tool.
    pub parallel_tool_calls: bool,
    /// Template variables (`chat_template_kwargs`, resolved `enable_thinking` …).
    pub template_kwargs: Map<String, Value>,
    /// Log-probabilities: `Some(k)` = the token's and `k` alternatives.
    pub logprobs: Option<usize>,
    /// Sampling and limits.
    pub generation: ValidGeneration,
}

/// Checks `req` against the served model and settings.
pub fn validate(req: ChatCompletionRequest, state: &AppState) -> Result<ValidChat, ApiError> {
    let messages = match req.messages {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::Missing {
                param: "messages".into(),
            })
        }
    };
    for (i, message) in messages.iter().enumerate() {
        check_message(i, message)?;
    }
    let format_spec = match &req.response_format {
        None | Some(Value::Null) => None,
        Some(format) => response_format_spec("response_format", format)?,
    };

    let tools = req.tools.unwrap_or_default();
    let tool_specs = ToolSpec::list_from_openai(&tools).map_err(|e| match e {
        ToolCallError::InvalidToolSpec { index, reason } => {
            ApiError::field(format!("tools[{index}]"), reason)
        }
        other => ApiError::field("tools", other.to_string()),
    })?;
    let mut forced = None;
    let tools_on = match &req.tool_choice {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(Value::String(s)) if s == "required" => {
            forced = Some(ForcedTool::Any);
            true
        }
        Some(Value::Object(choice)) => {
            forced = Some(ForcedTool::Named(named_function(choice)?));
            true
        }
        Some(other) => {
            return Err(ApiError::field(
                "tool_choice",
                format!("must be 'none', 'auto', 'required' or a function object, got {other}"),
            ))
        }
    };
    let (tools, tool_specs) = if tools_on {
        (tools, tool_specs)
    } else {
        (Vec::new(), Vec::new())
    };

    let logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&k) => {
            return Err(ApiError::field(
                "top_logprobs",
                format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(k)) if k > 0 => {
            return Err(ApiError::field("top_logprobs", "needs \"logprobs\": true"))
        }
        _ => None,
    };

    let mut template_kwargs = req.chat_template_kwargs.unwrap_or_default();
    let thinking = match template_kwargs.get("enable_thinking") {
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::Null) | None => match req.reasoning_effort.as_deref() {
            None => None,
            Some("none") => Some(false),
            Some("minimal" | "low" | "medium" | "high") => Some(true),
            Some(other) => {
                return Err(ApiError::field(
                    "reasoning_effort",
                    format!("must be one of none, minimal, low, medium, high; got '{other}'"),
                ))
            }
        },
        Some(other) => {
            return Err(ApiError::field(
                "chat_template_kwargs.enable_thinking",
                format!("must be a boolean, got {other}"),
            ))
        }
    };
    if let Some(on) = thinking {
        template_kwargs.insert("enable_thinking".into(), Value::Bool(on));
    }
    if let Some(effort) = &req.reasoning_effort {
        template_kwargs
            .entry("reasoning_effort")
            .or_insert_with(|| Value::String(effort.clone()));
    }

    let model = state.model();
    let mut generation = resolve_generation(
        &req.sampling,
        GenerationContext {
            flags: &state.config().defaults,
            model: model.generation_defaults(),
            builtin_max_tokens: BUILTIN_CHAT_MAX_TOKENS,
            logprobs,
            thinking_off: thinking == Some(false),
            vocab_size: model.config().vocab_size,
        },
    )?;
    generation.adapters =
        super::adapter::select(state, req.sampling.adapter.as_deref(), req.model.as_deref())?;
    let parallel_tool_calls = req.parallel_tool_calls.unwrap_or(true);
    let mut specs = Vec::new();
    if let Some(forced) = &forced {
        let format = state.tool_format();
        let spec = forced_tool_spec(
            "tool_choice",
            forced,
            &tool_specs,
            format,
            parallel_tool_calls,
            model,
        )?;
        specs.push(("tool_choice".to_string(), spec));
    }
    if let Some(spec) = format_spec {
        specs.push(("response_format".to_string(), spec));
    }
    specs.extend(vllm_spec(&req.sampling)?);
    if let [(first, _), (second, _), ..] = specs.as_slice() {
        return Err(ApiError::field(
            second.clone(),
            format!("cannot be combined with '{first}': a reply follows one constraint"),
        ));
    }
    let reasoning = thinking != Some(false)
        && state
            .template_capabilities()
            .is_some_and(|c| c.uses_think_tags);
    if let Some((param, spec)) = specs.first() {
        generation.sampling.constraint = Some(compile(model, param, spec, reasoning)?);
    } else if !tool_specs.is_empty() {
        // `auto` with strict tools: free text, constrained calls.
        generation.sampling.constraint =
            strict_tools_constraint(model, &tools, &tool_specs, state.tool_format(), reasoning)?;
    }
    Ok(ValidChat {
        messages,
        tools,
        tool_specs,
        parallel_tool_calls,
        template_kwargs,
        logprobs,
        generation,
    })
}

/// The function a `tool_choice` object names: OpenAI chat's `{type: function, function:
/// {name}}` or the flat `{type: function, name}` of the Responses API.
fn named_function(choice: &Map<String, Value>) -> Result<String, ApiError> {
    match choice.get("type").and_then(Value::as_str) {
        Some("function") => {}
        _ => {
            return Err(ApiError::field(
                "tool_choice.type",
                "must be 'function' in a tool_choice object",
            ))
        }
    }
    let name = choice
        .get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| choice.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.trim().is_empty());
    name.map(|n| n.trim().to_string()).ok_or_else(|| {
        ApiError::field(
            "tool_choice.function.name",
            "must name one of the offered tools",
        )
    })
}

/// Checks one message's shape; errors name `messages[i].field`.
pub fn check_message(i: usize, message: &Value) -> Result<(), ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(fields) = message else {
        return Err(ApiError::field(
            format!("messages[{i}]"),
            "must be an object",
        ));
    };
    let role = match fields.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
        Some(Value::String(r)) => {
            return Err(ApiError::field(
                at("role"),
                format!("must be one of {}; got '{r}'", ROLES.join(", ")),
            ))
        }
        Some(_) => return Err(ApiError::field(at("role"), "must be a string")),
        None => return Err(ApiError::Missing { param: at("role") }),
    };
    let has_calls = fields
        .get("tool_calls")
        .is_some_and(|c| c.as_array().is_some_and(|a| !a.is_empty()));
    match fields.get("content") {
        Some(Value::String(_)) => {}
        None | Some(Value::Null) if role == "assistant" => {}
        None | Some(Value::Null) => {
            return Err(ApiError::Missing {
                param: at("content"),
            })
        }
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                check_part(&at(&format!("content[{j}]")), part)?;
            }
        }
        Some(_) => {
            return Err(ApiError::field(
                at("content"),
                "must be a string or an array of content parts",
            ))
        }
    }
    if let Some(name) = fields.get("name") {
        if !name.is_string() && !name.is_null() {
            return Err(ApiError::field(at("name"), "must be a string"));
        }
    }
    match fields.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) if role == "assistant" => {
            for (j, call) in calls.iter().enumerate() {
                check_tool_call(&at(&format!("tool_calls[{j}]")), call)?;
            }
        }
        Some(Value::Array(_)) if !has_calls => {}
        Some(Value::Array(_)) => {
            return Err(ApiError::field(
                at("tool_calls"),
                "only assistant messages carry tool calls",
            ))
        }
        Some(_) => return Err(ApiError::field(at("tool_calls"), "must be an array")),
    }
    if let Some(id) = fields.get("tool_call_id") {
        if !id.is_string() && !id.is_null() {
            return Err(ApiError::field(at("tool_call_id"), "must be a string"));
        }
    }
    Ok(())
}

fn check_part(at: &str, part: &Value) -> Result<(), ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") => match part.get("text") {
            Some(Value::String(_)) => Ok(()),
            _ => Err(ApiError::field(format!("{at}.text"), "must be a string")),
        },
        Some("image_url" | "input_audio") => crate::media::parts::check_part(at, part),
        Some(kind @ ("file" | "image" | "audio")) => Err(ApiError::unsupported(
            format!("{at}.type"),
            format!("'{kind}' content is not supported: the served model reads text only"),
        )),
        Some(other) => Err(ApiError::field(
            format!("{at}.type"),
            format!("unknown content part type '{other}'"),
        )),
        None => Err(ApiError::field(
            at.to_string(),
            "must be an object with a 'type'",
        )),
    }
}

fn check_tool_call(at: &str, call: &Value) -> Result<(), ApiError> {
    let Some(function) = call.get("function").and_then(Value::as_object) else {
        return Err(ApiError::field(
            format!("{at}.function"),
            "must be an object with 'name' and 'arguments'",
        ));
    };
    match function.get("name") {
        Some(Value::String(n)) if !n.is_empty() => {}
        _ => {
            return Err(ApiError::field(
                format!("{at}.function.name"),
                "must be a non-empty string",
            ))
        }
    }
    match function.get("arguments") {
        None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(ApiError::field(
            format!("{at}.function.arguments"),
            "must be a JSON string or an object",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param_of(message: Value) -> Option<String> {
        check_message(0, &message)
            .err()
            .and_then(|e| e.param().map(str::to_string))
    }

    #[test]
    fn good_messages_pass() {
        for m in [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "developer", "content": "Be brief."}),
            json!({"role": "user", "content": [{"type": "text", "text": "Hi"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]}),
            json!({"role": "assistant"}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "22 C"}),
        ] {
            assert_eq!(check_message(0, &m), Ok(()), "{m}");
        }
    }

    #[test]
    fn bad_messages_name_the_field() {
        let cases = [
            (json!("hi"), "messages[0]"),
            (json!({"content": "x"}), "messages[0].role"),
            (json!({"role": "robot", "content": "x"}), "messages[0].role"),
            (json!({"role": 3, "content": "x"}), "messages[0].role"),
            (json!({"role": "user"}), "messages[0].content"),
            (
                json!({"role": "user", "content": 42}),
                "messages[0].content",
            ),
            (
                json!({"role": "user", "content": [{"type": "text"}]}),
                "messages[0].content[0].text",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
                "messages[0].content[0].image_url.url",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}),
                "messages[0].tool_calls[0].function.name",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}),
                "messages[0].tool_calls[0].function.arguments",
            ),
            (
                json!({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}),
                "messages[0].tool_calls",
            ),
        ];
        for (message, param) in cases {
            assert_eq!(
                param_of(message.clone()).as_deref(),
                Some(param),
                "{message}"
            );
        }
    }
}
