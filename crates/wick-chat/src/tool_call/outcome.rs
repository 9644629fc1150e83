//! What parsing a reply yields: [`ToolCall`]s, the prose around them, and why markup was refused.

use std::hash::{BuildHasher, RandomState};

use serde_json::Value;

use super::{RepairKind, ToolCallError, ToolFormat};

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// `call_` + 8 hex digits (see [`CallIdSource`]).
    pub id: String,
    /// The tool name (one of the offered tools when a tool list was given).
    pub name: String,
    /// The arguments, always a JSON object, keys in the order the model wrote them.
    pub arguments: Value,
    /// `arguments` serialized as compact JSON: the OpenAI `function.arguments` string. It is
    /// exactly the concatenation of the call's streamed argument deltas.
    pub arguments_json: String,
    /// The repairs that were needed, in the order they were applied; empty for a strict parse.
    pub repairs: Vec<RepairKind>,
}

/// A block of markup that did not become a call; its text was kept as content.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseFailure {
    /// Byte offset of the block in the parsed text.
    pub offset: usize,
    /// Why it was refused.
    pub error: ToolCallError,
}

/// The result of parsing a whole reply. Parsing never fails: what cannot be a call is content.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseOutcome {
    /// The format that was parsed.
    pub format: ToolFormat,
    /// The prose outside calls. Whitespace touching a call block belongs to the markup and is
    /// dropped; a reply without calls is returned unchanged.
    pub content: String,
    /// Reasoning split out of the reply (Gemma 4's thought channel); empty otherwise.
    pub reasoning: String,
    /// The calls, in order (several for parallel tool calls).
    pub calls: Vec<ToolCall>,
    /// Markup that looked like a call but was released as content, and why.
    pub failures: Vec<ParseFailure>,
}

impl ParseOutcome {
    /// The first reason a block was refused, if any.
    pub fn error(&self) -> Option<&ToolCallError> {
        self.failures.first().map(|failure| &failure.error)
    }
}

/// Where call ids come from. Ids are `call_` followed by 8 lowercase hex digits.
#[derive(Debug, Clone)]
pub enum CallIdSource {
    /// Random ids (std's randomly keyed hasher over a counter).
    Random {
        /// The keyed hasher.
        state: RandomState,
        /// Ids handed out so far.
        issued: u64,
    },
    /// `call_00000000`, `call_00000001`, … starting at `next`: deterministic, for tests.
    Counter {
        /// The next number.
        next: u32,
    },
}

impl CallIdSource {
    /// Random ids.
    pub fn random() -> Self {
        CallIdSource::Random {
            state: RandomState::new(),
            issued: 0,
        }
    }

    /// Counting ids from zero.
    pub fn counter() -> Self {
        CallIdSource::Counter { next: 0 }
    }

    /// The next id.
    pub fn next_id(&mut self) -> String {
        let n = match self {
            CallIdSource::Random { state, issued } => {
                *issued += 1;
                state.hash_one(*issued) as u32
            }
            CallIdSource::Counter { next } => {
                let n = *next;
                *next = next.wrapping_add(1);
                n
            }
        };
        format!("call_{n:08x}")
    }
}

impl Default for CallIdSource {
    fn default() -> Self {
        CallIdSource::random()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_the_openai_shape() {
        let mut random = CallIdSource::random();
        let a = random.next_id();
        let b = random.next_id();
        for id in [&a, &b] {
            assert_eq!(id.len(), 13);
            assert!(id.starts_with("call_"));
            assert!(id[5..]
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        }
        assert_ne!(a, b);
        let mut counter = CallIdSource::counter();
        assert_eq!(counter.next_id(), "call_00000000");
        assert_eq!(counter.next_id(), "call_00000001");
    }
}
