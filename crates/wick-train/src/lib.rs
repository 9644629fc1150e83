//! wick's LoRA trainer: supervised fine-tuning, DPO and ORPO of the dense families the
//! engine serves, f32 on the host, through the engine's own decoder on its training
//! backend (`wick_engine::backend::tape`, which records each pass and has a backward rule
//! per op; see docs/training.md for why not an autograd library).
//!
//! How the parts fit:
//! - [`base`] loads the engine's decoder over the frozen base onto the training backend;
//! - [`decoder`] runs the training forward and backward over a packed [`decoder::Batch`];
//! - [`lora`] holds the factors; [`optim`] AdamW, the schedule and clipping;
//! - [`loss`] turns per-token log-probabilities into SFT, DPO and ORPO losses and their
//!   gradients;
//! - [`data`] reads JSONL datasets into token sequences with loss masks;
//! - [`adapter_io`] writes and reads PEFT adapters, checkpoints and optimizer state;
//! - [`trainer`] is the loop;
//! - [`merge`] merges two adapters into one exactly (stacked factors), and [`fuse`] folds
//!   an adapter into a copy of its base model.
#![warn(missing_docs)]

pub mod adapter_io;
pub mod base;
pub mod data;
pub mod decoder;
mod error;
pub mod fuse;
pub mod lora;
pub mod loss;
pub mod merge;
pub mod optim;
pub mod trainer;

pub use error::{Result, TrainError};
