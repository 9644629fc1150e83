//! Gemma 4 text (`gemma4_text`, and the language model of `gemma4`), as transformers'
//! `Gemma4ForCausalLM` computes it:
//!
//! - sliding-window and full-attention layers (`layer_types`), each kind with its own head
//!   size and KV-head count (`per_layer_config`, or the older `global_head_dim` /
//!   `num_global_key_value_heads`), Q/K RMS norms, an RMS norm without scale on V, and
//!   attention scale 1;
//! - default rotary embeddings on sliding layers, proportional ones on full layers (only the
//!   first `partial_rotary_factor` of the frequencies rotate, over the whole head);
//! - `attention_k_eq_v`: full layers use the key projection (before its norm) as values;
//! - KV sharing: the last `num_kv_shared_layers` layers compute no K/V and attend to the
//!   cache of the last earlier layer of their kind, so a sequence's cache holds one entry
//!   per producing layer only (the KV pool, prompt cache and SSD tier store it once);
//! - per-layer input embeddings (PLE): a second embedding table plus a projection of the
//!   input embeddings give every layer a small extra input, gated into the residual stream
//!   after the MLP;
//! - the mixture-of-experts block of the 26B-A4B shape next to the dense MLP
//!   ([`crate::models::moe`]); a double-wide MLP on KV-shared layers (`use_double_wide_mlp`);
//! - a learned scalar per layer, embeddings scaled by `sqrt(hidden)`, final logit soft cap.
use std::borrow::Cow;
use std::ops::Range;

use serde_json::Value;
use wick_gguf::GgmlType;

use crate::adapters::{LoraBatch, Target};
use crate::backend::capability::{Capability, Need, Part, Requirement};
use crate::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, RopeSpec, RopeStyle,
};
use crate::config::gemma4::{Gemma4Layer, Gemma4Params, MoeShape};
use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::models::decoder::cache::SequenceCache;
use crate::models::decoder::loader::Loader;
use crate::models::mlp::GateUp;
use crate::models::moe::Experts;
use crate::models::vision::PassMedia;
use crate::models::{llama, Arch};
use crate::weights::WeightSource;
use crate::{EngineError, Result};

/// The most experts a layer may have.
const MAX_EXPERTS: usize = 1 << 12;
/// Bound on any one per-layer size read from the configuration.
const MAX_DIM: usize = 1 << 16;

/// What a Gemma 4 model needs of its backend beyond the core ops.
pub(crate) fn needs(params: &Gemma4Params) -> Vec<Need> {
    let widest = params.layers.iter().map(|l| l.head_dim).max().unwrap_or(0);
    let mut needs = vec![Need::new(
        Requirement::HeadDim(widest),
        Part::Text,
        "its full-attention layers",
    )];
    if params.layers.iter().any(|l| l.kv_source.is_some()) {
        needs.push(Need::op(
            Capability::SharedKv,
            Part::Text,
            "its KV-shared layers",
        ));
    }
    if params.moe.is_some() {
        needs.push(Need::op(
            Capability::HostTensors,
            Part::Text,
            "its expert routing (on the host)",
        ));
    }
    if params.vision.is_some() && params.bidirectional_vision {
        needs.push(Need::op(
            Capability::SharedKv,
            Part::Vision,
            "bidirectional image attention on its layers",
        ));
    }
    needs.push(Need::op(
        Capability::RowDeltas,
        Part::Adapters,
        "a batch whose sequences use different adapters",
    ));
    needs.push(Need::new(
        Requirement::NotBuilt("trimming caches that layers share"),
        Part::Speculation,
        "its KV-shared and sliding layers",
    ));
    needs
}

fn config_error(source: &str, reason: String) -> EngineError {
    EngineError::Config {
        source_name: source.to_string(),
        reason,
    }
}

