//! The mainstream dense families that are Llama plus a few switches: each reads its
//! `config.json` into the Llama base and sets the [`crate::config::Features`] and fields the
//! decoder needs (no model code of its own).
use serde_json::Value;

use crate::backend::{Activation, RopeStyle};
use crate::config::{HfKeys, HfNaming, MlpKind, ModelConfig, NormKind};
use crate::models::{gemma3, llama, Arch};
use crate::Result;

/// `partial_rotary_factor` at the top level or (transformers 5) inside `rope_parameters`.
fn partial_rotary(keys: &HfKeys<'_>) -> Result<Option<f64>> {
    if let Some(f) = keys.opt_f64("partial_rotary_factor")? {
        return Ok(Some(f));
    }
    match keys
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
    {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| keys.bad("rope_parameters.partial_rotary_factor", "must be a number")),
    }
}

fn set_partial_rotary(cfg: &mut ModelConfig, keys: &HfKeys<'_>, default: f64) -> Result<()> {
    let f = partial_rotary(keys)?.unwrap_or(default);
    if !(f > 0.0 && f <= 1.0) {
        return Err(keys.bad("partial_rotary_factor", "must be in (0, 1]"));
    }
    cfg.rotary_dims = (cfg.head_dim as f64 * f) as usize;
    Ok(())
}

/// A multiplier that must be a number when present.
fn multiplier(keys: &HfKeys<'_>, key: &str) -> Result<Option<f32>> {
    Ok(keys.opt_f64(key)?.map(|v| v as f32))
}

/// `sliding_window` on every layer (Mistral, StarCoder 2, Phi-3), `None` when null.
fn window_all(cfg: &mut ModelConfig, keys: &HfKeys<'_>) -> Result<()> {
    let window = keys.opt_usize("sliding_window")?;
    cfg.layer_windows = vec![window; cfg.num_layers];
    Ok(())
}

/// Mistral: Llama with a sliding window on every layer.
pub(super) fn mistral(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Mistral, 10_000.0, false)?;
    window_all(&mut cfg, keys)?;
    Ok(cfg)
}

/// Phi-3: fused `qkv_proj` and `gate_up_proj` (found by the loader), partial rotary,
/// LongRoPE, an optional sliding window.
pub(super) fn phi3(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Phi3, 10_000.0, false)?;
    set_partial_rotary(&mut cfg, keys, 1.0)?;
    window_all(&mut cfg, keys)?;
    Ok(cfg)
}

/// Gemma 2: Gemma 3's layout without Q/K norms and with one rotary base; sliding and
/// global layers alternate, both soft caps on.
pub(super) fn gemma2(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = gemma3::from_hf(keys)?;
    cfg.arch = Arch::Gemma2;
    cfg.rope = keys.rope(None, 10_000.0)?;
    cfg.rope_local = None;
    let window = keys.opt_usize("sliding_window")?.unwrap_or(4096);
    cfg.layer_windows = match keys.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|t| (t.as_str() == Some("sliding_attention")).then_some(window))
            .collect(),
        None => (0..cfg.num_layers)
            .map(|i| (i % 2 == 0).then_some(window))
            .collect(),
    };
    Ok(cfg)
}

/// OLMo 2: RMS norms after attention and after the MLP and none before; Q/K norms over
/// the whole projection.
pub(super) fn olmo2(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Olmo2, 10_000.0, false)?;
    cfg.sandwich_norms = true;
    cfg.features.pre_norms = false;
    cfg.features.qk_norm_full = true;
    Ok(cfg)
}

