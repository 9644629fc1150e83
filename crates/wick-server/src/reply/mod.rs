//! The reply pipeline: one place where a request's engine events become protocol-neutral
//! reply events, and every protocol is a thin encoder of that one stream.
//!
//! [`Reply`] submits a request, reads its [`EngineEvent`]s, runs the text through the
//! [`ReplyParser`] (`<think>` split, then tool calls) and hands out [`ReplyEvent`]s:
//! each generated token (for log-probabilities), the parts it released (text, reasoning,
//! tool-call start / argument piece / end, as [`Part`]), and last a [`Finish`] with the
//! protocol-neutral [`FinishReason`] and the [`ReplyUsage`] (cached and reasoning tokens
//! included). Which finish reason a reply has, when a reply stops early (a complete call with
//! `parallel_tool_calls` off), and how calls and repairs are counted are decided here, once.
//! A non-streamed reply is the collected stream ([`Reply::collect`]); a streamed one goes
//! through [`crate::encoders::stream`].
mod parser;

use std::collections::VecDeque;
use std::time::Instant;

use wick_chat::tool_call::RepairKind;
use wick_engine::scheduler::EngineEvent;
use wick_engine::{GenerationRequest, PromptLogprob, TokenEvent};

pub use parser::{ReasoningMode, ReplyOptions, ReplyParser};
/// A classified piece of a reply: text, reasoning, or a tool call's start, argument piece
/// or end (the tool-call parser's own event type, shared by every protocol).
pub use wick_chat::tool_call::StreamEvent as Part;

use crate::error::ApiError;
use crate::generation::Generation;
use crate::metrics::Metrics;
use crate::state::AppState;

/// What a reply stream hands out, in order: tokens and parts as they come, one `Finish`.
#[derive(Debug, Clone)]
pub enum ReplyEvent {
    /// The prompt's scores (one per prompt token after the first), before any token, for a
    /// request that asked for them ([`GenerationRequest::prompt_logprobs`]).
    Prompt(Vec<PromptLogprob>),
    /// A generated token, before the parts its text released (for log-probabilities).
    Token(TokenEvent),
    /// A classified piece of the reply.
    Part(Part),
    /// The end of a successful reply; always the last event.
    Finish(Finish),
}

/// Why a reply ended, in no protocol's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn (end-of-sequence token).
    EndTurn,
    /// A stop string matched (the string).
    StopSequence(String),
    /// The token limit was reached (also when it cut a tool call short).
    Length,
    /// The reply is tool calls.
    ToolCalls,
}

impl FinishReason {
    /// OpenAI's `finish_reason`.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::EndTurn | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of a reply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplyUsage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens that came from the prompt cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Generated tokens that were reasoning.
    pub reasoning_tokens: usize,
    /// Drafted and kept tokens, when the reply was decoded speculatively.
    pub speculation: Option<wick_engine::speculative::SpeculationUsage>,
}

/// The end of a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// Token counts.
    pub usage: ReplyUsage,
}

/// One tool call of a collected reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectedCall {
    /// `call_…`.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments JSON text.
    pub arguments: String,
    /// Repairs needed to parse it.
    pub repairs: Vec<RepairKind>,
}

/// A whole reply: the collected stream.
#[derive(Debug, Clone)]
pub struct Collected {
    /// Answer text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Tool calls in order.
    pub calls: Vec<CollectedCall>,
    /// Every generated token.
    pub tokens: Vec<TokenEvent>,
    /// The prompt's scores, when asked.
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// Why it ended, and the counts.
    pub finish: Finish,
}

impl Collected {
    /// Applies one part.
    fn apply(&mut self, part: Part) {
        match part {
            Part::Content(t) => self.content.push_str(&t),
            Part::Reasoning(t) => self.reasoning.push_str(&t),
            Part::CallStart { id, name, .. } => self.calls.push(CollectedCall {
                id,
                name,
                arguments: String::new(),
                repairs: Vec::new(),
            }),
            // Calls arrive in index order, so the index is the position.
            Part::CallArguments { index, delta } => {
                if let Some(call) = self.calls.get_mut(index) {
                    call.arguments.push_str(&delta);
                }
            }
            Part::CallEnd { index, repairs } => {
                if let Some(call) = self.calls.get_mut(index) {
                    call.repairs = repairs;
                }
            }
        }
    }
}

/// One request's reply, read event by event; dropping it cancels the generation.
pub struct Reply {
    state: AppState,
    generation: Option<Generation>,
    parser: ReplyParser,
    pending: VecDeque<ReplyEvent>,
    cached_tokens: usize,
    reasoning_tokens: usize,
    done: bool,
}

impl Reply {
    /// Queues `request` (arrived at `arrived`) and parses its output as `options` say; a
    /// full queue is 429, shutdown 503, an invalid request 400.
    pub fn start(
        state: &AppState,
        request: GenerationRequest,
        options: ReplyOptions,
        arrived: Instant,
    ) -> Result<Reply, ApiError> {
        let generation = Generation::submit(state, request, arrived)?;
        Ok(Reply {
            state: state.clone(),
            generation: Some(generation),
            parser: ReplyParser::new(options),
            pending: VecDeque::new(),
            cached_tokens: 0,
            reasoning_tokens: 0,
            done: false,
        })
    }