/// The configuration of a `gemma4` GGUF file as llama.cpp's converter writes it: per-layer
/// arrays for the sliding pattern, key/value heads and MLP sizes, the head sizes of each kind,
/// and the KV-shared layer count. Two facts live in tensors instead and are read at load
/// ([`complete_from_gguf`]): the full layers' proportional rotation (`rope_freqs`) and which
/// layers take their values from the key projection (no `attn_v`).
pub(super) fn from_gguf(keys: &GgufKeys<'_>, source: &str) -> Result<ModelConfig> {
    let src = source;
    let mut cfg = llama::base_from_gguf(keys, Arch::Gemma4, RopeStyle::Neox, 1_000_000.0)?;
    cfg.activation = Activation::GeluTanh;
    cfg.scale_embeddings = true;
    cfg.sandwich_norms = true;
    cfg.norm_weight_offset = false;
    cfg.attn_scale = 1.0;
    cfg.final_softcap = keys
        .opt_f64("final_logit_softcapping")?
        .filter(|&v| v > 0.0)
        .map(|v| v as f32);
    let (n, heads) = (cfg.num_layers, cfg.num_heads);
    let mut sliding = match keys.bools("attention.sliding_window_pattern")? {
        Some(p) if p.len() == n => p,
        Some(p) => {
            return Err(config_error(
                src,
                format!("{} sliding_window_pattern entries for {n} layers", p.len()),
            ))
        }
        None => (0..n).map(|i| (i + 1) % 6 != 0).collect(),
    };
    // transformers forces the last layer to full attention.
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    let per_layer = |key: &str, default: usize| -> Result<Vec<usize>> {
        match keys.usizes(key)? {
            None => Ok(vec![default; n]),
            Some(v) if v.len() == 1 => Ok(vec![v[0]; n]),
            Some(v) if v.len() == n => Ok(v),
            Some(v) => Err(config_error(
                src,
                format!("{} values of '{key}' for {n} layers", v.len()),
            )),
        }
    };
    let kv = per_layer("attention.head_count_kv", heads)?;
    let ff = per_layer("feed_forward_length", cfg.intermediate_size)?;
    let hd_full = keys.usize("attention.key_length")?;
    let hd_swa = keys
        .opt_usize("attention.key_length_swa")?
        .unwrap_or(hd_full);
    let dims: Vec<_> = (0..n)
        .map(|i| (if sliding[i] { hd_swa } else { hd_full }, kv[i]))
        .collect();
    let shared = keys.opt_usize("attention.shared_kv_layers")?.unwrap_or(0);
    let layers = layer_specs(src, heads, &sliding, &dims, shared, &[], |i, _| ff[i])?;
    let ple_dim = keys
        .opt_usize("embedding_length_per_layer_input")?
        .unwrap_or(0);
    if ple_dim > MAX_DIM {
        return Err(config_error(
            src,
            format!("per-layer input size {ple_dim} is out of range"),
        ));
    }
    let moe = match keys.opt_usize("expert_count")?.filter(|&e| e > 0) {
        Some(experts) => {
            let top_k = keys.usize("expert_used_count")?;
            let intermediate = keys.usize("expert_feed_forward_length")?;
            Some(moe_shape(src, experts, top_k, intermediate)?)
        }
        None => None,
    };
    let theta = |key: &str, default: f64| -> Result<f64> {
        let t = keys.opt_f64(key)?.unwrap_or(default);
        if t.is_finite() && t > 0.0 {
            Ok(t)
        } else {
            Err(config_error(src, format!("'{key}' {t} is out of range")))
        }
    };
    let rot_swa = keys
        .opt_usize("rope.dimension_count_swa")?
        .unwrap_or(hd_swa);
    let rope_sliding = proportional_rope(
        hd_swa,
        theta("rope.freq_base_swa", 10_000.0)?,
        rot_swa.min(hd_swa) as f64 / hd_swa as f64,
        1.0,
    );
    let rope_full = proportional_rope(hd_full, theta("rope.freq_base", 1_000_000.0)?, 1.0, 1.0);
    let pad_id = keys
        .meta
        .opt_u64("tokenizer.ggml.padding_token_id")?
        .map_or(0, |v| v as u32);
    let window = keys.opt_usize("attention.sliding_window")?.unwrap_or(512);
    let ple_vocab = cfg.vocab_size;
    finish(
        &mut cfg,
        window,
        Gemma4Params {
            layers,
            ple_dim,
            ple_vocab,
            moe,
            pad_id,
            rope_sliding,
            rope_full,
            bidirectional_vision: false,
            vision: None,
        },
    );
    Ok(cfg)
}

/// What a `gemma4` GGUF keeps in tensors rather than metadata, read into `cfg`: the full
/// layers' rotation, whose per-angle divisors `rope_freqs` holds (llama.cpp's way of writing
/// the proportional rotation: 1 for the turning angles, 1e30 for the still ones), and which
/// layers have no `attn_v` (their values are the key projection, as llama.cpp reads them).
pub(crate) fn complete_from_gguf(cfg: &mut ModelConfig, src: &dyn WeightSource) -> Result<()> {
    let Some(params) = cfg.gemma4.as_deref_mut() else {
        return Ok(());
    };
    if let Some(w) = src.get("rope_freqs.weight")? {
        let divisors = w.float_values("rope_freqs")?;
        let rope = &mut params.rope_full;
        if divisors.len() != rope.inv_freq.len()
            || divisors
                .iter()
                .any(|d| d.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater))
        {
            return Err(config_error(
                &src.source_name(),
                format!(
                    "rope_freqs holds {} positive divisors where the full layers turn {} angles",
                    divisors.len(),
                    rope.inv_freq.len()
                ),
            ));
        }
        for (f, d) in rope.inv_freq.iter_mut().zip(divisors) {
            *f = if d >= 1e20 { 0.0 } else { *f / d };
        }
    }
    for (i, l) in params.layers.iter_mut().enumerate() {
        if l.kv_source.is_none() {
            l.k_eq_v = !src.contains(&format!("blk.{i}.attn_v.weight"));
        }
    }
    Ok(())
}

