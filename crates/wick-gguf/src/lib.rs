//! Reader (and a small writer) for GGUF, the model container of llama.cpp.
//!
//! A GGUF file is a header of typed metadata (`general.*`, `<arch>.*`,
//! `tokenizer.ggml.*` …), a directory of tensors (name, shape, ggml type, offset) and an
//! aligned data section. [`GgufFile::open`] memory-maps the file, parses and validates
//! the whole header (every tensor must lie inside the file, every size must add up) and
//! hands out metadata values and raw tensor bytes. Nothing here knows about tensors as
//! numbers; the engine turns the bytes into weights.
//!
//! ```no_run
//! let gguf = wick_gguf::GgufFile::open("model.gguf")?;
//! let arch = gguf.metadata().get_str("general.architecture")?;
//! let layers = gguf.metadata().get_u64(&format!("{arch}.block_count"))?;
//! let embd = gguf.tensor("token_embd.weight")?;
//! println!("{arch}: {layers} layers, embeddings {:?} {}", embd.info.dims, embd.info.dtype);
//! # Ok::<(), wick_gguf::GgufError>(())
//! ```
#![warn(missing_docs)]

mod dtype;
mod error;
mod file;
mod metadata;
mod reader;
mod writer;

pub use dtype::GgmlType;
pub use error::GgufError;
pub use file::{GgufFile, TensorInfo, TensorView};
pub use metadata::{Metadata, MetadataValue};
pub use writer::GgufWriter;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
