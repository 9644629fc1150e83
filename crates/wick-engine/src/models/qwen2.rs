//! Qwen 2 / 2.5: Llama with Q/K/V biases (loaded when present) and NEOX rotary pairs.
use crate::backend::RopeStyle;
use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::models::{llama, Arch};
use crate::Result;

pub(super) fn from_gguf(keys: &GgufKeys<'_>, _source: &str) -> Result<ModelConfig> {
    llama::base_from_gguf(keys, Arch::Qwen2, RopeStyle::Neox, 1_000_000.0)
}

pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    llama::base_from_hf(keys, Arch::Qwen2, 10_000.0, false)
}