/// Granite: Llama with `embedding_multiplier`, `residual_multiplier`,
/// `attention_multiplier` (the score scale) and `logits_scaling` (a divisor).
pub(super) fn granite(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Granite, 10_000.0, false)?;
    cfg.features.embed_multiplier = multiplier(keys, "embedding_multiplier")?;
    cfg.features.residual_multiplier = multiplier(keys, "residual_multiplier")?;
    if let Some(a) = multiplier(keys, "attention_multiplier")? {
        cfg.attn_scale = a;
    }
    if let Some(s) = keys.opt_f64("logits_scaling")? {
        if !(s.is_finite() && s != 0.0) {
            return Err(keys.bad("logits_scaling", "must be a finite non-zero number"));
        }
        cfg.features.logit_multiplier = Some((1.0 / s) as f32);
    }
    Ok(cfg)
}

/// StarCoder 2: LayerNorms with biases (`norm_epsilon`), an ungated GELU MLP
/// (`c_fc` / `c_proj`), biases on every projection, an optional sliding window.
pub(super) fn starcoder2(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Starcoder2, 10_000.0, true)?;
    cfg.activation = keys.activation(Activation::GeluTanh)?;
    if let Some(eps) = keys.opt_f64("norm_epsilon")? {
        cfg.rms_eps = eps as f32;
    }
    cfg.features.norm = NormKind::Layer;
    cfg.features.mlp = MlpKind::Plain;
    cfg.features.hf_naming = HfNaming::Starcoder2;
    window_all(&mut cfg, keys)?;
    Ok(cfg)
}

/// SmolLM 3: Llama whose `no_rope_layers` (1 = rotary, 0 = none) leaves rotary
/// embeddings out of every fourth layer by default.
pub(super) fn smollm3(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::SmolLm3, 2_000_000.0, true)?;
    let layers = cfg.num_layers;
    cfg.features.rope_layers = match keys.get("no_rope_layers") {
        Some(Value::Array(flags)) => flags
            .iter()
            .map(|f| match f.as_u64() {
                Some(v) => Ok(v != 0),
                None => Err(keys.bad("no_rope_layers", "must hold 0 or 1 per layer")),
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(keys.bad("no_rope_layers", "must be a list")),
        None => {
            let interval = keys
                .opt_usize("no_rope_layer_interval")?
                .unwrap_or(4)
                .max(1);
            (0..layers).map(|i| (i + 1) % interval != 0).collect()
        }
    };
    if keys.opt_bool("use_sliding_window")?.unwrap_or(false) {
        let window = keys.opt_usize("sliding_window")?;
        let types = keys.get("layer_types").and_then(Value::as_array);
        cfg.layer_windows = (0..layers)
            .map(|i| {
                let sliding = types
                    .and_then(|t| t.get(i))
                    .and_then(Value::as_str)
                    .is_some_and(|t| t == "sliding_attention");
                window.filter(|_| sliding)
            })
            .collect();
    }
    Ok(cfg)
}

/// GLM-4: sandwich norms under GLM's names, fused `gate_up_proj`, Q/K/V biases, rotary
/// on the first half of each head in interleaved pairs.
pub(super) fn glm4(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::Glm4, 10_000.0, false)?;
    cfg.sandwich_norms = true;
    cfg.rope_style = RopeStyle::Interleaved;
    set_partial_rotary(&mut cfg, keys, 0.5)?;
    cfg.features.hf_naming = HfNaming::Glm4;
    Ok(cfg)
}

/// Whether a Hugging Face `llama` config is MiniCPM's: it carries MiniCPM's scaling
/// fields.
pub(super) fn is_minicpm(json: &Value) -> bool {
    ["scale_emb", "scale_depth", "dim_model_base"]
        .iter()
        .any(|k| json.get(k).is_some_and(|v| !v.is_null()))
}

