//! Anthropic Messages: the `message` body and the stream of `message_start`,
//! `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop` events (and
//! `ping` while a long prompt is prefilled).
use std::time::Duration;

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::Encoder;
use crate::anthropic::error;
use crate::error::ApiError;
use crate::reply::{Collected, Finish, FinishReason, Part, ReplyEvent, ReplyUsage};

/// wick does not sign thinking; this stands where Anthropic puts a signature, so clients that
/// send thinking blocks back have one to send.
pub const THINKING_SIGNATURE: &str = "wick-unsigned";

/// How often a `ping` goes out while nothing else does.
const PING_EVERY: Duration = Duration::from_secs(5);

/// What the message and every event repeat.
#[derive(Debug, Clone)]
pub struct MessageMeta {
    /// `msg_…`.
    pub id: String,
    /// The served model's id.
    pub model: String,
    /// Prompt tokens (known before generation starts).
    pub prompt_tokens: usize,
    /// Tokens of the longest prefix the request's `cache_control` breakpoints keep cached.
    pub pinned_prefix: usize,
}

/// `stop_reason` and `stop_sequence`.
fn stop(reason: &FinishReason) -> (&'static str, Value) {
    match reason {
        FinishReason::EndTurn => ("end_turn", Value::Null),
        FinishReason::StopSequence(s) => ("stop_sequence", json!(s)),
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::ToolCalls => ("tool_use", Value::Null),
    }
}

/// Anthropic's usage, which adds up to the prompt: `cache_read_input_tokens` the prefix
/// read from the prompt cache, `cache_creation_input_tokens` the rest of the prefix the
/// request's breakpoints (`pinned_prefix` tokens) stored, `input_tokens` the remainder. A
/// speculatively decoded reply adds a non-standard `speculation {drafted, accepted}`
/// (clients keep unknown usage fields).
pub fn usage(u: &ReplyUsage, pinned_prefix: usize) -> Value {
    let created = pinned_prefix
        .min(u.prompt_tokens)
        .saturating_sub(u.cached_tokens);
    let mut usage = json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens + created),
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    });
    if let Some(s) = u.speculation {
        usage["speculation"] = json!(s);
    }
    usage
}

/// A tool call's arguments as the `input` object (the parser already repaired them; text that
/// is still not an object is kept under `_raw`, never dropped).
fn input_of(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) | Err(_) if arguments.trim().is_empty() => json!({}),
        _ => json!({"_raw": arguments}),
    }
}

/// The `message` body of a whole reply.
pub fn whole(reply: Collected, meta: MessageMeta) -> Value {
    let mut content = Vec::new();
    if !reply.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": reply.reasoning, "signature": THINKING_SIGNATURE}));
    }
    if !reply.content.is_empty() {
        content.push(json!({"type": "text", "text": reply.content}));
    }
    for call in &reply.calls {
        content.push(json!({
            "type": "tool_use",
            "id": call.id,
            "name": call.name,
            "input": input_of(&call.arguments),
        }));
    }
    let (stop_reason, stop_sequence) = stop(&reply.finish.reason);
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&reply.finish.usage, meta.pinned_prefix),
    })
}

/// The kind of the block being streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    ToolUse,
}

/// The event encoder of one streamed message.
pub struct AnthropicEncoder {
    meta: MessageMeta,
    started: bool,
    /// The open block and its index.
    open: Option<Block>,
    next_index: usize,
}

impl AnthropicEncoder {
    /// An encoder for the message `meta` describes.
    pub fn new(meta: MessageMeta) -> Self {
        AnthropicEncoder {
            meta,
            started: false,
            open: None,
            next_index: 0,
        }
    }

    fn message_start(&mut self, cached: usize, frames: &mut Vec<Event>) {
        if self.started {
            return;
        }
        self.started = true;
        let u = ReplyUsage {
            prompt_tokens: self.meta.prompt_tokens,
            cached_tokens: cached,
            ..ReplyUsage::default()
        };
        frames.push(event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.meta.id,
                "type": "message",
                "role": "assistant",
                "model": self.meta.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": usage(&u, self.meta.pinned_prefix),
            }}),
        ));
    }

    fn close(&mut self, frames: &mut Vec<Event>) {
        let Some(block) = self.open.take() else {
            return;
        };
        let index = self.next_index - 1;
        if block == Block::Thinking {
            frames.push(delta(
                index,
                json!({"type": "signature_delta", "signature": THINKING_SIGNATURE}),
            ));
        }
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }

    /// Opens a block of `kind` unless one is open; returns its index.
    fn open(&mut self, kind: Block, block: Value, frames: &mut Vec<Event>) -> usize {
        if self.open == Some(kind) && kind != Block::ToolUse {
            return self.next_index - 1;
        }
        self.close(frames);
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some(kind);
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn part(&mut self, part: Part, frames: &mut Vec<Event>) {
        match part {
            Part::Content(text) => {
                let i = self.open(Block::Text, json!({"type": "text", "text": ""}), frames);
                frames.push(delta(i, json!({"type": "text_delta", "text": text})));
            }
            Part::Reasoning(text) => {
                let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                let i = self.open(Block::Thinking, block, frames);
                frames.push(delta(
                    i,
                    json!({"type": "thinking_delta", "thinking": text}),
                ));
            }
            Part::CallStart { id, name, .. } => {
                let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                self.open(Block::ToolUse, block, frames);
            }
            Part::CallArguments { delta: text, .. } => {
                if self.open == Some(Block::ToolUse) {
                    let i = self.next_index - 1;
                    frames.push(delta(
                        i,
                        json!({"type": "input_json_delta", "partial_json": text}),
                    ));
                }
            }
            Part::CallEnd { .. } => self.close(frames),
        }
    }

    fn finish(&mut self, finish: Finish, frames: &mut Vec<Event>) {
        self.close(frames);
        let (stop_reason, stop_sequence) = stop(&finish.reason);
        frames.push(event(
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage(&finish.usage, self.meta.pinned_prefix),
            }),
        ));
        frames.push(event("message_stop", json!({"type": "message_stop"})));
    }
}

