//! OpenAI text completions: `text_completion` bodies and frames, with `echo` and the legacy
//! log-probability columns. Raw completions are parsed as plain text, so a reply's parts
//! are its tokens' texts.
use axum::response::sse::Event;

use super::Encoder;
use crate::encoders::chat::usage;
use crate::error::ApiError;
use crate::logprobs::LegacyColumns;
use crate::openai::completions::{LegacyLogprobs, TextChoice, TextCompletion};
use crate::reply::{Collected, Part, ReplyEvent};
use crate::sse;
use crate::state::AppState;

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

/// The `text_completion` body of a whole reply; `echo` is the prompt text to put first,
/// `columns` the log-probability columns (holding the echoed prompt's tokens) when asked.
pub fn whole(
    reply: Collected,
    meta: &CompletionMeta,
    state: &AppState,
    echo: Option<String>,
    mut columns: Option<LegacyColumns>,
) -> TextCompletion {
    let tokenizer = state.model().tokenizer();
    if let Some(c) = &mut columns {
        for t in &reply.tokens {
            c.push_generated(tokenizer, t);
        }
    }
    let mut text = echo.unwrap_or_default();
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
    echo: Option<String>,
    columns: Option<LegacyColumns>,
    include_usage: bool,
}

impl CompletionEncoder {
    /// An encoder; `echo` and `columns` as for [`whole`].
    pub fn new(
        meta: CompletionMeta,
        state: AppState,
        echo: Option<String>,
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
}

impl Encoder for CompletionEncoder {
    fn start(&mut self) -> Vec<Event> {
        match self.echo.take() {
            Some(prompt) => vec![self.frame(prompt)],
            None => Vec::new(),
        }
    }

    fn event(&mut self, event: ReplyEvent) -> Vec<Event> {
        match event {
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

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![sse::error_event(&error)]
    }
}
