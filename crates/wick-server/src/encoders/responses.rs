//! OpenAI Responses: the `response` object (output items `reasoning`, `message`,
//! `function_call`) and its event stream (`response.created` … `response.completed`), and
//! the storing of finished responses for `previous_response_id`.
use axum::response::sse::Event;
use serde_json::{json, Value};

use super::Encoder;
use crate::error::ApiError;
use crate::openai::custom_tools;
use crate::openai::response_id;
use crate::openai::responses::split_namespace;
use crate::reply::{Collected, Finish, FinishReason, Part, ReplyEvent, ReplyUsage};
use crate::response_store::StoredResponse;
use crate::state::AppState;

/// What the response object repeats, and where it is stored.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `resp_…`.
    pub id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// The served model's id.
    pub model: String,
    /// The request's echoed fields (`instructions`, `tools`, `tool_choice`, …).
    pub echo: serde_json::Map<String, Value>,
    /// The tools as the request offered them (to name namespaced calls back).
    pub tools: Vec<Value>,
    /// The conversation so far as chat messages, when the response is to be stored.
    pub store: Option<Vec<Value>>,
}

/// The Responses usage object; a speculatively decoded reply adds a non-standard
/// `speculation {drafted, accepted}`.
pub fn usage(u: &ReplyUsage) -> Value {
    let mut usage = json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if let Some(s) = u.speculation {
        usage["speculation"] = json!(s);
    }
    usage
}

/// The response object in `status` with `output`.
pub fn response_object(
    meta: &ResponseMeta,
    status: &str,
    output: Vec<Value>,
    extra: Value,
) -> Value {
    let mut body = json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "model": meta.model,
        "output": output,
        "error": null,
        "incomplete_details": null,
        "usage": null,
    });
    if let Some(obj) = body.as_object_mut() {
        for (k, v) in &meta.echo {
            obj.insert(k.clone(), v.clone());
        }
        if let Value::Object(extra) = extra {
            obj.extend(extra);
        }
    }
    body
}

/// `status`, and what completes it, of a finished reply.
fn finished(meta: &ResponseMeta, finish: &Finish, output: Vec<Value>) -> Value {
    let extra = match finish.reason {
        FinishReason::Length => json!({
            "incomplete_details": {"reason": "max_output_tokens"},
            "usage": usage(&finish.usage),
        }),
        _ => json!({"usage": usage(&finish.usage)}),
    };
    let status = match finish.reason {
        FinishReason::Length => "incomplete",
        _ => "completed",
    };
    response_object(meta, status, output, extra)
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        vec![text_part(text)]
    } else {
        Vec::new()
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(
    id: &str,
    call_id: &str,
    name: &str,
    arguments: &str,
    status: &str,
    tools: &[Value],
) -> Value {
    if custom_tools::is_custom(name, tools) {
        return custom_tools::call_item(id, call_id, name, arguments, status);
    }
    let (namespace, name) = split_namespace(name, tools);
    let mut item = json!({
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    });
    if let (Some(ns), Some(obj)) = (namespace, item.as_object_mut()) {
        obj.insert("namespace".into(), json!(ns));
    }
    item
}

/// The chat message of a reply, which a follow-up's history continues with.
fn assistant_message(content: &str, calls: &[(String, String, String)]) -> Value {
    let mut m = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        m["tool_calls"] = calls
            .iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
    }
    m
}

/// Stores a finished response when asked.
fn store(state: &AppState, meta: &ResponseMeta, response: &Value, assistant: Value) {
    if let Some(conversation) = &meta.store {
        let mut conversation = conversation.clone();
        conversation.push(assistant);
        state.responses().insert(
            meta.id.clone(),
            StoredResponse {
                response: response.clone(),
                conversation,
            },
        );
    }
}

/// The response object of a whole reply (stored when the request asked).
pub fn whole(state: &AppState, reply: Collected, meta: ResponseMeta) -> Value {
    let mut output = Vec::new();
    if !reply.reasoning.is_empty() {
        output.push(reasoning_item(&response_id("rs_"), &reply.reasoning));
    }
    if !reply.content.is_empty() || reply.calls.is_empty() {
        output.push(message_item(
            &response_id("msg_"),
            &reply.content,
            "completed",
        ));
    }
    let mut calls = Vec::new();
    for c in &reply.calls {
        output.push(call_item(
            &response_id("fc_"),
            &c.id,
            &c.name,
            &c.arguments,
            "completed",
            &meta.tools,
        ));
        calls.push((c.id.clone(), c.name.clone(), c.arguments.clone()));
    }
    let body = finished(&meta, &reply.finish, output);
    store(
        state,
        &meta,
        &body,
        assistant_message(&reply.content, &calls),
    );
    body
}

