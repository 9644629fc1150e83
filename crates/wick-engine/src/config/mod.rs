//! The supported architectures ([`Arch`]) and the architecture-neutral hyperparameters
//! ([`ModelConfig`]); each architecture reads its own from GGUF metadata or `config.json`
//! (in [`crate::models`]).
use serde_json::Value;
use wick_gguf::Metadata;

use crate::backend::{Activation, RopeSpec, RopeStyle};
use crate::{EngineError, Result};

pub mod gemma4;
pub mod media;
pub mod mrope;
pub mod qwen35;
pub mod rope;

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
    /// Mistral: Llama with a sliding window on every layer (HF `mistral`).
    Mistral,
    /// Phi-3: fused QKV and gate/up projections, LongRoPE (GGUF and HF `phi3`).
    Phi3,
    /// Gemma 2: sandwich norms, attention and final-logit soft caps, alternating sliding
    /// window (GGUF and HF `gemma2`).
    Gemma2,
    /// OLMo 2: norms after attention and MLP (none before), full-width Q/K norms (GGUF and
    /// HF `olmo2`).
    Olmo2,
    /// Granite: Llama with embedding, residual, attention and logit multipliers (GGUF and
    /// HF `granite`).
    Granite,
    /// StarCoder 2: LayerNorm with bias, plain GELU MLP, biases on every projection (GGUF
    /// and HF `starcoder2`).
    Starcoder2,
    /// SmolLM 3: Llama with rotary embeddings left out on some layers (HF `smollm3`).
    SmolLm3,
    /// GLM-4: sandwich norms, fused gate/up, partial interleaved rotary (GGUF and HF `glm4`).
    Glm4,
    /// MiniCPM: a Hugging Face `llama` config carrying `scale_emb` / `scale_depth` /
    /// `dim_model_base` (HF `llama` fingerprinted, or `minicpm`).
    MiniCpm,
    /// Gemma 4 text: per-layer input embeddings, KV sharing, sliding and full layers with
    /// their own head sizes, proportional rotary embeddings, optional mixture of experts
    /// (HF `gemma4_text`/`gemma4`; see [`crate::models::gemma4`]).
    Gemma4,
    /// Qwen 3.5: gated DeltaNet linear-attention layers between full-attention layers with
    /// an output gate (HF `qwen3_5_text`/`qwen3_5`; GGUF `qwen35` is recognized, not loaded).
    Qwen35,
}

