//! The frozen base a trainer adapts: the engine's [`ModelConfig`], weight sources and
//! canonical tensor names, read once into f32 host matrices in Hugging Face row order.
//!
//! GGUF Llama files hold Q/K rows permuted for interleaved rotary pairs; they are put
//! back in Hugging Face order here (and the rotary style set to `rotate_half`), so the
//! trained factors are in the order PEFT and `wick serve --adapter` expect whatever the
//! base file was.
use std::path::Path;

use serde_json::Value;
use wick_engine::backend::RopeStyle;
use wick_engine::config::{Features, ModelConfig};
use wick_engine::models::Arch;
use wick_engine::weights::{GgufWeights, MlxQuantization, SafetensorsWeights, WeightSource};
use wick_gguf::GgufFile;

use crate::error::{io, Result, TrainError};

/// One decoder layer's frozen weights, row-major `[out, in]` matrices.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMS norm before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection `[heads·head_dim, hidden]`.
    pub wq: Vec<f32>,
    /// Key projection `[kv_heads·head_dim, hidden]`.
    pub wk: Vec<f32>,
    /// Value projection `[kv_heads·head_dim, hidden]`.
    pub wv: Vec<f32>,
    /// Output projection `[hidden, heads·head_dim]`.
    pub wo: Vec<f32>,
    /// RMS norm before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate projection `[intermediate, hidden]`.
    pub wg: Vec<f32>,
    /// Up projection `[intermediate, hidden]`.
    pub wu: Vec<f32>,
    /// Down projection `[hidden, intermediate]`.
    pub wd: Vec<f32>,
}

/// A Llama-family base model as f32 host matrices.
#[derive(Debug, Clone)]
pub struct BaseWeights {
    /// The engine's configuration (rotary style always `Neox`: rows are in HF order).
    pub cfg: ModelConfig,
    /// Token embeddings `[vocab, hidden]`.
    pub embed: Vec<f32>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMS norm.
    pub final_norm: Vec<f32>,
    /// Output head `[vocab, hidden]`; `None` when tied to the embeddings.
    pub lm_head: Option<Vec<f32>>,
    /// How the file stored the matrices (for the log: `f32`, `bf16`, `Q8_0`, ...).
    pub stored_as: String,
}

impl BaseWeights {
    /// Reads a GGUF file or a Hugging Face directory (safetensors f32/f16/bf16, or MLX
    /// affine-quantized, dequantized here).
    pub fn load(path: &Path) -> Result<BaseWeights> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        if meta.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
            let json: Value = serde_json::from_str(&text).map_err(|e| TrainError::Dataset {
                path: cfg_path.clone(),
                reason: format!("not valid JSON: {e}"),
            })?;
            let source = cfg_path.display().to_string();
            let cfg = ModelConfig::from_hf(&json, &source)?;
            let weights = SafetensorsWeights::open(path)?;
            let quant = MlxQuantization::from_config(&json, &path.display().to_string())?;
            let named = weights
                .canonical_as(cfg.features.hf_naming)
                .with_quantization(quant);
            Self::from_source(cfg, &named, false)
        } else {
            let file = GgufFile::open(path).map_err(wick_engine::EngineError::from)?;
            let cfg = ModelConfig::from_gguf(file.metadata(), &path.display().to_string())?;
            let permuted = cfg.rope_style == RopeStyle::Interleaved;
            Self::from_source(cfg, &GgufWeights::new(&file), permuted)
        }
    }

    /// Reads every matrix of `cfg`'s decoder from `src`. `permuted`: the file's Q/K rows
    /// are in llama.cpp's interleaved order.
    pub fn from_source(
        mut cfg: ModelConfig,
        src: &dyn WeightSource,
        permuted: bool,
    ) -> Result<BaseWeights> {
        check_supported(&cfg)?;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (q, kv) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let mut stored_as = String::new();
        let mut read = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let values = read_matrix(src, name, shape, &mut stored_as)?;
            Ok(values)
        };
        let embed = read("token_embd.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            for bias in ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_up"] {
                if src.contains(&format!("blk.{i}.{bias}.bias")) {
                    return Err(TrainError::Unsupported(format!(
                        "layer {i} has a {bias} bias (only bias-free Llama-family decoders train)"
                    )));
                }
            }
            let mut wq = read(&n("attn_q"), &[q, h])?;
            let mut wk = read(&n("attn_k"), &[kv, h])?;
            if permuted {
                wq = unpermute_rows(&wq, cfg.num_heads, h);
                wk = unpermute_rows(&wk, cfg.num_kv_heads, h);
            }
            layers.push(LayerWeights {
                attn_norm: read(&n("attn_norm"), &[h])?,
                wq,
                wk,
                wv: read(&n("attn_v"), &[kv, h])?,
                wo: read(&n("attn_output"), &[h, q])?,
                ffn_norm: read(&n("ffn_norm"), &[h])?,
                wg: read(&n("ffn_gate"), &[f, h])?,
                wu: read(&n("ffn_up"), &[f, h])?,
                wd: read(&n("ffn_down"), &[h, f])?,
            });
        }
        let final_norm = read("output_norm.weight", &[h])?;
        let lm_head = if src.contains("output.weight") || src.affine("output.weight")?.is_some() {
            Some(read("output.weight", &[cfg.vocab_size, h])?)
        } else {
            None
        };
        cfg.rope_style = RopeStyle::Neox;
        Ok(BaseWeights {
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            stored_as,
        })
    }

    /// The output head `[vocab, hidden]` (the embeddings when tied).
    pub fn head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

