//! Keeping user text from forging the prompt's markup tokens.
//!
//! A chat prompt is the template's markup around strings a client sent (message contents,
//! names, tool arguments and results, tool schemas). Only the markup may become markup tokens:
//! `<|im_start|>system` or `<tool_call>` typed in a message must stay text. The *protected*
//! tokens are every control token, and the user-defined tokens (added tokens not flagged
//! special, such as Qwen's `<tool_call>` and `<think>`) that a [`UserTextGuard`] names: those
//! whose text is one of its markers (what the tool-call and reasoning parsers act on) or that
//! the chat template itself writes. Other user-defined tokens (Gemma 3's `<h1>` or runs of
//! spaces) are ordinary text pieces and stay as they are.
//!
//! The server marks every client string before rendering — a marker character (one that occurs
//! in no input, see [`pick_marker`]) goes in front of each place where a protected token's text
//! could begin, and in front of every marker text whether or not it is a token — renders the
//! template as usual, and encodes the result with [`UserTextGuard::encode_marked`]: the markers
//! are removed, and a protected token whose text covers a marked place is encoded as plain
//! text (the pieces the model's pre-tokenizer and merges make of it, as for any text). Strings
//! that hold no such text get no marker, so the template sees them unchanged and a prompt
//! without such text encodes exactly as [`Tokenizer::encode`] encodes it.
//!
//! What a template copies (whole, trimmed, split) keeps its markers; text a template rewrites
//! (upper-cases, replaces inside) into a protected token's spelling is not covered.
use serde_json::Value;

use super::special_tokens::{Protection, SpecialTokenSplitter};
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

    /// The guard for prompts rendered by the chat template `template_source` (when there is
    /// one): besides the control tokens, it protects the user-defined tokens whose text is one
    /// of `markers` or that the template writes (text that occurs in its source and holds ASCII
    /// punctuation, so runs of spaces and words stay free), and it marks every text of
    /// `markers` in user text, token or not, so a caller can tell it from the template's own
    /// (see [`UserTextGuard::mark_text`]).
    pub fn user_text_guard(
        &self,
        template_source: Option<&str>,
        markers: &[&str],
    ) -> UserTextGuard {
        let splitter = self.splitter();
        let mut written = template_source
            .map(|t| splitter.tokens_in(t))
            .unwrap_or_default();
        written.sort_unstable();
        let protection = splitter.protection(|id, text| {
            markers.contains(&text)
                || (written.binary_search(&id).is_ok()
                    && text.bytes().any(|b| b.is_ascii_punctuation()))
        });
        let mut texts: Vec<String> = markers
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.to_string())
            .collect();
        texts.sort();
        texts.dedup();
        let mut protected = splitter.protected_ids(&protection);
        protected.sort_unstable();
        UserTextGuard {
            tokenizer: self.clone(),
            protection,
            protected,
            texts,
        }
    }
}

/// Marks client strings and encodes the prompt that holds them so that they cannot produce a
/// protected token (see the module docs); made by [`Tokenizer::user_text_guard`].
#[derive(Clone, Debug)]
pub struct UserTextGuard {
    tokenizer: Tokenizer,
    protection: Protection,
    /// Ids of the protected user-defined tokens, sorted.
    protected: Vec<u32>,
    /// Texts marked wherever they occur in user text, tokens or not; sorted.
    texts: Vec<String>,
}

impl UserTextGuard {
    /// The user-defined tokens this guard protects, by id (control tokens are always
    /// protected); sorted.
    pub fn protected_user_defined(&self) -> &[u32] {
        &self.protected
    }

    /// Whether user text can never produce token `id`: a control or unknown token, or a
    /// user-defined one this guard protects.
    pub fn is_protected(&self, id: u32) -> bool {
        self.tokenizer.is_special(id) || self.protected.binary_search(&id).is_ok()
    }

    /// `user_text` with `marker` in front of every place where a protected token's text begins
    /// (or could begin, completed by text around it) and of every marker text; `None` when
    /// there is no such place.
    pub fn mark_text(&self, user_text: &str, marker: char) -> Option<String> {
        let mut marks = self
            .tokenizer
            .splitter()
            .marks_in(user_text, &self.protection);
        for text in &self.texts {
            marks.extend(user_text.match_indices(text.as_str()).map(|(at, _)| at));
        }
        if marks.is_empty() {
            return None;
        }
        marks.sort_unstable();
        marks.dedup();
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
    pub fn mark_json(&self, value: &mut Value, marker: char) -> bool {
        match value {
            Value::String(s) => match self.mark_text(s, marker) {
                Some(marked) => {
                    *s = marked;
                    true
                }
                None => false,
            },
            Value::Array(items) => items
                .iter_mut()
                .fold(false, |any, v| self.mark_json(v, marker) | any),
            Value::Object(map) => {
                let mut any = false;
                if map.keys().any(|k| self.mark_text(k, marker).is_some()) {
                    let old = std::mem::take(map);
                    for (k, v) in old {
                        let k = self.mark_text(&k, marker).unwrap_or(k);
                        map.insert(k, v);
                    }
                    any = true;
                }
                for v in map.values_mut() {
                    any |= self.mark_json(v, marker);
                }
                any
            }
            _ => false,
        }
    }

    /// Encodes text in which user text was marked with `marker` (see the module docs): returns
    /// the text without markers and its ids. Added-token text is parsed outside the marked
    /// places; without markers this is [`Tokenizer::encode`].
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
            let ids = self.tokenizer.encode(&clean, add_special)?;
            return Ok((clean, ids));
        }
        let s = &*self.tokenizer.shared;
        let ids = match &s.backend {
            Backend::Gguf(codec) => {
                let mut ids = Vec::with_capacity(clean.len() / 3 + 2);
                if add_special && s.add_bos {
                    ids.extend(s.bos);
                }
                codec.encode(&s.hf, &clean, true, (&marks, &self.protection), &mut ids)?;
                if add_special {
                    ids.extend_from_slice(&s.suffix);
                }
                ids
            }
            Backend::Hf(codec) => {
                codec.encode_marked(s, &clean, (&marks, &self.protection), add_special)?
            }
        };
        Ok((clean, ids))
    }
}
