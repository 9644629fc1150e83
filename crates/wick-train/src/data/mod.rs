//! Training data: `train.jsonl` (and an optional `valid.jsonl`) in a directory, one JSON
//! object a line, the format told by the first row's keys:
//!
//! | format | row | loss on |
//! |---|---|---|
//! | messages | `{"messages": [{role, content}, …]}` | the last assistant turn only; the boundary is the render of the turns before it with the generation prompt (longest common prefix) |
//! | prompt-completion | `{"prompt": string or messages, "completion"}` | the completion, through the template's end of turn |
//! | text | `{"text"}` | every token (EOS appended) |
//! | preference | `{"prompt": string or messages, "chosen", "rejected"}` | each response, as a completion |
//!
//! A string prompt is a user turn of the chat template unless raw prompts are asked for
//! ([`rendering`]). A malformed row is an error naming the file and line.
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use wick_chat::chat_template::{normalize_messages, ChatInput};
use wick_engine::Model;

use crate::error::{io, Result, TrainError};

pub mod rendering;

pub use rendering::{PromptStyle, Rendering, TemplateKnown};

/// The row shapes a dataset may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{"messages": [...]}`.
    Messages,
    /// `{"prompt", "completion"}`.
    PromptCompletion,
    /// `{"text"}`.
    Text,
    /// `{"prompt", "chosen", "rejected"}`.
    Preference,
}

impl Format {
    /// The name `inspect-dataset` reports.
    pub fn name(self) -> &'static str {
        match self {
            Format::Messages => "messages",
            Format::PromptCompletion => "prompt-completion",
            Format::Text => "text",
            Format::Preference => "preference",
        }
    }

    fn of_row(row: &Map<String, Value>) -> Option<Format> {
        if row.contains_key("chosen") && row.contains_key("rejected") {
            Some(Format::Preference)
        } else if row.contains_key("messages") {
            Some(Format::Messages)
        } else if row.contains_key("prompt") && row.contains_key("completion") {
            Some(Format::PromptCompletion)
        } else if row.contains_key("text") {
            Some(Format::Text)
        } else {
            None
        }
    }
}

/// One tokenized sequence: `tokens[prompt_len..]` are the response the loss reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Tokens of the prompt (not predicted by an SFT loss).
    pub prompt_len: usize,
}

impl Sequence {
    /// Response tokens.
    pub fn response_len(&self) -> usize {
        self.tokens.len().saturating_sub(self.prompt_len.max(1))
    }
}

/// A training example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Example {
    /// A sequence with its response.
    Sft(Sequence),
    /// A preference pair sharing a prompt.
    Pair {
        /// The preferred response.
        chosen: Sequence,
        /// The dispreferred response.
        rejected: Sequence,
    },
}

impl Example {
    /// Tokens the forward passes of this example see.
    pub fn tokens(&self) -> usize {
        match self {
            Example::Sft(s) => s.tokens.len(),
            Example::Pair { chosen, rejected } => chosen.tokens.len() + rejected.tokens.len(),
        }
    }
}

/// What `inspect-dataset` says about a directory without tokenizing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetSummary {
    /// Detected from the first training row.
    pub format: Format,
    /// Rows of `train.jsonl`.
    pub n_train: usize,
    /// Rows of `valid.jsonl` (0 without one).
    pub n_valid: usize,
    /// Rows of both files whose `prompt` is a string (prompt-completion and preference).
    pub string_prompts: usize,
}

impl DatasetSummary {
    /// How the rows will become tokens with `style` for string prompts.
    pub fn rendering(&self, style: PromptStyle, template: TemplateKnown) -> Rendering {
        Rendering::of(self.format, self.string_prompts > 0, style, template)
    }
}

/// A tokenized dataset.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Row format.
    pub format: Format,
    /// Training examples.
    pub train: Vec<Example>,
    /// Validation examples.
    pub valid: Vec<Example>,
    /// Rows dropped because truncation left them no response token.
    pub dropped: usize,
    /// How the rows became tokens.
    pub rendering: Rendering,
}

struct RawRow {
    line: usize,
    row: Map<String, Value>,
}

fn read_rows(path: &Path) -> Result<Vec<RawRow>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |reason: String| TrainError::Data {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        };
        match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(row)) => rows.push(RawRow { line: i + 1, row }),
            Ok(_) => return Err(err("a row must be a JSON object".into())),
            Err(e) => return Err(err(format!("not valid JSON: {e}"))),
        }
    }
    Ok(rows)
}

fn files(dir: &Path) -> Result<(PathBuf, Option<PathBuf>)> {
    let train = dir.join("train.jsonl");
    if !train.is_file() {
        return Err(TrainError::Dataset {
            path: dir.to_path_buf(),
            reason: "no train.jsonl".into(),
        });
    }
    let valid = dir.join("valid.jsonl");
    Ok((train, valid.is_file().then_some(valid)))
}

