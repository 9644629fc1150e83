//! The incremental parser: text deltas in, content / reasoning / tool-call events out.
//!
//! The stream keeps everything it was given and a position before which everything is decided.
//! In prose it emits text as soon as it cannot be the start of markup: a tail that could begin a
//! marker is held back, and so is trailing whitespace, because whitespace touching a call block
//! belongs to the markup. At a marker the format's grammar decides (see [`super::grammar`]);
//! XML-style and Gemma 4 calls stream one argument at a time, JSON calls whole once their JSON
//! is complete. Every decision is prefix-stable, so the events do not depend on how the text was
//! chunked, and [`super::parse`] is this stream fed the whole text.

use serde_json::{Map, Value};

use super::grammar::{self, BodyGrammar, BodyStep, Opening, ParsedCall};
use super::repair::{record, RepairKind};
use super::scan::{leading_ws, prefix_of, Prefix};
use super::schema::{decode_argument, ToolBox};
use super::{gemma4, grammar::ArgText, hermes_json, CallIdSource, ParseFailure, ParseOutcome};
use super::{ToolCall, ToolFormat, ToolSpec};

/// What the stream reports as text arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// Prose that is safe to show (`delta.content`).
    Content(String),
    /// Reasoning text (`delta.reasoning`; Gemma 4's thought channel).
    Reasoning(String),
    /// A call begins: the first `delta.tool_calls` chunk, with its id and name.
    CallStart {
        /// Position of the call in the reply (`tool_calls[].index`).
        index: usize,
        /// `call_` + 8 hex digits.
        id: String,
        /// The tool name.
        name: String,
    },
    /// A piece of a call's `function.arguments` JSON text. The pieces of one call concatenate
    /// to its final `arguments_json`.
    CallArguments {
        /// The call's index.
        index: usize,
        /// The next piece.
        delta: String,
    },
    /// A call is complete; its arguments are final.
    CallEnd {
        /// The call's index.
        index: usize,
        /// The repairs the call needed, in order.
        repairs: Vec<RepairKind>,
    },
}

/// A pending decision is retried at once while the undecided text is shorter than this; beyond
/// it only after the text has grown by an eighth, which keeps huge arguments near linear time.
const EAGER_RETRY_BYTES: usize = 4096;

/// The incremental tool-call parser of one reply.
///
/// ```
/// use wick_chat::tool_call::{CallIdSource, StreamEvent, ToolCallStream, ToolFormat};
///
/// let mut stream = ToolCallStream::with_ids(ToolFormat::QwenXml, &[], CallIdSource::counter());
/// let mut events = stream.push("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa");
/// events.extend(stream.push("ris\n</parameter>\n</function>\n</tool_call>"));
/// events.extend(stream.finish());
/// assert_eq!(events, vec![
///     StreamEvent::Content("Checking.".into()),
///     StreamEvent::CallStart { index: 0, id: "call_00000000".into(), name: "get_weather".into() },
///     StreamEvent::CallArguments { index: 0, delta: r#"{"city":"Paris""#.into() },
///     StreamEvent::CallArguments { index: 0, delta: "}".into() },
///     StreamEvent::CallEnd { index: 0, repairs: vec![] },
/// ]);
/// ```
#[derive(Debug)]
pub struct ToolCallStream {
    format: ToolFormat,
    tools: Vec<ToolSpec>,
    ids: CallIdSource,
    /// Everything pushed so far.
    text: String,
    /// Everything before this byte offset is decided.
    pos: usize,
    mode: Mode,
    /// Whitespace at `pos` follows markup and is dropped.
    after_markup: bool,
    /// A bare JSON call may start at the next non-whitespace character.
    json_start: bool,
    /// The last block was bare JSON calls: a comma may separate the next one.
    after_bare: bool,
    /// `text.len()` must reach this before a pending decision is retried.
    retry_at: usize,
    finished: bool,
    outcome: ParseOutcome,
}