/// The rotary inverse frequencies of one layer kind: `rope_parameters[kind]` with
/// `rope_type` `default` or `proportional` (the first `partial_rotary_factor` of the
/// `head_dim / 2` frequencies, the rest 0), divided by `factor`.
fn rope_spec(keys: &HfKeys<'_>, kind: &str, head_dim: usize, theta: f64) -> Result<RopeSpec> {
    let params = keys.get("rope_parameters").and_then(|p| p.get(kind));
    let num = |k: &str| params.and_then(|p| p.get(k)).and_then(Value::as_f64);
    let rope_type = params
        .and_then(|p| p.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let theta = num("rope_theta").unwrap_or(theta);
    let (fraction, factor) = match rope_type {
        "default" => (1.0, 1.0),
        "proportional" => (
            num("partial_rotary_factor").unwrap_or(1.0),
            num("factor").unwrap_or(1.0),
        ),
        other => {
            return Err(config_error(
                keys.source,
                format!(
                    "rope_type '{other}' of {kind} layers is not supported (default, proportional)"
                ),
            ))
        }
    };
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(theta) || !positive(factor) || !(0.0..=1.0).contains(&fraction) {
        return Err(config_error(
            keys.source,
            format!("rope parameters of {kind} layers are out of range (theta {theta}, factor {factor}, partial_rotary_factor {fraction})"),
        ));
    }
    Ok(proportional_rope(head_dim, theta, fraction, factor))
}

/// Neox rotation over the whole head whose first `fraction` of the `head_dim / 2` angles turn
/// (`theta^(-2i/head_dim) / factor`) and the rest stay 0.
fn proportional_rope(head_dim: usize, theta: f64, fraction: f64, factor: f64) -> RopeSpec {
    let angles = ((fraction * head_dim as f64) as usize / 2).min(head_dim / 2);
    let inv_freq = (0..head_dim / 2)
        .map(|i| {
            if i < angles {
                (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64) / factor) as f32
            } else {
                0.0
            }
        })
        .collect();
    RopeSpec {
        style: RopeStyle::Neox,
        dims: head_dim,
        inv_freq,
        position_scale: 1.0,
        attention_factor: 1.0,
    }
}

/// The experts' shape, each count checked against the supported range.
fn moe_shape(src: &str, experts: usize, top_k: usize, intermediate: usize) -> Result<MoeShape> {
    if experts == 0
        || experts > MAX_EXPERTS
        || top_k == 0
        || top_k > experts
        || intermediate == 0
        || intermediate > MAX_DIM
    {
        return Err(config_error(
            src,
            format!("{experts} experts, top {top_k}, inner size {intermediate} are out of range"),
        ));
    }
    Ok(MoeShape {
        experts,
        top_k,
        intermediate,
    })
}

/// Each layer's shape from its kind, head size and key/value heads: checked against `heads`,
/// the last `shared` layers reading the K/V of the last earlier layer of their kind (with its
/// layout), and `intermediate(layer, kv_shared)` as the MLP's inner size.
fn layer_specs(
    src: &str,
    heads: usize,
    sliding: &[bool],
    dims: &[(usize, usize)],
    shared: usize,
    k_eq_v: &[bool],
    intermediate: impl Fn(usize, bool) -> usize,
) -> Result<Vec<Gemma4Layer>> {
    let n = sliding.len();
    if shared >= n {
        return Err(config_error(
            src,
            format!("{shared} KV-shared layers leave none of the {n} layers to compute K/V"),
        ));
    }
    let first_shared = n - shared;
    let mut layers = Vec::with_capacity(n);
    for (i, (&is_sliding, &(hd, kvh))) in sliding.iter().zip(dims).enumerate() {
        if hd == 0
            || !hd.is_multiple_of(2)
            || hd > MAX_DIM
            || kvh == 0
            || !heads.is_multiple_of(kvh)
        {
            return Err(config_error(
                src,
                format!(
                    "layer {i}: head_dim {hd} and {kvh} key/value heads do not fit {heads} heads"
                ),
            ));
        }
        let kv_source = if i >= first_shared {
            let source = (0..first_shared).rev().find(|&j| sliding[j] == is_sliding);
            Some(source.ok_or_else(|| {
                config_error(
                    src,
                    format!("KV-shared layer {i} has no earlier layer of its kind to share with"),
                )
            })?)
        } else {
            None
        };
        let inner = intermediate(i, kv_source.is_some());
        if inner == 0 || inner > 1 << 20 {
            return Err(config_error(
                src,
                format!("layer {i}: MLP inner size {inner} is out of range"),
            ));
        }
        layers.push(Gemma4Layer {
            sliding: is_sliding,
            head_dim: hd,
            kv_heads: kvh,
            kv_source,
            k_eq_v: k_eq_v.get(i).copied().unwrap_or(false),
            intermediate: inner,
        });
    }
    // KV-shared layers attend with their producer's K/V layout.
    for i in 0..n {
        if let Some(s) = layers[i].kv_source {
            let (hd, kvh) = (layers[s].head_dim, layers[s].kv_heads);
            if layers[i].head_dim != hd {
                return Err(config_error(
                    src,
                    format!(
                        "KV-shared layer {i} has head_dim {} but its source layer {s} has {hd}",
                        layers[i].head_dim
                    ),
                ));
            }
            layers[i].kv_heads = kvh;
        }
    }
    Ok(layers)
}

