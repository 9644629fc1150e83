//! Gemma 3 (text): scaled embeddings, sandwich norms, GELU-tanh MLP, Q/K norms, and five
//! sliding-window layers (local rotary base) for every global one.
use serde_json::Value;

use crate::backend::{Activation, RopeStyle};
use crate::config::{GgufKeys, HfKeys, HfNaming, ModelConfig, RopeConfig, RopeScaling};
use crate::models::{llama, Arch};
use crate::Result;

/// One global layer every this many (when the file does not list layer types).
const SLIDING_PATTERN: usize = 6;
/// Rotary base of sliding-window layers when the file does not say.
const LOCAL_ROPE_THETA: f64 = 10_000.0;

fn pattern_windows(layers: usize, window: usize, pattern: usize) -> Vec<Option<usize>> {
    (0..layers)
        .map(|i| {
            if (i + 1) % pattern.max(1) == 0 {
                None
            } else {
                Some(window)
            }
        })
        .collect()
}

fn apply_gemma(cfg: &mut ModelConfig) {
    cfg.activation = Activation::GeluTanh;
    cfg.scale_embeddings = true;
    cfg.sandwich_norms = true;
    cfg.rope_style = RopeStyle::Neox;
    cfg.features.hf_naming = HfNaming::Gemma;
}

pub(super) fn from_gguf(keys: &GgufKeys<'_>, _source: &str) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_gguf(keys, Arch::Gemma3, RopeStyle::Neox, 1_000_000.0)?;
    apply_gemma(&mut cfg);
    cfg.tie_embeddings = true;
    if let Some(window) = keys.opt_usize("attention.sliding_window")? {
        let pattern = keys
            .opt_usize("attention.sliding_window_pattern")?
            .unwrap_or(SLIDING_PATTERN);
        cfg.layer_windows = pattern_windows(cfg.num_layers, window, pattern);
    }
    cfg.rope_local = Some(RopeConfig {
        theta: LOCAL_ROPE_THETA,
        scaling: RopeScaling::None,
    });
    cfg.final_softcap = keys.opt_f64("final_logit_softcapping")?.map(|v| v as f32);
    cfg.attn_softcap = keys.opt_f64("attn_logit_softcapping")?.map(|v| v as f32);
    Ok(cfg)
}

pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Gemma3, 1_000_000.0, true)?;
    apply_gemma(&mut cfg);
    // Checked against the names wick implements (Gemma's default is the tanh GELU).
    cfg.activation = keys.activation(Activation::GeluTanh)?;
    cfg.norm_weight_offset = true;
    cfg.head_dim = keys.opt_usize("head_dim")?.unwrap_or(256);
    cfg.rotary_dims = cfg.head_dim;
    let scalar = keys
        .opt_f64("query_pre_attn_scalar")?
        .unwrap_or(cfg.head_dim as f64);
    cfg.attn_scale = (1.0 / scalar.sqrt()) as f32;
    cfg.rope = keys.rope(Some("full_attention"), 1_000_000.0)?;
    let mut local = keys.rope(Some("sliding_attention"), LOCAL_ROPE_THETA)?;
    if keys
        .get("rope_parameters")
        .and_then(|p| p.get("sliding_attention"))
        .is_none()
    {
        // Older configs: a separate base and no scaling for local layers.
        local = RopeConfig {
            theta: keys
                .opt_f64("rope_local_base_freq")?
                .unwrap_or(LOCAL_ROPE_THETA),
            scaling: RopeScaling::None,
        };
    }
    cfg.rope_local = Some(local);
    let window = keys.opt_usize("sliding_window")?.unwrap_or(4096);
    cfg.layer_windows = match keys.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|t| (t.as_str() == Some("sliding_attention")).then_some(window))
            .collect(),
        None => pattern_windows(
            cfg.num_layers,
            window,
            keys.opt_usize("sliding_window_pattern")?
                .unwrap_or(SLIDING_PATTERN),
        ),
    };
    cfg.final_softcap = keys.opt_f64("final_logit_softcapping")?.map(|v| v as f32);
    cfg.attn_softcap = keys.opt_f64("attn_logit_softcapping")?.map(|v| v as f32);
    Ok(cfg)
}