#[derive(Debug)]
enum Mode {
    Prose,
    Call(OpenCall),
    /// Inside a reasoning channel; `named` once the channel's name line is handled.
    Reasoning {
        named: bool,
    },
}

/// A call whose arguments are being read.
#[derive(Debug)]
struct OpenCall {
    index: usize,
    id: String,
    name: String,
    grammar: BodyGrammar,
    arguments: Map<String, Value>,
    json: String,
    repairs: Vec<RepairKind>,
}

/// Whether the main loop goes on or waits for text.
enum Flow {
    Continue,
    Wait,
}

impl ToolCallStream {
    /// A stream for `format` that validates names against `tools` (none: any name), with
    /// random call ids.
    pub fn new(format: ToolFormat, tools: &[ToolSpec]) -> Self {
        ToolCallStream::with_ids(format, tools, CallIdSource::random())
    }

    /// A stream taking call ids from `ids`.
    pub fn with_ids(format: ToolFormat, tools: &[ToolSpec], ids: CallIdSource) -> Self {
        ToolCallStream {
            format,
            tools: tools.to_vec(),
            ids,
            text: String::new(),
            pos: 0,
            mode: Mode::Prose,
            after_markup: false,
            json_start: true,
            after_bare: false,
            retry_at: 0,
            finished: false,
            outcome: ParseOutcome {
                format,
                content: String::new(),
                reasoning: String::new(),
                calls: Vec::new(),
                failures: Vec::new(),
            },
        }
    }

    /// Feeds the next piece of decoded text (special tokens kept) and returns what became
    /// certain. Text pushed after [`finish`](Self::finish) is ignored.
    pub fn push(&mut self, delta: &str) -> Vec<StreamEvent> {
        if self.finished {
            return Vec::new();
        }
        self.text.push_str(delta);
        if self.text.len() < self.retry_at {
            return Vec::new();
        }
        self.advance(false)
    }

