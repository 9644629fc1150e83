//! From generated text to a chat reply: [`ReplyParser`] runs the `<think>` splitter first and
//! the tool-call parser on what is left, as the text streams; [`ReplyAssembler`] collects its
//! events into a whole message.
use wick_chat::reasoning::{ReasoningSplitter, Segment};
use wick_chat::tool_call::{RepairKind, StreamEvent, ToolCallStream, ToolFormat, ToolSpec};

use crate::metrics::Metrics;
use crate::openai::chat::{FunctionOut, ToolCallOut};

/// A piece of the reply, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyEvent {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A tool call starts.
    CallStart {
        /// Position among the reply's calls.
        index: usize,
        /// `call_…`.
        id: String,
        /// Tool name.
        name: String,
    },
    /// A piece of a call's arguments JSON.
    CallArguments {
        /// The call.
        index: usize,
        /// The piece.
        delta: String,
    },
    /// A call is complete.
    CallEnd {
        /// The call.
        index: usize,
        /// Tool name.
        name: String,
        /// Repairs needed to parse it.
        repairs: Vec<RepairKind>,
    },
}

/// How a reply is parsed.
#[derive(Debug, Clone)]
pub struct ReplyOptions {
    /// Split `<think>` reasoning; `Some(true)` when the prompt opened the block.
    pub reasoning: Option<bool>,
    /// Parse tool calls in this format, validated against these tools.
    pub tools: Option<(ToolFormat, Vec<ToolSpec>)>,
    /// Keep more than the first call.
    pub parallel_tool_calls: bool,
}

/// The streaming reply parser of one request.
#[derive(Debug)]
pub struct ReplyParser {
    splitter: Option<ReasoningSplitter>,
    tools: Option<ToolCallStream>,
    parallel: bool,
    names: Vec<String>,
    ended: usize,
}

impl ReplyParser {
    /// A parser for `options`.
    pub fn new(options: ReplyOptions) -> Self {
        ReplyParser {
            splitter: options.reasoning.map(ReasoningSplitter::new),
            tools: options
                .tools
                .map(|(format, specs)| ToolCallStream::new(format, &specs)),
            parallel: options.parallel_tool_calls,
            names: Vec::new(),
            ended: 0,
        }
    }

    /// Feeds generated text; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        let segments = match &mut self.splitter {
            Some(s) => s.push(text),
            None => vec![Segment::Content(text.to_string())],
        };
        let mut out = Vec::new();
        for segment in segments {
            self.route(segment, &mut out);
        }
        out
    }

    /// Ends the reply: releases everything held.
    pub fn finish(&mut self) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        if let Some(s) = &mut self.splitter {
            for segment in s.flush() {
                self.route(segment, &mut out);
            }
        }
        if let Some(t) = &mut self.tools {
            let events = t.finish();
            for failure in t.failures() {
                tracing::debug!(error = %failure.error, "tool-call markup kept as content");
            }
            self.convert(events, &mut out);
        }
        out
    }

    /// Whether generating more is pointless: parallel calls are off and a call is complete.
    pub fn call_limit_reached(&self) -> bool {
        !self.parallel && self.ended > 0
    }

    fn route(&mut self, segment: Segment, out: &mut Vec<ReplyEvent>) {
        match segment {
            Segment::Reasoning(text) => out.push(ReplyEvent::Reasoning(text)),
            Segment::Content(text) => match &mut self.tools {
                Some(t) => {
                    let events = t.push(&text);
                    self.convert(events, out);
                }
                None if text.is_empty() => {}
                None => out.push(ReplyEvent::Content(text)),
            },
        }
    }

    fn convert(&mut self, events: Vec<StreamEvent>, out: &mut Vec<ReplyEvent>) {
        let parallel = self.parallel;
        let keep = |index: usize| parallel || index == 0;
        for event in events {
            match event {
                StreamEvent::Content(t) => out.push(ReplyEvent::Content(t)),
                StreamEvent::Reasoning(t) => out.push(ReplyEvent::Reasoning(t)),
                StreamEvent::CallStart { index, id, name } if keep(index) => {
                    self.names.push(name.clone());
                    out.push(ReplyEvent::CallStart { index, id, name });
                }
                StreamEvent::CallArguments { index, delta } if keep(index) => {
                    out.push(ReplyEvent::CallArguments { index, delta });
                }
                StreamEvent::CallEnd { index, repairs } if keep(index) => {
                    self.ended += 1;
                    let name = self.names.get(index).cloned().unwrap_or_default();
                    out.push(ReplyEvent::CallEnd {
                        index,
                        name,
                        repairs,
                    });
                }
                StreamEvent::CallStart { name, .. } => {
                    tracing::info!(tool = %name, "dropped a second tool call: parallel_tool_calls is false");
                }
                _ => {}
            }
        }
    }
}

