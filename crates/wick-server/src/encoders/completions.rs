//! OpenAI text completions: `text_completion` bodies and frames, with `echo` and the legacy
//! log-probability columns. Raw completions are parsed as plain text, so a reply's parts
//! are its tokens' texts. With `echo` and `logprobs` the prompt's tokens come first in the
//! columns, scored by the engine (the first one has no score: `null`).
use axum::response::sse::Event;
use wick_engine::PromptLogprob;

use super::Encoder;
use crate::encoders::chat::usage;
use crate::error::ApiError;
use crate::logprobs::LegacyColumns;
use crate::openai::completions::{LegacyLogprobs, TextChoice, TextCompletion};
use crate::reply::{Collected, Part, ReplyEvent};
use crate::sse;
use crate::state::AppState;

/// The prompt a reply echoes: its text, and its ids for the log-probability columns.
#[derive(Debug, Clone)]
pub struct Echo {
    /// The prompt text, put before the completion.
    pub text: String,
    /// The prompt's token ids.
    pub ids: Vec<u32>,
}

/// What every chunk and the response repeat.
#[derive(Debug, Clone)]
pub struct CompletionMeta {
    /// `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
}

impl CompletionMeta {
    fn body(
        &self,
        text: String,
        logprobs: Option<LegacyLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> TextCompletion {
        TextCompletion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![TextChoice {
                text,
                index: 0,
                logprobs,
                finish_reason,
            }],
            usage: None,
        }
    }
}

/// The `text_completion` body of a whole reply; `echo` is the prompt to put first,
/// `columns` the log-probability columns when asked (the echoed prompt's tokens first).
pub fn whole(
    reply: Collected,
    meta: &CompletionMeta,
    state: &AppState,
    echo: Option<Echo>,
    mut columns: Option<LegacyColumns>,
) -> TextCompletion {
    let tokenizer = state.model().tokenizer();
    if let Some(c) = &mut columns {
        if let Some(echo) = &echo {
            c.push_echo(tokenizer, &echo.ids, &reply.prompt_logprobs);
        }
        for t in &reply.tokens {
            c.push_generated(tokenizer, t);
        }
    }
    let mut text = echo.map(|e| e.text).unwrap_or_default();
    text.push_str(&reply.content);
    let mut body = meta.body(
        text,
        columns.as_mut().map(LegacyColumns::take),
        Some(reply.finish.reason.openai()),
    );
    body.usage = Some(usage(&reply.finish.usage));
    body
}

/// The frame encoder of one streamed completion.
pub struct CompletionEncoder {
    meta: CompletionMeta,
    state: AppState,
    /// The prompt still to send: with log-probabilities it waits for the prompt's scores
    /// (the reply's first event), else it is the first frame.
    echo: Option<Echo>,
    columns: Option<LegacyColumns>,
    include_usage: bool,
}

impl CompletionEncoder {
    /// An encoder; `echo` and `columns` as for [`whole`].
    pub fn new(
        meta: CompletionMeta,
        state: AppState,
        echo: Option<Echo>,
        columns: Option<LegacyColumns>,
        include_usage: bool,
    ) -> Self {
        CompletionEncoder {
            meta,
            state,
            echo,
            columns,
            include_usage,
        }
    }

    fn frame(&mut self, text: String) -> Event {
        let logprobs = self.columns.as_mut().map(LegacyColumns::take);
        sse::json_event(&self.meta.body(text, logprobs, None))
    }

    /// The echo frame, once: the prompt text and, with columns, its scored tokens.
    fn echo_frame(&mut self, scores: &[PromptLogprob]) -> Vec<Event> {
        let Some(echo) = self.echo.take() else {
            return Vec::new();
        };
        if let Some(c) = &mut self.columns {
            c.push_echo(self.state.model().tokenizer(), &echo.ids, scores);
        }
        vec![self.frame(echo.text)]
    }
}

impl Encoder for CompletionEncoder {
    fn start(&mut self) -> Vec<Event> {
        if self.columns.is_some() {
            // Sent with the prompt's scores (or before the first token of a prompt too
            // short to score).
            return Vec::new();
        }
        self.echo_frame(&[])
    }

    fn event(&mut self, event: ReplyEvent) -> Vec<Event> {
        if let ReplyEvent::Prompt(scores) = &event {
            return self.echo_frame(scores);
        }
        let mut frames = self.echo_frame(&[]);
        frames.extend(self.frames(event));
        frames
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![sse::error_event(&error)]
    }
}

impl CompletionEncoder {
    fn frames(&mut self, event: ReplyEvent) -> Vec<Event> {
        match event {
            ReplyEvent::Prompt(_) => Vec::new(),
            ReplyEvent::Token(t) => match &mut self.columns {
                Some(c) => {
                    c.push_generated(self.state.model().tokenizer(), &t);
                    // A token that released no text still sends its log-probability.
                    if t.text.is_empty() {
                        vec![self.frame(String::new())]
                    } else {
                        Vec::new()
                    }
                }
                None => Vec::new(),
            },
            ReplyEvent::Part(Part::Content(text)) => vec![self.frame(text)],
            ReplyEvent::Part(_) => Vec::new(),
            ReplyEvent::Finish(finish) => {
                let mut frames = vec![sse::json_event(&self.meta.body(
                    String::new(),
                    None,
                    Some(finish.reason.openai()),
                ))];
                if self.include_usage {
                    let mut body = self.meta.body(String::new(), None, None);
                    body.choices.clear();
                    body.usage = Some(usage(&finish.usage));
                    frames.push(sse::json_event(&body));
                }
                frames.push(sse::done_event());
                frames
            }
        }
    }
}