impl Encoder for AnthropicEncoder {
    fn event(&mut self, reply_event: ReplyEvent) -> Vec<Event> {
        let mut frames = Vec::new();
        match reply_event {
            // Only completions ask for prompt scores.
            ReplyEvent::Prompt(_) => {}
            ReplyEvent::Token(t) => self.message_start(t.cached_tokens, &mut frames),
            ReplyEvent::Part(part) => {
                self.message_start(0, &mut frames);
                self.part(part, &mut frames);
            }
            ReplyEvent::Finish(finish) => {
                self.message_start(finish.usage.cached_tokens, &mut frames);
                self.finish(finish, &mut frames);
            }
        }
        frames
    }

    fn error(&mut self, e: ApiError) -> Vec<Event> {
        if e.status().is_server_error() {
            tracing::error!(code = e.code(), "stream failed: {e}");
        }
        vec![event("error", error::body(&e))]
    }

    fn keepalive(&self) -> Option<Duration> {
        Some(PING_EVERY)
    }

    fn idle(&mut self) -> Vec<Event> {
        let mut frames = Vec::new();
        self.message_start(0, &mut frames);
        frames.push(event("ping", json!({"type": "ping"})));
        frames
    }
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

fn delta(index: usize, delta: Value) -> Event {
    event(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": index, "delta": delta}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_open_before_their_deltas_and_close_in_order() {
        let meta = MessageMeta {
            id: "msg_1".into(),
            model: "m".into(),
            prompt_tokens: 5,
            pinned_prefix: 0,
        };
        let mut enc = AnthropicEncoder::new(meta);
        let mut frames = Vec::new();
        for part in [
            Part::Reasoning("hm".into()),
            Part::Content("Hi".into()),
            Part::CallStart {
                index: 0,
                id: "call_1".into(),
                name: "f".into(),
            },
            Part::CallArguments {
                index: 0,
                delta: "{}".into(),
            },
            Part::CallEnd {
                index: 0,
                repairs: Vec::new(),
            },
        ] {
            frames.extend(enc.event(ReplyEvent::Part(part)));
        }
        frames.extend(enc.event(ReplyEvent::Finish(Finish {
            reason: FinishReason::ToolCalls,
            usage: ReplyUsage::default(),
        })));
        let got: Vec<String> = frames.iter().map(|f| format!("{f:?}")).collect();
        let joined = got.join("|");
        let order = [
            "message_start",
            "content_block_start",
            "thinking_delta",
            "signature_delta",
            "content_block_stop",
            "content_block_start",
            "text_delta",
            "content_block_stop",
            "content_block_start",
            "input_json_delta",
            "content_block_stop",
            "message_delta",
            "tool_use",
            "message_stop",
        ];
        let mut from = 0;
        for name in order {
            let at = joined[from..]
                .find(name)
                .unwrap_or_else(|| panic!("{name} missing after {from}: {joined}"));
            from += at + name.len();
        }
    }

    #[test]
    fn a_whole_message_has_typed_blocks_and_anthropic_usage() {
        let reply = Collected {
            content: "Hi".into(),
            reasoning: String::new(),
            calls: vec![crate::reply::CollectedCall {
                id: "call_1".into(),
                name: "f".into(),
                arguments: "{\"a\":1}".into(),
                repairs: Vec::new(),
            }],
            tokens: Vec::new(),
            prompt_logprobs: Vec::new(),
            finish: Finish {
                reason: FinishReason::ToolCalls,
                usage: ReplyUsage {
                    prompt_tokens: 10,
                    cached_tokens: 4,
                    completion_tokens: 3,
                    reasoning_tokens: 0,
                    speculation: Some(wick_engine::speculative::SpeculationUsage {
                        drafted: 8,
                        accepted: 5,
                    }),
                },
            },
        };
        let meta = MessageMeta {
            id: "msg_1".into(),
            model: "m".into(),
            prompt_tokens: 10,
            pinned_prefix: 0,
        };
        let body = whole(reply, meta);
        assert_eq!(body["stop_reason"], "tool_use");
        assert_eq!(body["content"][1]["input"], json!({"a": 1}));
        assert_eq!(body["usage"]["input_tokens"], 6);
        assert_eq!(body["usage"]["cache_read_input_tokens"], 4);
        assert_eq!(
            body["usage"]["speculation"],
            json!({"drafted": 8, "accepted": 5})
        );
        let plain = usage(&ReplyUsage::default(), 0);
        assert!(plain.get("speculation").is_none(), "{plain}");
    }

    #[test]
    fn usage_adds_up_to_the_prompt_with_breakpoints() {
        let u = ReplyUsage {
            prompt_tokens: 100,
            cached_tokens: 40,
            ..ReplyUsage::default()
        };
        let v = usage(&u, 90);
        assert_eq!(v["cache_read_input_tokens"], 40);
        assert_eq!(v["cache_creation_input_tokens"], 50);
        assert_eq!(v["input_tokens"], 10);
        // A breakpoint prefix already cached whole writes nothing.
        let v = usage(
            &ReplyUsage {
                cached_tokens: 95,
                ..u
            },
            90,
        );
        assert_eq!(v["cache_creation_input_tokens"], 0);
        assert_eq!(v["input_tokens"], 5);
    }
}
