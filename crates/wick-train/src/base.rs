//! The frozen base a trainer adapts: the engine's [`ModelConfig`], weight sources and
//! canonical tensor names, read once into host matrices in Hugging Face row order: f32,
//! or (QLoRA) the projections kept in the file's own encoding — GGUF blocks, MLX affine
//! groups, f16/bf16 — and dequantized for each product, as bitsandbytes' QLoRA does, so
//! the base costs its file size in memory instead of 4 bytes a weight.
//!
//! GGUF Llama files hold Q/K rows permuted for interleaved rotary pairs; they are put
//! back in Hugging Face order here (and the rotary style set to `rotate_half`), so the
//! trained factors are in the order PEFT and `wick serve --adapter` expect whatever the
//! base file was.
use std::borrow::Cow;
use std::path::Path;

use serde_json::Value;
use wick_engine::backend::RopeStyle;
use wick_engine::config::{Features, ModelConfig};
use wick_engine::models::Arch;
use wick_engine::weights::{
    AffineWeight, GgufWeights, HostWeight, MlxQuantization, SafetensorsWeights, WeightSource,
};
use wick_gguf::GgmlType;
use wick_gguf::GgufFile;

use crate::error::{io, Result, TrainError};

/// A frozen projection, row-major `[out, in]`.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// f32 values.
    F32(Vec<f32>),
    /// A GGUF or safetensors tensor in its stored type (quantized blocks, f16, bf16);
    /// `unpermute_heads`: a GGUF Q/K matrix whose rows go back to Hugging Face order.
    Stored {
        /// The tensor, owning its bytes.
        weight: HostWeight<'static>,
        /// Heads of a llama.cpp-permuted Q/K matrix.
        unpermute_heads: Option<usize>,
        /// Columns (`in`).
        cols: usize,
    },
    /// An MLX affine-quantized matrix.
    Affine(AffineWeight<'static>),
}

impl Matrix {
    /// The f32 values: borrowed, or dequantized now (a stored matrix was dequantized once
    /// at load, so this cannot fail later).
    pub fn values(&self) -> Cow<'_, [f32]> {
        let dequantized = match self {
            Matrix::F32(v) => return Cow::Borrowed(v),
            Matrix::Stored {
                weight,
                unpermute_heads,
                cols,
            } => weight.dequantize().map(|v| match unpermute_heads {
                Some(heads) => unpermute_rows(&v, *heads, *cols),
                None => v,
            }),
            Matrix::Affine(a) => a.dequantize(),
        };
        Cow::Owned(dequantized.expect("the matrix was dequantized once when it was loaded"))
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len() * 4,
            Matrix::Stored { weight, .. } => weight.bytes.len(),
            Matrix::Affine(a) => a.packed.len() + a.scales.bytes.len() + a.biases.bytes.len(),
        }
    }

    /// Whether products dequantize it first.
    pub fn is_stored(&self) -> bool {
        !matches!(self, Matrix::F32(_))
    }
}

/// What the loader does with a base stored in a type other than f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseMode {
    /// Dequantize every matrix to f32 once (fastest per step, 4 bytes a weight).
    #[default]
    F32,
    /// QLoRA: keep the projections as stored and dequantize each for its products.
    KeepStored,
}

