//! The repair layer: [`RepairKind`] and the JSON repair pipeline run only when strict parsing fails.
//!
//! The JSON pipeline follows the reference order: strip a ```` ``` ```` fence → strip prose
//! around the JSON → (strict parse) → Python literals → trailing commas → close unbalanced
//! brackets → single quotes (then trailing commas and unbalanced brackets again). The text is
//! re-parsed after every step and only the steps that changed the text are recorded.

use serde::Serialize;
use serde_json::Value;

/// One kind of repair applied to turn model output into a call. Calls carry the kinds that were
/// needed, in the order they were applied; a repair is never silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairKind {
    /// A Markdown code fence (```` ```json … ``` ````) around the JSON was removed.
    FencedWrapper,
    /// Prose before the first `{`/`[` (or after the last `}`/`]`) was removed.
    ProsePrefix,
    /// Single-quoted strings were rewritten as JSON strings.
    SingleQuotes,
    /// Commas before `}` or `]` were removed.
    TrailingCommas,
    /// Truncated JSON (or a truncated Gemma 4 call) was closed: an open string and the open
    /// brackets, dropping a dangling key or incomplete value when needed.
    UnbalancedBraces,
    /// Python `True`/`False`/`None` outside strings became `true`/`false`/`null`.
    PythonLiterals,
    /// The envelope had no name; `arguments.name` (or `arguments.function`) became the name.
    NameInArgs,
    /// A JSON tool envelope without any tags (the last resort for tag-based formats).
    BareJson,
    /// A call block without its closing tag(s) was closed: truncated output, or the model moved
    /// on without closing. Parameters that were not complete are dropped.
    UnclosedBlock,
    /// Text inside a call block that is not part of the format was skipped.
    StrayText,
    /// A parameter given twice: the first value is kept.
    DuplicateKey,
    /// A Gemma 4 value that is not JSON-like (`city:Paris`) was taken as raw text.
    BareValue,
    /// Call markup named a tool that was not offered: it is returned as a call anyway (so an
    /// agent can answer "no such tool" and the model retry) instead of leaking the markup into
    /// the content. Bare JSON naming an unknown tool is not markup and stays content.
    UnknownTool,
}

impl RepairKind {
    /// The stable snake_case name (as in the reference's `repairs` list).
    pub fn as_str(self) -> &'static str {
        match self {
            RepairKind::FencedWrapper => "fenced_wrapper",
            RepairKind::ProsePrefix => "prose_prefix",
            RepairKind::SingleQuotes => "single_quotes",
            RepairKind::TrailingCommas => "trailing_commas",
            RepairKind::UnbalancedBraces => "unbalanced_braces",
            RepairKind::PythonLiterals => "python_literals",
            RepairKind::NameInArgs => "name_in_args",
            RepairKind::BareJson => "bare_json",
            RepairKind::UnclosedBlock => "unclosed_block",
            RepairKind::StrayText => "stray_text",
            RepairKind::DuplicateKey => "duplicate_key",
            RepairKind::BareValue => "bare_value",
            RepairKind::UnknownTool => "unknown_tool",
        }
    }
}

impl std::fmt::Display for RepairKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Appends `kind` unless already recorded (a kind is listed once, at its first application).
pub(crate) fn record(repairs: &mut Vec<RepairKind>, kind: RepairKind) {
    if !repairs.contains(&kind) {
        repairs.push(kind);
    }
}

/// JSON text and the repairs that made it parse.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RepairedJson {
    pub(crate) value: Value,
    pub(crate) repairs: Vec<RepairKind>,
}

fn strict(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(text.trim())
}

