//! Protocol encoders: each protocol turns the one reply stream ([`crate::reply`]) into its
//! own frames. A streamed reply is driven by [`stream`]; a whole one is
//! [`crate::reply::Reply::collect`] turned into a body by the protocol's encoder.
//!
//! Adding a protocol means writing an [`Encoder`] (and a whole-body function): validation
//! and prompt building are the protocol's own, the generation, parsing, finish reasons and
//! usage are the pipeline's.
pub mod anthropic;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod responses;

use std::collections::VecDeque;
use std::time::Duration;

use axum::response::sse::Event;
use axum::response::Response;
use tracing::Instrument;

use crate::error::ApiError;
use crate::reply::{Reply, ReplyEvent};
use crate::sse;

/// Turns reply events into a protocol's server-sent events.
pub trait Encoder: Send + 'static {
    /// Frames sent before the reply's first event.
    fn start(&mut self) -> Vec<Event> {
        Vec::new()
    }

    /// Frames for one reply event; the [`ReplyEvent::Finish`] gives the closing frames.
    fn event(&mut self, event: ReplyEvent) -> Vec<Event>;

    /// The frames of a failure; the stream ends after them.
    fn error(&mut self, error: ApiError) -> Vec<Event>;

    /// How long the reply may stay silent (a long prefill) before [`Encoder::idle`] frames
    /// are sent, beyond the SSE comment keep-alives every stream gets; `None`: never.
    fn keepalive(&self) -> Option<Duration> {
        None
    }

    /// The frames sent after [`Encoder::keepalive`]'s silence (Anthropic's `ping`).
    fn idle(&mut self) -> Vec<Event> {
        Vec::new()
    }
}

/// State of one streamed reply; dropping it (client gone) drops the reply, which cancels
/// the generation.
struct Streaming<E> {
    reply: Reply,
    encoder: E,
    pending: VecDeque<Event>,
    done: bool,
}

impl<E: Encoder> Streaming<E> {
    async fn next_frame(&mut self) -> Option<Event> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Some(frame);
            }
            if self.done {
                return None;
            }
            let next = match self.encoder.keepalive() {
                Some(every) => match tokio::time::timeout(every, self.reply.next()).await {
                    Ok(next) => next,
                    // Reading the reply's channel is cancel-safe: nothing is lost.
                    Err(_) => {
                        let frames = self.encoder.idle();
                        self.pending.extend(frames);
                        continue;
                    }
                },
                None => self.reply.next().await,
            };
            match next {
                Some(Ok(event)) => {
                    let frames = self.encoder.event(event);
                    self.pending.extend(frames);
                }
                Some(Err(error)) => {
                    let frames = self.encoder.error(error);
                    self.pending.extend(frames);
                    self.done = true;
                }
                None => self.done = true,
            }
        }
    }
}

/// The `text/event-stream` response of `reply` in `encoder`'s protocol.
pub fn stream(reply: Reply, mut encoder: impl Encoder) -> Response {
    let pending = encoder.start().into();
    let state = Streaming {
        reply,
        encoder,
        pending,
        done: false,
    };
    let span = tracing::Span::current();
    let frames = futures_util::stream::unfold(state, move |mut s| {
        let span = span.clone();
        async move {
            let frame = s.next_frame().await?;
            Some((frame, s))
        }
        .instrument(span)
    });
    sse::response(frames)
}
