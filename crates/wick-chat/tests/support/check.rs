//! Checks shared by the tool-call tests and the fuzz target: the streaming parser, fed any
//! chunking of a text, must emit events that rebuild exactly the outcome of `parse`, and every
//! outcome must satisfy the invariants of the API.

use serde_json::Value;
use wick_chat::tool_call::{
    parse_with_ids, CallIdSource, ParseOutcome, RepairKind, StreamEvent, ToolCallStream,
    ToolFormat, ToolSpec,
};

/// A call rebuilt from stream events.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamedCall {
    pub id: String,
    pub name: String,
    pub arguments_json: String,
    pub repairs: Vec<RepairKind>,
}

/// What a client that only saw the events knows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Streamed {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<StreamedCall>,
}

/// Small deterministic xorshift generator (no dependency, reproducible from a seed).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Rebuilds calls from events, checking the event protocol on the way: a call starts before its
/// arguments, indexes are dense and in order, nothing follows a call's end.
pub fn rebuild(events: &[StreamEvent]) -> Result<Streamed, String> {
    let mut streamed = Streamed::default();
    let mut ended: Vec<bool> = Vec::new();
    for event in events {
        match event {
            StreamEvent::Content(text) => {
                if text.is_empty() {
                    return Err("empty content event".into());
                }
                streamed.content.push_str(text)
            }
            StreamEvent::Reasoning(text) => {
                if text.is_empty() {
                    return Err("empty reasoning event".into());
                }
                streamed.reasoning.push_str(text)
            }
            StreamEvent::CallStart { index, id, name } => {
                if *index != streamed.calls.len() {
                    return Err(format!("call index {index} out of order"));
                }
                streamed.calls.push(StreamedCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments_json: String::new(),
                    repairs: Vec::new(),
                });
                ended.push(false);
            }
            StreamEvent::CallArguments { index, delta } => {
                let call = streamed
                    .calls
                    .get_mut(*index)
                    .ok_or_else(|| format!("arguments before start of call {index}"))?;
                if ended[*index] {
                    return Err(format!("arguments after end of call {index}"));
                }
                call.arguments_json.push_str(delta);
            }
            StreamEvent::CallEnd { index, repairs } => {
                let call = streamed
                    .calls
                    .get_mut(*index)
                    .ok_or_else(|| format!("end before start of call {index}"))?;
                if ended[*index] {
                    return Err(format!("call {index} ended twice"));
                }
                ended[*index] = true;
                call.repairs = repairs.clone();
            }
        }
    }
    if let Some(open) = ended.iter().position(|done| !done) {
        return Err(format!("call {open} never ended"));
    }
    Ok(streamed)
}

/// Streams `chunks` through a fresh stream and rebuilds what a client sees.
pub fn stream_chunks(
    format: ToolFormat,
    tools: &[ToolSpec],
    chunks: &[&str],
) -> Result<Streamed, String> {
    let mut stream = ToolCallStream::with_ids(format, tools, CallIdSource::counter());
    let mut events = Vec::new();
    for chunk in chunks {
        events.extend(stream.push(chunk));
    }
    events.extend(stream.finish());
    rebuild(&events)
}

/// The client's view of a whole-text outcome.
pub fn as_streamed(outcome: &ParseOutcome) -> Streamed {
    Streamed {
        content: outcome.content.clone(),
        reasoning: outcome.reasoning.clone(),
        calls: outcome
            .calls
            .iter()
            .map(|call| StreamedCall {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments_json.clone(),
                repairs: call.repairs.clone(),
            })
            .collect(),
    }
}