pub(super) fn from_hf(keys: &HfKeys<'_>) -> Result<ModelConfig> {
    let src = keys.source;
    let mut cfg = llama::base_from_hf(keys, Arch::Gemma4, 1_000_000.0, true)?;
    cfg.activation = keys.activation(Activation::GeluTanh)?;
    cfg.scale_embeddings = true;
    cfg.sandwich_norms = true;
    cfg.norm_weight_offset = false;
    cfg.features.hf_naming = crate::config::HfNaming::Gemma;
    cfg.attn_scale = 1.0;
    cfg.final_softcap = keys.opt_f64("final_logit_softcapping")?.map(|v| v as f32);
    let bidirectional_vision = match keys
        .get("use_bidirectional_attention")
        .and_then(Value::as_str)
    {
        None => false,
        Some("vision") => true,
        Some(other) => {
            return Err(config_error(
                src,
                format!("use_bidirectional_attention '{other}' is not supported (only 'vision')"),
            ))
        }
    };
    let n = cfg.num_layers;
    let heads = cfg.num_heads;
    let head_dim = keys.opt_usize("head_dim")?.unwrap_or(256);
    let kv_heads = cfg.num_kv_heads;
    let window = keys.opt_usize("sliding_window")?.unwrap_or(512);
    let mut sliding: Vec<bool> = match keys.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(config_error(
                    src,
                    format!("layer type {t} is not supported"),
                )),
            })
            .collect::<Result<_>>()?,
        None => (0..n).map(|i| (i + 1) % 6 != 0).collect(),
    };
    if sliding.len() != n {
        return Err(config_error(
            src,
            format!("{} layer types for {n} layers", sliding.len()),
        ));
    }
    // transformers forces the last layer to full attention.
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    let k_eq_v = keys.opt_bool("attention_k_eq_v")?.unwrap_or(false);
    // Keyed by layer index; transformers writes the keys zero-padded past nine layers ("05").
    let per_layer = match keys.get("per_layer_config").and_then(Value::as_object) {
        Some(map) => {
            let mut by_layer = std::collections::HashMap::new();
            for (key, o) in map {
                let i: usize = key.trim().parse().map_err(|_| {
                    config_error(
                        src,
                        format!("per_layer_config key '{key}' is not a layer index"),
                    )
                })?;
                if by_layer.insert(i, o).is_some() {
                    return Err(config_error(
                        src,
                        format!("per_layer_config names layer {i} twice"),
                    ));
                }
            }
            Some(by_layer)
        }
        None => None,
    };
    let global_head_dim = keys.opt_usize("global_head_dim")?.unwrap_or(512);
    let global_kv = keys.opt_usize("num_global_key_value_heads")?;
    let shared = keys.opt_usize("num_kv_shared_layers")?.unwrap_or(0);
    let double_wide = keys.opt_bool("use_double_wide_mlp")?.unwrap_or(false);
    let mut dims = Vec::with_capacity(n);
    for (i, &is_sliding) in sliding.iter().enumerate() {
        let (mut hd, mut kvh) = (head_dim, kv_heads);
        match &per_layer {
            Some(map) => {
                if let Some(o) = map.get(&i) {
                    let field = |k: &str| -> Result<Option<usize>> {
                        match o.get(k) {
                            None | Some(Value::Null) => Ok(None),
                            Some(v) => v.as_u64().map(|v| Some(v as usize)).ok_or_else(|| {
                                config_error(
                                    src,
                                    format!("per_layer_config.{i}.{k} must be a count"),
                                )
                            }),
                        }
                    };
                    hd = field("head_dim")?.unwrap_or(hd);
                    kvh = field("num_key_value_heads")?.unwrap_or(kvh);
                }
            }
            None if !is_sliding => {
                hd = global_head_dim;
                if k_eq_v {
                    kvh = global_kv.unwrap_or(kvh);
                }
            }
            None => {}
        }
        dims.push((hd, kvh));
    }
    let base = cfg.intermediate_size;
    let k_eq_v: Vec<bool> = sliding.iter().map(|&sl| k_eq_v && !sl).collect();
    let layers = layer_specs(
        src,
        heads,
        &sliding,
        &dims,
        shared,
        &k_eq_v,
        |_, kv_shared| base * if double_wide && kv_shared { 2 } else { 1 },
    )?;
    let ple_dim = keys
        .opt_usize("hidden_size_per_layer_input")?
        .unwrap_or(256);
    let ple_vocab = keys
        .opt_usize("vocab_size_per_layer_input")?
        .unwrap_or(cfg.vocab_size);
    if ple_dim > MAX_DIM || (ple_dim > 0 && !(1..=1 << 24).contains(&ple_vocab)) {
        return Err(config_error(
            src,
            format!("per-layer input size {ple_dim} or vocabulary {ple_vocab} is out of range"),
        ));
    }
    let moe = if keys.opt_bool("enable_moe_block")?.unwrap_or(false) {
        let experts = keys.usize("num_experts")?;
        let top_k = keys.usize("top_k_experts")?;
        let intermediate = keys.usize("moe_intermediate_size")?;
        Some(moe_shape(src, experts, top_k, intermediate)?)
    } else {
        None
    };
    let hd_sliding = layers
        .iter()
        .find(|l| l.sliding)
        .map_or(head_dim, |l| l.head_dim);
    let hd_full = layers
        .iter()
        .find(|l| !l.sliding)
        .map_or(head_dim, |l| l.head_dim);
    let rope_sliding = rope_spec(keys, "sliding_attention", hd_sliding, 10_000.0)?;
    let rope_full = rope_spec(keys, "full_attention", hd_full, 1_000_000.0)?;
    finish(
        &mut cfg,
        window,
        Gemma4Params {
            layers,
            ple_dim,
            ple_vocab,
            moe,
            pad_id: keys.ids("pad_token_id").first().copied().unwrap_or(0),
            rope_sliding,
            rope_full,
            bidirectional_vision,
            vision: None,
        },
    );
    Ok(cfg)
}

