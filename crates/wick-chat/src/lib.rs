//! Everything textual around an LLM, with no tensor dependency.
//!
//! - [`tokenizer`]: a `tokenizers` tokenizer built from GGUF metadata or `tokenizer.json`.
//! - [`detokenizer`]: incremental decoding that never emits broken UTF-8.
//! - [`chat_template`]: Hugging Face Jinja chat templates rendered with `minijinja`.
//! - [`stop`]: stop strings matched on decoded text across token boundaries.
//! - [`reasoning`]: splitting `<think>…</think>` reasoning from the answer while streaming.
//! - [`tool_call`]: tool-call parsing for every model family, with a repair layer.
//! - [`markup`]: the prompt markup client text may not write (control tokens, parser markers).
#![warn(missing_docs)]

pub mod chat_template;
pub mod detokenizer;
pub mod markup;
pub mod reasoning;
pub mod stop;
pub mod tokenizer;
pub mod tool_call;
