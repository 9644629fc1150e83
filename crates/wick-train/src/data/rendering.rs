//! How a row's prompt becomes tokens. `messages` rows (and prompts given as a list of
//! messages) always go through the chat template; `text` rows never do. A string `prompt`
//! (prompt-completion and preference rows) is rendered as mlx-lm's `CompletionsDataset`
//! renders it: a user turn of the model's chat template with the generation prompt, the
//! response as the assistant's reply up to the template's end of turn. That is what
//! `wick serve`'s chat endpoints feed the model, so an adapter trained on such rows changes
//! chat replies. `--raw-prompt` keeps the text as it is (what `/v1/completions` feeds).
use serde_json::{json, Value};

/// What a string `prompt` becomes, as asked for (`--raw-prompt`, the job's `raw_prompt`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PromptStyle {
    /// `<template: system?, user: PROMPT, generation prompt>RESPONSE<end of turn>`, falling
    /// back to [`PromptStyle::Raw`] for a model without a chat template.
    #[default]
    Chat,
    /// `PROMPT` tokenized as it is, then `RESPONSE` and an EOS.
    Raw,
}

impl PromptStyle {
    /// `raw` is the `--raw-prompt` flag.
    pub fn from_raw_flag(raw: bool) -> PromptStyle {
        if raw {
            PromptStyle::Raw
        } else {
            PromptStyle::Chat
        }
    }
}

/// Whether the base model has a chat template, as far as the caller knows (`inspect-dataset`
/// over HTTP may not have the model at hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateKnown {
    /// The model has a chat template.
    Present,
    /// The model has none.
    Absent,
    /// Not looked at.
    Unknown,
}

impl From<bool> for TemplateKnown {
    fn from(present: bool) -> Self {
        if present {
            TemplateKnown::Present
        } else {
            TemplateKnown::Absent
        }
    }
}

/// How a dataset's rows become tokens: what `wick train`, `wick inspect-dataset`, the
/// inspect-dataset route and the web UI's fine-tune page report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rendering {
    /// `messages` rows, or prompts given as messages: every turn through the chat template,
    /// the loss on the last assistant turn.
    Messages,
    /// String prompts as a user turn of the chat template (with the generation prompt), the
    /// response as the assistant's reply through the template's end of turn.
    UserTurn,
    /// As [`Rendering::UserTurn`] when the model has a chat template, else raw (the model
    /// was not looked at).
    UserTurnIfTemplate,
    /// String prompts as raw text, the response after them and an EOS (`--raw-prompt`).
    RawPrompt,
    /// String prompts as raw text because the model has no chat template.
    RawNoTemplate,
    /// `text` rows: the text and an EOS.
    Text,
}

impl Rendering {
    /// The rendering of a dataset whose rows have string prompts or not, for a prompt style
    /// and what is known of the model's template.
    pub fn of(
        format: super::Format,
        string_prompts: bool,
        style: PromptStyle,
        template: TemplateKnown,
    ) -> Rendering {
        use super::Format;
        match format {
            Format::Text => Rendering::Text,
            Format::Messages => Rendering::Messages,
            Format::PromptCompletion | Format::Preference if !string_prompts => Rendering::Messages,
            Format::PromptCompletion | Format::Preference => match (style, template) {
                (PromptStyle::Raw, _) => Rendering::RawPrompt,
                (PromptStyle::Chat, TemplateKnown::Present) => Rendering::UserTurn,
                (PromptStyle::Chat, TemplateKnown::Absent) => Rendering::RawNoTemplate,
                (PromptStyle::Chat, TemplateKnown::Unknown) => Rendering::UserTurnIfTemplate,
            },
        }
    }

    /// `chat_template` or `raw`: whether string prompts (or all rows) meet the template.
    /// [`Rendering::UserTurnIfTemplate`] is `chat_template`, what every model with a
    /// template gets.
    pub fn name(self) -> &'static str {
        match self {
            Rendering::Messages | Rendering::UserTurn | Rendering::UserTurnIfTemplate => {
                "chat_template"
            }
            Rendering::RawPrompt | Rendering::RawNoTemplate | Rendering::Text => "raw",
        }
    }

    /// One sentence for people: what the model sees and what an adapter learns.
    pub fn describe(self) -> &'static str {
        match self {
            Rendering::Messages => {
                "chat template: every turn rendered as in chat, the loss on the last \
                 assistant turn"
            }
            Rendering::UserTurn => {
                "chat template: each prompt is a user turn (with the generation prompt) and \
                 the response the assistant's reply up to the end of turn, as chat requests \
                 are rendered"
            }
            Rendering::UserTurnIfTemplate => {
                "chat template: each prompt is a user turn (with the generation prompt) and \
                 the response the assistant's reply up to the end of turn, as chat requests \
                 are rendered (raw text if the base model has no chat template)"
            }
            Rendering::RawPrompt => {
                "raw, as asked: each prompt is tokenized as plain text and the response \
                 follows with an EOS; the adapter learns raw completions (/v1/completions), \
                 not chat replies"
            }
            Rendering::RawNoTemplate => {
                "raw: the base model has no chat template, so each prompt is tokenized as \
                 plain text and the response follows with an EOS"
            }
            Rendering::Text => "raw: each text is tokenized as it is, with an EOS",
        }
    }
}

/// A string prompt as the single user message mlx-lm makes of it.
pub(super) fn user_turn(prompt: &str) -> Vec<Value> {
    vec![json!({"role": "user", "content": prompt})]
}