impl Arch {
    /// All architectures, in the order error messages list them.
    pub const ALL: [Arch; 15] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Mistral,
        Arch::Phi3,
        Arch::Gemma2,
        Arch::Olmo2,
        Arch::Granite,
        Arch::Starcoder2,
        Arch::SmolLm3,
        Arch::Glm4,
        Arch::MiniCpm,
        Arch::Gemma4,
        Arch::Qwen35,
    ];

    /// The GGUF `general.architecture` name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Mistral => "mistral",
            Arch::Phi3 => "phi3",
            Arch::Gemma2 => "gemma2",
            Arch::Olmo2 => "olmo2",
            Arch::Granite => "granite",
            Arch::Starcoder2 => "starcoder2",
            Arch::SmolLm3 => "smollm3",
            Arch::Glm4 => "glm4",
            Arch::MiniCpm => "minicpm",
            Arch::Gemma4 => "gemma4",
            Arch::Qwen35 => "qwen35",
        }
    }

    /// From a GGUF architecture name.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// From a Hugging Face `model_type`.
    pub fn from_hf_model_type(model_type: &str) -> Option<Arch> {
        Some(match model_type {
            "llama" | "smollm" => Arch::Llama,
            "qwen2" | "qwen2_5_vl" | "qwen2_5_vl_text" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            "mistral" => Arch::Mistral,
            "phi3" => Arch::Phi3,
            "gemma2" => Arch::Gemma2,
            "olmo2" => Arch::Olmo2,
            "granite" => Arch::Granite,
            "starcoder2" => Arch::Starcoder2,
            "smollm3" => Arch::SmolLm3,
            "glm4" => Arch::Glm4,
            "minicpm" => Arch::MiniCpm,
            "gemma4" | "gemma4_text" => Arch::Gemma4,
            "qwen3_5" | "qwen3_5_text" => Arch::Qwen35,
            _ => return None,
        })
    }

    /// "llama, qwen2, qwen3, gemma3, …"
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
    /// YaRN: frequencies blended between interpolation and extrapolation, cos/sin scaled.
    Yarn(rope::Yarn),
    /// LongRoPE (Phi-3): per-pair divisors, short or long by the sequence length.
    LongRope(rope::LongRope),
    /// Dynamic NTK: the base grows with the sequence length past the trained context.
    Dynamic(rope::DynamicNtk),
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
    /// The rotary spec for heads of `dims` rotated dimensions (for sequences within the
    /// trained context; see [`RopeConfig::spec_for_len`]).
    pub fn spec(&self, style: RopeStyle, dims: usize) -> RopeSpec {
        self.spec_for_len(style, dims, 0)
    }

    /// Whether the frequencies depend on the sequence length (dynamic NTK, LongRoPE), so
    /// that a forward pass must build them for its own length.
    pub fn depends_on_length(&self) -> bool {
        matches!(
            self.scaling,
            RopeScaling::Dynamic(_) | RopeScaling::LongRope(_)
        )
    }

    /// The rotary spec for a forward pass whose longest sequence reaches `seq_len` tokens.
    pub fn spec_for_len(&self, style: RopeStyle, dims: usize, seq_len: usize) -> RopeSpec {
        let mut inv_freq = RopeSpec::base_inv_freq(self.theta, dims);
        let mut position_scale = 1.0;
        let mut attention_factor = 1.0;
        match &self.scaling {
            RopeScaling::None => {}
            RopeScaling::Yarn(y) => {
                (inv_freq, attention_factor) = y.inv_freq(self.theta, dims);
            }
            RopeScaling::LongRope(l) => {
                (inv_freq, attention_factor) = l.inv_freq(self.theta, dims, seq_len);
            }
            RopeScaling::Dynamic(d) => inv_freq = d.inv_freq(self.theta, dims, seq_len),
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
            attention_factor,
        }
    }
}

/// The normalization layers of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormKind {
    /// RMS norm times a weight.
    #[default]
    Rms,
    /// LayerNorm (mean and variance) times a weight, plus a bias where the file has one.
    Layer,
}

/// The MLP of each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlpKind {
    /// `down(act(gate(x)) * up(x))`.
    #[default]
    Gated,
    /// `down(act(up(x)))` (StarCoder 2).
    Plain,
}

/// How a family names its tensors in a Hugging Face checkpoint, where that differs from
/// Llama's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HfNaming {
    /// `input_layernorm`, `post_attention_layernorm` (pre-MLP), `mlp.{gate,up,down}_proj`.
    #[default]
    Llama,
    /// Gemma's sandwich norms: `pre_feedforward_layernorm` before the MLP.
    Gemma,
    /// GLM-4: `post_self_attn_layernorm`, `post_attention_layernorm` (pre-MLP),
    /// `post_mlp_layernorm`.
    Glm4,
    /// StarCoder 2: `mlp.c_fc` / `mlp.c_proj`.
    Starcoder2,
}

/// Family switches the decoder reads beyond the Llama layout; the defaults are Llama's.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// Normalization layers.
    pub norm: NormKind,
    /// Norms before attention and MLP (every family but OLMo 2, which only norms outputs).
    pub pre_norms: bool,
    /// Q/K norms span the whole projection rather than each head (OLMo 2).
    pub qk_norm_full: bool,
    /// MLP kind.
    pub mlp: MlpKind,
    /// Embeddings are multiplied by this (Granite `embedding_multiplier`, MiniCPM
    /// `scale_emb`), after any `sqrt(hidden)` of [`ModelConfig::scale_embeddings`].
    pub embed_multiplier: Option<f32>,
    /// Attention and MLP outputs are multiplied by this before the residual add (Granite
    /// `residual_multiplier`, MiniCPM `scale_depth / sqrt(layers)`).
    pub residual_multiplier: Option<f32>,
    /// Logits are multiplied by this (Granite `1 / logits_scaling`, MiniCPM
    /// `dim_model_base / hidden`).
    pub logit_multiplier: Option<f32>,
    /// Per layer, whether it applies rotary embeddings (empty: every layer does; SmolLM 3
    /// leaves them out on some).
    pub rope_layers: Vec<bool>,
    /// Tensor names in Hugging Face checkpoints.
    pub hf_naming: HfNaming,
}

