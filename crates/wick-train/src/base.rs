//! The frozen base a trainer adapts: the engine's own decoder (`wick_engine::models::
//! decoder`), loaded onto the training backend ([`TapeBackend`]) from the engine's config
//! and weight sources, so training runs the model code serving runs. Weights are f32
//! (dequantized once at load), or (QLoRA) the projections kept in the file's own encoding
//! — GGUF blocks, MLX affine groups, f16/bf16 — and dequantized for each product, as
//! bitsandbytes' QLoRA does, so the base costs its file size in memory.
//!
//! GGUF Llama files hold Q/K rows permuted for interleaved rotary pairs, and the engine
//! runs them so; the trainer's factors stay in Hugging Face order (what PEFT and
//! `wick serve --adapter` expect whatever the base file), and the `B` of Q and K is
//! permuted on its way to the backend and its gradient back ([`BaseWeights::permute`]).
use std::path::Path;

use serde_json::Value;
use wick_engine::adapters::permute_rows;
use wick_engine::backend::tape::TapeBackend;
use wick_engine::backend::RopeStyle;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::Decoder;
use wick_engine::weights::{GgufWeights, MlxQuantization, SafetensorsWeights, WeightSource};
use wick_gguf::GgufFile;

use crate::error::{io, Result, TrainError};

/// What the loader does with a base stored in a type other than f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseMode {
    /// Dequantize every matrix to f32 once (fastest per step, 4 bytes a weight).
    #[default]
    F32,
    /// QLoRA: keep the projections as stored and dequantize each for its products.
    KeepStored,
}

/// Heads of the Q and K projections of a base whose Q/K rows are in llama.cpp's
/// interleaved order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkOrder {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
}

/// A base model on the training backend.
pub struct BaseWeights {
    /// The engine's configuration.
    pub cfg: ModelConfig,
    /// The engine's decoder over the frozen weights.
    pub decoder: Decoder<TapeBackend>,
    /// How the file stored the matrices (for the log: `f32`, `bf16`, `Q8_0`, ...).
    pub stored_as: String,
    /// Set for a base whose Q/K rows are permuted (GGUF Llama files).
    pub permute: Option<QkOrder>,
    keep_stored: bool,
}

impl std::fmt::Debug for BaseWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BaseWeights")
            .field("arch", &self.cfg.arch)
            .field("stored_as", &self.stored_as)
            .field("permute", &self.permute)
            .finish_non_exhaustive()
    }
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

    /// Loads `cfg`'s decoder from `src` onto the training backend. `permuted`: the file's
    /// Q/K rows are in llama.cpp's interleaved order.
    pub fn from_source(
        cfg: ModelConfig,
        src: &dyn WeightSource,
        permuted: bool,
        mode: BaseMode,
    ) -> Result<BaseWeights> {
        let keep_stored = mode == BaseMode::KeepStored;
        let decoder = Decoder::load(TapeBackend::new(keep_stored), cfg.clone(), src)?;
        let mut stored_as = decoder.backend().stored_as();
        if stored_as.is_empty() {
            stored_as = "f32".into();
        }
        Ok(BaseWeights {
            permute: permuted.then_some(QkOrder {
                heads: cfg.num_heads,
                kv_heads: cfg.num_kv_heads,
            }),
            cfg,
            decoder,
            stored_as,
            keep_stored,
        })
    }

    /// Whether the projections are kept as stored (QLoRA).
    pub fn keeps_stored(&self) -> bool {
        self.keep_stored && self.stored_as != "f32"
    }

    /// Bytes the weights hold in memory.
    pub fn bytes(&self) -> usize {
        self.decoder.weight_bytes()
    }

    /// The heads of `target`'s rows when they are permuted in the base (Q and K of a GGUF
    /// Llama), so `B`'s rows are too.
    pub fn permuted_heads(&self, target: wick_engine::adapters::Target) -> Option<usize> {
        use wick_engine::adapters::Target;
        let p = self.permute?;
        match target {
            Target::Q => Some(p.heads),
            Target::K => Some(p.kv_heads),
            _ => None,
        }
    }

    /// `b` `[out, rank]` in the base's row order (Hugging Face order in, permuted where
    /// the base is).
    pub fn permute(
        &self,
        target: wick_engine::adapters::Target,
        b: &[f32],
        rank: usize,
    ) -> Vec<f32> {
        match self.permuted_heads(target) {
            Some(heads) => permute_rows(b, heads, rank),
            None => b.to_vec(),
        }
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
