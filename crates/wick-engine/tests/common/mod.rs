//! What the engine's integration tests share, one concept a file. A test includes it with
//! `mod common;` and uses the parts it needs (`use common::golden::TextGolden;`); a test
//! that needs only the serving helpers may include `serving.rs` alone (see there).
#![allow(dead_code)] // each test crate uses its own subset

/// The tiny llama GGUF the file-writing tests build.
pub mod gguf;
/// Goldens on disk and the text goldens' models.
pub mod golden;
/// PEFT adapters on the tiny Qwen 3.5 and Gemma 4 goldens, on any backend.
pub mod hybrid_adapters;
/// llama.cpp's greedy goldens of the real GGUF models.
pub mod llamacpp;
/// Forward passes, the greedy pick and logit comparisons.
pub mod logits;
/// The media goldens (images, audio).
pub mod media;
/// Real models through the engine: requests run alone and the engine's replies.
pub mod serving;
/// Random-weight models with real attention shapes, in f32 or MLX-quantized.
pub mod wide;