/// Invariants of every outcome.
pub fn check_invariants(
    outcome: &ParseOutcome,
    text: &str,
    tools: &[ToolSpec],
) -> Result<(), String> {
    for call in &outcome.calls {
        if !call.arguments.is_object() {
            return Err(format!("arguments of {} not an object", call.name));
        }
        let serialized = serde_json::to_string(&call.arguments).map_err(|e| e.to_string())?;
        if serialized != call.arguments_json {
            return Err(format!(
                "arguments_json {:?} is not arguments {}",
                call.arguments_json, call.arguments
            ));
        }
        let parsed: Value = serde_json::from_str(&call.arguments_json)
            .map_err(|e| format!("arguments_json is not JSON: {e}"))?;
        if parsed != call.arguments {
            return Err("arguments_json does not parse back to arguments".into());
        }
        let offered = tools.is_empty() || tools.iter().any(|tool| tool.name == call.name);
        if offered == call.repairs.contains(&RepairKind::UnknownTool) {
            return Err(format!(
                "call to {} marked unknown_tool: {}",
                call.name, !offered
            ));
        }
        let id_ok = call.id.len() == 13
            && call.id.starts_with("call_")
            && call.id[5..].chars().all(|c| c.is_ascii_hexdigit());
        if !id_ok {
            return Err(format!("bad id {}", call.id));
        }
        let mut seen = Vec::new();
        for kind in &call.repairs {
            if seen.contains(kind) {
                return Err(format!("repair {kind} listed twice"));
            }
            seen.push(*kind);
        }
    }
    for failure in &outcome.failures {
        if failure.offset > text.len() {
            return Err(format!("failure offset {} past the text", failure.offset));
        }
    }
    // With no call and no reasoning block, nothing is markup: the content is the text itself.
    if outcome.calls.is_empty() && outcome.format != ToolFormat::Gemma4 && outcome.content != text {
        return Err(format!(
            "no calls, but content {:?} differs from the text",
            outcome.content
        ));
    }
    if outcome.content.len() + outcome.reasoning.len() > text.len() {
        return Err("content and reasoning longer than the text".into());
    }
    Ok(())
}

/// Char-boundary split points of `text`.
pub fn boundaries(text: &str) -> Vec<usize> {
    (0..=text.len())
        .filter(|&at| text.is_char_boundary(at))
        .collect()
}

/// `text` cut into random chunks (1 to 8 characters, sometimes bigger).
pub fn random_chunks<'a>(text: &'a str, rng: &mut Rng) -> Vec<&'a str> {
    let mut chunks = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let span = if rng.below(10) == 0 { 64 } else { 8 };
        let mut len = 1 + rng.below(span);
        while at + len < text.len() && !text.is_char_boundary(at + len) {
            len += 1;
        }
        let end = (at + len).min(text.len());
        chunks.push(&text[at..end]);
        at = end;
    }
    chunks
}

/// Parses `text`, checks the invariants, and checks that streaming agrees: two pieces split at
/// every boundary when `every_split`, else at a few; and `random_rounds` random chunkings.
pub fn check_text(
    format: ToolFormat,
    text: &str,
    tools: &[ToolSpec],
    every_split: bool,
    random_rounds: usize,
    seed: u64,
) -> Result<ParseOutcome, String> {
    let outcome = parse_with_ids(format, text, tools, CallIdSource::counter());
    check_invariants(&outcome, text, tools)?;
    let expected = as_streamed(&outcome);
    let splits = boundaries(text);
    let mut rng = Rng::new(seed);
    let chosen: Vec<usize> = if every_split {
        splits
    } else {
        (0..4).map(|_| splits[rng.below(splits.len())]).collect()
    };
    for at in chosen {
        let got = stream_chunks(format, tools, &[&text[..at], &text[at..]])
            .map_err(|e| format!("split at {at}: {e}"))?;
        if got != expected {
            return Err(format!(
                "split at {at} differs:\n stream: {got:?}\n parse:  {expected:?}"
            ));
        }
    }
    for round in 0..random_rounds {
        let chunks = random_chunks(text, &mut rng);
        let got = stream_chunks(format, tools, &chunks)
            .map_err(|e| format!("random chunking {round}: {e}"))?;
        if got != expected {
            return Err(format!(
                "random chunking {chunks:?} differs:\n stream: {got:?}\n parse:  {expected:?}"
            ));
        }
    }
    Ok(outcome)
}
