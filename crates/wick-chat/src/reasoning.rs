//! Splitting `<think>…</think>` reasoning from the answer while the text streams.
//!
//! Qwen3, QwQ, DeepSeek-R1, MiniCPM and others write their reasoning between `<think>` and
//! `</think>` before the answer. [`ReasoningSplitter`] takes the decoded text piece by
//! piece and hands back [`Segment`]s: reasoning goes to `delta.reasoning`, the rest to
//! `delta.content`. A tag cut across pieces (`"</th"` + `"ink>"`) is held back until it is
//! known to be a tag or not, so a tag is never shown and the result does not depend on how
//! the text was cut into pieces.
//!
//! # Rules
//! - Outside reasoning, the open tag starts a reasoning block; inside, the close tag ends it.
//!   Blocks may appear anywhere and more than once. Text without tags is content.
//! - [`ReasoningSplitter::new`] takes `start_in_thinking`: set it when the rendered prompt
//!   already ends inside an open `<think>` (DeepSeek-R1 templates, Qwen3 with thinking
//!   forced), so the output starts as reasoning and only `</think>` appears in it.
//! - **Newlines around the tags** (on by default, see
//!   [`with_newline_trimming`](ReasoningSplitter::with_newline_trimming)): these models write
//!   `<think>\n…\n</think>\n\nanswer`. Newlines (`\n`, `\r`) at the start and at the end of a
//!   reasoning block and at the start of the content right after `</think>` are dropped, so
//!   the reasoning reads `…` and the content `answer`. Newlines anywhere else are kept, and
//!   so is content before the first tag. A reasoning block that is cut off (no `</think>`
//!   before the end) loses its trailing newlines too.
//! - Empty segments are never produced; an empty block (`<think>\n\n</think>`) yields nothing.
//!
//! ```
//! use wick_chat::reasoning::{ReasoningSplitter, Segment};
//!
//! let mut splitter = ReasoningSplitter::new(false);
//! let mut segments = splitter.push("<think>\nLet me see.\n</th");
//! segments.extend(splitter.push("ink>\n\nIt is 4."));
//! segments.extend(splitter.flush());
//! assert_eq!(
//!     segments,
//!     vec![
//!         Segment::Reasoning("Let me see.".into()),
//!         Segment::Content("It is 4.".into()),
//!     ]
//! );
//! ```

/// A piece of output, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text inside a reasoning block (tags removed).
    Reasoning(String),
    /// Answer text outside reasoning blocks.
    Content(String),
}

impl Segment {
    /// The text, whichever kind it is.
    pub fn text(&self) -> &str {
        match self {
            Segment::Reasoning(text) | Segment::Content(text) => text,
        }
    }
}

/// Errors building a splitter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReasoningError {
    /// A tag is the empty string, which would match everywhere.
    #[error("the reasoning {which} tag is empty")]
    EmptyTag {
        /// `"open"` or `"close"`.
        which: &'static str,
    },
}

/// The pair of tags around a reasoning block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningTags {
    open: String,
    close: String,
}

impl ReasoningTags {
    /// Custom tags, e.g. `("<thinking>", "</thinking>")`; neither may be empty.
    pub fn new(open: impl Into<String>, close: impl Into<String>) -> Result<Self, ReasoningError> {
        let (open, close) = (open.into(), close.into());
        if open.is_empty() {
            return Err(ReasoningError::EmptyTag { which: "open" });
        }
        if close.is_empty() {
            return Err(ReasoningError::EmptyTag { which: "close" });
        }
        Ok(Self { open, close })
    }

    /// The tag that starts a reasoning block.
    pub fn open(&self) -> &str {
        &self.open
    }

    /// The tag that ends a reasoning block.
    pub fn close(&self) -> &str {
        &self.close
    }
}

impl Default for ReasoningTags {
    /// `<think>` and `</think>`.
    fn default() -> Self {
        Self {
            open: "<think>".into(),
            close: "</think>".into(),
        }
    }
}

/// Streaming splitter of reasoning and content.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    tags: ReasoningTags,
    /// Whether the text now being received is inside a reasoning block.
    in_reasoning: bool,
    /// Received text not yet classified: a partial tag, and in reasoning also the newlines
    /// that may turn out to stand right before the close tag.
    held: String,
    /// Newlines at the start of the current block are still to be dropped.
    at_block_start: bool,
    /// Whether newlines around the tags are dropped.
    trim_newlines: bool,
}

fn is_newline(c: char) -> bool {
    c == '\n' || c == '\r'
}

impl ReasoningSplitter {
    /// A splitter for `<think>`/`</think>`; `start_in_thinking` when the prompt already opened
    /// the reasoning block.
    pub fn new(start_in_thinking: bool) -> Self {
        Self::with_tags(start_in_thinking, ReasoningTags::default())
    }

    /// A splitter for other tags.
    pub fn with_tags(start_in_thinking: bool, tags: ReasoningTags) -> Self {
        Self {
            tags,
            in_reasoning: start_in_thinking,
            held: String::new(),
            at_block_start: start_in_thinking,
            trim_newlines: true,
        }
    }

    /// Turns the dropping of newlines around the tags (see the module docs) on or off.
    pub fn with_newline_trimming(mut self, on: bool) -> Self {
        self.trim_newlines = on;
        self.at_block_start &= on;
        self
    }

