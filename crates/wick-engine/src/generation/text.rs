//! From sampled ids to the text a client may see: incremental detokenization followed
//! by stop-string matching.
use wick_chat::detokenizer::{IncrementalDecoder, SpecialTokens};
use wick_chat::stop::StopMatcher;
use wick_chat::tokenizer::Tokenizer;

use crate::Result;

/// Detokenizer plus stop matcher for one sequence.
pub struct TextStream {
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    text: String,
}

impl TextStream {
    /// A stream for `tokenizer` with `stops`.
    pub fn new(tokenizer: &Tokenizer, stops: &[String], keep_special: bool) -> Self {
        let special = if keep_special {
            SpecialTokens::Keep
        } else {
            SpecialTokens::Skip
        };
        TextStream {
            decoder: IncrementalDecoder::new(tokenizer, special),
            stops: StopMatcher::new(stops.iter().cloned()),
            text: String::new(),
        }
    }

    /// Feeds one id; returns the text released and the stop string if one matched.
    pub fn push(&mut self, id: u32) -> Result<(String, Option<String>)> {
        let piece = self.decoder.push(id)?;
        let step = self.stops.push(&piece);
        self.text.push_str(&step.emit);
        Ok((step.emit, step.stopped.map(|m| m.stop)))
    }

    /// Releases held text at the end; also reports a stop string completed by the flush.
    pub fn flush(&mut self) -> (String, Option<String>) {
        let rest = self.decoder.flush();
        let mut out = self.stops.push(&rest).emit;
        if !self.stops.is_stopped() {
            out.push_str(&self.stops.flush());
        }
        self.text.push_str(&out);
        (out, self.stops.stop_match().map(|m| m.stop.clone()))
    }

    /// All text released so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}
