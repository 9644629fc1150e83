//! [`Generation`]: one request submitted to the engine, read event by event, with its
//! latencies (time to first token, time between tokens) and token counts recorded.
//! Dropping it cancels the request in the engine.
use std::time::Instant;

use wick_engine::scheduler::{EngineEvent, RequestHandle};
use wick_engine::GenerationRequest;

use crate::error::ApiError;
use crate::state::AppState;

/// A request running in the engine.
pub struct Generation {
    state: AppState,
    handle: RequestHandle,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    tokens: usize,
    recorded: bool,
}

impl Generation {
    /// Queues `request` (arrived at `arrived`); a full queue is 429, shutdown 503, an
    /// invalid request 400.
    pub fn submit(
        state: &AppState,
        request: GenerationRequest,
        arrived: Instant,
    ) -> Result<Generation, ApiError> {
        let prompt_tokens = request.prompt.len();
        let handle = state.engine().submit(request)?;
        tracing::debug!(engine_request = handle.id(), prompt_tokens, "queued");
        state.metrics().generation_started();
        Ok(Generation {
            state: state.clone(),
            handle,
            arrived,
            last_token: None,
            prompt_tokens,
            tokens: 0,
            recorded: false,
        })
    }

    /// The next event; `None` after the last. Records latencies and, at the end, usage.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        let event = self.handle.next().await;
        let now = Instant::now();
        let metrics = self.state.metrics();
        match &event {
            Some(EngineEvent::Token(_)) => {
                match self.last_token {
                    None => metrics.observe_ttft(now - self.arrived),
                    Some(previous) => metrics.observe_inter_token(now - previous),
                }
                self.last_token = Some(now);
                self.tokens += 1;
            }
            Some(EngineEvent::Done(done)) => {
                let u = &done.usage;
                self.record(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
            }
            Some(EngineEvent::Failed(message)) => {
                tracing::warn!(%message, "generation failed");
            }
            None => {}
        }
        event
    }

    /// Prompt tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Tokens received so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn record(&mut self, prompt: usize, cached: usize, completion: usize) {
        if !self.recorded {
            self.recorded = true;
            self.state
                .metrics()
                .record_tokens(prompt, cached, completion);
        }
    }

    /// Stops early (the reply is complete without more tokens): records what was
    /// generated (`cached` of the prompt tokens came from the cache); dropping the
    /// generation then cancels it in the engine.
    pub fn stop_early(&mut self, cached: usize) {
        self.record(self.prompt_tokens, cached, self.tokens);
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.state.metrics().generation_ended();
        if !self.recorded {
            tracing::info!(
                generated = self.tokens,
                "request ended before its generation finished (client gone?): cancelled"
            );
        }
    }
}