/// Parses `text` as one JSON value, repairing it when strict parsing fails.
///
/// Returns serde_json's error for the last attempt when nothing recovers it.
pub(crate) fn repair_json(text: &str) -> Result<RepairedJson, serde_json::Error> {
    let mut last_error = match strict(text) {
        Ok(value) => {
            return Ok(RepairedJson {
                value,
                repairs: Vec::new(),
            })
        }
        Err(error) => error,
    };
    let mut current = text.to_string();
    let mut repairs = Vec::new();
    macro_rules! attempt {
        ($candidate:expr, $kind:expr) => {
            if let Some(next) = $candidate {
                current = next;
                record(&mut repairs, $kind);
                match strict(&current) {
                    Ok(value) => return Ok(RepairedJson { value, repairs }),
                    Err(error) => last_error = error,
                }
            }
        };
    }
    attempt!(strip_fence(&current), RepairKind::FencedWrapper);
    attempt!(strip_prose(&current), RepairKind::ProsePrefix);
    attempt!(python_literals(&current), RepairKind::PythonLiterals);
    attempt!(strip_trailing_commas(&current), RepairKind::TrailingCommas);
    if let Some(value) = close_unbalanced(&current) {
        record(&mut repairs, RepairKind::UnbalancedBraces);
        return Ok(RepairedJson { value, repairs });
    }
    attempt!(single_quotes(&current), RepairKind::SingleQuotes);
    attempt!(strip_trailing_commas(&current), RepairKind::TrailingCommas);
    if let Some(value) = close_unbalanced(&current) {
        record(&mut repairs, RepairKind::UnbalancedBraces);
        return Ok(RepairedJson { value, repairs });
    }
    Err(last_error)
}

/// Removes a surrounding Markdown code fence: an opening ```` ``` ```` line (with an optional
/// language tag) and, when present, the closing ```` ``` ````.
pub(crate) fn strip_fence(text: &str) -> Option<String> {
    let trimmed = text.trim();
    let after_ticks = trimmed.strip_prefix("```")?;
    let tag_len = after_ticks
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .unwrap_or(after_ticks.len());
    let body = &after_ticks[tag_len..];
    let body = body.strip_suffix("```").unwrap_or(body);
    Some(body.to_string())
}

/// Keeps the text from the first `{`/`[` to the last `}`/`]` (or to the end when truncated).
fn strip_prose(text: &str) -> Option<String> {
    let trimmed = text.trim();
    let start = trimmed.find(['{', '['])?;
    let end = trimmed
        .rfind(['}', ']'])
        .filter(|&end| end > start)
        .map(|end| end + 1)
        .unwrap_or(trimmed.len());
    if start == 0 && end == trimmed.len() {
        return None;
    }
    Some(trimmed[start..end].to_string())
}

/// Walks `text` outside strings; `"` strings (with escapes) and `'` strings are skipped.
/// `visit(index, byte)` is called for every byte outside strings.
fn outside_strings(text: &str, mut visit: impl FnMut(usize, u8)) {
    let bytes = text.as_bytes();
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for (index, &byte) in bytes.iter().enumerate() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if byte == b'\\' {
                    escaped = true;
                } else if byte == q {
                    quote = None;
                }
            }
            None => {
                if byte == b'"' || byte == b'\'' {
                    quote = Some(byte);
                } else {
                    visit(index, byte);
                }
            }
        }
    }
}

/// `True`/`False`/`None` as whole words outside strings → `true`/`false`/`null`.
fn python_literals(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut replacements: Vec<(usize, usize, &str)> = Vec::new();
    let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut skip_until = 0;
    outside_strings(text, |index, byte| {
        if index < skip_until || !byte.is_ascii_uppercase() {
            return;
        }
        if index > 0 && is_word(bytes[index - 1]) {
            return;
        }
        for (word, json) in [("True", "true"), ("False", "false"), ("None", "null")] {
            let end = index + word.len();
            if bytes[index..].starts_with(word.as_bytes())
                && bytes.get(end).is_none_or(|&b| !is_word(b))
            {
                replacements.push((index, end, json));
                skip_until = end;
            }
        }
    });
    splice(text, &replacements)
}

/// Applies non-overlapping `(start, end, replacement)` edits in order; `None` when there are none.
fn splice(text: &str, edits: &[(usize, usize, &str)]) -> Option<String> {
    if edits.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for &(start, end, replacement) in edits {
        out.push_str(&text[at..start]);
        out.push_str(replacement);
        at = end;
    }
    out.push_str(&text[at..]);
    Some(out)
}

/// Removes every comma that is followed (after whitespace) by `}` or `]`, outside strings.
pub(crate) fn strip_trailing_commas(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut edits: Vec<(usize, usize, &str)> = Vec::new();
    outside_strings(text, |index, byte| {
        if byte == b',' {
            let next = bytes[index + 1..]
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .copied();
            if matches!(next, Some(b'}') | Some(b']')) {
                edits.push((index, index + 1, ""));
            }
        }
    });
    splice(text, &edits)
}

