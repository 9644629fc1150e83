//! Stop strings matched on decoded text across token boundaries, without ever streaming a
//! part of a stop string.
//!
//! The matcher sees the generated text piece by piece (one detokenizer step at a time) and
//! answers, for each piece, what may be shown to the client now. Its result never depends
//! on how the text was cut into pieces: every split gives the same output as matching the
//! whole text at once (see the tests).
//!
//! # Rules
//! - **Earliest match wins**: of all stop strings that occur in the text, the one that
//!   starts first is the match; among stops starting at the same place the shortest one is
//!   reported (it is the first to be complete). Text from the match onward is discarded.
//! - **Hold-back**: the longest tail of the text that is a proper prefix of some stop string
//!   is held back until the next piece shows whether the stop completes, so no part of a
//!   stop string is ever emitted.
//! - A complete match is only acted on once no stop string that would start *earlier* can
//!   still complete. With stops `["abcd", "bc"]` the text `"abc"` waits: `"d"` next means
//!   `"abcd"` (nothing emitted), anything else means `"bc"` (emit `"a"`). Such waiting only
//!   happens when one stop string contains another one past its first character.
//!
//! # Cost
//! Each [`StopMatcher::push`] scans only the held-back tail (shorter than the longest stop
//! string) plus the new piece, so a long output costs time linear in its length.
//!
//! ```
//! use wick_chat::stop::StopMatcher;
//!
//! let mut stops = StopMatcher::new(["</answer>".to_string()]);
//! let step = stops.push("42</ans");
//! assert_eq!(step.emit, "42");
//! assert!(step.stopped.is_none());
//! let step = stops.push("wer> trailing");
//! assert_eq!(step.emit, "");
//! assert_eq!(step.stopped.map(|m| m.stop).as_deref(), Some("</answer>"));
//! ```

/// A stop string that matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// The stop string, as the request gave it.
    pub stop: String,
}

/// What one [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is safe to show now (possibly empty).
    pub emit: String,
    /// Set when a stop string matched: generation should halt, and nothing more is emitted.
    pub stopped: Option<StopMatch>,
}

/// Streaming stop-string matcher over decoded text.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// Non-empty stop strings, deduplicated.
    stops: Vec<String>,
    /// Byte length of the longest stop string.
    longest: usize,
    /// Text received but not yet emitted: it may still turn into a stop string.
    held: String,
    /// The match, once one was found; the matcher then ignores further input.
    matched: Option<StopMatch>,
}

