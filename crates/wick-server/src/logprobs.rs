//! Log-probabilities in OpenAI's two shapes: chat's per-token objects and the completions
//! API's columns, built from the engine's [`TokenEvent`]s.
use serde_json::{Map, Value};
use wick_chat::tokenizer::Tokenizer;
use wick_engine::{PromptLogprob, TokenEvent};

use crate::openai::chat::{TokenLogprob, TopLogprob};
use crate::openai::completions::LegacyLogprobs;

/// A token's text and exact bytes (`token` is the bytes with invalid UTF-8 replaced).
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Option<Vec<u8>>) {
    match tokenizer.token_bytes(id) {
        Some(bytes) => (
            String::from_utf8_lossy(&bytes).into_owned(),
            Some(bytes.into_owned()),
        ),
        None => (
            tokenizer.token_piece(id).unwrap_or_default().to_string(),
            None,
        ),
    }
}

/// Chat's entry for one generated token.
pub fn chat_entry(tokenizer: &Tokenizer, event: &TokenEvent) -> TokenLogprob {
    let (token, bytes) = token_text(tokenizer, event.id);
    TokenLogprob {
        id: event.id,
        token,
        logprob: event.logprob,
        bytes,
        top_logprobs: event
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| {
                let (token, bytes) = token_text(tokenizer, id);
                TopLogprob {
                    id,
                    token,
                    logprob,
                    bytes,
                }
            })
            .collect(),
    }
}

/// Builds the completions API's columns; text offsets count from `offset`, the length of
/// the text returned before these tokens.
#[derive(Debug)]
pub struct LegacyColumns {
    offset: usize,
    columns: LegacyLogprobs,
}

impl LegacyColumns {
    /// Columns whose first token starts at byte `offset` of the returned text.
    pub fn new(offset: usize) -> Self {
        LegacyColumns {
            offset,
            columns: LegacyLogprobs::default(),
        }
    }

    /// Adds an echoed prompt token with its score (`None` for the first token, which has
    /// no context to be scored in, and when the prompt was not scored).
    pub fn push_prompt(&mut self, tokenizer: &Tokenizer, id: u32, score: Option<&PromptLogprob>) {
        let (token, _) = token_text(tokenizer, id);
        match score {
            Some(s) => {
                let top = top_map(tokenizer, &s.top_logprobs);
                self.push(token, Some(s.logprob), Some(top));
            }
            None => self.push(token, None, None),
        }
    }

    /// Adds the echoed prompt `ids`; `scores[i]` scores `ids[i + 1]`.
    pub fn push_echo(&mut self, tokenizer: &Tokenizer, ids: &[u32], scores: &[PromptLogprob]) {
        for (i, &id) in ids.iter().enumerate() {
            let score = i.checked_sub(1).and_then(|j| scores.get(j));
            self.push_prompt(tokenizer, id, score);
        }
    }

    /// Adds a generated token.
    pub fn push_generated(&mut self, tokenizer: &Tokenizer, event: &TokenEvent) {
        let (token, _) = token_text(tokenizer, event.id);
        let top = top_map(tokenizer, &event.top_logprobs);
        self.push(token, Some(event.logprob), Some(top));
    }

    fn push(&mut self, token: String, logprob: Option<f32>, top: Option<Map<String, Value>>) {
        self.columns.text_offset.push(self.offset);
        self.offset += token.len();
        self.columns.tokens.push(token);
        self.columns.token_logprobs.push(logprob);
        self.columns.top_logprobs.push(top);
    }

    /// Takes the columns gathered so far (later tokens continue the offsets).
    pub fn take(&mut self) -> LegacyLogprobs {
        std::mem::take(&mut self.columns)
    }

    /// Whether no token is waiting in the columns.
    pub fn is_empty(&self) -> bool {
        self.columns.tokens.is_empty()
    }
}

/// The completions API's `{token: logprob}` map of alternatives.
fn top_map(tokenizer: &Tokenizer, top: &[(u32, f32)]) -> Map<String, Value> {
    top.iter()
        .map(|&(id, lp)| (token_text(tokenizer, id).0, Value::from(lp)))
        .collect()
}