    /// Whether the text received so far ends inside a reasoning block.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Feeds the next piece of decoded text; returns what can be classified now, adjacent
    /// segments of one kind merged.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            self.drop_leading_newlines();
            let tag = if self.in_reasoning {
                &self.tags.close
            } else {
                &self.tags.open
            };
            let tag_len = tag.len();
            if let Some(at) = self.held.find(tag.as_str()) {
                let mut body = &self.held[..at];
                if self.in_reasoning && self.trim_newlines {
                    body = body.trim_end_matches(is_newline);
                }
                append(&mut out, self.in_reasoning, body);
                self.held.drain(..at + tag_len);
                self.in_reasoning = !self.in_reasoning;
                self.at_block_start = self.trim_newlines;
                continue;
            }
            let mut keep_from = partial_tag_start(&self.held, tag);
            if self.in_reasoning && self.trim_newlines {
                keep_from = self.held[..keep_from].trim_end_matches(is_newline).len();
            }
            append(&mut out, self.in_reasoning, &self.held[..keep_from]);
            self.held.drain(..keep_from);
            return out;
        }
    }

    /// Releases what is held at the end of the output: a partial tag is plain text of the
    /// current kind after all.
    pub fn flush(&mut self) -> Vec<Segment> {
        self.drop_leading_newlines();
        let mut body = self.held.as_str();
        if self.in_reasoning && self.trim_newlines {
            body = body.trim_end_matches(is_newline);
        }
        let mut out = Vec::new();
        append(&mut out, self.in_reasoning, body);
        self.held.clear();
        out
    }

    fn drop_leading_newlines(&mut self) {
        if !self.at_block_start {
            return;
        }
        let trimmed = self.held.len() - self.held.trim_start_matches(is_newline).len();
        self.held.drain(..trimmed);
        if !self.held.is_empty() {
            self.at_block_start = false;
        }
    }
}

/// Adds `text` to `out`, merging with the last segment when it is of the same kind.
fn append(out: &mut Vec<Segment>, reasoning: bool, text: &str) {
    if text.is_empty() {
        return;
    }
    match (out.last_mut(), reasoning) {
        (Some(Segment::Reasoning(last)), true) | (Some(Segment::Content(last)), false) => {
            last.push_str(text)
        }
        _ => out.push(if reasoning {
            Segment::Reasoning(text.to_string())
        } else {
            Segment::Content(text.to_string())
        }),
    }
}

/// Byte position of the longest tail of `text` that is a proper prefix of `tag`, or
/// `text.len()` when there is none.
fn partial_tag_start(text: &str, tag: &str) -> usize {
    let first = text.len().saturating_sub(tag.len().saturating_sub(1));
    (first..text.len())
        .filter(|&at| text.is_char_boundary(at))
        .find(|&at| tag.starts_with(&text[at..]))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(splitter: &mut ReasoningSplitter, pieces: &[&str]) -> Vec<Segment> {
        let mut out = Vec::new();
        for piece in pieces {
            for segment in splitter.push(piece) {
                let reasoning = matches!(segment, Segment::Reasoning(_));
                append(&mut out, reasoning, segment.text());
            }
        }
        for segment in splitter.flush() {
            let reasoning = matches!(segment, Segment::Reasoning(_));
            append(&mut out, reasoning, segment.text());
        }
        out
    }

    #[test]
    fn partial_tags_are_held_back() {
        let mut s = ReasoningSplitter::new(false);
        assert_eq!(s.push("Hello <th"), vec![Segment::Content("Hello ".into())]);
        assert_eq!(s.push("ink>"), vec![]);
        assert!(s.in_reasoning());
        assert_eq!(s.push("hmm</"), vec![Segment::Reasoning("hmm".into())]);
        assert_eq!(s.push("b>"), vec![Segment::Reasoning("</b>".into())]);
    }

    #[test]
    fn prompt_opened_the_block() {
        let mut s = ReasoningSplitter::new(true);
        let out = run(&mut s, &["\nfirst\n\n</think>\n\nanswer\n"]);
        assert_eq!(
            out,
            vec![
                Segment::Reasoning("first".into()),
                Segment::Content("answer\n".into())
            ]
        );
    }

    #[test]
    fn newline_trimming_can_be_turned_off() {
        let mut s = ReasoningSplitter::new(false).with_newline_trimming(false);
        let out = run(&mut s, &["<think>\nx\n</think>\n\ny"]);
        assert_eq!(
            out,
            vec![
                Segment::Reasoning("\nx\n".into()),
                Segment::Content("\n\ny".into())
            ]
        );
    }

    #[test]
    fn empty_block_yields_nothing_and_unclosed_block_is_released() {
        let mut s = ReasoningSplitter::new(false);
        assert_eq!(
            run(&mut s, &["<think>\n\n</think>\n\nHi"]),
            vec![Segment::Content("Hi".into())]
        );
        let mut s = ReasoningSplitter::new(false);
        assert_eq!(
            run(&mut s, &["<think>cut off </thi"]),
            vec![Segment::Reasoning("cut off </thi".into())]
        );
    }

    #[test]
    fn custom_tags_and_their_errors() {
        let tags = ReasoningTags::new("[R]", "[/R]").expect("valid tags");
        let mut s = ReasoningSplitter::with_tags(false, tags);
        assert_eq!(
            run(&mut s, &["a[R]b[/", "R]c"]),
            vec![
                Segment::Content("a".into()),
                Segment::Reasoning("b".into()),
                Segment::Content("c".into())
            ]
        );
        assert_eq!(
            ReasoningTags::new("", "x"),
            Err(ReasoningError::EmptyTag { which: "open" })
        );
        assert_eq!(
            ReasoningTags::new("x", ""),
            Err(ReasoningError::EmptyTag { which: "close" })
        );
    }
}
