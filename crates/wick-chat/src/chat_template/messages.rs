//! Chat messages as the server hands them to a template: the OpenAI request's shapes turned into
//! the ones Hugging Face templates expect.
//!
//! - keys whose value is `null` are dropped (as transformers does: templates test `is defined`,
//!   and a `content: null` would print `None`), except `content`, which becomes `""` when null or
//!   missing: an assistant tool-call message comes with `content: null`, and nine of the 70
//!   llama.cpp test templates (Qwen3, QwQ, DeepSeek-R1 distills, Phi-3.5, Granite 3.3, LFM2,
//!   Devstral) fail on a missing content (`'</think>' in message.content`, `content + …`), while
//!   every template that renders both prints the same prompt for `""` as for no content;
//! - role `developer` becomes `system`;
//! - `content` made only of text parts becomes one string (parts joined with nothing between
//!   them); content with images, audio or other parts stays a list;
//! - `tool_calls[].function.arguments` given as a JSON string is parsed into an object; text that is
//!   not a JSON object stays the string;
//! - reasoning sent back under `reasoning` or `thinking` is also given as `reasoning_content`, and
//!   as `thinking` when that is absent (transformers' aliasing: most templates read
//!   `reasoning_content`, gpt-oss reads `thinking`).

use serde_json::{Map, Value};

/// Reasoning field names, the standard one (read by most templates) first.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Normalizes every message of a conversation (see the module docs).
pub fn normalize_messages(messages: Vec<Value>) -> Vec<Value> {
    messages.into_iter().map(normalize_message).collect()
}

/// Normalizes one message; values that are not JSON objects are returned unchanged.
pub fn normalize_message(message: Value) -> Value {
    let Value::Object(fields) = message else {
        return message;
    };
    let mut fields: Map<String, Value> = fields.into_iter().filter(|(_, v)| !v.is_null()).collect();
    fields
        .entry("content")
        .or_insert_with(|| Value::String(String::new()));
    if fields.get("role").and_then(Value::as_str) == Some("developer") {
        fields.insert("role".to_string(), Value::from("system"));
    }
    if let Some(content) = fields.get_mut("content") {
        flatten_text_parts(content);
    }
    if let Some(Value::Array(calls)) = fields.get_mut("tool_calls") {
        for call in calls.iter_mut() {
            parse_arguments(call);
        }
    }
    Value::Object(alias_reasoning(fields))
}

/// `[{"type":"text","text":"a"},{"type":"text","text":"b"}]` → `"ab"`; anything else unchanged.
fn flatten_text_parts(content: &mut Value) {
    let Value::Array(parts) = content else { return };
    let mut text = String::new();
    for part in parts.iter() {
        match (
            part.get("type").and_then(Value::as_str),
            part.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(piece)) => text.push_str(piece),
            _ => return,
        }
    }
    *content = Value::String(text);
}

/// `{"function": {"arguments": "{\"city\":\"Paris\"}"}}` → `{"function": {"arguments": {"city": "Paris"}}}`.
fn parse_arguments(call: &mut Value) {
    let Some(arguments) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
    else {
        return;
    };
    let Value::String(text) = arguments else {
        return;
    };
    if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(text) {
        *arguments = parsed;
    }
}

/// transformers' `_alias_reasoning_fields`: `{"thinking": r, **message, "reasoning_content": r}`
/// where `r` is the first non-null of `reasoning_content`, `thinking`, `reasoning`.
fn alias_reasoning(fields: Map<String, Value>) -> Map<String, Value> {
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|key| fields.get(*key).cloned());
    let Some(reasoning) = reasoning else {
        return fields;
    };
    let mut aliased = Map::new();
    aliased.insert("thinking".to_string(), reasoning.clone());
    aliased.extend(fields);
    aliased.insert("reasoning_content".to_string(), reasoning);
    aliased
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_flatten_and_media_parts_stay() {
        let text = normalize_message(json!({"role": "user", "content": [
            {"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]}));
        assert_eq!(text, json!({"role": "user", "content": "Describe this."}));
        let media = json!({"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "x"}}]});
        assert_eq!(normalize_message(media.clone()), media);
        assert_eq!(
            normalize_message(json!({"role": "user", "content": []}))["content"],
            json!("")
        );
    }

    #[test]
    fn developer_becomes_system_and_nulls_drop() {
        let msg =
            normalize_message(json!({"role": "developer", "content": "Be brief.", "name": null}));
        assert_eq!(msg, json!({"role": "system", "content": "Be brief."}));
        let call =
            normalize_message(json!({"role": "assistant", "content": null, "tool_calls": []}));
        assert_eq!(
            call,
            json!({"role": "assistant", "content": "", "tool_calls": []})
        );
    }

    #[test]
    fn arguments_parse_only_when_they_are_a_json_object() {
        let msg = normalize_message(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [true]}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{broken"}},
            {"id": "3", "type": "function", "function": {"name": "h", "arguments": "42"}}
        ]}));
        let calls = msg["tool_calls"].as_array().unwrap();
        assert_eq!(
            calls[0]["function"]["arguments"],
            json!({"b": 1, "a": [true]})
        );
        let keys: Vec<&String> = calls[0]["function"]["arguments"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["b", "a"], "key order is kept");
        assert_eq!(calls[1]["function"]["arguments"], json!("{broken"));
        assert_eq!(calls[2]["function"]["arguments"], json!("42"));
        assert_eq!(msg["content"], json!(""));
    }

    #[test]
    fn reasoning_is_aliased_like_transformers() {
        let msg =
            normalize_message(json!({"role": "assistant", "content": "4", "reasoning": "2+2"}));
        let keys: Vec<&String> = msg.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "thinking",
                "role",
                "content",
                "reasoning",
                "reasoning_content"
            ]
        );
        assert_eq!(msg["reasoning_content"], json!("2+2"));
        let own = normalize_message(
            json!({"role": "assistant", "thinking": "t", "reasoning_content": "r"}),
        );
        assert_eq!(own["thinking"], json!("t"));
        assert_eq!(own["reasoning_content"], json!("r"));
    }
}
