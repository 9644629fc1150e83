//! What a chat template can do, found out once when it is compiled: whether it renders tools,
//! whether it writes `<think>` reasoning, whether it accepts a system message.

/// What a chat template supports, as the server needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateCapabilities {
    /// The template reads the `tools` variable, so tool definitions reach the prompt.
    pub uses_tools: bool,
    /// The template writes `<think>`/`</think>` reasoning blocks (Qwen3, DeepSeek-R1, SmolLM3 …).
    pub uses_think_tags: bool,
    /// A system message renders: the template neither rejects it nor drops its text.
    pub supports_system_role: bool,
    /// The template marks assistant output with `{% generation %}` (transformers' assistant mask).
    pub marks_generation: bool,
}

/// The reasoning block tags of the thinking format.
pub const THINK_OPEN: &str = "<think>";
/// See [`THINK_OPEN`].
pub const THINK_CLOSE: &str = "</think>";

/// Whether `rendered` (a prompt ending with the generation prompt) leaves the model inside an
/// unclosed `<think>` block, so that its first tokens are reasoning (Qwen3 with thinking on,
/// DeepSeek-R1 and others that open `<think>` in the generation prompt).
pub fn starts_in_thinking(rendered: &str) -> bool {
    match rendered.rfind(THINK_OPEN) {
        Some(open) => !rendered[open..].contains(THINK_CLOSE),
        None => false,
    }
}

/// [`starts_in_thinking`] of a prompt whose client strings were marked with `user_mark`
/// ([`crate::markup`]): a tag right after the mark is a client's text, not the template's, and
/// neither opens nor closes a block.
pub fn starts_in_thinking_marked(rendered: &str, user_mark: char) -> bool {
    let templates = |tag: &'static str| {
        rendered
            .match_indices(tag)
            .map(|(at, _)| at)
            .filter(move |&at| !rendered[..at].ends_with(user_mark))
    };
    match templates(THINK_OPEN).last() {
        Some(open) => !templates(THINK_CLOSE).any(|close| close > open),
        None => false,
    }
}

/// Whether the template source mentions the `<think>` tags.
pub(crate) fn mentions_think_tags(source: &str) -> bool {
    source.contains(THINK_OPEN) && source.contains(THINK_CLOSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unclosed_think_at_the_end_is_thinking() {
        assert!(starts_in_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!starts_in_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!starts_in_thinking("<|im_start|>assistant\n"));
        assert!(starts_in_thinking(
            "<think>a</think>answer<|im_start|>assistant\n<think>"
        ));
    }

    #[test]
    fn marked_tags_are_client_text() {
        let m = '\u{FDD0}';
        let user = format!("<|im_start|>user\nsay {m}<think><|im_end|>\n<|im_start|>assistant\n");
        assert!(starts_in_thinking(&user.replace(m, "")));
        assert!(!starts_in_thinking_marked(&user, m));
        let open = format!("{user}<think>\n");
        assert!(starts_in_thinking_marked(&open, m));
        assert!(starts_in_thinking_marked(
            &format!("{open}x {m}</think>"),
            m
        ));
        assert!(!starts_in_thinking_marked(&format!("{open}x</think>"), m));
    }
}
