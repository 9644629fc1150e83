//! Llama (and SmolLM, Mistral-style) dense decoders; also the base the Qwen files extend.
use crate::backend::{Activation, RopeStyle};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeConfig, RopeScaling};
use crate::models::Arch;
use crate::Result;

/// The largest of a per-layer array (or the one value).
fn max_of(v: Option<Vec<usize>>) -> Option<usize> {
    v.and_then(|v| v.into_iter().max())
}

/// The fields every llama.cpp decoder architecture stores the same way.
pub(super) fn base_from_gguf(
    keys: &GgufKeys<'_>,
    arch: Arch,
    style: RopeStyle,
    default_theta: f64,
) -> Result<ModelConfig> {
    let hidden = keys.usize("embedding_length")?;
    let heads = keys.usize("attention.head_count")?;
    let head_dim = keys
        .opt_usize("attention.key_length")?
        .unwrap_or(hidden / heads.max(1));
    let layers = keys.layer_count("block_count")?;
    let scaling = match keys.opt_str("rope.scaling.type")? {
        Some("linear") => RopeScaling::Linear {
            factor: keys.opt_f64("rope.scaling.factor")?.unwrap_or(1.0),
        },
        _ => RopeScaling::None,
    };
    let vocab = match keys.opt_usize("vocab_size")? {
        Some(v) => v,
        None => keys
            .meta
            .get_array("tokenizer.ggml.tokens")
            .map(|a| a.len())
            .unwrap_or(0),
    };
    Ok(ModelConfig {
        arch,
        vocab_size: vocab,
        hidden_size: hidden,
        // Per-layer arrays (Gemma 4) give their largest value; the family reads the rest.
        intermediate_size: match max_of(keys.usizes("feed_forward_length")?) {
            Some(v) => v,
            None => keys.usize("feed_forward_length")?, // the missing key's own error
        },
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: max_of(keys.usizes("attention.head_count_kv")?).unwrap_or(heads),
        head_dim,
        rms_eps: keys
            .opt_f64("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5) as f32,
        context_length: keys.opt_usize("context_length")?.unwrap_or(4096),
        rope_style: style,
        rotary_dims: keys.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
        rope: RopeConfig {
            theta: keys.opt_f64("rope.freq_base")?.unwrap_or(default_theta),
            scaling,
        },
        rope_local: None,
        layer_windows: vec![None; layers],
        // llama.cpp's convention: a file without `output.weight` reads its head from the
        // embedding table.
        tie_embeddings: true,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        activation: Activation::Silu,
        scale_embeddings: false,
        sandwich_norms: false,
        norm_weight_offset: false,
        eos_token_ids: Vec::new(),
        bos_token_id: None,
        features: Default::default(),
        gemma4: None,
        qwen35: None,
        vision: None,
        audio: None,
        qwen_vision: None,
        mrope: None,
    })
}

/// The fields every Hugging Face decoder config stores the same way.
pub(super) fn base_from_hf(
    keys: &HfKeys<'_>,
    arch: Arch,
    default_theta: f64,
    default_tie: bool,
) -> Result<ModelConfig> {
    let hidden = keys.usize("hidden_size")?;
    let heads = keys.usize("num_attention_heads")?;
    let head_dim = keys.opt_usize("head_dim")?.unwrap_or(hidden / heads.max(1));
    let layers = keys.layer_count("num_hidden_layers")?;
    let rotary = keys
        .opt_f64("partial_rotary_factor")?
        .map(|f| (head_dim as f64 * f) as usize)
        .unwrap_or(head_dim);
    Ok(ModelConfig {
        arch,
        vocab_size: keys.usize("vocab_size")?,
        hidden_size: hidden,
        intermediate_size: keys.usize("intermediate_size")?,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: keys.opt_usize("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        rms_eps: keys.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        context_length: keys.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        rope_style: RopeStyle::Neox,
        rotary_dims: rotary,
        rope: keys.rope(None, default_theta)?,
        rope_local: None,
        layer_windows: vec![None; layers],
        tie_embeddings: keys.opt_bool("tie_word_embeddings")?.unwrap_or(default_tie),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        activation: keys.activation(if arch == Arch::Gemma3 {
            Activation::GeluTanh
        } else {
            Activation::Silu
        })?,
        scale_embeddings: false,
        sandwich_norms: false,
        norm_weight_offset: false,
        eos_token_ids: keys.ids("eos_token_id"),
        bos_token_id: keys.ids("bos_token_id").first().copied(),
        features: Default::default(),
        gemma4: None,
        qwen35: None,
        vision: None,
        audio: None,
        qwen_vision: None,
        mrope: None,
    })
}

/// GGUF Llama: the converter permuted Q/K rows for interleaved rotary pairs.
pub(super) fn from_gguf(keys: &GgufKeys<'_>, _source: &str) -> Result<ModelConfig> {
    base_from_gguf(keys, Arch::Llama, RopeStyle::Interleaved, 10_000.0)
}

/// Hugging Face `llama`.
pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    base_from_hf(keys, Arch::Llama, 10_000.0, false)
}
