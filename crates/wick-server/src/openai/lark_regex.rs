//! A regular Lark grammar as one regular expression, so a custom tool's Lark `format` can
//! bind the JSON string the model writes its input as (a JSON Schema `pattern`, which
//! llguidance matches against the string's unescaped text).
//!
//! Only grammars without recursion are regular; for those, every rule is inlined into
//! `start`. The subset read: rules and terminals (`name:` / `NAME:`, `?name:`, priorities
//! `name.2:`), alternatives over several lines (`| …`), string literals (`"…"`, JSON-style
//! escapes), regular expressions (`/…/` with flags `i`, `s`), groups `( … )`, optional
//! `[ … ]`, `?`, `*`, `+`, `~ n` and `~ n..m`, aliases `-> name` (dropped), comments `//`,
//! and `%import common.X` for the usual terminals (`LF`, `CR`, `WS`, `DIGIT`, …). Anything
//! else (`%ignore`, `%json`, special tokens, character ranges, recursion) gives `None`: the
//! grammar is then shown to the model but not enforced.
use std::collections::{HashMap, HashSet};

/// The longest expression produced (a bound on what inlining may blow up to).
const MAX_REGEX_BYTES: usize = 64 << 10;

/// The regular expression of `grammar`'s `start` rule, anchored, or `None` when the grammar
/// is outside the subset (see the module documentation) or not regular.
pub fn lark_to_regex(grammar: &str) -> Option<String> {
    let rules = parse_rules(grammar)?;
    let mut done = HashMap::new();
    let body = inline("start", &rules, &mut done, &mut HashSet::new())?;
    let out = format!("^(?:{body})$");
    (out.len() <= MAX_REGEX_BYTES).then_some(out)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Lit(String),
    Rx(String),
    Name(String),
    Open,
    Close,
    OpenOpt,
    CloseOpt,
    Bar,
    Quant(char),
    Repeat(u32, Option<u32>),
}

/// The common terminals `%import common.X` may bring in.
fn common(name: &str) -> Option<&'static str> {
    Some(match name {
        "LF" => r"\n",
        "CR" => r"\r",
        "NEWLINE" => r"(?:\r?\n)+",
        "WS" => r"[ \t\f\r\n]+",
        "WS_INLINE" => r"[ \t]+",
        "DIGIT" => "[0-9]",
        "HEXDIGIT" => "[0-9a-fA-F]",
        "INT" => "[0-9]+",
        "LETTER" => "[a-zA-Z]",
        "LCASE_LETTER" => "[a-z]",
        "UCASE_LETTER" => "[A-Z]",
        "WORD" => "[a-zA-Z]+",
        "CNAME" => "[a-zA-Z_][a-zA-Z0-9_]*",
        _ => return None,
    })
}

fn parse_rules(grammar: &str) -> Option<HashMap<String, Vec<Tok>>> {
    let mut rules: HashMap<String, Vec<Tok>> = HashMap::new();
    let mut current: Option<String> = None;
    for raw in grammar.lines() {
        let line = strip_comment(raw);
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(directive) = trimmed.strip_prefix('%') {
            let rest = directive.strip_prefix("import")?.trim();
            let name = rest.strip_prefix("common.")?.trim();
            let (name, alias) = match name.split_once("->") {
                Some((n, a)) => (n.trim(), a.trim()),
                None => (name, name),
            };
            rules.insert(alias.to_string(), vec![Tok::Rx(common(name)?.to_string())]);
            current = None;
            continue;
        }
        if let Some(more) = trimmed.strip_prefix('|') {
            let name = current.as_ref()?;
            let mut toks = vec![Tok::Bar];
            toks.extend(tokenize(more)?);
            rules.get_mut(name)?.extend(toks);
            continue;
        }
        let (head, body) = trimmed.split_once(':')?;
        let head = head.trim().trim_start_matches('?');
        let name = head.split('.').next()?.trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        if rules.contains_key(name) {
            return None;
        }
        rules.insert(name.to_string(), tokenize(body)?);
        current = Some(name.to_string());
    }
    Some(rules)
}