    /// The next event; `None` after `Finish` or an error. An error is the last item.
    pub async fn next(&mut self) -> Option<Result<ReplyEvent, ApiError>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            if self.done {
                return None;
            }
            let Some(running) = self.generation.as_mut() else {
                self.done = true;
                continue;
            };
            match running.next().await {
                Some(EngineEvent::Token(token)) => self.on_token(token),
                Some(EngineEvent::Done(mut done)) => {
                    if !done.prompt_logprobs.is_empty() {
                        let scores = std::mem::take(&mut done.prompt_logprobs);
                        self.pending.push_back(ReplyEvent::Prompt(scores));
                    }
                    let u = &done.usage;
                    let usage = ReplyUsage {
                        prompt_tokens: u.prompt_tokens,
                        cached_tokens: u.cached_tokens,
                        completion_tokens: u.completion_tokens,
                        reasoning_tokens: self.reasoning_tokens,
                        speculation: u.speculation,
                    };
                    self.end(Some(done.finish_reason), usage);
                }
                Some(EngineEvent::Failed(message)) => {
                    let error = ApiError::from_generation_failure(message);
                    return Some(Err(self.fail(error)));
                }
                None => {
                    let error = ApiError::Internal(
                        "the engine closed the request without an answer".into(),
                    );
                    return Some(Err(self.fail(error)));
                }
            }
        }
    }

    /// Runs the reply to its end and returns it whole.
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut reply = Collected {
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            tokens: Vec::new(),
            prompt_logprobs: Vec::new(),
            finish: Finish {
                reason: FinishReason::EndTurn,
                usage: ReplyUsage::default(),
            },
        };
        while let Some(event) = self.next().await {
            match event? {
                ReplyEvent::Prompt(scores) => reply.prompt_logprobs = scores,
                ReplyEvent::Token(t) => reply.tokens.push(t),
                ReplyEvent::Part(p) => reply.apply(p),
                ReplyEvent::Finish(f) => reply.finish = f,
            }
        }
        Ok(reply)
    }

    /// The state the reply runs in.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    fn on_token(&mut self, mut token: TokenEvent) {
        self.cached_tokens = token.cached_tokens;
        if !token.prompt_logprobs.is_empty() {
            let scores = std::mem::take(&mut token.prompt_logprobs);
            self.pending.push_back(ReplyEvent::Prompt(scores));
        }
        let parts = self.parser.push(&token.text);
        let reasoning = parts.iter().any(|p| matches!(p, Part::Reasoning(_)))
            && !parts.iter().any(|p| !matches!(p, Part::Reasoning(_)));
        if reasoning || (parts.is_empty() && self.parser.in_reasoning()) {
            self.reasoning_tokens += 1;
        }
        self.pending.push_back(ReplyEvent::Token(token));
        self.queue_parts(parts);
        if self.parser.call_limit_reached() {
            // The reply is complete: parallel calls are off and a call has ended.
            let usage = match self.generation.as_mut() {
                Some(running) => {
                    running.stop_early(self.cached_tokens);
                    ReplyUsage {
                        prompt_tokens: running.prompt_tokens(),
                        cached_tokens: self.cached_tokens,
                        completion_tokens: running.tokens(),
                        reasoning_tokens: self.reasoning_tokens,
                        speculation: None,
                    }
                }
                None => ReplyUsage::default(),
            };
            self.end(None, usage);
        }
    }

    fn queue_parts(&mut self, parts: Vec<Part>) {
        for part in parts {
            if let Part::CallEnd { index, repairs } = &part {
                record_call(self.state.metrics(), self.parser.call_name(*index), repairs);
            }
            self.pending.push_back(ReplyEvent::Part(part));
        }
    }

    /// Releases what the parser holds and queues the finish; `engine` is the engine's reason
    /// (`None`: stopped early on a complete call).
    fn end(&mut self, engine: Option<wick_engine::FinishReason>, usage: ReplyUsage) {
        let held = self.parser.finish();
        let cut_call = held.iter().any(|p| matches!(p, Part::CallEnd { .. }));
        self.queue_parts(held);
        let reason = match engine {
            // A call the token limit cut short and the parser closed is still a cut reply.
            Some(wick_engine::FinishReason::Length) if cut_call => FinishReason::Length,
            _ if self.parser.calls() > 0 => FinishReason::ToolCalls,
            None | Some(wick_engine::FinishReason::EndOfSequence) => FinishReason::EndTurn,
            Some(wick_engine::FinishReason::Cancelled) => FinishReason::EndTurn,
            Some(wick_engine::FinishReason::StopString(s)) => FinishReason::StopSequence(s),
            Some(wick_engine::FinishReason::Length) => FinishReason::Length,
        };
        self.pending
            .push_back(ReplyEvent::Finish(Finish { reason, usage }));
        self.generation = None;
        self.done = true;
    }

    fn fail(&mut self, error: ApiError) -> ApiError {
        self.generation = None;
        self.done = true;
        error
    }
}

/// Logs and counts a finished call (every repair is recorded, never silent).
pub fn record_call(metrics: &Metrics, name: &str, repairs: &[RepairKind]) {
    metrics.record_tool_call();
    if !repairs.is_empty() {
        let kinds: Vec<&str> = repairs.iter().map(|r| r.as_str()).collect();
        tracing::info!(tool = %name, repairs = ?kinds, "tool call repaired");
        for r in repairs {
            metrics.record_repair(r.as_str());
        }
    }
}