fn detect(path: &Path, rows: &[RawRow]) -> Result<Format> {
    let first = rows.first().ok_or_else(|| TrainError::Dataset {
        path: path.to_path_buf(),
        reason: "no rows".into(),
    })?;
    Format::of_row(&first.row).ok_or_else(|| TrainError::Data {
        path: path.to_path_buf(),
        line: first.line,
        reason: "unknown row format: expected `messages`, `prompt`+`completion`, `text`, or \
                 `prompt`+`chosen`+`rejected`"
            .into(),
    })
}

fn has_string_prompt(row: &Map<String, Value>) -> bool {
    row.get("prompt").is_some_and(Value::is_string)
}

/// Counts rows, detects the format and counts string prompts (every row is parsed as JSON).
pub fn inspect(dir: &Path) -> Result<DatasetSummary> {
    let (train, valid) = files(dir)?;
    let rows = read_rows(&train)?;
    let format = detect(&train, &rows)?;
    let valid_rows = match valid {
        Some(v) => read_rows(&v)?,
        None => Vec::new(),
    };
    let string_prompts = rows
        .iter()
        .chain(&valid_rows)
        .filter(|r| has_string_prompt(&r.row))
        .count();
    Ok(DatasetSummary {
        format,
        n_train: rows.len(),
        n_valid: valid_rows.len(),
        string_prompts,
    })
}

/// How rows become tokens.
pub struct Tokenizing<'a> {
    /// The base model's tokenizer and chat template.
    pub model: &'a Model,
    /// Longest sequence kept (tokens beyond are cut).
    pub max_seq: usize,
    /// What a string `prompt` becomes.
    pub prompt_style: PromptStyle,
}

impl Tokenizing<'_> {
    /// Whether string prompts meet the chat template: asked for, and the model has one.
    fn chat_prompts(&self) -> bool {
        self.prompt_style == PromptStyle::Chat && self.model.chat_template().is_some()
    }

    fn eos(&self) -> Option<u32> {
        self.model
            .tokenizer()
            .eos_ids()
            .first()
            .copied()
            .or_else(|| self.model.eos_ids().first().copied())
    }

    fn render(
        &self,
        messages: &[Value],
        generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let template = self
            .model
            .chat_template()
            .ok_or("the model has no chat template for `messages` rows")?;
        template
            .render(&ChatInput {
                messages: normalize_messages(messages.to_vec()),
                tools: None,
                add_generation_prompt: generation_prompt,
                kwargs: Map::new(),
            })
            .map_err(|e| format!("chat template: {e}"))
    }

    fn tokenize(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.model.tokenize(text).map_err(|e| e.to_string())
    }

    fn encode_plain(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.model
            .tokenizer()
            .encode(text, false)
            .map_err(|e| e.to_string())
    }

    /// A prompt and a response after it: messages, or a string as a user turn, through the
    /// chat template (the response an assistant turn); a string as raw text (the response
    /// and an EOS after it) when raw prompts are asked for or the model has no template.
    fn prompt_and_response(
        &self,
        prompt: &Value,
        response: &str,
    ) -> std::result::Result<Sequence, String> {
        match prompt {
            Value::String(p) if self.chat_prompts() => {
                self.with_reply(&rendering::user_turn(p), response)
            }
            Value::String(p) => {
                let mut tokens = self.tokenize(p)?;
                let prompt_len = tokens.len();
                tokens.extend(self.encode_plain(response)?);
                tokens.extend(self.eos());
                Ok(Sequence { tokens, prompt_len })
            }
            Value::Array(msgs) => {
                check_messages(msgs)?;
                self.with_reply(msgs, response)
            }
            _ => Err("`prompt` must be a string or a list of messages".into()),
        }
    }

    /// `msgs` and an assistant turn with `response`, split where the reply starts.
    fn with_reply(&self, msgs: &[Value], response: &str) -> std::result::Result<Sequence, String> {
        let mut all = msgs.to_vec();
        all.push(serde_json::json!({"role": "assistant", "content": response}));
        self.split(msgs, &all)
    }

    /// Tokens of `all` with the boundary where the render of `before` (with the
    /// generation prompt) stops matching.
    fn split(&self, before: &[Value], all: &[Value]) -> std::result::Result<Sequence, String> {
        let prompt = self.tokenize(&self.render(before, true)?)?;
        let tokens = self.tokenize(&self.render(all, false)?)?;
        let prompt_len = prompt
            .iter()
            .zip(&tokens)
            .take_while(|(a, b)| a == b)
            .count();
        Ok(Sequence { tokens, prompt_len })
    }

    fn sft_row(
        &self,
        format: Format,
        row: &Map<String, Value>,
    ) -> std::result::Result<Sequence, String> {
        let string = |k: &str| -> std::result::Result<&str, String> {
            row.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`{k}` must be a string"))
        };
        match format {
            Format::Text => {
                let mut tokens = self.tokenize(string("text")?)?;
                tokens.extend(self.eos());
                Ok(Sequence {
                    tokens,
                    prompt_len: 0,
                })
            }
            Format::PromptCompletion => {
                let prompt = row.get("prompt").cloned().unwrap_or(Value::Null);
                self.prompt_and_response(&prompt, string("completion")?)
            }
            Format::Messages => {
                let msgs = row
                    .get("messages")
                    .and_then(Value::as_array)
                    .ok_or("`messages` must be a list")?;
                check_messages(msgs)?;
                let last = msgs
                    .iter()
                    .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
                    .ok_or("`messages` has no assistant turn to learn")?;
                self.split(&msgs[..last], &msgs[..=last])
            }
            Format::Preference => Err("preference rows train with --method dpo or orpo".into()),
        }
    }

    fn pair_row(&self, row: &Map<String, Value>) -> std::result::Result<Example, String> {
        let prompt = row.get("prompt").ok_or("a preference row needs `prompt`")?;
        let response = |k: &str| -> std::result::Result<&str, String> {
            row.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`{k}` must be a string"))
        };
        let mut chosen = self.prompt_and_response(prompt, response("chosen")?)?;
        let mut rejected = self.prompt_and_response(prompt, response("rejected")?)?;
        // Over-length pairs lose the start of the prompt first, then the response's end.
        for s in [&mut chosen, &mut rejected] {
            if s.tokens.len() > self.max_seq {
                let cut = (s.tokens.len() - self.max_seq).min(s.prompt_len.saturating_sub(1));
                s.tokens.drain(..cut);
                s.prompt_len -= cut;
                s.tokens.truncate(self.max_seq);
            }
        }
        Ok(Example::Pair { chosen, rejected })
    }
}

