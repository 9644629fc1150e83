//! Cutting special and user-defined tokens out of text before the model sees it, as llama.cpp
//! does: the longest token first, every occurrence of it, then the next longest in what is left,
//! with the whitespace stripping some models ask for around their special tokens.
//!
//! Text that came from a user (a chat message inside a rendered template) may be *marked*: a
//! protected token — every control token, and the user-defined tokens a [`Protection`] names —
//! is not cut out where it covers a mark, so a user cannot forge the template's markup by typing
//! it. [`SpecialTokenSplitter::marks_in`] finds where marks go.
use std::collections::HashSet;
use std::sync::OnceLock;

use super::token_attrs::TokenAttrs;

/// A piece of input: text for the model, or a token found verbatim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    /// Text to tokenize.
    Text(&'t str),
    /// A special or user-defined token.
    Token(u32),
}

/// One token that may be found verbatim in text.
#[derive(Debug)]
struct Entry {
    id: u32,
    text: String,
    attrs: TokenAttrs,
}

/// A byte trie over the entries' texts, to find which of them occur in a text in one pass.
#[derive(Debug, Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    entry: Option<u32>,
    /// Whether a control or unknown token's text passes through this node.
    on_control_path: bool,
}

/// Finds special and user-defined tokens in text.
#[derive(Debug)]
pub(crate) struct SpecialTokenSplitter {
    /// Longest text first; ties by id.
    entries: Vec<Entry>,
    nodes: Vec<TrieNode>,
    /// Proper suffixes of the control tokens' texts, made on first use (see `marks_in`).
    control_suffixes: OnceLock<ControlSuffixes>,
}

/// The proper suffixes of some tokens' texts, to tell whether a string starts with the end of
/// such a token that text before it could complete.
#[derive(Clone, Debug, Default)]
struct ControlSuffixes {
    set: HashSet<Box<[u8]>>,
    longest: usize,
}

impl ControlSuffixes {
    fn add(&mut self, text: &str) {
        for (at, _) in text.char_indices().skip(1) {
            self.set.insert(text.as_bytes()[at..].into());
        }
        self.longest = self.longest.max(text.len());
    }

    /// Whether `text` starts with one of the suffixes.
    fn starts(&self, text: &str) -> bool {
        let bytes = text.as_bytes();
        (1..=self.longest.min(bytes.len()))
            .any(|n| text.is_char_boundary(n) && self.set.contains(&bytes[..n]))
    }
}

/// User-defined tokens that user text may not produce either, beside the control and unknown
/// tokens (which it never may): marks go where they begin, and they stay text where they cover
/// a mark. Made by [`SpecialTokenSplitter::protection`] for one splitter.
#[derive(Clone, Debug, Default)]
pub(crate) struct Protection {
    /// Indices of the protected entries, sorted.
    entries: Vec<u32>,
    suffixes: ControlSuffixes,
}

impl Protection {
    fn covers(&self, index: u32) -> bool {
        self.entries.binary_search(&index).is_ok()
    }
}