    /// Ends the reply: decides everything still held. A block that does not parse is released
    /// as content (fail-soft); a call cut off by the end is closed with what it has.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        self.advance(true)
    }

    /// Markup released as content so far, and why.
    pub fn failures(&self) -> &[ParseFailure] {
        &self.outcome.failures
    }

    /// The whole outcome (finishing the stream first if needed).
    pub fn into_outcome(mut self) -> ParseOutcome {
        self.finish();
        self.outcome
    }

    fn advance(&mut self, at_end: bool) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        loop {
            let flow = match self.mode {
                Mode::Prose => self.prose(at_end, &mut events),
                Mode::Call(_) => self.call(at_end, &mut events),
                Mode::Reasoning { named } => self.reasoning(named, at_end, &mut events),
            };
            if let Flow::Wait = flow {
                break;
            }
        }
        let pending = self.text.len() - self.pos;
        self.retry_at = if pending > EAGER_RETRY_BYTES {
            self.text.len() + pending / 8
        } else {
            0
        };
        events
    }

    fn emit_content(&mut self, text: &str, events: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        self.outcome.content.push_str(text);
        match events.last_mut() {
            Some(StreamEvent::Content(previous)) => previous.push_str(text),
            _ => events.push(StreamEvent::Content(text.to_string())),
        }
    }

    fn emit_reasoning(&mut self, text: &str, events: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        self.outcome.reasoning.push_str(text);
        match events.last_mut() {
            Some(StreamEvent::Reasoning(previous)) => previous.push_str(text),
            _ => events.push(StreamEvent::Reasoning(text.to_string())),
        }
    }

    /// Whether byte `at` of the text starts a line (only spaces or tabs before it on its line).
    fn at_line_start(&self, at: usize) -> bool {
        let before = self.text[..at].trim_end_matches([' ', '\t']);
        before.is_empty() || before.ends_with('\n')
    }

    /// Prose: emit what cannot be markup, stop at a marker and open its block.
    fn prose(&mut self, at_end: bool, events: &mut Vec<StreamEvent>) -> Flow {
        if self.after_markup {
            self.pos += leading_ws(&self.text[self.pos..]);
            if self.pos == self.text.len() {
                return Flow::Wait;
            }
            self.after_markup = false;
            // `{call}, {call}`: the comma belongs to the calls' markup.
            if std::mem::take(&mut self.after_bare) && self.text[self.pos..].starts_with(',') {
                self.pos += 1;
                self.after_markup = true;
                return Flow::Continue;
            }
        }
        let rest_at = self.pos;
        let rest = &self.text[rest_at..];
        if self.json_start {
            let ws = leading_ws(rest);
            match hermes_json::json_start_block(&rest[ws..], self.format.json_start(), at_end) {
                None => return Flow::Wait,
                Some(Some(block)) => return self.open_block(block, 0, ws, at_end, events),
                Some(None) => self.json_start = false,
            }
        }
        let rest = &self.text[rest_at..];
        let markers = self.format.markers();
        let mut hold = rest.len();
        let mut found = None;
        'scan: for (offset, byte) in rest.bytes().enumerate() {
            for marker in markers {
                if marker.text.as_bytes()[0] != byte
                    || (marker.line_start && !self.at_line_start(rest_at + offset))
                {
                    continue;
                }
                match prefix_of(&rest[offset..], marker.text) {
                    Prefix::Full => {
                        found = Some((offset, marker.block));
                        break 'scan;
                    }
                    Prefix::Partial if !at_end => {
                        hold = offset;
                        break 'scan;
                    }
                    _ => {}
                }
            }
        }
        match found {
            Some((offset, block)) => {
                let kept = rest[..offset].trim_end().len();
                self.open_block(block, kept, offset, at_end, events)
            }
            None => {
                let safe = if at_end {
                    rest.len()
                } else {
                    rest[..hold].trim_end().len()
                };
                let emitted = rest[..safe].to_string();
                self.pos += safe;
                self.emit_content(&emitted, events);
                if at_end {
                    self.pos = self.text.len();
                }
                Flow::Wait
            }
        }
    }

    /// Opens a `block` whose marker is at `marker` bytes after `pos`; the prose before it is
    /// `kept` bytes plus whitespace that the block absorbs if it is markup.
    fn open_block(
        &mut self,
        block: grammar::Block,
        kept: usize,
        marker: usize,
        at_end: bool,
        events: &mut Vec<StreamEvent>,
    ) -> Flow {
        if kept > 0 {
            let prose = self.text[self.pos..self.pos + kept].to_string();
            self.emit_content(&prose, events);
            self.pos += kept;
            self.json_start = false;
        }
        let gap = marker - kept;
        let start = self.pos + gap;
        let tools = ToolBox::accepting_unknown(&self.tools);
        let opening = match grammar::open(block, &self.text[start..], at_end, tools) {
            // A grammar must decide at the end; a refusal is the safe answer.
            Opening::NeedMore if at_end => Opening::Reject {
                len: self.text.len() - start,
                error: super::ToolCallError::UnsupportedPayload {
                    format: self.format.name(),
                    reason: "incomplete markup".to_string(),
                },
            },
            opening => opening,
        };
        match opening {
            Opening::NeedMore => Flow::Wait,
            Opening::Reject { len, error } => {
                let len = len.max(1).min(self.text.len() - start);
                let len = ceil_char_boundary(&self.text[start..], len);
                let released = self.text[self.pos..start + len].to_string();
                self.emit_content(&released, events);
                self.outcome.failures.push(ParseFailure {
                    offset: start,
                    error,
                });
                self.pos = start + len;
                // JSON that is not a call may be followed by one that is.
                self.json_start = block == grammar::Block::BareJson;
                Flow::Continue
            }
            Opening::Call {
                name,
                body,
                grammar,
            } => {
                let index = self.outcome.calls.len();
                let id = self.ids.next_id();
                events.push(StreamEvent::CallStart {
                    index,
                    id: id.clone(),
                    name: name.clone(),
                });
                // Reserve the call's slot so that indexes stay in order.
                self.outcome.calls.push(ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: Value::Object(Map::new()),
                    arguments_json: String::new(),
                    repairs: Vec::new(),
                });
                let repairs = if tools.offers(&name) {
                    Vec::new()
                } else {
                    vec![RepairKind::UnknownTool]
                };
                self.mode = Mode::Call(OpenCall {
                    index,
                    id,
                    name,
                    grammar,
                    arguments: Map::new(),
                    json: String::new(),
                    repairs,
                });
                self.pos = start + body.max(1);
                Flow::Continue
            }
            Opening::Calls { calls, len } => {
                let offered: Vec<bool> = calls.iter().map(|c| tools.offers(&c.name)).collect();
                for (mut call, offered) in calls.into_iter().zip(offered) {
                    if !offered {
                        record(&mut call.repairs, RepairKind::UnknownTool);
                    }
                    self.emit_whole_call(call, events);
                }
                self.pos = start + len.max(1);
                self.after_markup = true;
                self.json_start = true;
                self.after_bare = block == grammar::Block::BareJson;
                Flow::Continue
            }
            Opening::Reasoning { body } => {
                self.pos = start + body.max(1);
                self.mode = Mode::Reasoning { named: false };
                Flow::Continue
            }
        }
    }

    /// Emits a call that was parsed whole: start, all arguments, end.
    fn emit_whole_call(&mut self, call: ParsedCall, events: &mut Vec<StreamEvent>) {
        let index = self.outcome.calls.len();
        let id = self.ids.next_id();
        let arguments = Value::Object(call.arguments);
        let arguments_json = arguments.to_string();
        events.push(StreamEvent::CallStart {
            index,
            id: id.clone(),
            name: call.name.clone(),
        });
        events.push(StreamEvent::CallArguments {
            index,
            delta: arguments_json.clone(),
        });
        events.push(StreamEvent::CallEnd {
            index,
            repairs: call.repairs.clone(),
        });
        self.outcome.calls.push(ToolCall {
            id,
            name: call.name,
            arguments,
            arguments_json,
            repairs: call.repairs,
        });
    }

    /// Inside an incremental call: read arguments until the call ends.
    fn call(&mut self, at_end: bool, events: &mut Vec<StreamEvent>) -> Flow {
        let Mode::Call(open) = &mut self.mode else {
            return Flow::Continue;
        };
        let rest = &self.text[self.pos..];
        let step = match grammar::step(open.grammar, rest, at_end, open.arguments.len()) {
            BodyStep::NeedMore if at_end => BodyStep::End {
                len: rest.len(),
                repair: Some(RepairKind::UnclosedBlock),
            },
            step => step,
        };
        match step {
            BodyStep::NeedMore => Flow::Wait,
            BodyStep::Arg {
                key,
                value,
                len,
                repairs,
            } => {
                self.pos += ceil_char_boundary(rest, len.max(1));
                for kind in repairs {
                    record(&mut open.repairs, kind);
                }
                if open.arguments.contains_key(&key) {
                    record(&mut open.repairs, RepairKind::DuplicateKey);
                    return Flow::Continue;
                }
                let value = match value {
                    ArgText::Raw(raw) => {
                        let tools = ToolBox::new(&self.tools);
                        let (value, repairs) = decode_argument(tools.find(&open.name), &key, &raw);
                        for kind in repairs {
                            record(&mut open.repairs, kind);
                        }
                        value
                    }
                    ArgText::Json(value) => value,
                };
                let mut delta = String::from(if open.arguments.is_empty() { "{" } else { "," });
                delta.push_str(&Value::String(key.clone()).to_string());
                delta.push(':');
                delta.push_str(&value.to_string());
                open.arguments.insert(key, value);
                open.json.push_str(&delta);
                events.push(StreamEvent::CallArguments {
                    index: open.index,
                    delta,
                });
                Flow::Continue
            }
            BodyStep::Skip { len, repair } => {
                self.pos += ceil_char_boundary(rest, len.max(1));
                if let Some(kind) = repair {
                    record(&mut open.repairs, kind);
                }
                Flow::Continue
            }
            BodyStep::End { len, repair } => {
                self.pos += ceil_char_boundary(rest, len);
                if let Some(kind) = repair {
                    record(&mut open.repairs, kind);
                }
                let Mode::Call(mut open) = std::mem::replace(&mut self.mode, Mode::Prose) else {
                    return Flow::Continue;
                };
                let close = if open.arguments.is_empty() { "{}" } else { "}" };
                open.json.push_str(close);
                events.push(StreamEvent::CallArguments {
                    index: open.index,
                    delta: close.to_string(),
                });
                events.push(StreamEvent::CallEnd {
                    index: open.index,
                    repairs: open.repairs.clone(),
                });
                self.outcome.calls[open.index] = ToolCall {
                    id: open.id,
                    name: open.name,
                    arguments: Value::Object(open.arguments),
                    arguments_json: open.json,
                    repairs: open.repairs,
                };
                self.after_markup = true;
                self.json_start = true;
                Flow::Continue
            }
        }
    }

    /// Inside a reasoning channel: strip its name line, emit text up to the channel close.
    fn reasoning(&mut self, named: bool, at_end: bool, events: &mut Vec<StreamEvent>) -> Flow {
        let rest = &self.text[self.pos..];
        if !named {
            match prefix_of(rest, gemma4::CHANNEL_NAME) {
                Prefix::Full => self.pos += gemma4::CHANNEL_NAME.len(),
                Prefix::Partial if !at_end => return Flow::Wait,
                _ if rest.is_empty() && !at_end => return Flow::Wait,
                _ => {}
            }
            self.mode = Mode::Reasoning { named: true };
            return Flow::Continue;
        }
        if let Some(close) = rest.find(gemma4::CHANNEL_CLOSE) {
            let text = rest[..close].to_string();
            self.emit_reasoning(&text, events);
            self.pos += close + gemma4::CHANNEL_CLOSE.len();
            self.mode = Mode::Prose;
            self.after_markup = true;
            return Flow::Continue;
        }
        let safe = if at_end {
            rest.len()
        } else {
            rest.len() - partial_suffix(rest, gemma4::CHANNEL_CLOSE)
        };
        let text = rest[..safe].to_string();
        self.emit_reasoning(&text, events);
        self.pos += safe;
        if at_end {
            self.mode = Mode::Prose;
        }
        Flow::Wait
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&len| {
            text.is_char_boundary(text.len() - len) && marker.starts_with(&text[text.len() - len..])
        })
        .unwrap_or(0)
}

