//! From generated text to reply parts: the `<think>` splitter runs first and the tool-call
//! parser on what is left, as the text streams.
use wick_chat::reasoning::{ReasoningSplitter, Segment};
use wick_chat::tool_call::{StreamEvent as Part, ToolCallStream, ToolFormat, ToolSpec};

/// The reasoning tag a reply may open with when the template does not announce one.
const THINK_OPEN: &str = "<think>";

/// Whether and how `<think>` reasoning is split from the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningMode {
    /// Never (raw completions).
    Off,
    /// The chat template uses `<think>` tags; `starts_in_thinking` when the prompt opened the
    /// block.
    Template {
        /// The prompt ends inside an open `<think>` block.
        starts_in_thinking: bool,
    },
    /// The template says nothing of reasoning: split only if the reply itself opens with
    /// `<think>` (leading whitespace allowed), so a model that thinks anyway does not leak its
    /// reasoning into the answer.
    Detect,
}

/// How a reply is parsed.
#[derive(Debug, Clone)]
pub struct ReplyOptions {
    /// `<think>` splitting.
    pub reasoning: ReasoningMode,
    /// Parse tool calls in this format, validated against these tools.
    pub tools: Option<(ToolFormat, Vec<ToolSpec>)>,
    /// Keep more than the first call.
    pub parallel_tool_calls: bool,
}

impl ReplyOptions {
    /// Plain text: no reasoning split, no tool calls (raw completions).
    pub fn plain() -> Self {
        ReplyOptions {
            reasoning: ReasoningMode::Off,
            tools: None,
            parallel_tool_calls: true,
        }
    }

    /// Whether the engine must keep special tokens' text (tags the parsers look for; a
    /// template that announces no tags has none that are special tokens).
    pub fn needs_special_text(&self) -> bool {
        matches!(self.reasoning, ReasoningMode::Template { .. }) || self.tools.is_some()
    }
}

/// The streaming reply parser of one request.
#[derive(Debug)]
pub struct ReplyParser {
    splitter: Option<ReasoningSplitter>,
    /// [`ReasoningMode::Detect`] before the reply's start is known: the text so far.
    sniffed: Option<String>,
    tools: Option<ToolCallStream>,
    parallel: bool,
    names: Vec<String>,
    ended: usize,
}

impl ReplyParser {
    /// A parser for `options`.
    pub fn new(options: ReplyOptions) -> Self {
        let (splitter, sniffed) = match options.reasoning {
            ReasoningMode::Off => (None, None),
            ReasoningMode::Template { starts_in_thinking } => {
                (Some(ReasoningSplitter::new(starts_in_thinking)), None)
            }
            ReasoningMode::Detect => (None, Some(String::new())),
        };
        ReplyParser {
            splitter,
            sniffed,
            tools: options
                .tools
                .map(|(format, specs)| ToolCallStream::new(format, &specs)),
            parallel: options.parallel_tool_calls,
            names: Vec::new(),
            ended: 0,
        }
    }