/// One decoder layer's frozen weights, row-major `[out, in]` matrices.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMS norm before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection `[heads·head_dim, hidden]`.
    pub wq: Matrix,
    /// Key projection `[kv_heads·head_dim, hidden]`.
    pub wk: Matrix,
    /// Value projection `[kv_heads·head_dim, hidden]`.
    pub wv: Matrix,
    /// Output projection `[hidden, heads·head_dim]`.
    pub wo: Matrix,
    /// RMS norm before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate projection `[intermediate, hidden]`.
    pub wg: Matrix,
    /// Up projection `[intermediate, hidden]`.
    pub wu: Matrix,
    /// Down projection `[hidden, intermediate]`.
    pub wd: Matrix,
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
    /// affine-quantized), every matrix dequantized to f32.
    pub fn load(path: &Path) -> Result<BaseWeights> {
        Self::load_as(path, BaseMode::F32)
    }

    /// [`Self::load`], the projections kept as stored under [`BaseMode::KeepStored`].
    pub fn load_as(path: &Path, mode: BaseMode) -> Result<BaseWeights> {
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
            Self::from_source(cfg, &named, false, mode)
        } else {
            let file = GgufFile::open(path).map_err(wick_engine::EngineError::from)?;
            let cfg = ModelConfig::from_gguf(file.metadata(), &path.display().to_string())?;
            let permuted = cfg.rope_style == RopeStyle::Interleaved;
            Self::from_source(cfg, &GgufWeights::new(&file), permuted, mode)
        }
    }

    /// Reads every matrix of `cfg`'s decoder from `src`. `permuted`: the file's Q/K rows
    /// are in llama.cpp's interleaved order.
    pub fn from_source(
        mut cfg: ModelConfig,
        src: &dyn WeightSource,
        permuted: bool,
        mode: BaseMode,
    ) -> Result<BaseWeights> {
        check_supported(&cfg)?;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (q, kv) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let mut stored_as = String::new();
        let mut read_as = |name: &str, shape: &[usize], keep: Option<Option<usize>>| {
            read_matrix(src, name, shape, &mut stored_as, keep)
        };
        let keep = mode == BaseMode::KeepStored;
        // A projection: kept as stored (with its Q/K permutation to undo) or f32.
        let mut proj = |name: &str, shape: &[usize], heads: Option<usize>| -> Result<Matrix> {
            let unpermute = heads.filter(|_| permuted);
            let m = read_as(name, shape, keep.then_some(unpermute))?;
            Ok(match (m, unpermute) {
                (Matrix::F32(v), Some(heads)) => Matrix::F32(unpermute_rows(&v, heads, shape[1])),
                (m, _) => m,
            })
        };
        // The norms, embeddings and head are f32 (a row gather and the loss rows' logits);
        // only the projections may stay as stored. "stored as" names their types.
        let read = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            match read_matrix(src, name, shape, &mut String::new(), None)? {
                Matrix::F32(v) => Ok(v),
                _ => unreachable!("read_matrix without keep returns f32"),
            }
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
            let wq = proj(&n("attn_q"), &[q, h], Some(cfg.num_heads))?;
            let wk = proj(&n("attn_k"), &[kv, h], Some(cfg.num_kv_heads))?;
            let wv = proj(&n("attn_v"), &[kv, h], None)?;
            let wo = proj(&n("attn_output"), &[h, q], None)?;
            let wg = proj(&n("ffn_gate"), &[f, h], None)?;
            let wu = proj(&n("ffn_up"), &[f, h], None)?;
            let wd = proj(&n("ffn_down"), &[h, f], None)?;
            layers.push(LayerWeights {
                attn_norm: read(&n("attn_norm"), &[h])?,
                wq,
                wk,
                wv,
                wo,
                ffn_norm: read(&n("ffn_norm"), &[h])?,
                wg,
                wu,
                wd,
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

    /// Whether the projections are kept as stored (QLoRA).
    pub fn keeps_stored(&self) -> bool {
        self.layers.iter().any(|l| l.wq.is_stored())
    }

    /// Bytes the weights hold in memory.
    pub fn bytes(&self) -> usize {
        let mut n = (self.embed.len() + self.final_norm.len()) * 4;
        n += self.lm_head.as_ref().map_or(0, |v| v.len() * 4);
        for l in &self.layers {
            n += (l.attn_norm.len() + l.ffn_norm.len()) * 4;
            n += [&l.wq, &l.wk, &l.wv, &l.wo, &l.wg, &l.wu, &l.wd]
                .iter()
                .map(|m| m.bytes())
                .sum::<usize>();
        }
        n
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

/// Reads `name` (shape `shape`). `keep`: a projection that may stay as stored, with the
/// heads of its Q/K permutation if any; it is dequantized once here to check it, and kept
/// in its stored form unless that is f32 already.
fn read_matrix(
    src: &dyn WeightSource,
    name: &str,
    shape: &[usize],
    stored_as: &mut String,
    keep: Option<Option<usize>>,
) -> Result<Matrix> {
    let want: usize = shape.iter().product();
    let missing = || TrainError::Unsupported(format!("{}: no tensor {name}", src.source_name()));
    let (values, dtype, kept) = if let Some(a) = src.affine(name)? {
        if a.rows * a.cols != want {
            return Err(TrainError::Unsupported(format!(
                "{}: {name} is {}×{}, expected {shape:?}",
                src.source_name(),
                a.rows,
                a.cols
            )));
        }
        let values = a.dequantize()?;
        let dtype = format!("mlx-affine-{}bit", a.bits);
        let kept = keep.map(|_| Matrix::Affine(owned_affine(a)));
        (values, dtype, kept)
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
        let values = w.dequantize()?;
        let dtype = w.dtype.to_string();
        let kept = match keep {
            Some(unpermute_heads) if w.dtype != GgmlType::F32 && shape.len() == 2 => {
                Some(Matrix::Stored {
                    weight: owned(w),
                    unpermute_heads,
                    cols: shape[1],
                })
            }
            _ => None,
        };
        (values, dtype, kept)
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
    Ok(kept.unwrap_or(Matrix::F32(values)))
}

fn owned(w: HostWeight<'_>) -> HostWeight<'static> {
    HostWeight {
        name: w.name,
        dtype: w.dtype,
        shape: w.shape,
        bytes: Cow::Owned(w.bytes.into_owned()),
    }
}

fn owned_affine(a: AffineWeight<'_>) -> AffineWeight<'static> {
    AffineWeight {
        name: a.name,
        rows: a.rows,
        cols: a.cols,
        bits: a.bits,
        group_size: a.group_size,
        packed: Cow::Owned(a.packed.into_owned()),
        scales: owned(a.scales),
        biases: owned(a.biases),
    }
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