/// `line` without a `//` comment outside literals and regexes.
fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut i = 0;
    let mut in_str = false;
    let mut in_rx = false;
    while i < bytes.len() {
        let c = bytes[i];
        if (in_str || in_rx) && c == b'\\' {
            i += 2;
            continue;
        }
        match c {
            b'"' if !in_rx => in_str = !in_str,
            b'/' if !in_str && !in_rx && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            b'/' if !in_str => in_rx = !in_rx,
            _ => {}
        }
        i += 1;
    }
    line
}

fn tokenize(text: &str) -> Option<Vec<Tok>> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' => i += 1,
            '"' => {
                let mut s = String::new();
                i += 1;
                loop {
                    let c = *chars.get(i)?;
                    i += 1;
                    match c {
                        '"' => break,
                        '\\' => {
                            let e = *chars.get(i)?;
                            i += 1;
                            s.push(match e {
                                'n' => '\n',
                                't' => '\t',
                                'r' => '\r',
                                '"' => '"',
                                '\\' => '\\',
                                '/' => '/',
                                _ => return None,
                            });
                        }
                        c => s.push(c),
                    }
                }
                // A case-insensitive literal (`"x"i`) is outside the subset.
                if chars.get(i) == Some(&'i') {
                    return None;
                }
                out.push(Tok::Lit(s));
            }
            '/' => {
                let mut rx = String::new();
                i += 1;
                loop {
                    let c = *chars.get(i)?;
                    i += 1;
                    match c {
                        '/' => break,
                        '\\' => {
                            let e = *chars.get(i)?;
                            i += 1;
                            if e != '/' {
                                rx.push('\\');
                            }
                            rx.push(e);
                        }
                        c => rx.push(c),
                    }
                }
                let mut flags = String::new();
                while let Some(&f) = chars.get(i) {
                    if f == 'i' || f == 's' {
                        flags.push(f);
                        i += 1;
                    } else if f.is_ascii_alphabetic() {
                        return None;
                    } else {
                        break;
                    }
                }
                out.push(Tok::Rx(if flags.is_empty() {
                    rx
                } else {
                    format!("(?{flags}:{rx})")
                }));
            }
            '(' => {
                out.push(Tok::Open);
                i += 1;
            }
            ')' => {
                out.push(Tok::Close);
                i += 1;
            }
            '[' => {
                out.push(Tok::OpenOpt);
                i += 1;
            }
            ']' => {
                out.push(Tok::CloseOpt);
                i += 1;
            }
            '|' => {
                out.push(Tok::Bar);
                i += 1;
            }
            '?' | '*' | '+' => {
                out.push(Tok::Quant(c));
                i += 1;
            }
            '~' => {
                i += 1;
                let rest: String = chars[i..].iter().collect();
                let rest = rest.trim_start();
                let skipped = chars.len() - i - rest.chars().count();
                let spec: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.')
                    .collect();
                i += skipped + spec.chars().count();
                let (lo, hi) = match spec.split_once("..") {
                    Some((lo, hi)) => (lo.parse().ok()?, Some(hi.parse().ok()?)),
                    None => {
                        let n = spec.parse().ok()?;
                        (n, Some(n))
                    }
                };
                out.push(Tok::Repeat(lo, hi));
            }
            '-' if chars.get(i + 1) == Some(&'>') => {
                // An alias names the tree node; the text is the same. It ends the
                // alternative's items.
                i += 2;
                while i < chars.len() && chars[i] != '|' {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push(Tok::Name(chars[start..i].iter().collect()));
            }
            _ => return None,
        }
    }
    Some(out)
}

/// The expression of rule `name`, its references inlined; `None` on recursion or an
/// unknown name.
fn inline(
    name: &str,
    rules: &HashMap<String, Vec<Tok>>,
    done: &mut HashMap<String, String>,
    active: &mut HashSet<String>,
) -> Option<String> {
    if let Some(rx) = done.get(name) {
        return Some(rx.clone());
    }
    if !active.insert(name.to_string()) {
        return None; // recursion: not regular (as far as this reading goes)
    }
    let toks = rules.get(name)?;
    let mut pos = 0;
    let rx = alternatives(toks, &mut pos, rules, done, active)?;
    if pos != toks.len() {
        return None;
    }
    active.remove(name);
    if rx.len() > MAX_REGEX_BYTES {
        return None;
    }
    done.insert(name.to_string(), rx.clone());
    Some(rx)
}

