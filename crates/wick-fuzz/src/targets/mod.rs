//! The fuzz targets. Each builds its seeds in memory (no downloads): tiny but valid files made
//! by wick's own writers, so mutations start from inputs that reach deep into the parsers.
mod files;
mod texts;

pub use files::{gguf, hf_json, safetensors, ssd};
pub use texts::{chat_template, tool_call};

use crate::Target;

/// Every target, in the order the driver runs them.
pub fn all() -> anyhow::Result<Vec<Target>> {
    Ok(vec![
        gguf()?,
        safetensors()?,
        hf_json()?,
        ssd()?,
        tool_call(),
        chat_template(),
    ])
}

/// Target names, for `--help` and argument checks.
pub const NAMES: &[&str] = &[
    "gguf",
    "safetensors",
    "hf-json",
    "ssd",
    "tool-call",
    "chat-template",
];