impl SpecialTokenSplitter {
    /// Collects the control, unknown and user-defined tokens of a vocabulary.
    pub fn new(tokens: &[String], attrs: &[TokenAttrs]) -> Self {
        let mut entries: Vec<Entry> = tokens
            .iter()
            .zip(attrs)
            .enumerate()
            .filter(|(_, (t, a))| !t.is_empty() && a.is_matched_in_text(true))
            .map(|(id, (t, &a))| Entry {
                id: id as u32,
                text: t.clone(),
                attrs: a,
            })
            .collect();
        entries.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));

        let mut nodes = vec![TrieNode::default()];
        for (index, entry) in entries.iter().enumerate() {
            let mut node = 0usize;
            let special = entry.attrs.is_special();
            for &b in entry.text.as_bytes() {
                node = match nodes[node].children.iter().find(|(c, _)| *c == b) {
                    Some(&(_, next)) => next as usize,
                    None => {
                        nodes.push(TrieNode::default());
                        let next = nodes.len() - 1;
                        nodes[node].children.push((b, next as u32));
                        next
                    }
                };
                nodes[node].on_control_path |= special;
            }
            nodes[node].entry.get_or_insert(index as u32);
        }
        for node in &mut nodes {
            node.children.sort_unstable();
        }
        SpecialTokenSplitter {
            entries,
            nodes,
            control_suffixes: OnceLock::new(),
        }
    }

    /// Cuts `text` into fragments. User-defined tokens are always cut out; control and unknown
    /// tokens only when `parse_special`.
    #[cfg(test)]
    pub fn split<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        self.split_marked(text, parse_special, &[], &Protection::default())
    }

    /// The protection of the user-defined tokens whose text `pick` accepts (the others stay
    /// free for user text, as they always are).
    pub fn protection(&self, mut pick: impl FnMut(u32, &str) -> bool) -> Protection {
        let mut protection = Protection::default();
        for (index, entry) in self.entries.iter().enumerate() {
            if !entry.attrs.is_special() && pick(entry.id, &entry.text) {
                protection.entries.push(index as u32);
                protection.suffixes.add(&entry.text);
            }
        }
        protection
    }

    /// Ids of the tokens that occur in `text` (control, unknown and user-defined alike).
    pub fn tokens_in(&self, text: &str) -> Vec<u32> {
        self.entries_in(text, true)
            .into_iter()
            .map(|index| self.entries[index as usize].id)
            .collect()
    }

    /// Ids of the user-defined tokens `protection` protects.
    pub fn protected_ids(&self, protection: &Protection) -> Vec<u32> {
        protection
            .entries
            .iter()
            .map(|&index| self.entries[index as usize].id)
            .collect()
    }

    /// Byte offsets in `user_text` where a protected token's text (a control or unknown token,
    /// or one `protection` names) begins: whole, cut off by the end of the string (text after it
    /// could complete the token), or — offset 0 — the string starts with the end of one. Empty
    /// for text that cannot form a protected token.
    pub fn marks_in(&self, user_text: &str, protection: &Protection) -> Vec<usize> {
        let bytes = user_text.as_bytes();
        let mut marks = Vec::new();
        let suffixes = self
            .control_suffixes
            .get_or_init(|| self.build_control_suffixes());
        if suffixes.starts(user_text) || protection.suffixes.starts(user_text) {
            marks.push(0);
        }
        for start in 0..bytes.len() {
            if !user_text.is_char_boundary(start) || marks.last() == Some(&start) {
                continue;
            }
            let mut node = 0usize;
            let mut reached_end = true;
            for &b in &bytes[start..] {
                let children = &self.nodes[node].children;
                match children.binary_search_by(|(c, _)| c.cmp(&b)) {
                    Ok(i) => node = children[i].1 as usize,
                    Err(_) => {
                        reached_end = false;
                        break;
                    }
                }
                if self.entry_is_protected(node, protection) {
                    break;
                }
            }
            // A whole protected token, or a prefix of one running to the end of the text. The
            // prefix of an unprotected user-defined token alone is left unmarked: such tokens
            // are matched in user text anyway, and a mark in an object key the template reads
            // (a tiny vocabulary's `thought` begins where `content` ends) renames the key.
            let protected_prefix = || {
                self.nodes[node].on_control_path
                    || protection.entries.iter().any(|&i| {
                        self.entries[i as usize]
                            .text
                            .as_bytes()
                            .starts_with(&bytes[start..])
                    })
            };
            if self.entry_is_protected(node, protection)
                || (reached_end && node != 0 && protected_prefix())
            {
                marks.push(start);
            }
        }
        marks
    }

    fn entry_is_protected(&self, node: usize, protection: &Protection) -> bool {
        self.nodes[node]
            .entry
            .is_some_and(|index| self.is_protected(index, protection))
    }

    fn is_protected(&self, index: u32, protection: &Protection) -> bool {
        self.entries[index as usize].attrs.is_special() || protection.covers(index)
    }

    fn build_control_suffixes(&self) -> ControlSuffixes {
        let mut suffixes = ControlSuffixes::default();
        for entry in self.entries.iter().filter(|e| e.attrs.is_special()) {
            suffixes.add(&entry.text);
        }
        suffixes
    }

    /// Like [`split`](Self::split), but a protected token (control, unknown, or named by
    /// `protection`) is not cut out where it covers one of `marks` (sorted byte offsets into
    /// `text`): there it stays text.
    pub fn split_marked<'t>(
        &self,
        text: &'t str,
        parse_special: bool,
        marks: &[usize],
        protection: &Protection,
    ) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let found = self.entries_in(text, parse_special);
        if found.is_empty() {
            return vec![Fragment::Text(text)];
        }

        #[derive(Clone, Copy)]
        enum Part {
            Text(usize, usize),
            Token(u32),
        }
        let mut parts = vec![Part::Text(0, text.len())];
        for &index in &found {
            let entry = &self.entries[index as usize];
            let needle = entry.text.as_str();
            let mut next = Vec::with_capacity(parts.len() + 2);
            for part in parts {
                let Part::Text(mut start, end) = part else {
                    next.push(part);
                    continue;
                };
                let mut from = start;
                while start < end {
                    let Some(at) = text[from..end].find(needle) else {
                        next.push(Part::Text(start, end));
                        break;
                    };
                    let hit = from + at;
                    if covers_mark(marks, hit, hit + needle.len())
                        && self.is_protected(index, protection)
                    {
                        // User text: leave it, look for the token further on.
                        from = hit + text[hit..].chars().next().map_or(1, char::len_utf8);
                        continue;
                    }
                    let mut left_end = hit;
                    if entry.attrs.contains(TokenAttrs::LSTRIP) {
                        while left_end > start && is_c_space(text.as_bytes()[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Part::Text(start, left_end));
                    }
                    next.push(Part::Token(entry.id));
                    start = hit + needle.len();
                    if entry.attrs.contains(TokenAttrs::RSTRIP) {
                        while start < end && is_c_space(text.as_bytes()[start]) {
                            start += 1;
                        }
                    }
                    from = start;
                }
            }
            parts = next;
        }
        parts
            .into_iter()
            .map(|p| match p {
                Part::Text(s, e) => Fragment::Text(&text[s..e]),
                Part::Token(id) => Fragment::Token(id),
            })
            .collect()
    }

    /// Indices (in priority order) of the entries that occur in `text` and may be cut out.
    fn entries_in(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut found = Vec::new();
        for start in 0..bytes.len() {
            let mut node = 0usize;
            for &b in &bytes[start..] {
                let children = &self.nodes[node].children;
                match children.binary_search_by(|(c, _)| c.cmp(&b)) {
                    Ok(i) => node = children[i].1 as usize,
                    Err(_) => break,
                }
                if let Some(index) = self.nodes[node].entry {
                    if self.entries[index as usize]
                        .attrs
                        .is_matched_in_text(parse_special)
                    {
                        found.push(index);
                    }
                }
            }
        }
        found.sort_unstable();
        found.dedup();
        found
    }
}