/// Closes truncated JSON. First the reference's way (close an open string, then every open
/// bracket); if that does not parse, cut back to the last complete value and close from there
/// (a dangling key, `:` or `,` is dropped). `None` when the text is not truncated JSON.
fn close_unbalanced(text: &str) -> Option<Value> {
    let scan = TruncationScan::run(text.trim())?;
    let trimmed = text.trim();
    let mut closed = trimmed.to_string();
    if scan.in_string {
        if scan.dangling_escape {
            closed.pop();
        }
        closed.push('"');
    }
    closed.extend(scan.stack.iter().rev().map(|&open| closer(open)));
    if let Ok(value) = serde_json::from_str(&closed) {
        return Some(value);
    }
    let mut cut = trimmed[..scan.last_complete].to_string();
    cut.extend(
        scan.stack[..scan.depth_at_complete]
            .iter()
            .rev()
            .map(|&open| closer(open)),
    );
    serde_json::from_str(&cut).ok()
}

fn closer(open: u8) -> char {
    if open == b'{' {
        '}'
    } else {
        ']'
    }
}

/// Where truncated JSON can be cut and closed.
struct TruncationScan {
    /// Open brackets at the end of the text, outermost first.
    stack: Vec<u8>,
    /// The text ends inside a string.
    in_string: bool,
    /// … right after a backslash.
    dangling_escape: bool,
    /// Byte length of the longest prefix that ends right after a complete value or an opening
    /// bracket (so that closing the brackets open there gives valid JSON).
    last_complete: usize,
    /// How many of `stack`'s brackets were open at `last_complete`.
    depth_at_complete: usize,
}

impl TruncationScan {
    /// `None` when nothing is open (not truncated), when a closer does not match, or when the
    /// text does not start with a bracket.
    fn run(text: &str) -> Option<TruncationScan> {
        let bytes = text.as_bytes();
        if !matches!(bytes.first(), Some(b'{') | Some(b'[')) {
            return None;
        }
        let mut stack: Vec<u8> = Vec::new();
        let mut in_string = false;
        let mut escaped = false;
        let mut last_complete = 0;
        let mut depth_at_complete = 0;
        // Whether the string being read is an object key (keys are not complete values).
        let mut string_is_key = false;
        // In an object: true when the next string is a key.
        let mut expect_key = false;
        let mut index = 0;
        while index < bytes.len() {
            let byte = bytes[index];
            if in_string {
                if escaped {
                    escaped = false;
                } else if byte == b'\\' {
                    escaped = true;
                } else if byte == b'"' {
                    in_string = false;
                    if !string_is_key {
                        last_complete = index + 1;
                        depth_at_complete = stack.len();
                    }
                }
                index += 1;
                continue;
            }
            match byte {
                b'"' => {
                    in_string = true;
                    string_is_key = stack.last() == Some(&b'{') && expect_key;
                    expect_key = false;
                }
                b'{' | b'[' => {
                    stack.push(byte);
                    expect_key = byte == b'{';
                    last_complete = index + 1;
                    depth_at_complete = stack.len();
                }
                b'}' | b']' => {
                    let open = stack.pop()?;
                    if closer(open) as u8 != byte {
                        return None;
                    }
                    expect_key = false;
                    last_complete = index + 1;
                    depth_at_complete = stack.len();
                    if stack.is_empty() && index + 1 < bytes.len() {
                        // Text after the top-level value: not a truncation.
                        return None;
                    }
                }
                b',' => expect_key = stack.last() == Some(&b'{'),
                b':' => expect_key = false,
                _ if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'.' => {
                    // A bare literal or number: complete only when something follows it.
                    let start = index;
                    while index < bytes.len()
                        && (bytes[index].is_ascii_alphanumeric()
                            || matches!(bytes[index], b'-' | b'+' | b'.'))
                    {
                        index += 1;
                    }
                    if index < bytes.len() && start < index {
                        last_complete = index;
                        depth_at_complete = stack.len();
                    }
                    continue;
                }
                _ => {}
            }
            index += 1;
        }
        if stack.is_empty() {
            return None;
        }
        Some(TruncationScan {
            stack,
            in_string,
            dangling_escape: in_string && escaped,
            last_complete,
            depth_at_complete,
        })
    }
}

