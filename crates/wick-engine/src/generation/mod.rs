//! Turning a prompt into tokens: requests, the per-sequence state machine the scheduler
//! drives, and [`Model::generate`](crate::Model::generate) for one sequence.
mod request;
mod sequence;
mod text;

pub use request::{
    CachePoint, FinishReason, GenerationOutput, GenerationRequest, PromptLogprob, TokenEvent,
    Usage, DEFAULT_PREFILL_CHUNK, PROMPT_SCORE_CHUNK,
};
pub use sequence::{DraftOutput, Sequence, SequenceStep};
pub use text::TextStream;