/// Sets `cfg`'s common fields from Gemma 4's own: they describe the largest layer, so that
/// sizes derived from them (the KV pool's block, memory estimates) are upper bounds.
fn finish(cfg: &mut ModelConfig, window: usize, params: Gemma4Params) {
    let layers = &params.layers;
    cfg.layer_windows = layers.iter().map(|l| l.sliding.then_some(window)).collect();
    if let Some(hd) = layers.iter().map(|l| l.head_dim).max() {
        cfg.head_dim = hd;
    }
    if let Some(kvh) = layers.iter().map(|l| l.kv_heads).max() {
        cfg.num_kv_heads = kvh;
    }
    cfg.rotary_dims = cfg.head_dim;
    cfg.gemma4 = Some(Box::new(params));
}

/// A layer's K/V projections (absent on KV-shared layers).
struct KvProjection<B: Backend> {
    k: B::Matrix,
    /// `None` with `attention_k_eq_v`: the key projection gives the values.
    v: Option<B::Matrix>,
    k_norm: B::Tensor,
    /// Ones: V's RMS norm has no scale.
    v_norm: B::Tensor,
}

/// The mixture-of-experts block of one layer.
struct MoeBlock<B: Backend> {
    router: B::Matrix,
    /// The router's input norm weight: its `scale` times `hidden^-0.5`.
    router_norm: B::Tensor,
    experts: Experts<B>,
    post_dense_norm: B::Tensor,
    pre_norm: B::Tensor,
    post_norm: B::Tensor,
}

/// A layer's per-layer-input gate.
struct PleGate<B: Backend> {
    gate: B::Matrix,
    proj: B::Matrix,
    norm: B::Tensor,
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    q: B::Matrix,
    q_norm: B::Tensor,
    kv: Option<KvProjection<B>>,
    o: B::Matrix,
    post_attn_norm: B::Tensor,
    ffn_norm: B::Tensor,
    gate_up: GateUp<B>,
    down: B::Matrix,
    post_ffw_norm: B::Tensor,
    moe: Option<MoeBlock<B>>,
    ple: Option<PleGate<B>>,
    scalar: f32,
    attention: AttentionParams,
    sliding: bool,
    /// The cache entry this layer appends to or reads.
    slot: usize,
    /// Whether this is the pass's last layer to read its cache entry.
    evict: bool,
}

/// The model-wide per-layer-input weights.
struct Ple<B: Backend> {
    table: B::Matrix,
    proj: B::Matrix,
    norm: B::Tensor,
    dim: usize,
    vocab: usize,
}

/// What every layer of a Gemma 4 pass reads besides the residual stream
/// ([`Gemma4Model::prelude`]).
pub(crate) struct Prelude<B: Backend> {
    /// Each layer's per-layer input (none without them).
    per_layer: Vec<B::Tensor>,
    rope_sliding: B::Rope,
    rope_full: B::Rope,
}

