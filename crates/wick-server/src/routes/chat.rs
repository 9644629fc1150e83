//! `POST /v1/chat/completions`: validate, render and tokenize the conversation, queue it,
//! then answer whole or as a stream of `chat.completion.chunk` events.
use std::collections::VecDeque;
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
use crate::logprobs::chat_entry;
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatLogprobs, ChunkChoice, Delta, FunctionDelta, TokenLogprob, ToolCallDelta,
};
use crate::openai::{response_id, unix_now, Usage};
use crate::reply::{record_call, ReplyAssembler, ReplyEvent, ReplyOptions, ReplyParser};
use crate::state::AppState;
use crate::validation::chat::{validate, ValidChat};
use crate::{prompt, sse};

/// What every chunk and the response repeat.
#[derive(Debug, Clone)]
struct ReplyMeta {
    id: String,
    created: u64,
    model: String,
}

/// Handles a chat completion request.
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let chat = validate(req, &state)?;
    let ValidChat {
        messages,
        tools,
        tool_specs,
        parallel_tool_calls,
        template_kwargs,
        logprobs,
        generation,
    } = chat;
    let prompt = prompt::chat_prompt(&state, messages, tools, template_kwargs).await?;
    let context = state.model().info().context_length;
    let max_tokens = generation
        .max_tokens
        .resolve(prompt.ids.len(), context, "messages")?;
    let think_tags = state
        .template_capabilities()
        .is_some_and(|c| c.uses_think_tags);
    let options = ReplyOptions {
        reasoning: (think_tags || prompt.starts_in_thinking).then_some(prompt.starts_in_thinking),
        tools: (!tool_specs.is_empty()).then(|| (state.tool_format(), tool_specs)),
        parallel_tool_calls,
    };
    let mut request = GenerationRequest::new(prompt.ids)
        .max_tokens(max_tokens)
        .sampling(generation.sampling)
        .stop(generation.stop);
    request.ignore_eos = generation.ignore_eos;
    request.keep_special_text = options.reasoning.is_some() || options.tools.is_some();
    let running = Generation::submit(&state, request, arrived)?;
    let meta = ReplyMeta {
        id: response_id("chatcmpl-"),
        created: unix_now(),
        model: state.config().model_id.clone(),
    };
    let parser = ReplyParser::new(options);
    if generation.stream {
        let stream = ChatStream {
            state,
            generation: Some(running),
            parser,
            meta,
            pending: VecDeque::new(),
            logprobs: logprobs.map(|_| Vec::new()),
            any_calls: false,
            include_usage: generation.include_usage,
            done: false,
        };
        Ok(stream.into_response())
    } else {
        whole(state, running, parser, meta, logprobs.is_some()).await
    }
}

/// Runs the generation to its end and answers one `chat.completion`.
async fn whole(
    state: AppState,
    mut running: Generation,
    mut parser: ReplyParser,
    meta: ReplyMeta,
    want_logprobs: bool,
) -> Result<Response, ApiError> {
    let mut reply = ReplyAssembler::default();
    let mut logprobs = Vec::new();
    let tokenizer = state.model().tokenizer();
    let (finish_reason, usage) = loop {
        match running.next().await {
            Some(EngineEvent::Token(t)) => {
                if want_logprobs {
                    logprobs.push(chat_entry(tokenizer, &t));
                }
                for e in parser.push(&t.text) {
                    note(&state, &e);
                    reply.apply(&e);
                }
                if parser.call_limit_reached() {
                    running.stop_early();
                    break (
                        "tool_calls",
                        Usage::new(running.prompt_tokens(), 0, running.tokens()),
                    );
                }
            }
            Some(EngineEvent::Done(done)) => {
                let u = &done.usage;
                break (
                    done.finish_reason.openai(),
                    Usage::new(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
                );
            }
            Some(EngineEvent::Failed(message)) => return Err(ApiError::Generation(message)),
            None => {
                return Err(ApiError::Internal(
                    "the engine closed the request without an answer".into(),
                ))
            }
        }
    };
    drop(running);
    for e in parser.finish() {
        note(&state, &e);
        reply.apply(&e);
    }
    let finish_reason = if reply.calls.is_empty() {
        finish_reason
    } else {
        "tool_calls"
    };
    let content = if reply.content.is_empty() && !reply.calls.is_empty() {
        None
    } else {
        Some(reply.content)
    };
    let body = ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content,
                reasoning_content: (!reply.reasoning.is_empty()).then_some(reply.reasoning),
                tool_calls: reply.calls,
            },
            logprobs: want_logprobs.then_some(ChatLogprobs { content: logprobs }),
            finish_reason,
        }],
        usage,
    };
    Ok(Json(body).into_response())
}

/// Logs and counts finished tool calls.
fn note(state: &AppState, event: &ReplyEvent) {
    if let ReplyEvent::CallEnd { name, repairs, .. } = event {
        record_call(state.metrics(), name, repairs);
    }
}

