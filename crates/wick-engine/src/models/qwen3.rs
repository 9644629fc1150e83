//! Qwen 3: per-head RMS norms on Q and K before the rotary embedding, no biases.
use crate::backend::RopeStyle;
use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::models::{llama, Arch};
use crate::Result;

pub(super) fn from_gguf(keys: &GgufKeys<'_>, _source: &str) -> Result<ModelConfig> {
    llama::base_from_gguf(keys, Arch::Qwen3, RopeStyle::Neox, 1_000_000.0)
}

pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    llama::base_from_hf(keys, Arch::Qwen3, 10_000.0, false)
}