/// The ids of a pass's new tokens, for the per-layer inputs.
pub(crate) enum TokenIds<'a, B: Backend> {
    /// On the host, soft tokens standing for the pad token.
    Host(&'a [u32]),
    /// Held by the backend (a greedy decode step fed the last step's argmax): embedded
    /// there, so the step is queued without waiting for them.
    Backend(&'a B::Ids),
}

/// A loaded Gemma 4 (everything but the embedding, final norm and head, which
/// [`crate::models::decoder::Decoder`] holds).
pub(crate) struct Gemma4Model<B: Backend> {
    layers: Vec<Layer<B>>,
    ple: Option<Ple<B>>,
    params: Gemma4Params,
}

fn f32_weight(name: String, values: &[f32]) -> HostWeight<'static> {
    HostWeight {
        name,
        dtype: GgmlType::F32,
        shape: vec![values.len()],
        bytes: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

impl<B: Backend> Gemma4Model<B> {
    /// Loads the layers of `cfg` (which [`from_hf`] made) through `ld`.
    pub(crate) fn load(ld: &mut Loader<'_, B>, cfg: &ModelConfig) -> Result<Self> {
        let params = cfg
            .gemma4
            .as_deref()
            .cloned()
            .ok_or_else(|| EngineError::InvalidInput("not a Gemma 4 configuration".into()))?;
        let h = cfg.hidden_size;
        let n = params.layers.len();
        let ple = if params.ple_dim > 0 {
            let width = n * params.ple_dim;
            Some(Ple {
                table: ld.matrix("per_layer_token_embd.weight", params.ple_vocab, width)?,
                proj: ld.matrix("per_layer_model_proj.weight", width, h)?,
                norm: ld.required_norm("per_layer_proj_norm.weight", params.ple_dim)?,
                dim: params.ple_dim,
                vocab: params.ple_vocab,
            })
        } else {
            None
        };
        // Slot of each producing layer, and the last layer reading each slot.
        let mut slot_of = vec![0usize; n];
        let mut slots = 0;
        for (i, l) in params.layers.iter().enumerate() {
            slot_of[i] = match l.kv_source {
                None => {
                    slots += 1;
                    slots - 1
                }
                Some(s) => slot_of[s],
            };
        }
        let mut last_reader = vec![0usize; slots];
        for (i, &s) in slot_of.iter().enumerate() {
            last_reader[s] = i;
        }
        let ones = |ld: &mut Loader<'_, B>, len: usize| {
            ld.backend
                .vector(f32_weight("v_norm".into(), &vec![1.0; len]))
        };
        let mut layers = Vec::with_capacity(n);
        for (i, spec) in params.layers.iter().enumerate() {
            let name = |s: &str| format!("blk.{i}.{s}");
            let hd = spec.head_dim;
            let q_dim = cfg.num_heads * hd;
            let kv_dim = spec.kv_heads * hd;
            let kv = if spec.kv_source.is_none() {
                Some(KvProjection {
                    k: ld.matrix(&name("attn_k.weight"), kv_dim, h)?,
                    v: if spec.k_eq_v {
                        None
                    } else {
                        Some(ld.matrix(&name("attn_v.weight"), kv_dim, h)?)
                    },
                    k_norm: ld.required_norm(&name("attn_k_norm.weight"), hd)?,
                    v_norm: ones(ld, hd)?,
                })
            } else {
                None
            };
            let f = spec.intermediate;
            let moe = match &params.moe {
                Some(m) => Some(load_moe(ld, i, h, m, cfg.activation)?),
                None => None,
            };
            let ple_gate = match &ple {
                Some(p) => Some(PleGate {
                    gate: ld.matrix(&name("inp_gate.weight"), p.dim, h)?,
                    proj: ld.matrix(&name("proj.weight"), h, p.dim)?,
                    norm: ld.required_norm(&name("post_norm.weight"), h)?,
                }),
                None => None,
            };
            let scalar = match ld.src.get(&name("layer_output_scale.weight"))? {
                Some(w) => {
                    ld.check(&w, &[1])?;
                    w.float_values("layer scalar")?[0]
                }
                None => 1.0,
            };
            let gate = ld.matrix(&name("ffn_gate.weight"), f, h)?;
            let up = ld.matrix(&name("ffn_up.weight"), f, h)?;
            let gate_up = GateUp::new(ld.backend, gate, up, f)?;
            layers.push(Layer {
                attn_norm: ld.required_norm(&name("attn_norm.weight"), h)?,
                q: ld.matrix(&name("attn_q.weight"), q_dim, h)?,
                q_norm: ld.required_norm(&name("attn_q_norm.weight"), hd)?,
                kv,
                o: ld.matrix(&name("attn_output.weight"), h, q_dim)?,
                post_attn_norm: ld.required_norm(&name("post_attention_norm.weight"), h)?,
                ffn_norm: ld.required_norm(&name("ffn_norm.weight"), h)?,
                gate_up,
                down: ld.matrix(&name("ffn_down.weight"), h, f)?,
                post_ffw_norm: ld.required_norm(&name("post_ffw_norm.weight"), h)?,
                moe,
                ple: ple_gate,
                scalar,
                attention: AttentionParams {
                    heads: cfg.num_heads,
                    kv_heads: spec.kv_heads,
                    head_dim: hd,
                    scale: 1.0,
                    window: cfg.layer_windows[i],
                    softcap: None,
                },
                sliding: spec.sliding,
                slot: slot_of[i],
                evict: last_reader[slot_of[i]] == i,
            });
        }
        Ok(Gemma4Model {
            layers,
            ple,
            params,
        })
    }

    /// The id soft tokens stand for: their per-layer inputs are the pad token's (as
    /// transformers' `Gemma4Model` places media).
    pub(crate) fn pad_id(&self) -> u32 {
        self.params.pad_id
    }

    /// Whether the per-layer inputs can embed ids the backend holds, picked from logits
    /// `vocab` wide: the per-layer table has a row for each (else the ids are read on the
    /// host, where those past it stand for the pad token).
    pub(crate) fn embeds_backend_ids(&self, vocab: usize) -> bool {
        self.ple.as_ref().is_none_or(|p| p.vocab >= vocab)
    }

    /// `(kv_heads, head_dim, window)` of each cache entry of a sequence.
    pub(crate) fn cache_layout(&self) -> Vec<(usize, usize, Option<usize>)> {
        self.layers
            .iter()
            .filter(|l| l.kv.is_some())
            .map(|l| {
                let a = &l.attention;
                (a.kv_heads, a.head_dim, a.window)
            })
            .collect()
    }

    /// Runs the layers over `x` (the embedded new tokens, media rows placed; `ids` their
    /// ids; rows `ranges[i]` for `caches[i]`
    /// at `positions`), appending to each cache; returns the residual stream after the
    /// last layer. The soft tokens of a bidirectional media item see each other on the
    /// sliding layers. `lora` adds the adapters' deltas beside every projection (the
    /// experts' excepted).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_layers(
        &self,
        be: &B,
        cfg: &ModelConfig,
        x: B::Tensor,
        ids: TokenIds<'_, B>,
        positions: &[usize],
        caches: &mut [&mut SequenceCache<B>],
        ranges: &[Range<usize>],
        media: Option<&PassMedia>,
        lora: &LoraBatch<'_, B>,
    ) -> Result<B::Tensor> {
        let prelude = self.prelude(be, cfg, &x, ids, positions, lora)?;
        let span = 0..self.layers.len();
        self.run_span(be, cfg, &prelude, x, caches, ranges, media, lora, span)
    }

    /// What every layer of a pass reads besides the residual stream: the per-layer inputs
    /// (from the embedded tokens `x` and their `ids`) and the rotary tables of `positions`.
    pub(crate) fn prelude(
        &self,
        be: &B,
        cfg: &ModelConfig,
        x: &B::Tensor,
        ids: TokenIds<'_, B>,
        positions: &[usize],
        lora: &LoraBatch<'_, B>,
    ) -> Result<Prelude<B>> {
        let eps = cfg.rms_eps;
        let h = cfg.hidden_size;
        let per_layer = match &self.ple {
            Some(p) => {
                let tok = match ids {
                    TokenIds::Host(ids) => {
                        let ple_ids: Vec<u32> = ids
                            .iter()
                            .map(|&id| {
                                if (id as usize) < p.vocab {
                                    id
                                } else {
                                    self.params.pad_id
                                }
                            })
                            .collect();
                        be.embed(&p.table, &ple_ids)?
                    }
                    TokenIds::Backend(ids) => be.embed_ids(&p.table, ids)?,
                };
                let tok = be.scale(&tok, (p.dim as f32).sqrt())?;
                let proj = be.linear(x, &p.proj, None)?;
                let proj = lora.apply(be, 0, Target::PleModel, x, proj)?;
                let proj = be.scale(&proj, (h as f32).powf(-0.5))?;
                let proj = be.rms_norm(&proj, &p.norm, eps)?;
                let both = be.scale(&be.add(&proj, &tok)?, std::f32::consts::FRAC_1_SQRT_2)?;
                be.split_columns(&both, &vec![p.dim; self.layers.len()])?
            }
            None => Vec::new(),
        };
        Ok(Prelude {
            per_layer,
            rope_sliding: be.rope_table(positions, &self.params.rope_sliding)?,
            rope_full: be.rope_table(positions, &self.params.rope_full)?,
        })
    }

    /// Each layer's cache entry, and whether it reads an earlier layer's keys and values
    /// (a KV-shared layer) instead of appending its own.
    pub(crate) fn kv_slots(&self) -> Vec<(usize, bool)> {
        self.layers
            .iter()
            .map(|l| (l.slot, l.kv.is_none()))
            .collect()
    }

    /// Layers `span` of a pass whose [`Prelude`] is `prelude`, from their input `x` (see
    /// [`Gemma4Model::run_layers`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_span(
        &self,
        be: &B,
        cfg: &ModelConfig,
        prelude: &Prelude<B>,
        mut x: B::Tensor,
        caches: &mut [&mut SequenceCache<B>],
        ranges: &[Range<usize>],
        media: Option<&PassMedia>,
        lora: &LoraBatch<'_, B>,
        span: Range<usize>,
    ) -> Result<B::Tensor> {
        let eps = cfg.rms_eps;
        let total: usize = ranges.iter().map(|r| r.len()).sum();
        let Prelude {
            per_layer,
            rope_sliding,
            rope_full,
        } = prelude;
        let layers = crate::models::layer_span(&self.layers, &span)?;
        // A layer's last residual add also makes the next layer's input norm.
        let mut normed_input: Option<B::Tensor> = None;
        for (i, (li, layer)) in span.zip(layers).enumerate() {
            let a = &layer.attention;
            let table = if layer.sliding {
                rope_sliding
            } else {
                rope_full
            };
            let hn = match normed_input.take() {
                Some(hn) => hn,
                None => be.rms_norm(&x, &layer.attn_norm, eps)?,
            };
            // The layer's own projections (queries, and keys and values unless it reads an
            // earlier layer's) multiply the same rows: one launch where the backend can.
            let mut ws = vec![(&layer.q, None)];
            if let Some(kv) = &layer.kv {
                ws.push((&kv.k, None));
                ws.extend(kv.v.as_ref().map(|v| (v, None)));
            }
            let mut outs = be.linear_many(&hn, &ws)?.into_iter();
            let mut next_out = || {
                outs.next().ok_or_else(|| EngineError::Backend {
                    backend: be.name(),
                    message: "linear_many returned too few products".into(),
                })
            };
            let q = next_out()?;
            let q = lora.apply(be, li, Target::Q, &hn, q)?;
            let kv = match &layer.kv {
                Some(kv) => {
                    let k = next_out()?;
                    Some(match &kv.v {
                        Some(_) => {
                            let v = next_out()?;
                            let [k, v] =
                                lora.apply_many(be, li, [Target::K, Target::V], &hn, [k, v])?;
                            (kv, k, v)
                        }
                        None => {
                            let k = lora.apply(be, li, Target::K, &hn, k)?;
                            (kv, k.clone(), k)
                        }
                    })
                }
                None => None,
            };
            let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = caches
                .iter_mut()
                .zip(ranges)
                .map(|(cache, r)| AttentionSegment {
                    rows: r.clone(),
                    cache: &mut cache.layers_mut()[layer.slot],
                })
                .collect();
            // Bidirectional media blocks exist on sliding layers only.
            let ends = media.filter(|_| layer.sliding).map(|m| m.ends.as_slice());
            let q_norm = (&q, &layer.q_norm);
            let attn = match kv {
                Some((kv, k, v)) => {
                    let heads = be.norm_rope_qkv(
                        q_norm,
                        Some((&k, &kv.k_norm)),
                        Some((&v, &kv.v_norm)),
                        a.heads,
                        a.kv_heads,
                        table,
                        eps,
                    )?;
                    let (Some(k), Some(v)) = (&heads.k, &heads.v) else {
                        return Err(EngineError::Backend {
                            backend: be.name(),
                            message: "norm_rope_qkv returned no keys or values".into(),
                        });
                    };
                    be.attention_shared(
                        &heads.q,
                        Some((k, v)),
                        &mut segments,
                        a,
                        layer.evict,
                        ends,
                    )?
                }
                None => {
                    let heads =
                        be.norm_rope_qkv(q_norm, None, None, a.heads, a.kv_heads, table, eps)?;
                    be.attention_shared(&heads.q, None, &mut segments, a, layer.evict, ends)?
                }
            };
            drop(segments);
            let o = be.linear(&attn, &layer.o, None)?;
            let o = lora.apply(be, li, Target::O, &attn, o)?;
            let (sum, hf) = be.add_post_norm(
                &x,
                &o,
                &layer.post_attn_norm,
                eps,
                1.0,
                Some(&layer.ffn_norm),
            )?;
            let hf = hf.ok_or_else(|| EngineError::Backend {
                backend: be.name(),
                message: "add_post_norm returned no norm".into(),
            })?;
            x = sum;
            let act = layer.gate_up.apply(be, lora, li, &hf, cfg.activation)?;
            let m = be.linear(&act, &layer.down, None)?;
            let mut m = lora.apply(be, li, Target::Down, &act, m)?;
            if let Some(moe) = &layer.moe {
                let dense = be.rms_norm(&m, &moe.post_dense_norm, eps)?;
                let r = be.rms_norm(&x, &moe.router_norm, eps)?;
                let logits = be.linear(&r, &moe.router, None)?;
                let logits = lora.apply(be, li, Target::Router, &r, logits)?;
                let e_in = be.rms_norm(&x, &moe.pre_norm, eps)?;
                // Deltas on the experts (PEFT's `target_parameters`) run one product per
                // expert (mounting them needs `Capability::ExpertAdapters`).
                let e_out = if lora.touches_experts(li) {
                    be.moe_with_deltas(&moe.experts, &e_in, &logits, total, lora, li)?
                } else {
                    be.moe(&moe.experts, &e_in, &logits, total)?
                };
                let e_out = be.rms_norm(&e_out, &moe.post_norm, eps)?;
                m = be.add(&dense, &e_out)?;
            }
            let next = layers.get(i + 1).map(|l| &l.attn_norm);
            let (sum, hn) = match (&layer.ple, per_layer.get(li)) {
                (Some(g), Some(pl)) => {
                    (x, _) = be.add_post_norm(&x, &m, &layer.post_ffw_norm, eps, 1.0, None)?;
                    let gated = if lora.touches(li, Target::PleGate) {
                        let gate = be.linear(&x, &g.gate, None)?;
                        let gate = lora.apply(be, li, Target::PleGate, &x, gate)?;
                        be.glu(&gate, pl, cfg.activation)?
                    } else {
                        be.linear_act_mul(&x, &g.gate, pl, cfg.activation)?
                    };
                    let p = be.linear(&gated, &g.proj, None)?;
                    let p = lora.apply(be, li, Target::PleProj, &gated, p)?;
                    be.add_post_norm(&x, &p, &g.norm, eps, layer.scalar, next)?
                }
                _ => be.add_post_norm(&x, &m, &layer.post_ffw_norm, eps, layer.scalar, next)?,
            };
            x = sum;
            normed_input = hn;
        }

        Ok(x)
    }
}