/// The output item being streamed.
#[derive(Debug)]
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// The event encoder of one streamed response.
pub struct ResponsesEncoder {
    meta: ResponseMeta,
    state: AppState,
    sequence: u64,
    output: Vec<Value>,
    open: Option<Open>,
    content: String,
    calls: Vec<(String, String, String)>,
}

impl ResponsesEncoder {
    /// An encoder of the response `meta` describes.
    pub fn new(meta: ResponseMeta, state: AppState) -> Self {
        ResponsesEncoder {
            meta,
            state,
            sequence: 0,
            output: Vec::new(),
            open: None,
            content: String::new(),
            calls: Vec::new(),
        }
    }

    fn emit(&mut self, kind: &str, mut data: Value, frames: &mut Vec<Event>) {
        if let Some(obj) = data.as_object_mut() {
            obj.insert("type".into(), json!(kind));
            obj.insert("sequence_number".into(), json!(self.sequence));
        }
        self.sequence += 1;
        frames.push(Event::default().event(kind).data(data.to_string()));
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn close(&mut self, frames: &mut Vec<Event>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.index();
        let item = match open {
            Open::Reasoning { id, text } => {
                let part = json!({"type": "reasoning_text", "text": text});
                self.emit(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                    frames,
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                    frames,
                );
                reasoning_item(&id, &text)
            }
            Open::Message { id, text } => {
                self.emit("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}), frames);
                self.emit("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part(&text)}), frames);
                message_item(&id, &text, "completed")
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
            } => {
                if custom_tools::is_custom(&name, &self.meta.tools) {
                    self.custom_input_done(&id, index, &arguments, frames);
                } else {
                    let (_, short) = split_namespace(&name, &self.meta.tools);
                    self.emit("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "name": short, "arguments": arguments}), frames);
                }
                let item = call_item(
                    &id,
                    &call_id,
                    &name,
                    &arguments,
                    "completed",
                    &self.meta.tools,
                );
                self.calls.push((call_id, name, arguments));
                item
            }
        };
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
            frames,
        );
        self.output.push(item);
    }

    fn part(&mut self, part: Part, frames: &mut Vec<Event>) {
        let index = self.index();
        match part {
            Part::Reasoning(delta) => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    self.close(frames);
                    let id = response_id("rs_");
                    let item = json!({"type": "reasoning", "id": id, "summary": [], "content": []});
                    let index = self.index();
                    self.emit(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                        frames,
                    );
                    self.emit("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}), frames);
                    self.open = Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.index();
                if let Some(Open::Reasoning { id, text }) = &mut self.open {
                    text.push_str(&delta);
                    let data = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta});
                    self.emit("response.reasoning_text.delta", data, frames);
                }
            }
            Part::Content(delta) => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    self.close(frames);
                    let id = response_id("msg_");
                    let index = self.index();
                    self.emit("response.output_item.added", json!({"output_index": index, "item": message_item(&id, "", "in_progress")}), frames);
                    self.emit("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part("")}), frames);
                    self.open = Some(Open::Message {
                        id,
                        text: String::new(),
                    });
                }
                self.content.push_str(&delta);
                let index = self.index();
                if let Some(Open::Message { id, text }) = &mut self.open {
                    text.push_str(&delta);
                    let data = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []});
                    self.emit("response.output_text.delta", data, frames);
                }
            }
            Part::CallStart {
                id: call_id, name, ..
            } => {
                self.close(frames);
                let id = response_id("fc_");
                let index = self.index();
                let item = call_item(&id, &call_id, &name, "", "in_progress", &self.meta.tools);
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                    frames,
                );
                self.open = Some(Open::Call {
                    id,
                    call_id,
                    name,
                    arguments: String::new(),
                });
            }
            Part::CallArguments { delta, .. } => {
                if let Some(Open::Call {
                    id,
                    name,
                    arguments,
                    ..
                }) = &mut self.open
                {
                    arguments.push_str(&delta);
                    if custom_tools::is_custom(name, &self.meta.tools) {
                        // The input is sent whole when the call closes: a JSON fragment of
                        // the arguments is not a piece of it.
                        return;
                    }
                    let data = json!({"item_id": id, "output_index": index, "delta": delta});
                    self.emit("response.function_call_arguments.delta", data, frames);
                }
            }
            Part::CallEnd { .. } => self.close(frames),
        }
    }
}

impl ResponsesEncoder {
    /// The events that end a custom call's input: its whole `input` as one delta, then
    /// `response.custom_tool_call_input.done`.
    fn custom_input_done(
        &mut self,
        id: &str,
        index: usize,
        arguments: &str,
        frames: &mut Vec<Event>,
    ) {
        let input = custom_tools::input_of(arguments);
        self.emit(
            "response.custom_tool_call_input.delta",
            json!({"item_id": id, "output_index": index, "delta": input}),
            frames,
        );
        self.emit(
            "response.custom_tool_call_input.done",
            json!({"item_id": id, "output_index": index, "input": input}),
            frames,
        );
    }
}