impl Default for Features {
    fn default() -> Self {
        Features {
            norm: NormKind::Rms,
            pre_norms: true,
            qk_norm_full: false,
            mlp: MlpKind::Gated,
            embed_multiplier: None,
            residual_multiplier: None,
            logit_multiplier: None,
            rope_layers: Vec::new(),
            hf_naming: HfNaming::Llama,
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
    /// Family switches beyond the Llama layout.
    pub features: Features,
    /// Gemma 4's per-layer layout (head sizes, KV sharing, PLE, experts).
    pub gemma4: Option<Box<gemma4::Gemma4Params>>,
    /// Qwen 3.5's hybrid layout (linear-attention layers and their shape).
    pub qwen35: Option<qwen35::Qwen35Config>,
    /// The vision tower and projector of a multimodal checkpoint (Gemma 3's SigLIP), when
    /// `config.json` describes one; whether its weights are present is checked at load.
    pub vision: Option<media::VisionConfig>,
    /// The audio tower of a multimodal checkpoint (Gemma 4's Conformer), when `config.json`
    /// describes one; whether its weights are present is checked at load.
    pub audio: Option<media::AudioConfig>,
    /// Qwen 3.5's vision tower, when `config.json` describes one (weights checked at load).
    pub qwen_vision: Option<media::QwenVisionConfig>,
    /// Multimodal rotary positions (Qwen-VL), used for prompts that hold images.
    pub mrope: Option<mrope::Mrope>,
}

/// Typed reads of GGUF `<arch>.*` keys with errors naming the file.
pub(crate) struct GgufKeys<'a> {
    pub meta: &'a Metadata,
    pub arch: &'a str,
}

/// The most decoder layers a configuration may claim. Checked before anything is sized by the
/// layer count; the loader then requires each layer's tensors, so a file cannot claim more
/// layers than it holds. Published models have at most a few hundred.
pub(crate) const MAX_LAYERS: usize = 1 << 12;

/// A layer count from `source`'s `key`, refused above [`MAX_LAYERS`].
fn checked_layers(layers: usize, key: &str, source: &str) -> Result<usize> {
    if layers > MAX_LAYERS {
        return Err(EngineError::Config {
            source_name: source.to_string(),
            reason: format!("'{key}' is {layers}; at most {MAX_LAYERS} layers are supported"),
        });
    }
    Ok(layers)
}

impl GgufKeys<'_> {
    /// The layer count under `key`, checked before anything is sized by it.
    pub fn layer_count(&self, key: &str) -> Result<usize> {
        let full = format!("{}.{key}", self.arch);
        let layers = self.usize(key)?;
        checked_layers(layers, &full, &self.meta.path().display().to_string())
    }
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
    /// A count stored as one number or as an array of them (one per layer).
    pub fn usizes(&self, key: &str) -> Result<Option<Vec<usize>>> {
        let full = format!("{}.{key}", self.arch);
        let bad = || EngineError::Config {
            source_name: self.meta.path().display().to_string(),
            reason: format!("'{full}' must be a count or an array of counts"),
        };
        match self.meta.get(&full) {
            None => Ok(None),
            Some(v) => match v.as_array() {
                Some(items) => items
                    .iter()
                    .map(|x| x.as_u64().map(|x| x as usize).ok_or_else(bad))
                    .collect::<Result<Vec<_>>>()
                    .map(Some),
                None => v.as_u64().map(|x| Some(vec![x as usize])).ok_or_else(bad),
            },
        }
    }
    /// An array of booleans (one per layer).
    pub fn bools(&self, key: &str) -> Result<Option<Vec<bool>>> {
        let full = format!("{}.{key}", self.arch);
        let bad = || EngineError::Config {
            source_name: self.meta.path().display().to_string(),
            reason: format!("'{full}' must be an array of booleans"),
        };
        match self.meta.get(&full) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|b| b.as_bool().ok_or_else(bad))
                .collect::<Result<Vec<_>>>()
                .map(Some),
        }
    }
}