    /// Feeds generated text; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        let Some(text) = self.sniff(text) else {
            return Vec::new();
        };
        let segments = match &mut self.splitter {
            Some(s) => s.push(&text),
            None => vec![Segment::Content(text)],
        };
        let mut out = Vec::new();
        for segment in segments {
            self.route(segment, &mut out);
        }
        out
    }

    /// Ends the reply: releases everything held.
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        if let Some(text) = self.sniffed.take() {
            self.route(Segment::Content(text), &mut out);
        }
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

    /// Whether the text so far ends inside a reasoning block.
    pub fn in_reasoning(&self) -> bool {
        self.splitter.as_ref().is_some_and(|s| s.in_reasoning())
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.names.len()
    }

    /// The name of call `index` (empty if there is none).
    pub fn call_name(&self, index: usize) -> &str {
        self.names.get(index).map_or("", String::as_str)
    }

    /// In [`ReasoningMode::Detect`], holds text until the reply's start shows whether it
    /// opens a `<think>` block; returns the text to parse now (`None`: still undecided).
    fn sniff(&mut self, text: &str) -> Option<String> {
        let Some(held) = &mut self.sniffed else {
            return Some(text.to_string());
        };
        held.push_str(text);
        let start = held.trim_start();
        if start.starts_with(THINK_OPEN) {
            tracing::debug!("the reply opens a <think> block: splitting reasoning");
            self.splitter = Some(ReasoningSplitter::new(false));
            // The whitespace before the block is neither reasoning nor answer.
            let start = start.to_string();
            self.sniffed = None;
            return Some(start);
        } else if THINK_OPEN.starts_with(start) {
            return None;
        }
        self.sniffed.take()
    }

    fn route(&mut self, segment: Segment, out: &mut Vec<Part>) {
        match segment {
            Segment::Reasoning(text) => out.push(Part::Reasoning(text)),
            Segment::Content(text) => match &mut self.tools {
                Some(t) => {
                    let events = t.push(&text);
                    self.convert(events, out);
                }
                None if text.is_empty() => {}
                None => out.push(Part::Content(text)),
            },
        }
    }

    fn convert(&mut self, events: Vec<Part>, out: &mut Vec<Part>) {
        let parallel = self.parallel;
        let keep = |index: usize| parallel || index == 0;
        for event in events {
            match event {
                Part::CallStart { index, id, name } if keep(index) => {
                    self.names.push(name.clone());
                    out.push(Part::CallStart { index, id, name });
                }
                Part::CallArguments { index, .. } | Part::CallEnd { index, .. } if !keep(index) => {
                }
                Part::CallStart { name, .. } => {
                    tracing::info!(tool = %name, "dropped a second tool call: parallel_tool_calls is false");
                }
                Part::CallEnd { .. } => {
                    self.ended += 1;
                    out.push(event);
                }
                Part::Content(t) if t.is_empty() => {}
                other => out.push(other),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::CollectedCall;
    use serde_json::json;

    fn weather() -> Vec<ToolSpec> {
        ToolSpec::list_from_openai(&[json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})])
        .unwrap()
    }

    /// Content, reasoning and calls of a reply fed in `pieces`.
    struct Parsed {
        parts: Vec<Part>,
        content: String,
        reasoning: String,
        calls: Vec<CollectedCall>,
    }

    fn run(options: ReplyOptions, pieces: &[&str]) -> Parsed {
        let mut parser = ReplyParser::new(options);
        let mut parts = Vec::new();
        for p in pieces {
            parts.extend(parser.push(p));
        }
        parts.extend(parser.finish());
        let mut out = Parsed {
            parts: parts.clone(),
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
        };
        for part in parts {
            match part {
                Part::Content(t) => out.content.push_str(&t),
                Part::Reasoning(t) => out.reasoning.push_str(&t),
                Part::CallStart { id, name, .. } => out.calls.push(CollectedCall {
                    id,
                    name,
                    arguments: String::new(),
                    repairs: Vec::new(),
                }),
                Part::CallArguments { index, delta } => out.calls[index].arguments.push_str(&delta),
                Part::CallEnd { index, repairs } => out.calls[index].repairs = repairs,
            }
        }
        out
    }

    fn options(reasoning: ReasoningMode, tools: bool) -> ReplyOptions {
        ReplyOptions {
            reasoning,
            tools: tools.then(|| (ToolFormat::HermesJson, weather())),
            parallel_tool_calls: true,
        }
    }

    #[test]
    fn think_split_then_tool_parse() {
        let got = run(
            options(
                ReasoningMode::Template {
                    starts_in_thinking: true,
                },
                true,
            ),
            &[
                "I should check the weather.\n</th",
                "ink>\n\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", ",
                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ],
        );
        assert_eq!(got.reasoning, "I should check the weather.");
        assert_eq!(got.content, "Let me look.");
        assert_eq!(got.calls.len(), 1);
        assert_eq!(got.calls[0].name, "get_weather");
        assert_eq!(got.calls[0].arguments, r#"{"city":"Paris"}"#);
        assert!(got.calls[0].repairs.is_empty());
    }

    #[test]
    fn bare_json_call_is_repaired_and_recorded() {
        let got = run(
            options(ReasoningMode::Off, true),
            &["{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"],
        );
        assert_eq!(got.calls.len(), 1);
        assert_eq!(
            got.calls[0].repairs,
            vec![wick_chat::tool_call::RepairKind::BareJson]
        );
        assert_eq!(got.content, "");
    }

    #[test]
    fn only_the_first_call_without_parallel_calls() {
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}\n</tool_call>\n";
        let two = format!("{call}{}", call.replace("\"A\"", "\"B\""));
        let mut parser = ReplyParser::new(ReplyOptions {
            parallel_tool_calls: false,
            ..options(ReasoningMode::Off, true)
        });
        let mut parts = parser.push(&two);
        assert!(parser.call_limit_reached());
        parts.extend(parser.finish());
        let starts = parts
            .iter()
            .filter(|e| matches!(e, Part::CallStart { .. }))
            .count();
        assert_eq!(starts, 1);
        assert_eq!(parser.calls(), 1);
    }

    #[test]
    fn plain_text_passes_through() {
        let got = run(
            ReplyOptions::plain(),
            &["<think>a", " thought</think>Hello"],
        );
        assert_eq!(got.content, "<think>a thought</think>Hello");
        assert!(got.parts.iter().all(|e| matches!(e, Part::Content(_))));
    }

    #[test]
    fn detected_reasoning_is_split_when_the_reply_opens_with_think() {
        // The tag may arrive in pieces, after whitespace.
        let got = run(
            options(ReasoningMode::Detect, false),
            &["\n<th", "ink>", "plan it\n</think>\n\nThe answer."],
        );
        assert_eq!(got.reasoning, "plan it");
        assert_eq!(got.content, "The answer.");
    }

    #[test]
    fn detection_leaves_think_tags_inside_an_answer_alone() {
        let got = run(
            options(ReasoningMode::Detect, false),
            &["Use <th", "ink> tags like <think>this</think>."],
        );
        assert_eq!(got.reasoning, "");
        assert_eq!(got.content, "Use <think> tags like <think>this</think>.");
        // A reply shorter than the tag is released at the end.
        let short = run(options(ReasoningMode::Detect, false), &["<th"]);
        assert_eq!(short.content, "<th");
    }
}
