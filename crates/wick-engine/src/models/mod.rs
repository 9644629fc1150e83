//! Supported architectures and the decoder they share.
//!
//! Each architecture file reads its configuration (from GGUF metadata and from
//! `config.json`) into a [`ModelConfig`]; [`decoder::Decoder`] runs every one of them,
//! switching on the config's flags (biases, Q/K norms, sandwich norms, activation …).
pub mod decoder;
mod gemma3;
pub mod greedy;
mod llama;
mod qwen2;
mod qwen3;

use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::Result;

/// A supported model architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama 2/3, SmolLM, Mistral-style dense decoders (GGUF `llama`, HF `llama`/`mistral`).
    Llama,
    /// Qwen 2 / 2.5: Llama plus Q/K/V biases (GGUF and HF `qwen2`).
    Qwen2,
    /// Qwen 3: Q/K RMS norms, no biases (GGUF and HF `qwen3`).
    Qwen3,
    /// Gemma 3 text: sandwich norms, GELU, scaled embeddings, interleaved sliding-window
    /// and global layers with two rotary bases (GGUF `gemma3`, HF `gemma3_text`/`gemma3`).
    Gemma3,
}

impl Arch {
    /// All architectures, in the order error messages list them.
    pub const ALL: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

    /// The GGUF `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// From a GGUF architecture name.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// From a Hugging Face `model_type`.
    pub fn from_hf_model_type(model_type: &str) -> Option<Arch> {
        Some(match model_type {
            "llama" | "mistral" | "smollm" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            _ => return None,
        })
    }

    /// "llama, qwen2, qwen3, gemma3"
    pub fn supported_list() -> String {
        Arch::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub(crate) fn config_from_gguf(self, keys: &GgufKeys<'_>, source: &str) -> Result<ModelConfig> {
        match self {
            Arch::Llama => llama::from_gguf(keys, source),
            Arch::Qwen2 => qwen2::from_gguf(keys, source),
            Arch::Qwen3 => qwen3::from_gguf(keys, source),
            Arch::Gemma3 => gemma3::from_gguf(keys, source),
        }
    }

    pub(crate) fn config_from_hf(self, keys: &HfKeys<'_>) -> Result<ModelConfig> {
        match self {
            Arch::Llama => llama::from_hf(keys),
            Arch::Qwen2 => qwen2::from_hf(keys),
            Arch::Qwen3 => qwen3::from_hf(keys),
            Arch::Gemma3 => gemma3::from_hf(keys),
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