impl StopMatcher {
    /// A matcher for these stop strings; empty strings are ignored (they would match
    /// everywhere). With no stop strings left, every piece passes straight through.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        let mut list: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        list.sort();
        list.dedup();
        let longest = list.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops: list,
            longest,
            held: String::new(),
            matched: None,
        }
    }

    /// The stop strings in use (sorted, deduplicated, none empty).
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The match found so far, by [`push`](Self::push) or at [`flush`](Self::flush).
    pub fn stop_match(&self) -> Option<&StopMatch> {
        self.matched.as_ref()
    }

    /// Whether a stop string matched; later pushes emit nothing.
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// Feeds the next piece of decoded text and returns what can be shown now.
    ///
    /// Once a stop matched (in this call or an earlier one), the result of later calls is
    /// empty: `stopped` is reported exactly once.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.matched.is_some() {
            return StopStep::default();
        }
        if self.stops.is_empty() {
            return StopStep {
                emit: text.to_string(),
                stopped: None,
            };
        }
        self.held.push_str(text);
        let complete = self.earliest_match();
        let pending = self.earliest_partial();
        match (complete, pending) {
            // A stop that starts earlier could still complete: wait for more text.
            (Some((start, _)), Some(partial)) if partial < start => self.emit_before(partial),
            (Some((start, stop)), _) => {
                let emit = self.held[..start].to_string();
                self.held.clear();
                let found = StopMatch {
                    stop: self.stops[stop].clone(),
                };
                self.matched = Some(found.clone());
                StopStep {
                    emit,
                    stopped: Some(found),
                }
            }
            (None, Some(partial)) => self.emit_before(partial),
            (None, None) => StopStep {
                emit: std::mem::take(&mut self.held),
                stopped: None,
            },
        }
    }

    /// Releases the held-back text at the end of generation.
    ///
    /// A held tail that only began a stop string is returned as is. If the held text already
    /// contains a complete stop (one that was waiting for an earlier-starting, longer stop
    /// to complete or not), the text is cut there and [`stop_match`](Self::stop_match)
    /// reports it.
    pub fn flush(&mut self) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        match self.earliest_match() {
            Some((start, stop)) => {
                self.matched = Some(StopMatch {
                    stop: self.stops[stop].clone(),
                });
                let emit = self.held[..start].to_string();
                self.held.clear();
                emit
            }
            None => std::mem::take(&mut self.held),
        }
    }

    /// Emits the held text before byte `at` and keeps the rest.
    fn emit_before(&mut self, at: usize) -> StopStep {
        let rest = self.held.split_off(at);
        StopStep {
            emit: std::mem::replace(&mut self.held, rest),
            stopped: None,
        }
    }

    /// Start and stop index of the earliest complete stop in `held`; the shortest stop wins
    /// a tie.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| Some((self.held.find(stop.as_str())?, stop.len(), index)))
            .min()
            .map(|(start, _, index)| (start, index))
    }

    /// Earliest byte position whose tail of `held` is a proper prefix of some stop string.
    fn earliest_partial(&self) -> Option<usize> {
        let len = self.held.len();
        let first = len.saturating_sub(self.longest.saturating_sub(1));
        (first..len)
            .filter(|&at| self.held.is_char_boundary(at))
            .find(|&at| {
                let tail = &self.held[at..];
                self.stops
                    .iter()
                    .any(|stop| stop.len() > tail.len() && stop.starts_with(tail))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()))
    }

    #[test]
    fn text_without_stops_passes_through_at_once() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("hello").emit, "hello");
        let mut m = matcher(&[""]);
        assert_eq!(m.push("hello").emit, "hello");
        assert!(m.stops().is_empty());
    }

    #[test]
    fn partial_stop_is_held_then_released() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("abc ST").emit, "abc ");
        assert_eq!(m.push("O").emit, "");
        assert_eq!(m.push("P!").emit, "");
        assert_eq!(m.stop_match().map(|s| s.stop.as_str()), Some("STOP"));
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("abc ST").emit, "abc ");
        assert_eq!(m.push("OQ").emit, "STOQ");
        assert_eq!(m.push("ST").emit, "");
        assert_eq!(m.flush(), "ST");
        assert!(!m.is_stopped());
    }

    #[test]
    fn nothing_after_a_match() {
        let mut m = matcher(&["x"]);
        let step = m.push("axb");
        assert_eq!(step.emit, "a");
        assert!(step.stopped.is_some());
        assert_eq!(m.push("more"), StopStep::default());
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn waits_for_a_longer_stop_that_starts_earlier() {
        let mut m = matcher(&["abcd", "bc"]);
        assert_eq!(m.push("abc").emit, "");
        let step = m.push("d");
        assert_eq!(step.emit, "");
        assert_eq!(step.stopped.map(|s| s.stop).as_deref(), Some("abcd"));

        let mut m = matcher(&["abcd", "bc"]);
        assert_eq!(m.push("abc").emit, "");
        let step = m.push("x");
        assert_eq!(step.emit, "a");
        assert_eq!(step.stopped.map(|s| s.stop).as_deref(), Some("bc"));

        let mut m = matcher(&["abcd", "bc"]);
        assert_eq!(m.push("abc").emit, "");
        assert_eq!(m.flush(), "a");
        assert_eq!(m.stop_match().map(|s| s.stop.as_str()), Some("bc"));
    }
}