/// MiniCPM: Llama with embeddings times `scale_emb`, residual branches times
/// `scale_depth / sqrt(layers)` and logits times `dim_model_base / hidden`.
pub(super) fn minicpm(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let mut cfg = llama::base_from_hf(keys, Arch::MiniCpm, 10_000.0, false)?;
    cfg.features.embed_multiplier = multiplier(keys, "scale_emb")?;
    cfg.features.residual_multiplier = keys
        .opt_f64("scale_depth")?
        .map(|d| (d / (cfg.num_layers as f64).sqrt()) as f32);
    if let Some(base) = keys.opt_f64("dim_model_base")? {
        if !(base.is_finite() && base > 0.0) {
            return Err(keys.bad("dim_model_base", "must be a positive number"));
        }
        cfg.features.logit_multiplier = Some((base / cfg.hidden_size as f64) as f32);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
               "vocab_size": 32, "intermediate_size": 128})
    }

    fn with(extra: Value) -> Value {
        let mut v = base();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn minicpm_is_fingerprinted_from_a_llama_config() {
        let json = with(
            json!({"model_type": "llama", "scale_emb": 12, "scale_depth": 1.4,
                                "dim_model_base": 16}),
        );
        let cfg = ModelConfig::from_hf(&json, "config.json").unwrap();
        assert_eq!(cfg.arch, Arch::MiniCpm);
        assert_eq!(cfg.features.embed_multiplier, Some(12.0));
        assert!((cfg.features.residual_multiplier.unwrap() - 0.7).abs() < 1e-6);
        assert_eq!(cfg.features.logit_multiplier, Some(0.25));
        let plain = ModelConfig::from_hf(&with(json!({"model_type": "llama"})), "c").unwrap();
        assert_eq!(plain.arch, Arch::Llama);
        assert_eq!(plain.features, crate::config::Features::default());
    }

    #[test]
    fn smollm3_rope_layers_default_to_every_fourth_without() {
        let cfg = ModelConfig::from_hf(&with(json!({"model_type": "smollm3"})), "c").unwrap();
        assert_eq!(cfg.features.rope_layers, vec![true, true, true, false]);
        let err = ModelConfig::from_hf(
            &with(json!({"model_type": "smollm3", "no_rope_layers": [1, 1]})),
            "config.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("2 per-layer rotary flags for 4 layers"),
            "{err}"
        );
    }

    #[test]
    fn unknown_model_type_lists_every_family() {
        let err = ModelConfig::from_hf(&with(json!({"model_type": "mamba"})), "config.json")
            .unwrap_err()
            .to_string();
        for name in [
            "llama",
            "mistral",
            "phi3",
            "gemma2",
            "olmo2",
            "granite",
            "starcoder2",
            "smollm3",
            "glm4",
            "minicpm",
        ] {
            assert!(err.contains(name), "{name} missing from: {err}");
        }
        assert!(err.contains("mamba"), "{err}");
    }

    #[test]
    fn families_name_the_optional_ops_they_need() {
        use crate::backend::capability::{Capability, Part, Requirement};
        let ops = |extra: Value| {
            let cfg = ModelConfig::from_hf(&with(extra), "c").unwrap();
            crate::models::needs(&cfg)
                .into_iter()
                .filter(|n| n.part == Part::Text)
                .filter_map(|n| match n.requirement {
                    Requirement::Op(c) => Some(c),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(ops(json!({"model_type": "llama"})), vec![]);
        assert_eq!(
            ops(json!({"model_type": "starcoder2"})),
            vec![Capability::LayerNorm, Capability::Activation]
        );
        let yarn = json!({"model_type": "mistral", "rope_scaling":
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}});
        assert_eq!(ops(yarn), vec![Capability::RopeAttentionFactor]);
    }

    #[test]
    fn bad_multipliers_are_config_errors() {
        for bad in [
            json!({"model_type": "granite", "logits_scaling": 0}),
            json!({"model_type": "granite", "embedding_multiplier": "x"}),
            json!({"model_type": "llama", "dim_model_base": -1}),
            json!({"model_type": "glm4", "partial_rotary_factor": 2.0}),
        ] {
            let err = ModelConfig::from_hf(&with(bad.clone()), "config.json");
            let err = err.expect_err(&bad.to_string()).to_string();
            assert!(err.contains("config.json"), "{err}");
        }
    }
}