fn check_messages(msgs: &[Value]) -> std::result::Result<(), String> {
    if msgs.is_empty() {
        return Err("`messages` is empty".into());
    }
    for (i, m) in msgs.iter().enumerate() {
        let ok = m.get("role").and_then(Value::as_str).is_some()
            && m.get("content")
                .is_some_and(|c| c.is_string() || c.is_array());
        if !ok {
            return Err(format!("message {i} needs a string `role` and a `content`"));
        }
    }
    Ok(())
}

fn tokenize_file(
    path: &Path,
    format: Format,
    preference: bool,
    t: &Tokenizing<'_>,
    dropped: &mut usize,
    string_prompts: &mut usize,
) -> Result<Vec<Example>> {
    let rows = read_rows(path)?;
    let mut out = Vec::with_capacity(rows.len());
    for RawRow { line, row } in rows {
        let err = |reason: String| TrainError::Data {
            path: path.to_path_buf(),
            line,
            reason,
        };
        if Format::of_row(&row) != Some(format) {
            return Err(err(format!(
                "the row is not in the file's format ({}, from its first row)",
                format.name()
            )));
        }
        *string_prompts += usize::from(has_string_prompt(&row));
        let example = if preference {
            t.pair_row(&row).map_err(err)?
        } else {
            let mut s = t.sft_row(format, &row).map_err(err)?;
            s.tokens.truncate(t.max_seq);
            Example::Sft(s)
        };
        let empty = match &example {
            Example::Sft(s) => s.response_len() == 0,
            Example::Pair { chosen, rejected } => {
                chosen.response_len() == 0 || rejected.response_len() == 0
            }
        };
        if empty {
            *dropped += 1;
        } else {
            out.push(example);
        }
    }
    Ok(out)
}

/// Reads and tokenizes `dir`'s `train.jsonl` and `valid.jsonl` for a method that needs
/// preference rows (`preference`) or not.
pub fn load(dir: &Path, preference: bool, t: &Tokenizing<'_>) -> Result<Dataset> {
    let (train_path, valid_path) = files(dir)?;
    let format = detect(&train_path, &read_rows(&train_path)?)?;
    if preference != (format == Format::Preference) {
        return Err(TrainError::Dataset {
            path: train_path,
            reason: if preference {
                format!("DPO and ORPO need preference rows (prompt, chosen, rejected); this file has {} rows", format.name())
            } else {
                "preference rows (prompt, chosen, rejected) train with --method dpo or orpo".into()
            },
        });
    }
    let mut dropped = 0;
    let mut string_prompts = 0;
    let train = tokenize_file(
        &train_path,
        format,
        preference,
        t,
        &mut dropped,
        &mut string_prompts,
    )?;
    if train.is_empty() {
        return Err(TrainError::Dataset {
            path: train_path,
            reason: "no row keeps a response token within --seq".into(),
        });
    }
    let valid = match valid_path {
        Some(p) => tokenize_file(&p, format, preference, t, &mut dropped, &mut string_prompts)?,
        None => Vec::new(),
    };
    let template = TemplateKnown::from(t.model.chat_template().is_some());
    Ok(Dataset {
        format,
        train,
        valid,
        dropped,
        rendering: Rendering::of(format, string_prompts > 0, t.prompt_style, template),
    })
}
