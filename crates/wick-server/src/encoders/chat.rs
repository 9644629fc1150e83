//! OpenAI chat completions: `chat.completion` bodies and `chat.completion.chunk` frames.
use axum::response::sse::Event;
use wick_chat::tokenizer::Tokenizer;

use super::Encoder;
use crate::error::ApiError;
use crate::logprobs::chat_entry;
use crate::openai::chat::{
    AssistantMessage, CallRepairs, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs,
    ChunkChoice, Delta, FunctionDelta, FunctionOut, TokenLogprob, ToolCallDelta, ToolCallOut,
};
use crate::openai::Usage;
use crate::reply::{Collected, Finish, Part, ReplyEvent, ReplyUsage};
use crate::sse;
use crate::state::AppState;

/// What every chunk and the response repeat.
#[derive(Debug, Clone)]
pub struct ChatMeta {
    /// `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
}

/// OpenAI's usage object of a reply.
pub fn usage(u: &ReplyUsage) -> Usage {
    Usage {
        speculation: u.speculation,
        ..Usage::new(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
    }
}

/// The `chat.completion` body of a whole reply.
pub fn whole(
    reply: Collected,
    meta: ChatMeta,
    tokenizer: &Tokenizer,
    want_logprobs: bool,
) -> ChatCompletion {
    let logprobs = want_logprobs.then(|| ChatLogprobs {
        content: reply
            .tokens
            .iter()
            .map(|t| chat_entry(tokenizer, t))
            .collect(),
    });
    let calls: Vec<ToolCallOut> = reply
        .calls
        .into_iter()
        .map(|c| ToolCallOut {
            id: c.id,
            kind: "function",
            function: FunctionOut {
                name: c.name,
                arguments: c.arguments,
            },
            wick_repairs: c.repairs.iter().map(|r| r.as_str()).collect(),
        })
        .collect();
    let content = if reply.content.is_empty() && !calls.is_empty() {
        None
    } else {
        Some(reply.content)
    };
    ChatCompletion {
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
                tool_calls: calls,
            },
            logprobs,
            finish_reason: reply.finish.reason.openai(),
        }],
        usage: usage(&reply.finish.usage),
    }
}

/// The chunk encoder of one streamed chat reply.
pub struct ChatEncoder {
    meta: ChatMeta,
    state: AppState,
    /// Entries of tokens whose text is not out yet (`None`: not asked for).
    logprobs: Option<Vec<TokenLogprob>>,
    /// Repairs of the calls so far, sent in the finish chunk.
    repairs: Vec<CallRepairs>,
    include_usage: bool,
}

impl ChatEncoder {
    /// An encoder; `logprobs` when the client asked for them, `include_usage` for a last
    /// usage chunk.
    pub fn new(meta: ChatMeta, state: AppState, logprobs: bool, include_usage: bool) -> Self {
        ChatEncoder {
            meta,
            state,
            logprobs: logprobs.then(Vec::new),
            repairs: Vec::new(),
            include_usage,
        }
    }

    fn chunk(&self, delta: Delta, logprobs: Option<ChatLogprobs>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: None,
            }],
            usage: None,
            wick_repairs: Vec::new(),
        }
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

    fn part(&mut self, part: Part) -> Option<Delta> {
        Some(match part {
            Part::Content(text) => Delta {
                content: Some(text),
                ..Delta::default()
            },
            Part::Reasoning(text) => Delta {
                reasoning_content: Some(text),
                ..Delta::default()
            },
            Part::CallStart { index, id, name } => tool_delta(ToolCallDelta {
                index,
                id: Some(id),
                kind: Some("function"),
                function: Some(FunctionDelta {
                    name: Some(name),
                    arguments: Some(String::new()),
                }),
            }),
            Part::CallArguments { index, delta } => tool_delta(ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: Some(FunctionDelta {
                    name: None,
                    arguments: Some(delta),
                }),
            }),
            // A call-delta without `function` breaks client libraries' stream helpers, so
            // the repairs travel in the finish chunk.
            Part::CallEnd { index, repairs } => {
                if !repairs.is_empty() {
                    self.repairs.push(CallRepairs {
                        index,
                        repairs: repairs.iter().map(|r| r.as_str()).collect(),
                    });
                }
                return None;
            }
        })
    }

    fn finish(&mut self, finish: Finish) -> Vec<Event> {
        let mut frames = Vec::new();
        if let Some(logprobs) = self.take_logprobs() {
            frames.push(sse::json_event(
                &self.chunk(Delta::default(), Some(logprobs)),
            ));
        }
        let mut last = self.chunk(Delta::default(), None);
        last.choices[0].finish_reason = Some(finish.reason.openai());
        last.wick_repairs = std::mem::take(&mut self.repairs);
        frames.push(sse::json_event(&last));
        if self.include_usage {
            let mut chunk = self.chunk(Delta::default(), None);
            chunk.choices.clear();
            chunk.usage = Some(usage(&finish.usage));
            frames.push(sse::json_event(&chunk));
        }
        frames.push(sse::done_event());
        frames
    }
}

impl Encoder for ChatEncoder {
    fn start(&mut self) -> Vec<Event> {
        let first = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..Delta::default()
        };
        vec![sse::json_event(&self.chunk(first, None))]
    }

    fn event(&mut self, event: ReplyEvent) -> Vec<Event> {
        match event {
            // Only completions ask for prompt scores.
            ReplyEvent::Prompt(_) => Vec::new(),
            ReplyEvent::Token(t) => {
                if let Some(entries) = &mut self.logprobs {
                    entries.push(chat_entry(self.state.model().tokenizer(), &t));
                }
                Vec::new()
            }
            ReplyEvent::Part(part) => match self.part(part) {
                Some(delta) => {
                    let logprobs = self.take_logprobs();
                    vec![sse::json_event(&self.chunk(delta, logprobs))]
                }
                None => Vec::new(),
            },
            ReplyEvent::Finish(finish) => self.finish(finish),
        }
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![sse::error_event(&error)]
    }
}

fn tool_delta(call: ToolCallDelta) -> Delta {
    Delta {
        tool_calls: Some(vec![call]),
        ..Delta::default()
    }
}