/// Refuses what the hand-written backward does not cover: everything beyond the plain
/// Llama decoder (pre-norm RMS, SwiGLU, rotary on every layer, no soft caps or
/// multipliers).
fn check_supported(cfg: &ModelConfig) -> Result<()> {
    let name = cfg.arch.name();
    if !matches!(cfg.arch, Arch::Llama | Arch::Mistral) {
        return Err(TrainError::Unsupported(format!(
            "architecture {name}: the trainer covers the Llama family (llama, mistral)"
        )));
    }
    let plain = cfg.features == Features::default()
        && !cfg.sandwich_norms
        && !cfg.scale_embeddings
        && !cfg.norm_weight_offset
        && cfg.attn_softcap.is_none()
        && cfg.final_softcap.is_none()
        && cfg.activation == wick_engine::backend::Activation::Silu
        && cfg.rotary_dims <= cfg.head_dim
        && cfg.rotary_dims.is_multiple_of(2)
        && !cfg.rope.depends_on_length();
    if !plain {
        return Err(TrainError::Unsupported(format!(
            "{name} with features outside the plain Llama decoder"
        )));
    }
    Ok(())
}

fn read_matrix(
    src: &dyn WeightSource,
    name: &str,
    shape: &[usize],
    stored_as: &mut String,
) -> Result<Vec<f32>> {
    let want: usize = shape.iter().product();
    let missing = || TrainError::Unsupported(format!("{}: no tensor {name}", src.source_name()));
    let (values, dtype) = if let Some(a) = src.affine(name)? {
        (a.dequantize()?, format!("mlx-affine-{}bit", a.bits))
    } else {
        let w = src.get(name)?.ok_or_else(missing)?;
        let have: usize = w.shape.iter().product();
        if have != want {
            return Err(TrainError::Unsupported(format!(
                "{}: {name} has shape {:?}, expected {shape:?}",
                src.source_name(),
                w.shape
            )));
        }
        (w.dequantize()?, w.dtype.to_string())
    };
    if values.len() != want {
        return Err(TrainError::Unsupported(format!(
            "{}: {name} holds {} values, expected {want}",
            src.source_name(),
            values.len()
        )));
    }
    if shape.len() == 2 && !stored_as.contains(&dtype) {
        if !stored_as.is_empty() {
            stored_as.push('+');
        }
        stored_as.push_str(&dtype);
    }
    Ok(values)
}

/// Undoes llama.cpp's Q/K row permutation: within each head, file row `2j + t` is
/// Hugging Face row `t·hd/2 + j`.
pub(crate) fn unpermute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols.max(1);
    let hd = rows / heads.max(1);
    let half = hd / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let src = h * hd + j * 2 + t;
                let dst = h * hd + t * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_order() {
        // One head of dim 4, one column: HF rows [0,1,2,3] are stored as [0,2,1,3].
        assert_eq!(
            unpermute_rows(&[0.0, 2.0, 1.0, 3.0], 1, 1),
            vec![0.0, 1.0, 2.0, 3.0]
        );
    }
}
