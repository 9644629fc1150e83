//! wick's inference engine.
#![warn(missing_docs)]

pub mod sampler;
