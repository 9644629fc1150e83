//! The seam between the streaming parser and the family grammars: how a block opens and how a
//! call body is read one argument at a time.
//!
//! A grammar function looks at the text from some position to the end of what has arrived and
//! says either "need more text" or a decision. Decisions must be prefix-stable (the same on every
//! longer text) and, when `at_end` is true, a grammar must decide and consume at least one byte
//! (or end the call): that is what makes streaming agree with whole-text parsing and what
//! guarantees that parsing never hangs.

use serde_json::{Map, Value};

use super::scan::{leading_ws, prefix_of, stray_len, Prefix};
use super::schema::ToolBox;
use super::{gemma4, hermes_json, llama3_json, minicpm, mistral, tagged};
use super::{RepairKind, ToolCallError};

/// The kinds of markup block the formats use (a format lists the ones it recognises).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Block {
    /// `<tool_call>…</tool_call>` with a JSON, Qwen-XML or GLM body.
    Tagged,
    /// MiniCPM `<function name="…">…</function>`.
    XmlAttr,
    /// Gemma 4 `<|tool_call>call:NAME{…}<tool_call|>`.
    Gemma4Call,
    /// Gemma 4 reasoning channel `<|channel>…<channel|>`.
    Gemma4Channel,
    /// Llama 3 `{"name":…,"parameters":…}`, optionally after `<|python_tag|>`.
    Llama3,
    /// Mistral `[TOOL_CALLS]…`.
    Mistral,
    /// A tool envelope in bare JSON (or a ```` ```json ```` fence): the last resort.
    BareJson,
}

/// A literal that opens a block in prose.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Marker {
    /// The literal text.
    pub(crate) text: &'static str,
    /// The block it opens.
    pub(crate) block: Block,
    /// Only recognised at the start of a line (after optional spaces).
    pub(crate) line_start: bool,
}

/// Which bare JSON a format accepts at the start of the reply (and right after a call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonStart {
    /// None: the format has special-token markers.
    Off,
    /// `{`, `[` or a fence opens a [`Block::BareJson`] (tagged formats' last resort).
    LastResort,
    /// `{` opens a [`Block::Llama3`] call; `[` or a fence opens a [`Block::BareJson`].
    Llama3,
}

/// A call found whole (JSON payloads), before it gets an id.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParsedCall {
    pub(crate) name: String,
    pub(crate) arguments: Map<String, Value>,
    pub(crate) repairs: Vec<RepairKind>,
}

/// What a block's grammar decided at its opening marker.
#[derive(Debug)]
pub(crate) enum Opening {
    /// The opening cannot be decided yet.
    NeedMore,
    /// Not a call: the first `len` bytes (at least the marker) are released as content.
    Reject { len: usize, error: ToolCallError },
    /// A call whose arguments are read incrementally from offset `body` with `grammar`.
    Call {
        name: String,
        body: usize,
        grammar: BodyGrammar,
    },
    /// Whole calls (JSON payloads) spanning `len` bytes.
    Calls { calls: Vec<ParsedCall>, len: usize },
    /// A reasoning block whose text starts at offset `body`.
    Reasoning { body: usize },
}

/// The incremental call bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyGrammar {
    /// `<parameter=K>V</parameter>…</function></tool_call>`.
    QwenXml,
    /// `<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`.
    Glm,
    /// `<param name="K">V</param>…</function>`.
    MiniCpm,
    /// `k:v,…}<tool_call|>`.
    Gemma4,
}

/// An argument value as written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ArgText {
    /// Raw text, decoded with the parameter's schema.
    Raw(String),
    /// Already typed (Gemma 4's JSON-like values).
    Json(Value),
}

/// One step of reading a call body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum BodyStep {
    /// Cannot decide yet (never returned when `at_end`).
    NeedMore,
    /// One argument, spanning `len` bytes (> 0).
    Arg {
        key: String,
        value: ArgText,
        len: usize,
        repairs: Vec<RepairKind>,
    },
    /// `len` bytes (> 0) that carry no argument were skipped.
    Skip {
        len: usize,
        repair: Option<RepairKind>,
    },
    /// The call ends after `len` bytes.
    End {
        len: usize,
        repair: Option<RepairKind>,
    },
}

