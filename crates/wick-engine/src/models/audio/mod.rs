//! Audio towers: what turns a clip's log-mel features into rows of the text model's
//! embedding space.
//!
//! - this file: the tower's configuration (Gemma 4's `audio_config`) and what the server
//!   needs to prepare clips for it ([`AudioConfig::caps`]);
//! - `gemma4.rs`: Gemma 4's Conformer (the USM encoder) and its `embed_audio` projection.
//!
//! A request's clips run through the tower once, when the request's cache is set up
//! ([`crate::Model::attach_media`]); the rows replace the clip's soft tokens in the prefill,
//! where they attend causally like text.
pub(crate) mod gemma4;

use serde_json::Value;

use crate::config::media::AudioConfig;
use crate::config::HfKeys;
use crate::media::AudioCaps;
use crate::{EngineError, Result};

/// Most Conformer layers, width and channels an audio tower may declare (far above real
/// checkpoints; keeps a corrupt config from sizing huge buffers).
const MAX_LAYERS: usize = 256;
const MAX_WIDTH: usize = 1 << 16;
/// Mel bins of Gemma 4's feature extractor (the SSCP's projection is sized for them).
pub const MEL_BINS: usize = 128;
/// Most soft tokens of one clip (30 s at 40 ms a token), as Gemma4Processor caps them.
pub const MAX_TOKENS: usize = 750;

impl AudioConfig {
    /// Reads a Gemma 4 `config.json`; `None` when it has no `audio_config` (no audio tower).
    pub(crate) fn from_hf(json: &Value, source: &str) -> Result<Option<Self>> {
        let Some(audio) = json.get("audio_config").filter(|v| v.is_object()) else {
            return Ok(None);
        };
        let keys = HfKeys {
            json: audio,
            source,
        };
        let top = HfKeys { json, source };
        let bounded = |key: &str, default: usize, max: usize| -> Result<usize> {
            let v = keys.opt_usize(key)?.unwrap_or(default);
            if v == 0 || v > max {
                return Err(keys.bad(key, &format!("must be in 1..={max}")));
            }
            Ok(v)
        };
        let id = |keys_: &[&str], default: u32| -> Result<u32> {
            for key in keys_ {
                if let Some(v) = top.opt_usize(key)? {
                    return u32::try_from(v).map_err(|_| top.bad(key, "is not a token id"));
                }
            }
            Ok(default)
        };
        let channels = match keys.get("subsampling_conv_channels") {
            None => [128, 32],
            Some(Value::Array(a)) if a.len() == 2 => {
                let c = |v: &Value| {
                    v.as_u64()
                        .map(|v| v as usize)
                        .filter(|&v| v > 0 && v <= MAX_WIDTH)
                        .ok_or_else(|| keys.bad("subsampling_conv_channels", "is not 2 widths"))
                };
                [c(&a[0])?, c(&a[1])?]
            }
            Some(_) => {
                return Err(keys.bad("subsampling_conv_channels", "is not 2 widths"));
            }
        };
        if let Some(act) = keys.get("hidden_act").and_then(Value::as_str) {
            if !matches!(act, "silu" | "swish") {
                return Err(keys.bad("hidden_act", "is not SiLU (the one wick implements)"));
            }
        }
        let f = |key: &str, default: f64| -> Result<f32> {
            Ok(keys.opt_f64(key)?.unwrap_or(default) as f32)
        };
        let cfg = AudioConfig {
            hidden_size: bounded("hidden_size", 1024, MAX_WIDTH)?,
            num_layers: bounded("num_hidden_layers", 12, MAX_LAYERS)?,
            num_heads: bounded("num_attention_heads", 8, MAX_WIDTH)?,
            conv_channels: channels,
            conv_kernel: bounded("conv_kernel_size", 5, 1024)?,
            residual_weight: f("residual_weight", 0.5)?,
            chunk: bounded("attention_chunk_size", 12, 4096)?,
            context_left: bounded("attention_context_left", 13, 4096)?,
            context_right: keys.opt_usize("attention_context_right")?.unwrap_or(0),
            logit_cap: f("attention_logit_cap", 50.0)?,
            invalid_logit: f("attention_invalid_logits_value", -1.0e9)?,
            clipped_linears: keys.opt_bool("use_clipped_linears")?.unwrap_or(true),
            eps: f("rms_norm_eps", 1e-6)?,
            gradient_clipping: f("gradient_clipping", 1e10)?,
            output_dims: bounded("output_proj_dims", 1536, MAX_WIDTH)?,
            audio_token_id: id(&["audio_token_id", "audio_token_index"], 258_881)?,
            boa_token_id: id(&["boa_token_id", "boa_token_index"], 256_000)?,
            eoa_token_id: id(&["eoa_token_id", "eoa_token_index"], 258_883)?,
        };
        let reason = if !cfg.hidden_size.is_multiple_of(cfg.num_heads) {
            Some(format!(
                "audio hidden_size {} is not a multiple of its {} heads",
                cfg.hidden_size, cfg.num_heads
            ))
        } else if cfg.context_right > 4096 {
            Some("audio attention_context_right is above 4096".to_string())
        } else if cfg.logit_cap.is_nan() || cfg.logit_cap <= 0.0 {
            Some("audio attention_logit_cap must be positive".to_string())
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(EngineError::Config {
                source_name: source.to_string(),
                reason,
            });
        }
        Ok(Some(cfg))
    }

    /// Keys one chunk of queries sees: the chunk, `left − 1` frames before it and `right`
    /// after it.
    pub fn context_size(&self) -> usize {
        self.chunk + self.context_left - 1 + self.context_right
    }

    /// What the server needs to prepare clips and prompts for this tower.
    pub fn caps(&self) -> AudioCaps {
        AudioCaps {
            sample_rate: 16_000,
            mel_bins: MEL_BINS,
            max_tokens: MAX_TOKENS,
            audio_token_id: self.audio_token_id,
            boa_token_id: self.boa_token_id,
            eoa_token_id: self.eoa_token_id,
        }
    }
}

/// Soft tokens the tower makes of `frames` feature frames: two stride-2 convolutions
/// (kernel 3, padding 1) each keep `ceil(n / 2)` rows.
pub fn soft_tokens(frames: usize) -> usize {
    frames.div_ceil(2).div_ceil(2)
}
