//! Template source as jinja2 would read it: newlines normalized, and transformers'
//! `{% generation %}` tag turned into something minijinja understands.
//!
//! - jinja2 turns `\r\n` and `\r` into `\n` everywhere in a template (text and string literals).
//! - transformers' `AssistantTracker` extension adds `{% generation %}…{% endgeneration %}`, which
//!   renders its body unchanged (it only records where assistant text lies). Rewriting the tags
//!   to `{% if true %}…{% endif %}` keeps the body and every whitespace-control modifier, so
//!   `trim_blocks`/`lstrip_blocks` and `-` act on them exactly as on the original tags.

/// The source minijinja should compile for a Hugging Face chat template.
pub(crate) fn prepare(source: &str) -> String {
    let normalized = source.replace("\r\n", "\n").replace('\r', "\n");
    rewrite_generation_tags(&normalized)
}

/// Whether a template marks assistant output with `{% generation %}`.
pub(crate) fn has_generation_tags(source: &str) -> bool {
    find_block_tags(source)
        .iter()
        .any(|tag| matches!(tag.keyword, "generation" | "endgeneration"))
}

fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut copied = 0;
    for tag in find_block_tags(source) {
        let replacement = match tag.keyword {
            "generation" => "if true",
            "endgeneration" => "endif",
            _ => continue,
        };
        out.push_str(&source[copied..tag.keyword_start]);
        out.push_str(replacement);
        copied = tag.keyword_start + tag.keyword.len();
    }
    out.push_str(&source[copied..]);
    out
}

/// A `{% keyword %}` tag whose whole body is one word.
struct BlockTag<'a> {
    keyword: &'a str,
    keyword_start: usize,
}

/// Every block tag made of a single word (`{%- generation -%}`, `{% endgeneration %}`, `{% else %}`),
/// outside comments and `{% raw %}` sections.
fn find_block_tags(source: &str) -> Vec<BlockTag<'_>> {
    let mut tags = Vec::new();
    let mut at = 0;
    let mut in_raw = false;
    while let Some(offset) = source[at..].find('{') {
        let start = at + offset;
        let rest = &source[start..];
        if !in_raw && rest.starts_with("{#") {
            // The closing `#}` comes after the opening `{#` (`{#}` does not close itself).
            at = match rest[2..].find("#}") {
                Some(end) => start + 2 + end + 2,
                None => source.len(),
            };
            continue;
        }
        if !rest.starts_with("{%") {
            at = start + 1;
            continue;
        }
        // The closing `%}` comes after the opening `{%` (in `{%}` they overlap).
        let Some(end) = rest[2..].find("%}").map(|e| e + 2) else {
            break;
        };
        let inner = &rest[2..end];
        let trimmed = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+']);
        let word = trimmed.trim();
        let is_word =
            !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if is_word {
            if in_raw {
                if word == "endraw" {
                    in_raw = false;
                }
            } else if word == "raw" {
                in_raw = true;
            } else {
                let keyword_start = start
                    + 2
                    + (inner.len() - inner.trim_start_matches(['-', '+']).len())
                    + (trimmed.len() - trimmed.trim_start().len());
                tags.push(BlockTag {
                    keyword: word,
                    keyword_start,
                });
            }
        }
        at = start + end + 2;
    }
    tags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_if_blocks_keeping_modifiers() {
        let src = "a{%- generation -%}\n  b\n{% endgeneration %}c";
        assert_eq!(prepare(src), "a{%- if true -%}\n  b\n{% endif %}c");
        assert!(has_generation_tags(src));
    }

    #[test]
    fn other_text_is_left_alone() {
        let src = "{# {% generation %} #}{% raw %}{% generation %}{% endraw %}{{ 'generation' }}{% if x %}y{% endif %}";
        assert_eq!(prepare(src), src);
        assert!(!has_generation_tags(src));
    }

    #[test]
    fn overlapping_tag_marks_do_not_panic() {
        // Found by wick-fuzz: `{%}` once sliced `rest[2..1]`.
        for src in [
            "{%}",
            "{%}}",
            "a{%}{% generation %}b",
            "{#}",
            "{#}#}{% generation %}",
        ] {
            let _ = prepare(src);
            let _ = has_generation_tags(src);
        }
        assert_eq!(prepare("{#}{% generation %}#}"), "{#}{% generation %}#}");
    }

    #[test]
    fn newlines_are_normalized() {
        assert_eq!(prepare("a\r\nb\rc"), "a\nb\nc");
    }
}