impl BodyStep {
    /// What a body that stops short of its end answers: wait for more text, or, at the end
    /// of the output, end the call there (repaired as an unclosed block).
    pub(crate) fn short(text: &str, at_end: bool) -> BodyStep {
        if at_end {
            BodyStep::End {
                len: text.len(),
                repair: Some(RepairKind::UnclosedBlock),
            }
        } else {
            BodyStep::NeedMore
        }
    }
}

/// One step through a call body made of tagged entries (GLM's `<arg_key>` pairs,
/// MiniCPM's `<param>`s): after whitespace, `entry_open` starts an entry, which `entry`
/// reads from its offset; `close` ends the call; a tag cut short waits for more text;
/// anything else is skipped as stray text.
pub(crate) fn tagged_entries_step(
    text: &str,
    at_end: bool,
    (entry_open, close): (&str, &str),
    entry: impl FnOnce(&str, usize, bool) -> BodyStep,
) -> BodyStep {
    let ws = leading_ws(text);
    let rest = &text[ws..];
    if rest.is_empty() {
        return BodyStep::short(text, at_end);
    }
    let matches = [prefix_of(rest, entry_open), prefix_of(rest, close)];
    if matches[0] == Prefix::Full {
        return entry(text, ws, at_end);
    }
    if matches[1] == Prefix::Full {
        return BodyStep::End {
            len: ws + close.len(),
            repair: None,
        };
    }
    if matches.contains(&Prefix::Partial) {
        return BodyStep::short(text, at_end);
    }
    BodyStep::Skip {
        len: ws + stray_len(rest),
        repair: Some(RepairKind::StrayText),
    }
}

/// Decides what the block that starts `text` (at its marker) is.
pub(crate) fn open(block: Block, text: &str, at_end: bool, tools: ToolBox<'_>) -> Opening {
    match block {
        Block::Tagged => tagged::open(text, at_end, tools),
        Block::XmlAttr => minicpm::open(text, at_end, tools),
        Block::Gemma4Call => gemma4::open_call(text, at_end, tools),
        Block::Gemma4Channel => Opening::Reasoning {
            body: gemma4::CHANNEL_OPEN.len(),
        },
        Block::Llama3 => llama3_json::open(text, at_end, tools),
        Block::Mistral => mistral::open(text, at_end, tools),
        Block::BareJson => hermes_json::open_bare(text, at_end, tools),
    }
}

/// Reads the next piece of a call body from `text`; `args_so_far` counts the arguments read.
pub(crate) fn step(grammar: BodyGrammar, text: &str, at_end: bool, args_so_far: usize) -> BodyStep {
    match grammar {
        BodyGrammar::QwenXml => super::qwen_xml::step(text, at_end),
        BodyGrammar::Glm => super::glm::step(text, at_end),
        BodyGrammar::MiniCpm => minicpm::step(text, at_end),
        BodyGrammar::Gemma4 => gemma4::step(text, at_end, args_so_far),
    }
}

/// Length of the block from its start `text` through the first `close` tag, for releasing a
/// refused block whole; `None` while the tag has not arrived (the whole text when `at_end`).
pub(crate) fn through_close(text: &str, close: &str, at_end: bool) -> Option<usize> {
    match text.find(close) {
        Some(at) => Some(at + close.len()),
        None if at_end => Some(text.len()),
        None => None,
    }
}

/// A refusal of the block from `text` through `close` (see [`through_close`]).
pub(crate) fn reject_through(
    text: &str,
    close: &str,
    at_end: bool,
    error: ToolCallError,
) -> Opening {
    match through_close(text, close, at_end) {
        Some(len) => Opening::Reject { len, error },
        None => Opening::NeedMore,
    }
}

/// Whether `name` can be a tool name: non-empty, no whitespace, no angle brackets.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c == '<' || c == '>')
}
