//! Hugging Face chat templates rendered with `minijinja`, byte for byte as transformers renders
//! them with jinja2.
//!
//! A model's `chat_template` (from `tokenizer_config.json`, `chat_template.jinja` or GGUF
//! `tokenizer.chat_template`) is compiled once into a [`ChatTemplate`] and rendered for every
//! request from a [`ChatInput`]: the messages (normalized first with [`normalize_messages`]), the
//! tools, `add_generation_prompt` and the request's `chat_template_kwargs` (`enable_thinking`,
//! `reasoning_effort` …).
//!
//! How the parts fit: `source` prepares the text (newlines, `{% generation %}` tags);
//! `environment` configures minijinja as transformers configures jinja2 (`trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, `tojson`, `namespace`) and
//! adds Python's printing (`python_str`), type tests (`python_types`), string and dict methods
//! (`python_methods`), filters (`filters`), `json.dumps` (`json`) and `strftime` on a [`Clock`];
//! [`normalize_messages`] turns OpenAI request messages into template input;
//! [`TemplateCapabilities`], [`ChatTemplate::reads_variable`] and [`starts_in_thinking`] tell the
//! server what a template does.
//!
//! Where wick knowingly differs from jinja2 (all outside the 70 llama.cpp test templates except
//! the first): `'…'|safe + text` does not HTML-escape `text` (markupsafe's `Markup.__add__` does);
//! the `~` operator and `loop` over a string follow minijinja (floats print without Python's
//! exponent form, no `loop.length`); `x|attr(name)` on a dict finds the key. And it accepts more
//! than jinja2's sandbox, as llama.cpp does: looping over `none`, `append`/`pop` on lists held in
//! a namespace, `from_json`, `tojson` of `map`/`select` results.
//!
//! ```
//! use wick_chat::chat_template::{ChatInput, ChatTemplate, TemplateTokens};
//!
//! let source = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
//!               {% if add_generation_prompt %}<|assistant|>{% endif %}";
//! let special = TemplateTokens { bos_token: Some("<s>".into()), ..TemplateTokens::default() };
//! let template = ChatTemplate::new(source, special).unwrap();
//! let input = ChatInput {
//!     messages: vec![serde_json::json!({"role": "user", "content": " Hello! "})],
//!     add_generation_prompt: true,
//!     ..ChatInput::default()
//! };
//! assert_eq!(template.render(&input).unwrap(), "<s><|user|>Hello!\n<|assistant|>");
//! ```

mod capabilities;
mod clock;
mod environment;
mod error;
mod filters;
mod json;
mod messages;
mod mutable_list;
mod python_methods;
mod python_str;
mod python_types;
mod source;
mod strftime;

use std::collections::BTreeSet;
use std::sync::Arc;

use minijinja::value::Value;
use minijinja::Environment;

pub use capabilities::{
    starts_in_thinking, starts_in_thinking_marked, TemplateCapabilities, THINK_CLOSE, THINK_OPEN,
};
pub use clock::{CivilTime, Clock, FixedClock, SystemClock};
pub use error::TemplateError;
pub use messages::{normalize_message, normalize_messages};
pub use strftime::strftime;

/// The special tokens a template may print (`{{ bos_token }}`), as transformers passes them: only
/// the ones the tokenizer defines become variables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateTokens {
    /// Beginning-of-sequence token, e.g. `<|begin_of_text|>`.
    pub bos_token: Option<String>,
    /// End-of-sequence token, e.g. `<|im_end|>` or `</s>`.
    pub eos_token: Option<String>,
    /// Unknown-token token.
    pub unk_token: Option<String>,
    /// Padding token.
    pub pad_token: Option<String>,
    /// Separator token.
    pub sep_token: Option<String>,
    /// Classifier token.
    pub cls_token: Option<String>,
    /// Mask token.
    pub mask_token: Option<String>,
}

impl TemplateTokens {
    fn variables(&self) -> impl Iterator<Item = (&'static str, &String)> {
        [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("pad_token", &self.pad_token),
            ("sep_token", &self.sep_token),
            ("cls_token", &self.cls_token),
            ("mask_token", &self.mask_token),
        ]
        .into_iter()
        .filter_map(|(name, token)| token.as_ref().map(|t| (name, t)))
    }
}

/// One rendering's input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatInput {
    /// The conversation: JSON objects with `role`, `content` (a string or a list of parts),
    /// `tool_calls`, `tool_call_id`, `reasoning_content` …, usually after [`normalize_messages`].
    pub messages: Vec<serde_json::Value>,
    /// Tool definitions (`{"type": "function", "function": {...}}`); `None` renders as `tools = none`.
    pub tools: Option<Vec<serde_json::Value>>,
    /// End the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Further template variables: `enable_thinking`, `reasoning_effort`, anything from the
    /// request's `chat_template_kwargs`. They override the special tokens of the same name.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template: compile once, render for every request, from any thread.