/// `len` moved forward to a character boundary of `text` (grammars count bytes of ASCII
/// markup, so this only guards against a grammar bug splitting a character).
fn ceil_char_boundary(text: &str, len: usize) -> usize {
    let mut len = len.min(text.len());
    while !text.is_char_boundary(len) {
        len += 1;
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(format: ToolFormat, chunks: &[&str]) -> Vec<StreamEvent> {
        let mut stream = ToolCallStream::with_ids(format, &[], CallIdSource::counter());
        let mut events = Vec::new();
        for chunk in chunks {
            events.extend(stream.push(chunk));
        }
        events.extend(stream.finish());
        events
    }

    #[test]
    fn prose_streams_live_and_holds_partial_markers() {
        let mut stream = ToolCallStream::new(ToolFormat::HermesJson, &[]);
        assert_eq!(
            stream.push("Hello wor"),
            vec![StreamEvent::Content("Hello wor".into())]
        );
        assert_eq!(
            stream.push("ld <tool_"),
            vec![StreamEvent::Content("ld".into())]
        );
        assert_eq!(
            stream.push("box>"),
            vec![StreamEvent::Content(" <tool_box>".into())]
        );
        assert_eq!(stream.finish(), vec![]);
    }

    #[test]
    fn no_markup_means_content_unchanged() {
        let text = "  Plain reply\n\nwith trailing space  \n";
        let outcome = crate::tool_call::parse(ToolFormat::QwenXml, text, &[]);
        assert_eq!(outcome.content, text);
        assert!(outcome.calls.is_empty());
    }

    #[test]
    fn gemma_reasoning_channel() {
        let events = run(
            ToolFormat::Gemma4,
            &[
                "<|chan",
                "nel>thou",
                "ght\nLet me think<chan",
                "nel|>\nAnswer.",
            ],
        );
        assert_eq!(
            events,
            vec![
                StreamEvent::Reasoning("Let me think".into()),
                StreamEvent::Content("Answer.".into()),
            ]
        );
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc<chan", "<channel|>"), 5);
        assert_eq!(partial_suffix("abc", "<channel|>"), 0);
        assert_eq!(partial_suffix("é<", "<channel|>"), 1);
    }
}

#[cfg(test)]
mod leak_tests {
    //! Markup that used to reach the content (issue: tool-call markup leaking).
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<ToolSpec> {
        ToolSpec::list_from_openai(&[json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})])
        .unwrap()
    }

    fn parse_all(format: ToolFormat, text: &str) -> ParseOutcome {
        // Every split point gives the same outcome.
        let tools = weather();
        let whole = {
            let mut s = ToolCallStream::with_ids(format, &tools, CallIdSource::counter());
            s.push(text);
            s.into_outcome()
        };
        for cut in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut s = ToolCallStream::with_ids(format, &tools, CallIdSource::counter());
            s.push(&text[..cut]);
            s.push(&text[cut..]);
            let split = s.into_outcome();
            assert_eq!(split.content, whole.content, "cut at {cut}");
            assert_eq!(split.calls.len(), whole.calls.len(), "cut at {cut}");
        }
        whole
    }

    #[test]
    fn a_tagged_call_to_a_tool_not_offered_is_a_call_marked_unknown_tool() {
        let text = "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>";
        let out = parse_all(ToolFormat::HermesJson, text);
        assert_eq!(out.content, "");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].name, "read_file");
        assert_eq!(out.calls[0].repairs, vec![RepairKind::UnknownTool]);
        // XML-style markup too.
        let xml = "<tool_call>\n<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>";
        let out = parse_all(ToolFormat::QwenXml, xml);
        assert_eq!(out.content, "");
        assert_eq!(out.calls[0].repairs, vec![RepairKind::UnknownTool]);
    }

    #[test]
    fn bare_json_naming_an_unknown_tool_stays_content() {
        let text = "{\"name\": \"Bob\", \"arguments\": {\"age\": 3}}";
        let out = parse_all(ToolFormat::HermesJson, text);
        assert_eq!(out.content, text);
        assert!(out.calls.is_empty());
    }

    #[test]
    fn comma_separated_bare_calls_are_all_calls() {
        let call = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}";
        let text = format!("{call}, {}", call.replace("\"A\"", "\"B\""));
        let out = parse_all(ToolFormat::HermesJson, &text);
        assert_eq!(out.content, "");
        assert_eq!(out.calls.len(), 2);
        assert_eq!(out.calls[1].arguments, json!({"city": "B"}));
    }

    #[test]
    fn a_bare_call_after_other_json_is_a_call() {
        let text = "{\"note\": 1}\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}";
        let out = parse_all(ToolFormat::HermesJson, text);
        assert_eq!(out.content, "{\"note\": 1}");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].repairs, vec![RepairKind::BareJson]);
    }
}