/// The state of one streamed reply; dropping it (client gone) cancels the generation.
struct ChatStream {
    state: AppState,
    generation: Option<Generation>,
    parser: ReplyParser,
    meta: ReplyMeta,
    pending: VecDeque<Event>,
    /// Entries of tokens whose text is not out yet (`None`: not asked for).
    logprobs: Option<Vec<TokenLogprob>>,
    any_calls: bool,
    include_usage: bool,
    done: bool,
}

impl ChatStream {
    fn into_response(mut self) -> Response {
        let first = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..Delta::default()
        };
        let event = self.chunk(first, None, None);
        self.pending.push_back(event);
        let span = tracing::Span::current();
        let events = futures_util::stream::unfold(self, move |mut s| {
            let span = span.clone();
            async move {
                let event = s.next_event().await?;
                Some((event, s))
            }
            .instrument(span)
        });
        sse::response(events)
    }

    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.done {
                return None;
            }
            let event = match self.generation.as_mut() {
                Some(running) => running.next().await,
                None => {
                    self.done = true;
                    continue;
                }
            };
            match event {
                Some(EngineEvent::Token(t)) => {
                    if let Some(entries) = &mut self.logprobs {
                        entries.push(chat_entry(self.state.model().tokenizer(), &t));
                    }
                    let events = self.parser.push(&t.text);
                    self.emit(events);
                    if self.parser.call_limit_reached() {
                        let usage = match self.generation.as_mut() {
                            Some(running) => {
                                running.stop_early();
                                Usage::new(running.prompt_tokens(), 0, running.tokens())
                            }
                            None => Usage::new(0, 0, 0),
                        };
                        self.finish("tool_calls", usage);
                    }
                }
                Some(EngineEvent::Done(done)) => {
                    let u = &done.usage;
                    let usage = Usage::new(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
                    self.finish(done.finish_reason.openai(), usage);
                }
                Some(EngineEvent::Failed(message)) => self.fail(ApiError::Generation(message)),
                None => self.fail(ApiError::Internal(
                    "the engine closed the request without an answer".into(),
                )),
            }
        }
    }

    fn chunk(
        &self,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> Event {
        sse::json_event(&ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason,
            }],
            usage: None,
        })
    }

    /// Takes the log-probabilities waiting for a chunk.
    fn take_logprobs(&mut self) -> Option<ChatLogprobs> {
        match &mut self.logprobs {
            Some(entries) if !entries.is_empty() => Some(ChatLogprobs {
                content: std::mem::take(entries),
            }),
            _ => None,
        }
    }

    fn emit(&mut self, events: Vec<ReplyEvent>) {
        for event in events {
            note(&self.state, &event);
            let delta = match event {
                ReplyEvent::Content(text) => Delta {
                    content: Some(text),
                    ..Delta::default()
                },
                ReplyEvent::Reasoning(text) => Delta {
                    reasoning_content: Some(text),
                    ..Delta::default()
                },
                ReplyEvent::CallStart { index, id, name } => {
                    self.any_calls = true;
                    tool_delta(ToolCallDelta {
                        index,
                        id: Some(id),
                        kind: Some("function"),
                        function: Some(FunctionDelta {
                            name: Some(name),
                            arguments: Some(String::new()),
                        }),
                        wick_repairs: Vec::new(),
                    })
                }
                ReplyEvent::CallArguments { index, delta } => tool_delta(ToolCallDelta {
                    index,
                    function: Some(FunctionDelta {
                        name: None,
                        arguments: Some(delta),
                    }),
                    ..ToolCallDelta::default()
                }),
                ReplyEvent::CallEnd { repairs, .. } if repairs.is_empty() => continue,
                ReplyEvent::CallEnd { index, repairs, .. } => tool_delta(ToolCallDelta {
                    index,
                    wick_repairs: repairs.iter().map(|r| r.as_str()).collect(),
                    ..ToolCallDelta::default()
                }),
            };
            let logprobs = self.take_logprobs();
            let event = self.chunk(delta, logprobs, None);
            self.pending.push_back(event);
        }
    }

    /// Ends a successful stream: held text, the finish chunk, usage, `[DONE]`.
    fn finish(&mut self, finish_reason: &'static str, usage: Usage) {
        let events = self.parser.finish();
        self.emit(events);
        if let Some(logprobs) = self.take_logprobs() {
            let event = self.chunk(Delta::default(), Some(logprobs), None);
            self.pending.push_back(event);
        }
        let reason = if self.any_calls {
            "tool_calls"
        } else {
            finish_reason
        };
        let event = self.chunk(Delta::default(), None, Some(reason));
        self.pending.push_back(event);
        if self.include_usage {
            let event = sse::json_event(&ChatCompletionChunk {
                id: self.meta.id.clone(),
                object: "chat.completion.chunk",
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
            });
            self.pending.push_back(event);
        }
        self.pending.push_back(sse::done_event());
        self.generation = None;
        self.done = true;
    }

    /// Ends a failed stream with an error frame.
    fn fail(&mut self, error: ApiError) {
        self.pending.push_back(sse::error_event(&error));
        self.generation = None;
        self.done = true;
    }
}

fn tool_delta(call: ToolCallDelta) -> Delta {
    Delta {
        tool_calls: Some(vec![call]),
        ..Delta::default()
    }
}