pub struct ChatTemplate {
    env: Environment<'static>,
    special: TemplateTokens,
    capabilities: TemplateCapabilities,
    /// Variables the template reads without setting them first (`messages`, `tools`,
    /// `enable_thinking`, `xml_tools` …), with attribute paths (`message.content`).
    variables: BTreeSet<String>,
    /// The source it was compiled from.
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special", &self.special)
            .field("capabilities", &self.capabilities)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `strftime_now` reads the system clock (UTC).
    pub fn new(source: &str, special: TemplateTokens) -> Result<ChatTemplate, TemplateError> {
        ChatTemplate::with_clock(source, special, Arc::new(SystemClock))
    }

    /// Compiles `source` with the clock `strftime_now` reads (a [`FixedClock`] for
    /// reproducible prompts).
    pub fn with_clock(
        source: &str,
        special: TemplateTokens,
        clock: Arc<dyn Clock>,
    ) -> Result<ChatTemplate, TemplateError> {
        let env = environment::build(source::prepare(source), clock)?;
        let variables = env
            .get_template(environment::TEMPLATE_NAME)
            .map_err(|err| TemplateError::from_compile(&err))?
            .undeclared_variables(true)
            .into_iter()
            .collect();
        let mut template = ChatTemplate {
            env,
            special,
            variables,
            source: source.to_string(),
            capabilities: TemplateCapabilities {
                uses_tools: false,
                uses_think_tags: capabilities::mentions_think_tags(source),
                supports_system_role: true,
                marks_generation: source::has_generation_tags(source),
            },
        };
        template.capabilities.uses_tools = template.reads_variable("tools");
        template.capabilities.supports_system_role = template.probe_system_role();
        Ok(template)
    }

    /// What the template supports.
    pub fn capabilities(&self) -> TemplateCapabilities {
        self.capabilities
    }

    /// The template's source, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens given at construction.
    pub fn special_tokens(&self) -> &TemplateTokens {
        &self.special
    }

    /// Renders the prompt for `input`.
    pub fn render(&self, input: &ChatInput) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(environment::TEMPLATE_NAME)
            .map_err(|err| TemplateError::from_render(&err))?;
        template
            .render(self.context(input))
            .map_err(|err| TemplateError::from_render(&err))
    }

    /// The variables a rendering sees, in transformers' order of precedence: special tokens, then
    /// the kwargs, then `messages`, `tools`, `documents` and `add_generation_prompt`.
    fn context(&self, input: &ChatInput) -> Value {
        let mut variables: Vec<(String, Value)> = self
            .special
            .variables()
            .map(|(name, token)| (name.to_string(), Value::from(token.as_str())))
            .collect();
        variables.extend(
            input
                .kwargs
                .iter()
                .map(|(name, value)| (name.clone(), json::template_value(value))),
        );
        variables.push((
            "messages".into(),
            input.messages.iter().map(json::template_value).collect(),
        ));
        variables.push((
            "tools".into(),
            input.tools.as_ref().map_or(Value::from(()), |tools| {
                tools.iter().map(json::template_value).collect()
            }),
        ));
        variables.push(("documents".into(), Value::from(())));
        variables.push((
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        ));
        Value::from_pairs(variables)
    }

    /// Whether the template reads the variable `name` (set by the caller, not by the template
    /// before use), e.g. `tools`, `enable_thinking`, `reasoning_effort`, `xml_tools`.
    pub fn reads_variable(&self, name: &str) -> bool {
        self.variables.iter().any(|v| {
            v == name
                || v.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('.'))
        })
    }

    /// Renders a system message holding a marker: supported when the marker reaches the prompt.
    /// When the template fails even without a system message, nothing can be concluded and the
    /// answer is yes.
    fn probe_system_role(&self) -> bool {
        const MARKER: &str = "wick-system-probe-7f3a";
        let user = serde_json::json!({"role": "user", "content": "Hello"});
        let with_system = ChatInput {
            messages: vec![
                serde_json::json!({"role": "system", "content": MARKER}),
                user.clone(),
            ],
            add_generation_prompt: true,
            ..ChatInput::default()
        };
        match self.render(&with_system) {
            Ok(rendered) => rendered.contains(MARKER),
            Err(_) => {
                let without = ChatInput {
                    messages: vec![user],
                    add_generation_prompt: true,
                    ..ChatInput::default()
                };
                self.render(&without).is_err()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn chat_template_is_send_and_sync() {
        assert_send_sync::<ChatTemplate>();
    }
}
