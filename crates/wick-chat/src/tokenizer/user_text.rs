//! Keeping user text from forging special tokens.
//!
//! A chat prompt is the template's markup around strings a client sent (message contents,
//! names, tool arguments and results, tool schemas). Only the markup may become control tokens:
//! `<|im_start|>system` typed in a message must stay text. The server marks every client string
//! before rendering — a marker character (one that occurs in no input, see [`pick_marker`]) goes
//! in front of each place where a control token's text could begin — renders the template as
//! usual, and encodes the result with [`Tokenizer::encode_marked`]: the markers are removed, and
//! a control token whose text covers a marked place is encoded as plain text. Strings that
//! cannot form a control token get no marker, so the template sees them unchanged and a prompt
//! without such text encodes exactly as [`Tokenizer::encode`] encodes it.
//!
//! What a template copies (whole, trimmed, split) keeps its markers; text a template rewrites
//! (upper-cases, replaces inside) into a control token's spelling is not covered.
use serde_json::Value;

use super::special_tokens::SpecialTokenSplitter;
use super::{Backend, Tokenizer, TokenizerError};

/// Candidates for the marker: Unicode noncharacters, which no text is meant to carry.
fn marker_candidates() -> impl Iterator<Item = char> {
    (0xFDD0..=0xFDEF)
        .chain((1..=16u32).flat_map(|plane| [plane * 0x10000 + 0xFFFE, plane * 0x10000 + 0xFFFF]))
        .filter_map(char::from_u32)
}

/// A marker character that occurs in none of `values` (all their strings and keys) nor in
/// `texts`; `None` in the absurd case that every candidate occurs.
pub fn pick_marker<'a>(
    values: impl IntoIterator<Item = &'a Value>,
    texts: impl IntoIterator<Item = &'a str>,
) -> Option<char> {
    let mut used = std::collections::HashSet::new();
    let mut note = |s: &str| {
        used.extend(s.chars().filter(|&c| {
            let c = c as u32;
            (0xFDD0..=0xFDEF).contains(&c) || c & 0xFFFE == 0xFFFE
        }))
    };
    fn walk(v: &Value, note: &mut dyn FnMut(&str)) {
        match v {
            Value::String(s) => note(s),
            Value::Array(items) => items.iter().for_each(|v| walk(v, note)),
            Value::Object(map) => map.iter().for_each(|(k, v)| {
                note(k);
                walk(v, note);
            }),
            _ => {}
        }
    }
    for v in values {
        walk(v, &mut note);
    }
    for t in texts {
        note(t);
    }
    marker_candidates().find(|c| !used.contains(c))
}

impl Tokenizer {
    fn splitter(&self) -> &SpecialTokenSplitter {
        let s = &*self.shared;
        match &s.backend {
            Backend::Gguf(codec) => codec.splitter(),
            Backend::Hf(codec) => codec.splitter(s),
        }
    }

    /// `user_text` with `marker` in front of every place where a control token's text begins
    /// (or could begin, completed by text around it); `None` when there is no such place.
    pub fn mark_user_text(&self, user_text: &str, marker: char) -> Option<String> {
        let marks = self.splitter().marks_in(user_text);
        if marks.is_empty() {
            return None;
        }
        let mut out = String::with_capacity(user_text.len() + marks.len() * marker.len_utf8());
        let mut last = 0;
        for m in marks {
            out.push_str(&user_text[last..m]);
            out.push(marker);
            last = m;
        }
        out.push_str(&user_text[last..]);
        Some(out)
    }

    /// Marks every string (and object key) inside `value` as user text, in place; whether any
    /// was changed.
    pub fn mark_user_json(&self, value: &mut Value, marker: char) -> bool {
        match value {
            Value::String(s) => match self.mark_user_text(s, marker) {
                Some(marked) => {
                    *s = marked;
                    true
                }
                None => false,
            },
            Value::Array(items) => items
                .iter_mut()
                .fold(false, |any, v| self.mark_user_json(v, marker) | any),
            Value::Object(map) => {
                let mut any = false;
                if map.keys().any(|k| self.mark_user_text(k, marker).is_some()) {
                    let old = std::mem::take(map);
                    for (k, v) in old {
                        let k = self.mark_user_text(&k, marker).unwrap_or(k);
                        map.insert(k, v);
                    }
                    any = true;
                }
                for v in map.values_mut() {
                    any |= self.mark_user_json(v, marker);
                }
                any
            }
            _ => false,
        }
    }

    /// Encodes text in which user text was marked with `marker` (see the module docs): returns
    /// the text without markers and its ids. Special-token text is parsed outside the marked
    /// places; without markers this is [`encode`](Self::encode).
    pub fn encode_marked(
        &self,
        text: &str,
        marker: char,
        add_special: bool,
    ) -> Result<(String, Vec<u32>), TokenizerError> {
        let mut clean = String::with_capacity(text.len());
        let mut marks = Vec::new();
        for c in text.chars() {
            if c == marker {
                marks.push(clean.len());
            } else {
                clean.push(c);
            }
        }
        marks.dedup();
        if marks.is_empty() {
            let ids = self.encode(&clean, add_special)?;
            return Ok((clean, ids));
        }
        let s = &*self.shared;
        let ids = match &s.backend {
            Backend::Gguf(codec) => {
                let mut ids = Vec::with_capacity(clean.len() / 3 + 2);
                if add_special && s.add_bos {
                    ids.extend(s.bos);
                }
                codec.encode(&s.hf, &clean, true, &marks, &mut ids)?;
                if add_special {
                    ids.extend_from_slice(&s.suffix);
                }
                ids
            }
            Backend::Hf(codec) => codec.encode_marked(s, &clean, &marks, add_special)?,
        };
        Ok((clean, ids))
    }
}
