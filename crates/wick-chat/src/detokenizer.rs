//! Incremental decoding for streaming: ids in one at a time, text out as soon as it is stable.
//!
//! [`IncrementalDecoder`] keeps a short window of recent ids. For each new id it decodes the
//! window twice — up to the last emitted id (the prefix) and up to the new one — and emits what
//! the second text adds to the first, unless that ends in U+FFFD: then the last bytes are an
//! incomplete UTF-8 sequence (a character split over byte tokens) and the text waits for the
//! next id. Decoding the prefix again gives the decoder its context, so SentencePiece's leading
//! space and similar rules come out as in a full decode; the window restarts at the last emitted
//! id, so the cost per id does not grow with the length of the output.
//!
//! Everything emitted, concatenated (with [`flush`](IncrementalDecoder::flush) at the end),
//! equals `tokenizer.decode(all_ids, skip_special)`.
//!
//! ```no_run
//! use wick_chat::detokenizer::{IncrementalDecoder, SpecialTokens};
//! # fn demo(tokenizer: &wick_chat::tokenizer::Tokenizer, ids: &[u32]) -> Result<(), wick_chat::tokenizer::TokenizerError> {
//! let mut decoder = IncrementalDecoder::new(tokenizer, SpecialTokens::Skip);
//! let mut text = String::new();
//! for &id in ids {
//!     text.push_str(&decoder.push(id)?);
//! }
//! text.push_str(&decoder.flush());
//! assert_eq!(text, tokenizer.decode(ids, true)?);
//! # Ok(()) }
//! ```
use crate::tokenizer::{Tokenizer, TokenizerError};

/// What the decoder does with control tokens (`<|im_end|>`, BOS …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Leave them out of the text (what a chat client sees).
    Skip,
    /// Render them as their text (what tool-call and reasoning parsers need).
    Keep,
}

/// Streaming detokenizer for one sequence.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Ids from the start of the prefix on.
    window: Vec<u32>,
    /// `window[..read]` has been emitted (its text may still be needed as context).
    read: usize,
}

impl IncrementalDecoder {
    /// A decoder for a new sequence.
    pub fn new(tokenizer: &Tokenizer, special: SpecialTokens) -> Self {
        IncrementalDecoder {
            tokenizer: tokenizer.clone(),
            skip_special: special == SpecialTokens::Skip,
            window: Vec::new(),
            read: 0,
        }
    }

    /// Adds one id and returns the text that became stable (often empty while a multi-byte
    /// character is incomplete). An id outside the vocabulary is an error and is not added.
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let vocab_size = self.tokenizer.vocab_size();
        if id as usize >= vocab_size {
            return Err(TokenizerError::IdOutOfRange { id, vocab_size });
        }
        self.window.push(id);
        let prefix = self.decode(&self.window[..self.read])?;
        let full = self.decode(&self.window)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(new) = full.get(prefix.len()..) else {
            // The new id rewrote text already emitted (no known decoder does that); wait.
            return Ok(String::new());
        };
        let new = new.to_string();
        // The emitted ids become the context of the next window.
        self.window.drain(..self.read);
        self.read = self.window.len();
        Ok(new)
    }

    /// Returns whatever is still held back (an incomplete character decodes to U+FFFD) and
    /// starts over for a new sequence.
    pub fn flush(&mut self) -> String {
        let rest = match (
            self.decode(&self.window[..self.read]),
            self.decode(&self.window),
        ) {
            (Ok(prefix), Ok(full)) => full.get(prefix.len()..).unwrap_or_default().to_string(),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "incremental decoder could not flush");
                String::new()
            }
        };
        self.window.clear();
        self.read = 0;
        rest
    }

    /// Number of ids kept for context and for incomplete characters: a few in normal text,
    /// independent of how long the output is.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer.decode(ids, self.skip_special)
    }
}