impl Encoder for ResponsesEncoder {
    fn start(&mut self) -> Vec<Event> {
        let mut frames = Vec::new();
        let response = response_object(&self.meta, "in_progress", Vec::new(), Value::Null);
        self.emit(
            "response.created",
            json!({"response": response}),
            &mut frames,
        );
        self.emit(
            "response.in_progress",
            json!({"response": response}),
            &mut frames,
        );
        frames
    }

    fn event(&mut self, event: ReplyEvent) -> Vec<Event> {
        let mut frames = Vec::new();
        match event {
            ReplyEvent::Prompt(_) | ReplyEvent::Token(_) => {}
            ReplyEvent::Part(part) => self.part(part, &mut frames),
            ReplyEvent::Finish(finish) => {
                self.close(&mut frames);
                if self.output.is_empty() {
                    // An empty answer is still one (empty) message, as in the whole body.
                    self.part(Part::Content(String::new()), &mut frames);
                    self.close(&mut frames);
                }
                let response = finished(&self.meta, &finish, self.output.clone());
                let assistant = assistant_message(&self.content, &self.calls);
                store(&self.state, &self.meta, &response, assistant);
                // A reply the token limit cut ends with `response.incomplete` (status
                // `incomplete`, `incomplete_details.reason` `max_output_tokens`), as
                // OpenAI's; every other successful end with `response.completed`.
                let kind = if finish.reason == FinishReason::Length {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                self.emit(kind, json!({"response": response}), &mut frames);
            }
        }
        frames
    }

    fn error(&mut self, e: ApiError) -> Vec<Event> {
        let mut frames = Vec::new();
        self.close(&mut frames);
        if e.status().is_server_error() {
            tracing::error!(code = e.code(), "stream failed: {e}");
        }
        frames.extend(failed_frames(
            &self.meta,
            &e,
            self.output.clone(),
            self.sequence,
        ));
        frames
    }
}

/// `response.failed` (numbered from `sequence`) for `error`.
pub fn failed_frames(
    meta: &ResponseMeta,
    error: &ApiError,
    output: Vec<Value>,
    sequence: u64,
) -> Vec<Event> {
    let extra = json!({"error": {"code": error.code(), "message": error.to_string()}});
    let response = response_object(meta, "failed", output, extra);
    let data =
        json!({"type": "response.failed", "sequence_number": sequence, "response": response});
    vec![Event::default()
        .event("response.failed")
        .data(data.to_string())]
}

/// The whole stream of a response that failed before generation began: `response.created`
/// then `response.failed`.
pub fn failed_stream(meta: &ResponseMeta, error: &ApiError) -> Vec<Event> {
    let created = response_object(meta, "in_progress", Vec::new(), Value::Null);
    let data = json!({"type": "response.created", "sequence_number": 0, "response": created});
    let mut frames = vec![Event::default()
        .event("response.created")
        .data(data.to_string())];
    frames.extend(failed_frames(meta, error, Vec::new(), 1));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ResponseMeta {
        ResponseMeta {
            id: "resp_1".into(),
            created_at: 1,
            model: "m".into(),
            echo: serde_json::Map::new(),
            tools: Vec::new(),
            store: None,
        }
    }

    #[test]
    fn usage_names_cached_and_reasoning_tokens() {
        let u = usage(&ReplyUsage {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 3,
            reasoning_tokens: 2,
            speculation: Some(wick_engine::speculative::SpeculationUsage {
                drafted: 4,
                accepted: 3,
            }),
        });
        assert_eq!(u["speculation"], json!({"drafted": 4, "accepted": 3}));
        assert_eq!(u["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 2);
        assert_eq!(u["total_tokens"], 13);
    }

    #[test]
    fn a_cut_reply_is_incomplete() {
        let finish = Finish {
            reason: FinishReason::Length,
            usage: ReplyUsage::default(),
        };
        let body = finished(&meta(), &finish, Vec::new());
        assert_eq!(body["status"], "incomplete");
        assert_eq!(body["incomplete_details"]["reason"], "max_output_tokens");
    }

    #[test]
    fn an_overlong_prompt_fails_with_context_length_exceeded() {
        let error = ApiError::ContextOverflow {
            param: "messages",
            prompt: 10,
            max_tokens: 1,
            needed: 11,
            limit: 10,
        };
        let frames = failed_stream(&meta(), &error);
        let text = format!("{:?}", frames[1]);
        assert!(
            text.contains("response.failed") && text.contains("context_length_exceeded"),
            "{text}"
        );
    }
}
