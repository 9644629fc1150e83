//! Supported architectures and the decoder they share.
//!
//! Each architecture file reads its configuration (from GGUF metadata and from
//! `config.json`) into a [`ModelConfig`]; [`decoder::Decoder`] runs every one of them,
//! switching on the config's flags (biases, Q/K norms, sandwich norms, activation …).
pub mod audio;
pub mod decoder;
pub mod deltanet;
mod dense;
mod gemma3;
pub mod gemma4;
pub mod greedy;
mod llama;
mod mlp;
pub mod moe;
pub mod mrope;
mod qwen2;
mod qwen3;
pub mod qwen35;
mod qwen35_gguf;
pub mod recurrent;
pub mod vision;

use serde_json::Value;
use wick_gguf::Metadata;

use crate::backend::capability::Need;
pub use crate::config::Arch;
use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::{EngineError, Result};

/// Layers `span` of a model's `layers` (a staged training pass runs a few at a time), or
/// an error naming the span the model lacks.
pub(crate) fn layer_span<'a, T>(layers: &'a [T], span: &std::ops::Range<usize>) -> Result<&'a [T]> {
    layers.get(span.clone()).ok_or_else(|| {
        EngineError::InvalidInput(format!("layers {span:?} of a model of {}", layers.len()))
    })
}

pub(crate) use qwen35_gguf::Qwen35Gguf;

/// What a model configured as `cfg` needs of its backend beyond the core ops: its layer
/// stack's needs (each family declares them beside its layers) and its towers'.
pub fn needs(cfg: &ModelConfig) -> Vec<Need> {
    let mut needs = match (&cfg.gemma4, &cfg.qwen35) {
        (Some(g), _) => gemma4::needs(g),
        (None, Some(_)) => qwen35::needs(cfg),
        (None, None) => decoder::dense::needs(cfg),
    };
    needs.extend(decoder::towers::needs(cfg));
    needs
}

impl Arch {
    pub(crate) fn config_from_gguf(self, keys: &GgufKeys<'_>, source: &str) -> Result<ModelConfig> {
        match self {
            Arch::Llama => llama::from_gguf(keys, source),
            Arch::Qwen2 => qwen2::from_gguf(keys, source),
            Arch::Qwen3 => qwen3::from_gguf(keys, source),
            Arch::Gemma3 => gemma3::from_gguf(keys, source),
            Arch::Qwen35 => qwen35_gguf::from_gguf(keys, source),
            Arch::Gemma4 => gemma4::from_gguf(keys, source),
            other => Err(EngineError::Config {
                source_name: source.to_string(),
                reason: format!(
                    "GGUF files of architecture '{other}' are not supported yet; load its Hugging Face (safetensors) directory instead"
                ),
            }),
        }
    }

    pub(crate) fn config_from_hf(self, keys: &HfKeys<'_>) -> Result<ModelConfig> {
        match self {
            Arch::Llama => llama::from_hf(keys),
            Arch::Qwen2 => qwen2::from_hf(keys),
            Arch::Qwen3 => qwen3::from_hf(keys),
            Arch::Gemma3 => gemma3::from_hf(keys),
            Arch::Mistral => dense::mistral(keys),
            Arch::Phi3 => dense::phi3(keys),
            Arch::Gemma2 => dense::gemma2(keys),
            Arch::Olmo2 => dense::olmo2(keys),
            Arch::Granite => dense::granite(keys),
            Arch::Starcoder2 => dense::starcoder2(keys),
            Arch::SmolLm3 => dense::smollm3(keys),
            Arch::Glm4 => dense::glm4(keys),
            Arch::MiniCpm => dense::minicpm(keys),
            Arch::Gemma4 => gemma4::from_hf(keys),
            Arch::Qwen35 => qwen35::from_hf(keys),
        }
    }
}

impl ModelConfig {
    /// Reads the configuration of a GGUF file.
    pub fn from_gguf(meta: &Metadata, source: &str) -> Result<Self> {
        let arch_name = meta.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| EngineError::UnsupportedArch {
            source_name: source.to_string(),
            arch: arch_name.to_string(),
            supported: Arch::supported_list(),
        })?;
        let keys = GgufKeys {
            meta,
            arch: arch_name,
        };
        let cfg = arch.config_from_gguf(&keys, source)?;
        cfg.validate(source)?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf(json: &Value, source: &str) -> Result<Self> {
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch =
            Arch::from_hf_model_type(model_type).ok_or_else(|| EngineError::UnsupportedArch {
                source_name: source.to_string(),
                arch: model_type.to_string(),
                supported: Arch::supported_list(),
            })?;
        // Multimodal wrappers keep the language model's fields under `text_config`.
        let text = json
            .get("text_config")
            .filter(|t| t.is_object())
            .unwrap_or(json);
        let keys = HfKeys { json: text, source };
        // MiniCPM ships as `llama` with its scaling fields.
        let arch = if arch == Arch::Llama && dense::is_minicpm(text) {
            Arch::MiniCpm
        } else {
            arch
        };
        let mut cfg = arch.config_from_hf(&keys)?;
        // A multimodal wrapper may say whether the head is tied beside `text_config` only.
        if !std::ptr::eq(text, json) && text.get("tie_word_embeddings").is_none() {
            if let Some(tied) = (HfKeys { json, source }).opt_bool("tie_word_embeddings")? {
                cfg.tie_embeddings = tied;
            }
        }
        if arch == Arch::Gemma3 {
            cfg.vision = crate::config::media::VisionConfig::from_hf(json, source)?;
        }
        if arch == Arch::Gemma4 {
            cfg.audio = crate::config::media::AudioConfig::from_hf(json, source)?;
        }
        if let Some(g4) = cfg.gemma4.as_mut() {
            g4.vision = crate::config::media::Gemma4VisionConfig::from_hf(json, source)?;
        }
        // Qwen 3.5 and Qwen2.5-VL (a Qwen2 text model) may carry a Qwen vision tower.
        let qwen25 = model_type == "qwen2_5_vl";
        if arch == Arch::Qwen35 || qwen25 {
            cfg.qwen_vision =
                crate::config::media::QwenVisionConfig::from_hf(json, source, qwen25)?;
            if cfg.qwen_vision.is_some() {
                cfg.mrope = crate::config::mrope::Mrope::from_hf(&keys, cfg.rotary_dims)?;
            }
        }
        if cfg.eos_token_ids.is_empty() {
            cfg.eos_token_ids = HfKeys { json, source }.ids("eos_token_id");
        }
        cfg.validate(source)?;
        Ok(cfg)
    }
}