fn load_moe<B: Backend>(
    ld: &mut Loader<'_, B>,
    i: usize,
    h: usize,
    m: &MoeShape,
    activation: Activation,
) -> Result<MoeBlock<B>> {
    let name = |s: &str| format!("blk.{i}.{s}");
    let router = ld.matrix(&name("ffn_gate_inp.weight"), m.experts, h)?;
    let scale = ld.required(&name("ffn_gate_inp.scale"))?;
    ld.check(&scale, &[h])?;
    let root = (h as f32).powf(-0.5);
    let scale: Vec<f32> = scale
        .float_values("router scale")?
        .into_iter()
        .map(|s| s * root)
        .collect();
    let router_norm = ld.backend.vector(f32_weight(name("router_norm"), &scale))?;
    let pes = ld.required(&name("ffn_down_exps.scale"))?;
    ld.check(&pes, &[m.experts])?;
    let per_expert_scale = pes.float_values("per-expert scale")?;
    let gate_up = ld.required(&name("ffn_gate_up_exps.weight"))?;
    ld.check(&gate_up, &[m.experts, 2 * m.intermediate, h])?;
    let down = ld.required(&name("ffn_down_exps.weight"))?;
    ld.check(&down, &[m.experts, h, m.intermediate])?;
    let (experts, bytes) = Experts::upload(
        ld.backend,
        &gate_up,
        &down,
        per_expert_scale,
        m.top_k,
        activation,
    )?;
    ld.bytes += bytes;
    Ok(MoeBlock {
        router,
        router_norm,
        experts,
        post_dense_norm: ld.required_norm(&name("post_ffw_norm_1.weight"), h)?,
        pre_norm: ld.required_norm(&name("pre_ffw_norm_2.weight"), h)?,
        post_norm: ld.required_norm(&name("post_ffw_norm_2.weight"), h)?,
    })
}
