//! The supported architectures ([`Arch`]) and the architecture-neutral hyperparameters
//! ([`ModelConfig`]); each architecture reads its own from GGUF metadata or `config.json`
//! (in [`crate::models`]).
use serde_json::Value;
use wick_gguf::Metadata;

use crate::backend::{Activation, RopeSpec, RopeStyle};
use crate::{EngineError, Result};

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
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How rotary frequencies are scaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No scaling.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Overall factor.
        factor: f64,
        /// Wavelengths longer than `original / low_freq_factor` are fully scaled.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Training context of the unscaled model.
        original_max_position: f64,
    },
    /// Per-pair frequency divisors stored in the file (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
}

/// Rotary parameters of one kind of layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Base θ.
    pub theta: f64,
    /// Scaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// The rotary spec for heads of `dims` rotated dimensions.
    pub fn spec(&self, style: RopeStyle, dims: usize) -> RopeSpec {
        let mut inv_freq = RopeSpec::base_inv_freq(self.theta, dims);
        let mut position_scale = 1.0;
        match &self.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => position_scale = (1.0 / factor) as f32,
            RopeScaling::Factors(f) => {
                for (x, d) in inv_freq.iter_mut().zip(f) {
                    *x /= d;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let low_wavelen = original_max_position / low_freq_factor;
                let high_wavelen = original_max_position / high_freq_factor;
                for x in inv_freq.iter_mut() {
                    let f = *x as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original_max_position / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    *x = scaled as f32;
                }
            }
        }
        RopeSpec {
            style,
            dims,
            inv_freq,
            position_scale,
        }
    }
}

/// Everything the decoder needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size (embedding rows).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP inner size.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// RMS-norm epsilon.
    pub rms_eps: f32,
    /// Context the model was trained for.
    pub context_length: usize,
    /// Rotary pairing (depends on the file format for Llama).
    pub rope_style: RopeStyle,
    /// Rotated dimensions per head.
    pub rotary_dims: usize,
    /// Rotary parameters of full-attention layers.
    pub rope: RopeConfig,
    /// Rotary parameters of sliding-window layers, when they differ (Gemma 3).
    pub rope_local: Option<RopeConfig>,
    /// Sliding window of each layer (`None` = full attention).
    pub layer_windows: Vec<Option<usize>>,
    /// Output projection shares the embedding matrix.
    pub tie_embeddings: bool,
    /// Multiplier of `q·k`.
    pub attn_scale: f32,
    /// Soft cap of attention scores.
    pub attn_softcap: Option<f32>,
    /// Soft cap of final logits.
    pub final_softcap: Option<f32>,
    /// MLP activation.
    pub activation: Activation,
    /// Embeddings are multiplied by `sqrt(hidden)` (Gemma).
    pub scale_embeddings: bool,
    /// Gemma's sandwich norms around attention and MLP outputs.
    pub sandwich_norms: bool,
    /// Norm weights are stored as offsets from 1 (Hugging Face Gemma) and need `+1`.
    pub norm_weight_offset: bool,
    /// End-of-sequence ids from the model config (the tokenizer may add more).
    pub eos_token_ids: Vec<u32>,
    /// Beginning-of-sequence id from the model config.
    pub bos_token_id: Option<u32>,
}

/// Typed reads of GGUF `<arch>.*` keys with errors naming the file.
pub(crate) struct GgufKeys<'a> {
    pub meta: &'a Metadata,
    pub arch: &'a str,
}

impl GgufKeys<'_> {
    pub fn usize(&self, key: &str) -> Result<usize> {
        Ok(self.meta.get_u64(&format!("{}.{key}", self.arch))? as usize)
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        Ok(self
            .meta
            .opt_u64(&format!("{}.{key}", self.arch))?
            .map(|v| v as usize))
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        Ok(self.meta.opt_f64(&format!("{}.{key}", self.arch))?)
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        Ok(self.meta.opt_str(&format!("{}.{key}", self.arch))?)
    }
}

/// Typed reads of `config.json` fields with errors naming the file.
pub(crate) struct HfKeys<'a> {
    pub json: &'a Value,
    pub source: &'a str,
}

impl HfKeys<'_> {
    fn bad(&self, key: &str, what: &str) -> EngineError {
        EngineError::Config {
            source_name: self.source.to_string(),
            reason: format!("'{key}' {what}"),
        }
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.bad(key, "is missing"))
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .map(|v| v as usize)
                    .ok_or_else(|| self.bad(key, "must be a non-negative integer"))
            })
            .transpose()
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.bad(key, "must be a number")))
            .transpose()
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.bad(key, "must be a boolean"))
            })
            .transpose()
    }
    /// Token ids that may be given as one number or a list.
    pub fn ids(&self, key: &str) -> Vec<u32> {
        match self.get(key) {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Rotary θ and scaling, from the pre-5.0 `rope_theta`/`rope_scaling` fields or the
    /// newer `rope_parameters` (optionally keyed by layer type).
    pub fn rope(&self, layer_type: Option<&str>, default_theta: f64) -> Result<RopeConfig> {
        let params = self
            .get("rope_parameters")
            .map(|p| match layer_type.and_then(|t| p.get(t)) {
                Some(inner) => inner,
                None => p,
            });
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(self.opt_f64("rope_theta")?)
            .unwrap_or(default_theta);
        let scaling_obj = params.or_else(|| self.get("rope_scaling"));
        let scaling = match scaling_obj {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let f = |k: &str| s.get(k).and_then(Value::as_f64);
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear {
                        factor: f("factor").unwrap_or(1.0),
                    },
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor").unwrap_or(8.0),
                        low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                        high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                        original_max_position: f("original_max_position_embeddings")
                            .unwrap_or(8192.0),
                    },
                    other => {
                        return Err(self.bad(
                            "rope_scaling",
                            &format!("type '{other}' is not supported (default, linear, llama3)"),
                        ))
                    }
                }
            }
        };
        Ok(RopeConfig { theta, scaling })
    }
}

/// Token ids of a JSON field that may hold one number or a list.
pub(crate) fn hf_ids(json: &Value, key: &str) -> Vec<u32> {
    match json.get(key) {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    /// Checks the sizes every architecture relies on.
    pub(crate) fn validate(&self, source: &str) -> Result<()> {
        let bad = |reason: String| {
            Err(EngineError::Config {
                source_name: source.to_string(),
                reason,
            })
        };
        if self.num_layers == 0
            || self.hidden_size == 0
            || self.num_heads == 0
            || self.head_dim == 0
        {
            return bad(format!(
                "layers {}, hidden {}, heads {}, head_dim {} must all be positive",
                self.num_layers, self.hidden_size, self.num_heads, self.head_dim
            ));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rotary_dims > self.head_dim || !self.rotary_dims.is_multiple_of(2) {
            return bad(format!(
                "rotary dimensions {} do not fit head_dim {}",
                self.rotary_dims, self.head_dim
            ));
        }
        if self.layer_windows.len() != self.num_layers {
            return bad(format!(
                "{} layer windows for {} layers",
                self.layer_windows.len(),
                self.num_layers
            ));
        }
        Ok(())
    }

    /// Bytes of KV cache one token takes in f32, summed over layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4
    }
}