/// Rewrites `'…'` strings as `"…"` strings, escaping embedded `"` and unescaping `\'`.
fn single_quotes(text: &str) -> Option<String> {
    if !text.contains('\'') {
        return None;
    }
    let mut out = String::with_capacity(text.len() + 8);
    let mut changed = false;
    let mut chars = text.chars().peekable();
    // None: outside strings; Some(q): inside a string opened by q.
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match quote {
            None => {
                if c == '\'' {
                    quote = Some('\'');
                    out.push('"');
                    changed = true;
                } else {
                    if c == '"' {
                        quote = Some('"');
                    }
                    out.push(c);
                }
            }
            Some('"') => {
                out.push(c);
                if c == '\\' {
                    if let Some(next) = chars.next() {
                        out.push(next);
                    }
                } else if c == '"' {
                    quote = None;
                }
            }
            Some(_) => match c {
                '\\' => match chars.next() {
                    Some('\'') => out.push('\''),
                    Some(next) => {
                        out.push('\\');
                        out.push(next);
                    }
                    None => {}
                },
                '"' => out.push_str("\\\""),
                '\'' => {
                    out.push('"');
                    quote = None;
                }
                _ => out.push(c),
            },
        }
    }
    if quote == Some('\'') {
        out.push('"');
    }
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn repaired(text: &str) -> (Value, Vec<&'static str>) {
        let result = repair_json(text).unwrap_or_else(|e| panic!("{text:?} did not repair: {e}"));
        (
            result.value,
            result.repairs.iter().map(|k| k.as_str()).collect(),
        )
    }

    #[test]
    fn strict_json_needs_no_repair() {
        assert_eq!(repaired(" {\"a\": 1} "), (json!({"a": 1}), vec![]));
    }

    #[test]
    fn each_repair_alone() {
        assert_eq!(
            repaired("```json\n{\"a\": 1}\n```"),
            (json!({"a": 1}), vec!["fenced_wrapper"])
        );
        assert_eq!(
            repaired("Sure, here: {\"a\": 1} done"),
            (json!({"a": 1}), vec!["prose_prefix"])
        );
        assert_eq!(
            repaired("{\"a\": True, \"b\": None, \"c\": \"True\"}"),
            (
                json!({"a": true, "b": null, "c": "True"}),
                vec!["python_literals"]
            )
        );
        assert_eq!(
            repaired("{\"a\": [1, 2,], }"),
            (json!({"a": [1, 2]}), vec!["trailing_commas"])
        );
        assert_eq!(
            repaired("{\"a\": {\"b\": \"tex"),
            (json!({"a": {"b": "tex"}}), vec!["unbalanced_braces"])
        );
        assert_eq!(
            repaired("{'a': 'it\\'s \"x\"'}"),
            (json!({"a": "it's \"x\""}), vec!["single_quotes"])
        );
    }

    #[test]
    fn truncation_drops_dangling_keys() {
        assert_eq!(repaired("{\"a\": 1, \"b").0, json!({"a": 1}));
        assert_eq!(repaired("{\"a\": 1, \"b\":").0, json!({"a": 1}));
        assert_eq!(repaired("{\"a\": [1, 2").0, json!({"a": [1, 2]}));
        assert_eq!(repaired("{\"a\": [1, 2,").0, json!({"a": [1, 2]}));
        assert_eq!(repaired("{\"a\": tru").0, json!({}));
        assert_eq!(repaired("[").0, json!([]));
    }

    #[test]
    fn repairs_combine_in_reference_order() {
        assert_eq!(
            repaired("```\n{'a': True, 'b': [1,],\n```"),
            (
                json!({"a": true, "b": [1]}),
                vec![
                    "fenced_wrapper",
                    "prose_prefix",
                    "python_literals",
                    "trailing_commas",
                    "single_quotes",
                    "unbalanced_braces"
                ]
            )
        );
    }

    #[test]
    fn hopeless_text_fails() {
        assert!(repair_json("no json here").is_err());
        assert!(repair_json("{\"a\": }}").is_err());
        assert!(repair_json("").is_err());
    }
}