/// Typed reads of `config.json` fields with errors naming the file.
pub(crate) struct HfKeys<'a> {
    pub json: &'a Value,
    pub source: &'a str,
}

impl HfKeys<'_> {
    /// The layer count under `key`, checked before anything is sized by it.
    pub fn layer_count(&self, key: &str) -> Result<usize> {
        checked_layers(self.usize(key)?, key, self.source)
    }

    /// The MLP activation named by `hidden_activation` or `hidden_act`; `default` when neither
    /// is given. `gelu` is taken as the tanh approximation only where that is the default
    /// (Gemma, as transformers does); a name wick does not implement is an error.
    pub fn activation(&self, default: Activation) -> Result<Activation> {
        let key = if self.get("hidden_activation").is_some() {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let Some(value) = self.get(key) else {
            return Ok(default);
        };
        let name = value
            .as_str()
            .ok_or_else(|| self.bad(key, "must be a string"))?;
        match name {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new" | "gelu_fast" => {
                Ok(Activation::GeluTanh)
            }
            "gelu" if default == Activation::GeluTanh => Ok(Activation::GeluTanh),
            other => Err(self.bad(
                key,
                &format!("'{other}' is not a supported activation (silu, gelu_pytorch_tanh)"),
            )),
        }
    }

    pub(crate) fn bad(&self, key: &str, what: &str) -> EngineError {
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
                    "yarn" | "longrope" | "dynamic" => rope::from_hf(self, kind, s)?,
                    // Early Phi-3 configs name LongRoPE "su".
                    "su" => rope::from_hf(self, "longrope", s)?,
                    other => {
                        return Err(self.bad(
                            "rope_scaling",
                            &format!(
                                "type '{other}' is not supported (default, linear, llama3, yarn, longrope, dynamic)"
                            ),
                        ))
                    }
                }
            }
        };
        Ok(RopeConfig { theta, scaling })
    }
}