fn alternatives(
    toks: &[Tok],
    pos: &mut usize,
    rules: &HashMap<String, Vec<Tok>>,
    done: &mut HashMap<String, String>,
    active: &mut HashSet<String>,
) -> Option<String> {
    let mut alts = vec![sequence(toks, pos, rules, done, active)?];
    while toks.get(*pos) == Some(&Tok::Bar) {
        *pos += 1;
        alts.push(sequence(toks, pos, rules, done, active)?);
    }
    Some(if alts.len() == 1 {
        alts.remove(0)
    } else {
        format!("(?:{})", alts.join("|"))
    })
}

fn sequence(
    toks: &[Tok],
    pos: &mut usize,
    rules: &HashMap<String, Vec<Tok>>,
    done: &mut HashMap<String, String>,
    active: &mut HashSet<String>,
) -> Option<String> {
    let mut out = String::new();
    while let Some(t) = toks.get(*pos) {
        let atom = match t {
            Tok::Bar | Tok::Close | Tok::CloseOpt => break,
            Tok::Lit(s) => {
                *pos += 1;
                format!("(?:{})", escape(s))
            }
            Tok::Rx(r) => {
                *pos += 1;
                format!("(?:{r})")
            }
            Tok::Name(n) => {
                *pos += 1;
                format!("(?:{})", inline(n, rules, done, active)?)
            }
            Tok::Open | Tok::OpenOpt => {
                let optional = *t == Tok::OpenOpt;
                *pos += 1;
                let inner = alternatives(toks, pos, rules, done, active)?;
                let close = if optional { Tok::CloseOpt } else { Tok::Close };
                if toks.get(*pos) != Some(&close) {
                    return None;
                }
                *pos += 1;
                if optional {
                    format!("(?:{inner})?")
                } else {
                    format!("(?:{inner})")
                }
            }
            Tok::Quant(_) | Tok::Repeat(..) => return None,
        };
        let atom = match toks.get(*pos) {
            Some(Tok::Quant(q)) => {
                *pos += 1;
                format!("{atom}{q}")
            }
            Some(Tok::Repeat(lo, hi)) => {
                *pos += 1;
                match hi {
                    Some(hi) if hi == lo => format!("{atom}{{{lo}}}"),
                    Some(hi) => format!("{atom}{{{lo},{hi}}}"),
                    None => format!("{atom}{{{lo},}}"),
                }
            }
            _ => atom,
        };
        out.push_str(&atom);
        if out.len() > MAX_REGEX_BYTES {
            return None;
        }
    }
    Some(out)
}

/// `text` as a regex that matches it literally.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str(r"\n"),
            '\r' => out.push_str(r"\r"),
            '\t' => out.push_str(r"\t"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATCH: &str = r#"start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"#;

    #[test]
    fn codex_apply_patch_grammar_is_regular() {
        let rx = lark_to_regex(PATCH).expect("regular");
        assert!(rx.starts_with("^(?:") && rx.ends_with(")$"), "{rx}");
        assert!(rx.contains(r"\*\*\* Begin Patch"), "{rx}");
        assert!(!rx.contains("line"), "aliases are dropped: {rx}");
    }

    #[test]
    fn operators_map_to_regex_operators() {
        let rx = lark_to_regex("start: \"a\" [\"b\"] (\"c\" | D)* E~2..3 F~2\nD: /[0-9]/i\nE: \"e\"\nF: \"f\" // comment").unwrap();
        assert_eq!(
            rx,
            "^(?:(?:a)(?:(?:b))?(?:(?:(?:c)|(?:(?:(?i:[0-9])))))*(?:(?:e)){2,3}(?:(?:f)){2})$"
        );
    }

    #[test]
    fn what_is_not_regular_or_not_read_gives_none() {
        for g in [
            "start: \"(\" start \")\" | \"x\"",    // recursion
            "start: a\na: b\nb: a",                // indirect recursion
            "start: missing",                      // unknown rule
            "start: \"a\"\n%ignore \" \"",         // a directive outside the subset
            "start: %json {\"type\": \"object\"}", // llguidance's extension
            "start: \"a\"..\"z\"",                 // character ranges
            "start: \"x\"i",                       // case-insensitive literal
            "other: \"x\"",                        // no start
        ] {
            assert_eq!(lark_to_regex(g), None, "{g}");
        }
    }
}
