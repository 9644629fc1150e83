//! Shared by the chat-template tests: the real templates from the llama.cpp test assets and the
//! conversations in `tests/goldens/chat_templates/conversations.json`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use wick_chat::chat_template::{ChatInput, ChatTemplate, CivilTime, FixedClock, TemplateTokens};

/// `tests/goldens/chat_templates` of this crate.
pub fn goldens_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/chat_templates")
}

/// `$WICK_HOME/assets/llama.cpp/templates`, or an error telling how to get it.
pub fn templates_dir() -> Result<PathBuf> {
    let home = match std::env::var_os("WICK_HOME") {
        Some(home) => PathBuf::from(home),
        None => {
            PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cache/wick")
        }
    };
    let dir = home.join("assets/llama.cpp/templates");
    if !dir.is_dir() {
        bail!("{} is missing: run `wick pull test-assets`", dir.display());
    }
    Ok(dir)
}

/// Every `.jinja` file of the real templates, sorted by name.
pub fn template_files() -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(templates_dir()?)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "jinja"))
        .collect();
    files.sort();
    Ok(files)
}

/// One conversation of `conversations.json`.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub name: String,
    pub input: ChatInput,
}

/// The parsed `conversations.json`.
#[derive(Debug)]
pub struct Spec {
    pub now: CivilTime,
    pub special: TemplateTokens,
    pub conversations: Vec<Conversation>,
    pub fallback_shapes: Vec<String>,
    pub golden_sample: Vec<String>,
}

impl Spec {
    pub fn load() -> Result<Spec> {
        let path = goldens_dir().join("conversations.json");
        let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
        let json: Value = serde_json::from_str(&text)?;
        let now = json["now"].as_str().context("now")?;
        let number = |range: std::ops::Range<usize>| -> Result<u32> { Ok(now[range].parse()?) };
        let now = CivilTime::new(
            now[0..4].parse()?,
            number(5..7)?,
            number(8..10)?,
            number(11..13)?,
            number(14..16)?,
            number(17..19)?,
        )
        .context("now is not a valid date")?;
        let special = TemplateTokens {
            bos_token: json["special_tokens"]["bos_token"]
                .as_str()
                .map(String::from),
            eos_token: json["special_tokens"]["eos_token"]
                .as_str()
                .map(String::from),
            ..TemplateTokens::default()
        };
        let tools: Vec<Value> = json["tools"].as_array().context("tools")?.clone();
        let mut conversations = Vec::new();
        for (name, conv) in json["conversations"].as_object().context("conversations")? {
            conversations.push(Conversation {
                name: name.clone(),
                input: ChatInput {
                    messages: conv["messages"].as_array().context("messages")?.clone(),
                    tools: conv["tools"]
                        .as_bool()
                        .unwrap_or(false)
                        .then(|| tools.clone()),
                    add_generation_prompt: conv["add_generation_prompt"].as_bool().unwrap_or(false),
                    kwargs: conv["kwargs"].as_object().cloned().unwrap_or_default(),
                },
            });
        }
        let strings = |key: &str| -> Vec<String> {
            json[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok(Spec {
            now,
            special,
            conversations,
            fallback_shapes: strings("fallback_shapes"),
            golden_sample: strings("golden_sample"),
        })
    }

    pub fn conversation(&self, name: &str) -> Result<&Conversation> {
        self.conversations
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| anyhow!("no conversation {name}"))
    }

    /// Compiles a template file with the spec's special tokens and fixed clock.
    pub fn compile(&self, path: &Path) -> Result<ChatTemplate> {
        let source = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        ChatTemplate::with_clock(
            &source,
            self.special.clone(),
            Arc::new(FixedClock(self.now)),
        )
        .with_context(|| format!("compiling {}", path.display()))
    }
}

/// Where two texts first differ, with a little context on each side, for failure messages.
pub fn first_difference(expected: &str, actual: &str) -> String {
    let at = expected
        .char_indices()
        .zip(actual.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(expected.len().min(actual.len()));
    let at = (0..=at)
        .rev()
        .find(|i| expected.is_char_boundary(*i) && actual.is_char_boundary(*i))
        .unwrap_or(0);
    let start = (0..=at.saturating_sub(60))
        .rev()
        .find(|i| expected.is_char_boundary(*i) && actual.is_char_boundary(*i))
        .unwrap_or(0);
    let end = |s: &str| {
        (at + 80..=s.len())
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(s.len())
            .min(s.len())
    };
    format!(
        "first difference at byte {at} (expected {} bytes, got {}):\n  expected: {:?}\n  actual:   {:?}",
        expected.len(),
        actual.len(),
        &expected[start..end(expected)],
        &actual[start..end(actual)]
    )
}