/// Checks a `generation_config.json` before its defaults are used: an object whose sampling
/// fields wick reads are numbers in range (or null), and whose token ids are ids.
pub(crate) fn check_generation_config(gen: &Value, source: &str) -> Result<()> {
    let bad = |reason: String| EngineError::Config {
        source_name: source.to_string(),
        reason,
    };
    let Some(obj) = gen.as_object() else {
        return Err(bad(format!(
            "must be a JSON object, not {}",
            match gen {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
            }
        )));
    };
    let number = |key: &str, ok: fn(f64) -> bool, range: &str| -> Result<()> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(v) => match v.as_f64() {
                Some(x) if ok(x) => Ok(()),
                _ => Err(bad(format!("'{key}' is {v}; it must be a number {range}"))),
            },
        }
    };
    number(
        "temperature",
        |x| (x as f32).is_finite() && x >= 0.0,
        ">= 0",
    )?;
    number("top_p", |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
    number(
        "repetition_penalty",
        |x| (x as f32).is_finite() && x > 0.0,
        "> 0",
    )?;
    match obj.get("top_k") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64().is_some() => {}
        Some(v) => {
            return Err(bad(format!(
                "'top_k' is {v}; it must be a non-negative integer"
            )))
        }
    }
    for key in ["eos_token_id", "bos_token_id", "pad_token_id"] {
        let is_id = |v: &Value| v.as_u64().is_some_and(|id| id <= u64::from(u32::MAX));
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if is_id(v) => {}
            Some(Value::Array(a)) if a.iter().all(is_id) => {}
            Some(v) => {
                return Err(bad(format!(
                    "'{key}' is {v}; it must be a token id or a list of them"
                )))
            }
        }
    }
    Ok(())
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
        for (name, value) in [
            ("layer count", self.num_layers),
            ("hidden size", self.hidden_size),
            ("head count", self.num_heads),
            ("head dimension", self.head_dim),
            ("intermediate (MLP) size", self.intermediate_size),
            ("vocabulary size", self.vocab_size),
        ] {
            if value == 0 {
                return bad(format!("{name} is 0; it must be positive"));
            }
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        // No supported family runs without rotary embeddings: 0 rotated dimensions
        // (`rope.dimension_count = 0`, `partial_rotary_factor: 0`) is a damaged file, not
        // a position-free model.
        if self.rotary_dims == 0
            || self.rotary_dims > self.head_dim
            || !self.rotary_dims.is_multiple_of(2)
        {
            return bad(format!(
                "rotary dimensions {} do not fit head_dim {} (they must be a positive even \
                 number no larger than it)",
                self.rotary_dims, self.head_dim
            ));
        }
        for rope in std::iter::once(&self.rope).chain(&self.rope_local) {
            if let RopeScaling::LongRope(l) = &rope.scaling {
                l.check(self.rotary_dims)
                    .map_err(|reason| EngineError::Config {
                        source_name: source.to_string(),
                        reason,
                    })?;
            }
        }
        if self.layer_windows.len() != self.num_layers {
            return bad(format!(
                "{} layer windows for {} layers",
                self.layer_windows.len(),
                self.num_layers
            ));
        }
        if let Some(i) = self.layer_windows.iter().position(|w| *w == Some(0)) {
            return bad(format!(
                "layer {i} has a sliding window of 0 tokens (sliding_window / \
                 attention.sliding_window); it must be positive"
            ));
        }
        self.validate_numbers()
            .map_err(|reason| EngineError::Config {
                source_name: source.to_string(),
                reason,
            })
    }

    /// Sizes within what any real model has (so that products of them cannot overflow) and
    /// floating-point parameters that are finite and in range.
    fn validate_numbers(&self) -> std::result::Result<(), String> {
        const MAX_DIM: usize = 1 << 20;
        const MAX_VOCAB: usize = 1 << 24;
        for (name, value, max) in [
            ("hidden size", self.hidden_size, MAX_DIM),
            ("intermediate size", self.intermediate_size, MAX_DIM * 4),
            ("head count", self.num_heads, 1 << 12),
            ("head dimension", self.head_dim, 1 << 14),
            ("vocabulary size", self.vocab_size, MAX_VOCAB),
            ("context length", self.context_length, 1 << 30),
        ] {
            if value > max {
                return Err(format!("{name} {value} is above the supported {max}"));
            }
        }
        if self.context_length == 0 {
            return Err("context length must be positive".into());
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0 && self.rms_eps < 1.0) {
            return Err(format!(
                "RMS-norm epsilon (rms_norm_eps / attention.layer_norm_rms_epsilon) is {}; it must be a finite number in [0, 1)",
                self.rms_eps
            ));
        }
        let ropes = std::iter::once(("rope theta (rope_theta / rope.freq_base)", &self.rope))
            .chain(self.rope_local.iter().map(|r| ("local rope theta", r)));
        for (name, rope) in ropes {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                return Err(format!(
                    "{name} is {}; it must be a positive finite number",
                    rope.theta
                ));
            }
            let factors: Vec<f64> = match &rope.scaling {
                RopeScaling::None => Vec::new(),
                RopeScaling::Linear { factor } => vec![*factor],
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position,
                } => vec![
                    *factor,
                    *low_freq_factor,
                    *high_freq_factor,
                    *original_max_position,
                ],
                RopeScaling::Factors(f) => f.iter().map(|&v| f64::from(v)).collect(),
                RopeScaling::Yarn(y) => y.parameters(),
                RopeScaling::LongRope(l) => l.parameters(),
                RopeScaling::Dynamic(d) => d.parameters(),
            };
            if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                return Err(format!(
                    "rope scaling parameter {f} must be a positive finite number"
                ));
            }
        }
        for (name, cap) in [
            ("attention soft cap", self.attn_softcap),
            ("final logit soft cap", self.final_softcap),
        ] {
            if let Some(c) = cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
                return Err(format!("{name} {c} must be a positive finite number"));
            }
        }
        for (name, m) in [
            ("embedding multiplier", self.features.embed_multiplier),
            ("residual multiplier", self.features.residual_multiplier),
        ] {
            if let Some(m) = m.filter(|m| !(m.is_finite() && *m != 0.0)) {
                return Err(format!("{name} {m} must be a finite non-zero number"));
            }
        }
        // A negative one would turn the logits around (and the padded vocabulary's `-inf`
        // bias into `+inf`).
        if let Some(m) = self
            .features
            .logit_multiplier
            .filter(|m| !(m.is_finite() && *m > 0.0))
        {
            return Err(format!(
                "logit multiplier {m} must be a positive finite number"
            ));
        }
        if !self.features.rope_layers.is_empty()
            && self.features.rope_layers.len() != self.num_layers
        {
            return Err(format!(
                "{} per-layer rotary flags for {} layers",
                self.features.rope_layers.len(),
                self.num_layers
            ));
        }
        if !self.attn_scale.is_finite() || self.attn_scale <= 0.0 {
            return Err(format!(
                "attention scale {} must be a positive finite number",
                self.attn_scale
            ));
        }
        Ok(())
    }

    /// Bytes of KV cache one token takes in f32, summed over layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.cache_windows().len() * 2 * self.num_kv_heads * self.head_dim * 4
    }

    /// Each KV cache a sequence holds, in order: its row width (KV heads × head dimension)
    /// and sliding window. Gemma 4's sliding and full layers have their own head sizes.
    pub fn cache_shapes(&self) -> Vec<(usize, Option<usize>)> {
        match &self.gemma4 {
            Some(g) => self
                .layer_windows
                .iter()
                .zip(&g.layers)
                .filter(|(_, l)| l.kv_source.is_none())
                .map(|(w, l)| (l.kv_heads * l.head_dim, *w))
                .collect(),
            None => self
                .cache_windows()
                .into_iter()
                .map(|w| (self.num_kv_heads * self.head_dim, w))
                .collect(),
        }
    }

    /// The sliding window of each KV cache a sequence holds: one per layer, except that
    /// layers sharing another layer's cache (Gemma 4) and linear-attention layers (Qwen 3.5)
    /// have none of their own.
    pub fn cache_windows(&self) -> Vec<Option<usize>> {
        match &self.gemma4 {
            Some(g) => self
                .layer_windows
                .iter()
                .zip(&g.layers)
                .filter(|(_, l)| l.kv_source.is_none())
                .map(|(w, _)| *w)
                .collect(),
            None => match &self.qwen35 {
                // A hybrid's linear-attention layers keep recurrent state, not KV.
                Some(q) => self
                    .layer_windows
                    .iter()
                    .zip(&q.linear_layers)
                    .filter(|(_, &linear)| !linear)
                    .map(|(w, _)| *w)
                    .collect(),
                None => self.layer_windows.clone(),
            },
        }
    }
}