/// Whether a mark lies in `start..end` (`marks` sorted).
fn covers_mark(marks: &[usize], start: usize, end: usize) -> bool {
    let first = marks.partition_point(|&m| m < start);
    marks.get(first).is_some_and(|&m| m < end)
}

/// C's `isspace` in the "C" locale, which llama.cpp uses for stripping.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitter(specs: &[(&str, TokenAttrs)]) -> SpecialTokenSplitter {
        let tokens: Vec<String> = specs.iter().map(|(t, _)| t.to_string()).collect();
        let attrs: Vec<TokenAttrs> = specs.iter().map(|(_, a)| *a).collect();
        SpecialTokenSplitter::new(&tokens, &attrs)
    }

    #[test]
    fn control_tokens_only_when_parsing_specials() {
        let s = splitter(&[
            ("hello", TokenAttrs::NORMAL),
            ("<|im_start|>", TokenAttrs::CONTROL),
            ("<tool_call>", TokenAttrs::USER_DEFINED),
        ]);
        let text = "<|im_start|>user\n<tool_call>x";
        assert_eq!(
            s.split(text, true),
            [
                Fragment::Token(1),
                Fragment::Text("user\n"),
                Fragment::Token(2),
                Fragment::Text("x")
            ]
        );
        assert_eq!(
            s.split(text, false),
            [
                Fragment::Text("<|im_start|>user\n"),
                Fragment::Token(2),
                Fragment::Text("x")
            ]
        );
    }

    #[test]
    fn longest_token_wins_and_all_occurrences_are_cut() {
        let s = splitter(&[
            ("\n", TokenAttrs::USER_DEFINED),
            ("\n\n", TokenAttrs::USER_DEFINED),
        ]);
        assert_eq!(
            s.split("a\n\n\nb\n", false),
            [
                Fragment::Text("a"),
                Fragment::Token(1),
                Fragment::Token(0),
                Fragment::Text("b"),
                Fragment::Token(0)
            ]
        );
    }

    #[test]
    fn strip_flags_swallow_whitespace() {
        let s = splitter(&[
            ("<|end|>", TokenAttrs::CONTROL.with(TokenAttrs::RSTRIP)),
            ("<mask>", TokenAttrs::CONTROL.with(TokenAttrs::LSTRIP)),
        ]);
        assert_eq!(
            s.split("a <|end|> \n b", true),
            [
                Fragment::Text("a "),
                Fragment::Token(0),
                Fragment::Text("b")
            ]
        );
        assert_eq!(
            s.split("a  <mask> b", true),
            [
                Fragment::Text("a"),
                Fragment::Token(1),
                Fragment::Text(" b")
            ]
        );
    }

    #[test]
    fn protected_user_defined_tokens_stay_text_where_marked() {
        let s = splitter(&[
            ("<|im_start|>", TokenAttrs::CONTROL),
            ("<tool_call>", TokenAttrs::USER_DEFINED),
            ("<h1>", TokenAttrs::USER_DEFINED),
        ]);
        let protection = s.protection(|_, text| text == "<tool_call>");
        assert_eq!(s.protected_ids(&protection), [1]);
        let text = "<tool_call><h1>";
        // `<h1>` runs to the end, but no protected token begins with it: not marked.
        let marks = s.marks_in(text, &protection);
        assert_eq!(marks, [0]);
        assert_eq!(
            s.split_marked(text, true, &marks, &protection),
            [Fragment::Text("<tool_call>"), Fragment::Token(2)]
        );
        // Without the protection a mark does not keep it, as for any unprotected token.
        assert!(s.marks_in(text, &Protection::default()).is_empty());
        assert_eq!(
            s.split_marked(text, true, &marks, &Protection::default()),
            [Fragment::Token(1), Fragment::Token(2)]
        );
        assert_eq!(
            s.split_marked("<h1>", true, &[0], &protection),
            [Fragment::Token(2)]
        );
        // The end of a protected token at the start of user text is marked too.
        assert_eq!(s.marks_in("call> x", &protection), [0]);
        assert!(s.marks_in("h1> x", &protection).is_empty());
    }

    #[test]
    fn empty_and_plain_text() {
        let s = splitter(&[("<s>", TokenAttrs::CONTROL)]);
        assert!(s.split("", true).is_empty());
        assert_eq!(s.split("héllo", true), [Fragment::Text("héllo")]);
        assert_eq!(s.split("<s>", true), [Fragment::Token(0)]);
    }

    #[test]
    fn only_protected_tokens_prefixes_are_marked_at_the_end() {
        let s = splitter(&[
            ("thought\n", TokenAttrs::USER_DEFINED),
            ("<|turn>", TokenAttrs::CONTROL),
            ("tool>", TokenAttrs::USER_DEFINED),
        ]);
        let none = Protection::default();
        // `content` ends where the user-defined `thought` begins: no mark, the key stays.
        assert!(s.marks_in("content", &none).is_empty());
        // A control token whole or cut off by the end of the text is marked.
        assert_eq!(s.marks_in("a<|turn>", &none), [1]);
        assert_eq!(s.marks_in("a<|tu", &none), [1]);
        // A protected user-defined token's prefix is marked too.
        let protection = s.protection(|_, text| text == "tool>");
        assert_eq!(s.marks_in("a to", &protection), [2]);
        assert!(s.marks_in("a to", &none).is_empty());
    }
}
