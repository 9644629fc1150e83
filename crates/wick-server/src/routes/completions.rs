//! `POST /v1/completions`: raw text completion (no chat template), whole or streamed, with
//! `echo` and the legacy `logprobs` columns.
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tracing::Instrument;
use wick_engine::scheduler::EngineEvent;
use wick_engine::GenerationRequest;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generation::Generation;
use crate::logprobs::LegacyColumns;
use crate::openai::completions::{CompletionRequest, LegacyLogprobs, TextChoice, TextCompletion};
use crate::openai::{response_id, unix_now, Usage};
use crate::state::AppState;
use crate::validation::completion::{validate, PromptInput};
use crate::{prompt, sse};

/// Handles a text completion request.
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let valid = validate(req, &state)?;
    let (ids, prompt_text) = match valid.prompt {
        PromptInput::Text(text) => {
            let ids = prompt::tokenize(&state, text.clone()).await?;
            (ids, text)
        }
        PromptInput::Tokens(ids) => {
            let vocab = state.model().config().vocab_size;
            if let Some(i) = ids.iter().position(|&id| id as usize >= vocab) {
                return Err(ApiError::field(
                    format!("prompt[{i}]"),
                    format!("token id {} is outside the vocabulary ({vocab})", ids[i]),
                ));
            }
            let text = if valid.echo {
                prompt::detokenize(&state, ids.clone()).await?
            } else {
                String::new()
            };
            (ids, text)
        }
    };
    let gen = valid.generation;
    let context = state.model().info().context_length;
    let max_tokens = gen.max_tokens.resolve(ids.len(), context, "prompt")?;
    let echo = valid.echo.then_some(prompt_text);
    let mut columns = valid.logprobs.map(|_| LegacyColumns::new(0));
    if let (Some(columns), Some(_)) = (&mut columns, &echo) {
        for &id in &ids {
            columns.push_prompt(state.model().tokenizer(), id);
        }
    }
    let mut request = GenerationRequest::new(ids)
        .max_tokens(max_tokens)
        .sampling(gen.sampling)
        .stop(gen.stop);
    request.ignore_eos = gen.ignore_eos;
    let running = Generation::submit(&state, request, arrived)?;
    let meta = Meta {
        id: response_id("cmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    if gen.stream {
        Ok(stream(
            state,
            running,
            meta,
            echo,
            columns,
            gen.include_usage,
        ))
    } else {
        whole(state, running, meta, echo, columns).await
    }
}

#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
}

impl Meta {
    fn body(
        &self,
        text: String,
        logprobs: Option<LegacyLogprobs>,
        finish_reason: Option<&'static str>,
        usage: Option<Usage>,
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
            usage,
        }
    }
}

async fn whole(
    state: AppState,
    mut running: Generation,
    meta: Meta,
    echo: Option<String>,
    mut columns: Option<LegacyColumns>,
) -> Result<Response, ApiError> {
    let mut text = echo.unwrap_or_default();
    let tokenizer = state.model().tokenizer();
    loop {
        match running.next().await {
            Some(EngineEvent::Token(t)) => {
                if let Some(c) = &mut columns {
                    c.push_generated(tokenizer, &t);
                }
                text.push_str(&t.text);
            }
            Some(EngineEvent::Done(done)) => {
                let u = &done.usage;
                let usage = Usage::new(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
                let body = meta.body(
                    text,
                    columns.as_mut().map(LegacyColumns::take),
                    Some(done.finish_reason.openai()),
                    Some(usage),
                );
                return Ok(Json(body).into_response());
            }
            Some(EngineEvent::Failed(message)) => return Err(ApiError::Generation(message)),
            None => {
                return Err(ApiError::Internal(
                    "the engine closed the request without an answer".into(),
                ))
            }
        }
    }
}

/// One streamed completion; dropping it cancels the generation.
struct CompletionStream {
    state: AppState,
    running: Option<Generation>,
    meta: Meta,
    columns: Option<LegacyColumns>,
    include_usage: bool,
    pending: std::collections::VecDeque<Event>,
}

fn stream(
    state: AppState,
    running: Generation,
    meta: Meta,
    echo: Option<String>,
    mut columns: Option<LegacyColumns>,
    include_usage: bool,
) -> Response {
    let mut pending = std::collections::VecDeque::new();
    if let Some(prompt) = echo {
        let logprobs = columns.as_mut().map(LegacyColumns::take);
        pending.push_back(sse::json_event(&meta.body(prompt, logprobs, None, None)));
    }
    let s = CompletionStream {
        state,
        running: Some(running),
        meta,
        columns,
        include_usage,
        pending,
    };
    let span = tracing::Span::current();
    let events = futures_util::stream::unfold(s, move |mut s| {
        let span = span.clone();
        async move {
            let event = s.next_event().await?;
            Some((event, s))
        }
        .instrument(span)
    });
    sse::response(events)
}

impl CompletionStream {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            let running = self.running.as_mut()?;
            match running.next().await {
                Some(EngineEvent::Token(t)) => {
                    let logprobs = self.columns.as_mut().map(|c| {
                        c.push_generated(self.state.model().tokenizer(), &t);
                        c.take()
                    });
                    if !t.text.is_empty() || logprobs.is_some() {
                        let body = self.meta.body(t.text, logprobs, None, None);
                        self.pending.push_back(sse::json_event(&body));
                    }
                }
                Some(EngineEvent::Done(done)) => {
                    let body = self.meta.body(
                        String::new(),
                        None,
                        Some(done.finish_reason.openai()),
                        None,
                    );
                    self.pending.push_back(sse::json_event(&body));
                    if self.include_usage {
                        let u = &done.usage;
                        let mut body = self.meta.body(
                            String::new(),
                            None,
                            None,
                            Some(Usage::new(
                                u.prompt_tokens,
                                u.cached_tokens,
                                u.completion_tokens,
                            )),
                        );
                        body.choices.clear();
                        self.pending.push_back(sse::json_event(&body));
                    }
                    self.pending.push_back(sse::done_event());
                    self.running = None;
                }
                Some(EngineEvent::Failed(message)) => {
                    self.pending
                        .push_back(sse::error_event(&ApiError::Generation(message)));
                    self.running = None;
                }
                None => {
                    self.pending.push_back(sse::error_event(&ApiError::Internal(
                        "the engine closed the request without an answer".into(),
                    )));
                    self.running = None;
                }
            }
        }
    }
}