#[cfg(test)]
mod validation_tests {
    use super::*;

    #[test]
    fn generation_config_must_be_an_object_of_numbers() {
        let check = |v: Value| check_generation_config(&v, "generation_config.json");
        for bad in [
            serde_json::json!([]),
            Value::Null,
            serde_json::json!("x"),
            serde_json::json!({"temperature": "x"}),
            serde_json::json!({"temperature": -1.0}),
            serde_json::json!({"top_p": 0.0}),
            serde_json::json!({"top_p": 1.5}),
            serde_json::json!({"top_k": -3}),
            serde_json::json!({"top_k": 2.5}),
            serde_json::json!({"repetition_penalty": 0}),
            serde_json::json!({"repetition_penalty": 1e300}),
            serde_json::json!({"eos_token_id": "2"}),
            serde_json::json!({"eos_token_id": [1, -2]}),
            serde_json::json!({"eos_token_id": 8589934592u64}),
        ] {
            let err = check(bad.clone()).expect_err(&bad.to_string()).to_string();
            assert!(err.contains("generation_config.json"), "{err}");
        }
        let err = check(serde_json::json!({"temperature": "x"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("'temperature'"), "{err}");
        for good in [
            serde_json::json!({}),
            serde_json::json!({"temperature": 0.7, "top_p": 0.9, "top_k": 20,
                               "repetition_penalty": 1.05, "eos_token_id": [1, 2],
                               "bos_token_id": 1, "pad_token_id": null, "do_sample": true}),
        ] {
            check(good).unwrap();
        }
    }

    #[test]
    fn layer_counts_are_bounded_before_use() {
        assert!(checked_layers(MAX_LAYERS, "k", "f").is_ok());
        let err = checked_layers(1 << 40, "num_hidden_layers", "config.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("config.json") && err.contains("num_hidden_layers"),
            "{err}"
        );
    }
}