/// Logs and counts a finished call (every repair is recorded, never silent).
pub fn record_call(metrics: &Metrics, name: &str, repairs: &[RepairKind]) {
    metrics.record_tool_call();
    if !repairs.is_empty() {
        let kinds: Vec<&str> = repairs.iter().map(|r| r.as_str()).collect();
        tracing::info!(tool = %name, repairs = ?kinds, "tool call repaired");
        for r in repairs {
            metrics.record_repair(r.as_str());
        }
    }
}

/// Collects reply events into a message.
#[derive(Debug, Default)]
pub struct ReplyAssembler {
    /// Answer text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Calls in order.
    pub calls: Vec<ToolCallOut>,
}

impl ReplyAssembler {
    /// Applies one event.
    pub fn apply(&mut self, event: &ReplyEvent) {
        match event {
            ReplyEvent::Content(t) => self.content.push_str(t),
            ReplyEvent::Reasoning(t) => self.reasoning.push_str(t),
            ReplyEvent::CallStart { id, name, .. } => self.calls.push(ToolCallOut {
                id: id.clone(),
                kind: "function",
                function: FunctionOut {
                    name: name.clone(),
                    arguments: String::new(),
                },
                wick_repairs: Vec::new(),
            }),
            ReplyEvent::CallArguments { index, delta } => {
                if let Some(call) = self.call_mut(*index) {
                    call.function.arguments.push_str(delta);
                }
            }
            ReplyEvent::CallEnd { index, repairs, .. } => {
                if let Some(call) = self.call_mut(*index) {
                    call.wick_repairs = repairs.iter().map(|r| r.as_str()).collect();
                }
            }
        }
    }

    fn call_mut(&mut self, index: usize) -> Option<&mut ToolCallOut> {
        // Calls arrive in index order, so the index is the position.
        self.calls.get_mut(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<ToolSpec> {
        ToolSpec::list_from_openai(&[json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})])
        .unwrap()
    }

    fn run(options: ReplyOptions, pieces: &[&str]) -> (Vec<ReplyEvent>, ReplyAssembler) {
        let mut parser = ReplyParser::new(options);
        let mut events = Vec::new();
        for p in pieces {
            events.extend(parser.push(p));
        }
        events.extend(parser.finish());
        let mut asm = ReplyAssembler::default();
        for e in &events {
            asm.apply(e);
        }
        (events, asm)
    }

    #[test]
    fn think_split_then_tool_parse() {
        let options = ReplyOptions {
            reasoning: Some(true),
            tools: Some((ToolFormat::HermesJson, weather())),
            parallel_tool_calls: true,
        };
        let (_, asm) = run(
            options,
            &[
                "I should check the weather.\n</th",
                "ink>\n\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", ",
                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ],
        );
        assert_eq!(asm.reasoning, "I should check the weather.");
        assert_eq!(asm.content, "Let me look.");
        assert_eq!(asm.calls.len(), 1);
        assert_eq!(asm.calls[0].function.name, "get_weather");
        assert_eq!(asm.calls[0].function.arguments, r#"{"city":"Paris"}"#);
        assert!(asm.calls[0].wick_repairs.is_empty());
    }

    #[test]
    fn bare_json_call_is_repaired_and_recorded() {
        let options = ReplyOptions {
            reasoning: None,
            tools: Some((ToolFormat::HermesJson, weather())),
            parallel_tool_calls: true,
        };
        let (_, asm) = run(
            options,
            &["{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"],
        );
        assert_eq!(asm.calls.len(), 1);
        assert_eq!(asm.calls[0].wick_repairs, vec!["bare_json"]);
        assert_eq!(asm.content, "");
    }

    #[test]
    fn only_the_first_call_without_parallel_calls() {
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}\n</tool_call>\n";
        let two = format!("{call}{}", call.replace("\"A\"", "\"B\""));
        let mut parser = ReplyParser::new(ReplyOptions {
            reasoning: None,
            tools: Some((ToolFormat::HermesJson, weather())),
            parallel_tool_calls: false,
        });
        let mut events = parser.push(&two);
        assert!(parser.call_limit_reached());
        events.extend(parser.finish());
        let starts = events
            .iter()
            .filter(|e| matches!(e, ReplyEvent::CallStart { .. }))
            .count();
        assert_eq!(starts, 1);
    }

    #[test]
    fn plain_text_passes_through() {
        let options = ReplyOptions {
            reasoning: None,
            tools: None,
            parallel_tool_calls: true,
        };
        let (events, asm) = run(options, &["Hello", " <think>not split</think>"]);
        assert_eq!(asm.content, "Hello <think>not split</think>");
        assert!(events.iter().all(|e| matches!(e, ReplyEvent::Content(_))));
    }
}
