//! Qwen 3.5 from a GGUF file as llama.cpp's converter writes it (`qwen35`).
//!
//! The converter does not store the checkpoint's tensors as they are. Against the Hugging Face
//! layout the [`Hybrid`](super::qwen35) loader reads, a `qwen35` file differs in four ways, each
//! undone here on load so that one loader serves both formats:
//! - names: the DeltaNet projections are `attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`,
//!   `ssm_out`, its parameters `ssm_a`, `ssm_dt.bias`, `ssm_conv1d`, `ssm_norm`, and the pre-MLP
//!   norm is `post_attention_norm`;
//! - value heads: where there are fewer key heads than value heads, every value-head axis is
//!   reordered from grouped by key head (`[g0v0, g0v1, g1v0, g1v1]`) to tiled
//!   (`[g0v0, g1v0, g0v1, g1v1]`) — rows of the V part of `attn_qkv`, of `attn_gate`,
//!   `ssm_beta`, `ssm_alpha`, the V channels of the convolution, `ssm_a`, `ssm_dt` and the
//!   columns of `ssm_out`;
//! - `ssm_a` holds `-exp(A_log)`, not `A_log`;
//! - the `(1 + w)` RMS norms hold `1 + w` (all but the DeltaNet's own gated norm);
//! - the convolution is `[channels, kernel]` without the checkpoint's middle axis.
use std::borrow::Cow;

use wick_gguf::GgmlType;

use super::{llama, Arch};
use crate::backend::RopeStyle;
use crate::config::qwen35::{DeltaShape, Qwen35Config};
use crate::config::{GgufKeys, ModelConfig};
use crate::weights::{HostWeight, WeightSource};
use crate::{EngineError, Result};

/// The configuration of a `qwen35` GGUF file.
pub(super) fn from_gguf(keys: &GgufKeys<'_>, source: &str) -> Result<ModelConfig> {
    let bad = |reason: String| EngineError::Config {
        source_name: source.to_string(),
        reason,
    };
    let mut cfg = llama::base_from_gguf(keys, Arch::Qwen35, RopeStyle::Neox, 10_000_000.0)?;
    // The file's norms hold `1 + w`; `Qwen35Gguf` hands `w` back so the loaders' offset
    // applies to both formats alike.
    cfg.norm_weight_offset = true;
    // Multi-token-prediction blocks come after the model's layers and count in
    // `block_count` (`nextn_predict_layers` of them): wick decodes without them.
    let mtp = keys.opt_usize("nextn_predict_layers")?.unwrap_or(0);
    if mtp >= cfg.num_layers {
        return Err(bad(format!(
            "{mtp} prediction blocks of {} blocks leave no layers",
            cfg.num_layers
        )));
    }
    cfg.num_layers -= mtp;
    cfg.layer_windows.truncate(cfg.num_layers);
    let layers = cfg.num_layers;
    let key = |k: &str| format!("{}.{k}", keys.arch);
    let mut linear_layers: Vec<bool> = match keys.meta.get(&key("attention.recurrent_layers")) {
        Some(v) => v
            .as_array()
            .ok_or_else(|| bad("'attention.recurrent_layers' must be an array".into()))?
            .iter()
            .map(|b| {
                b.as_bool()
                    .ok_or_else(|| bad("'attention.recurrent_layers' must hold booleans".into()))
            })
            .collect::<Result<_>>()?,
        None => {
            let every = keys
                .opt_usize("full_attention_interval")?
                .unwrap_or(4)
                .max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if linear_layers.len() == layers + mtp {
        linear_layers.truncate(layers);
    }
    if linear_layers.len() != layers {
        return Err(bad(format!(
            "{} recurrent_layers entries for {layers} layers",
            linear_layers.len()
        )));
    }
    if linear_layers.iter().all(|&l| l) {
        return Err(bad(
            "a Qwen 3.5 model needs at least one full-attention layer".into(),
        ));
    }
    let dim = |k: &str| -> Result<usize> {
        let v = keys.usize(k)?;
        if v == 0 || v > 1 << 14 {
            return Err(bad(format!("'{k}' is {v}; it must be in 1..=16384")));
        }
        Ok(v)
    };
    let (k_heads, v_heads) = (dim("ssm.group_count")?, dim("ssm.time_step_rank")?);
    let inner = dim("ssm.inner_size")?;
    if !v_heads.is_multiple_of(k_heads) || !inner.is_multiple_of(v_heads) {
        return Err(bad(format!(
            "{v_heads} value heads of an inner size {inner} do not divide among {k_heads} key heads"
        )));
    }
    let delta = DeltaShape {
        k_heads,
        v_heads,
        k_dim: dim("ssm.state_size")?,
        v_dim: inner / v_heads,
        conv_kernel: dim("ssm.conv_kernel")?,
    };
    if delta.conv_kernel > 64 {
        return Err(bad(format!(
            "ssm.conv_kernel {} is above the supported 64",
            delta.conv_kernel
        )));
    }
    if cfg.rotary_dims == 0 || cfg.rotary_dims > cfg.head_dim {
        return Err(bad(format!(
            "rope.dimension_count {} for heads of {}",
            cfg.rotary_dims, cfg.head_dim
        )));
    }
    cfg.qwen35 = Some(Qwen35Config {
        linear_layers,
        delta,
    });
    Ok(cfg)
}

/// A `qwen35` GGUF file seen through the Hugging Face layout's canonical names and values
/// (the module's doc lists what is undone).
pub(crate) struct Qwen35Gguf<'a> {
    file: &'a dyn WeightSource,
    shape: DeltaShape,
}

/// What a canonical name stands for in the file.
enum Part {
    /// The same tensor under the same name.
    Same,
    /// A norm stored as `1 + w`.
    OffsetNorm(String),
    /// A tensor whose value-head axis is tiled: rows of `head_rows` rows per head, after
    /// `skip_rows` rows that are not per value head.
    HeadRows {
        file: String,
        skip_rows: usize,
        head_rows: usize,
    },
    /// `ssm_out`: columns tiled by value head.
    HeadCols(String),
    /// `ssm_a`: `-exp(A_log)`, tiled.
    NegExpA(String),
    /// `ssm_conv1d`: `[channels, kernel]`, its V channels tiled.
    Conv(String),
    /// Another name, as stored.
    Renamed(String),
}

impl<'a> Qwen35Gguf<'a> {
    pub(crate) fn new(file: &'a dyn WeightSource, shape: DeltaShape) -> Self {
        Qwen35Gguf { file, shape }
    }

    fn part(&self, name: &str) -> Part {
        let Some(rest) = name.strip_prefix("blk.") else {
            return match name {
                "output_norm.weight" => Part::OffsetNorm(name.into()),
                _ => Part::Same,
            };
        };
        let Some((layer, tail)) = rest.split_once('.') else {
            return Part::Same;
        };
        let file = |s: &str| format!("blk.{layer}.{s}");
        let sh = self.shape;
        let qk_rows = 2 * sh.k_heads * sh.k_dim;
        match tail {
            "attn_norm.weight" | "attn_q_norm.weight" | "attn_k_norm.weight" => {
                Part::OffsetNorm(name.into())
            }
            "ffn_norm.weight" => Part::OffsetNorm(file("post_attention_norm.weight")),
            "linear_attn.in_proj_qkv.weight" => Part::HeadRows {
                file: file("attn_qkv.weight"),
                skip_rows: qk_rows,
                head_rows: sh.v_dim,
            },
            "linear_attn.in_proj_z.weight" => Part::HeadRows {
                file: file("attn_gate.weight"),
                skip_rows: 0,
                head_rows: sh.v_dim,
            },
            "linear_attn.in_proj_b.weight" => Part::HeadRows {
                file: file("ssm_beta.weight"),
                skip_rows: 0,
                head_rows: 1,
            },
            "linear_attn.in_proj_a.weight" => Part::HeadRows {
                file: file("ssm_alpha.weight"),
                skip_rows: 0,
                head_rows: 1,
            },
            "linear_attn.dt_bias" => Part::HeadRows {
                file: file("ssm_dt.bias"),
                skip_rows: 0,
                head_rows: 1,
            },
            "linear_attn.A_log" => Part::NegExpA(file("ssm_a")),
            "linear_attn.conv1d.weight" => Part::Conv(file("ssm_conv1d.weight")),
            "linear_attn.out_proj.weight" => Part::HeadCols(file("ssm_out.weight")),
            "linear_attn.norm.weight" => Part::Renamed(file("ssm_norm.weight")),
            _ => Part::Same,
        }
    }

    /// The file's value-head position of checkpoint value head `hv`.
    fn tiled(&self, hv: usize) -> usize {
        let r = self.shape.v_heads / self.shape.k_heads;
        (hv % r) * self.shape.k_heads + hv / r
    }

    fn need(&self, name: &str) -> Result<HostWeight<'a>> {
        self.file
            .get(name)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.file.source_name(),
                tensor: name.to_string(),
            })
    }

    fn bad(&self, w: &HostWeight<'_>, what: String) -> EngineError {
        EngineError::Config {
            source_name: self.file.source_name(),
            reason: format!("tensor '{}': {what}", w.name),
        }
    }

    /// Rows `skip_rows..` of `w` (whole rows, in any element type) put back in grouped order.
    fn untile_rows(
        &self,
        w: HostWeight<'a>,
        skip_rows: usize,
        head_rows: usize,
    ) -> Result<HostWeight<'a>> {
        let rows = w.shape.first().copied().unwrap_or(0);
        let v_rows = self.shape.v_heads * head_rows;
        if rows != skip_rows + v_rows || !w.bytes.len().is_multiple_of(rows.max(1)) {
            return Err(self.bad(
                &w,
                format!("{rows} rows where {} were expected", skip_rows + v_rows),
            ));
        }
        if self.shape.v_heads == self.shape.k_heads {
            return Ok(w);
        }
        let row = w.bytes.len() / rows;
        let head = head_rows * row;
        let mut out = Vec::with_capacity(w.bytes.len());
        out.extend_from_slice(&w.bytes[..skip_rows * row]);
        let v = &w.bytes[skip_rows * row..];
        for hv in 0..self.shape.v_heads {
            let p = self.tiled(hv);
            out.extend_from_slice(&v[p * head..(p + 1) * head]);
        }
        Ok(HostWeight {
            bytes: Cow::Owned(out),
            ..w
        })
    }

    /// `ssm_out`'s columns put back in grouped order: blocks moved within each row where the
    /// element type's blocks tile a head's columns, else the matrix dequantized to f32 first.
    fn untile_cols(&self, w: HostWeight<'a>) -> Result<HostWeight<'a>> {
        let sh = self.shape;
        let [rows, cols] = w.shape[..] else {
            return Err(self.bad(&w, format!("shape {:?} is not a matrix", w.shape)));
        };
        if cols != sh.v_heads * sh.v_dim {
            return Err(self.bad(
                &w,
                format!(
                    "{cols} columns where {} were expected",
                    sh.v_heads * sh.v_dim
                ),
            ));
        }
        if sh.v_heads == sh.k_heads {
            return Ok(w);
        }
        let block = w.dtype.block_len() as usize;
        let w = if block > 0 && sh.v_dim.is_multiple_of(block) {
            w
        } else {
            // K-quant super-blocks (256) straddle heads of 128 columns: the matrix becomes
            // f16 (llama.cpp's own float type for weights; a quarter of f32's bytes read per
            // token on top of the quantized ones).
            let v = w.dequantize()?;
            HostWeight {
                name: w.name,
                dtype: GgmlType::F16,
                shape: w.shape,
                bytes: Cow::Owned(
                    v.iter()
                        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                        .collect(),
                ),
            }
        };
        if !w.bytes.len().is_multiple_of(rows.max(1)) {
            return Err(self.bad(&w, "rows of unequal size".into()));
        }
        let row = w.bytes.len() / rows;
        let head = row / sh.v_heads;
        let mut out = Vec::with_capacity(w.bytes.len());
        for r in w.bytes.chunks_exact(row) {
            for hv in 0..sh.v_heads {
                let p = self.tiled(hv);
                out.extend_from_slice(&r[p * head..(p + 1) * head]);
            }
        }
        Ok(HostWeight {
            bytes: Cow::Owned(out),
            ..w
        })
    }

    fn f32s(name: String, shape: Vec<usize>, v: &[f32]) -> HostWeight<'a> {
        HostWeight {
            name,
            dtype: GgmlType::F32,
            shape,
            bytes: Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }
}

impl WeightSource for Qwen35Gguf<'_> {
    fn source_name(&self) -> String {
        self.file.source_name()
    }

    fn get(&self, name: &str) -> Result<Option<HostWeight<'_>>> {
        let sh = self.shape;
        let w = match self.part(name) {
            Part::Same => return self.file.get(name),
            Part::Renamed(file) => return self.file.get(&file),
            Part::OffsetNorm(file) => {
                let Some(w) = self.file.get(&file)? else {
                    return Ok(None);
                };
                let v: Vec<f32> = w.float_values("a norm")?.iter().map(|x| x - 1.0).collect();
                Self::f32s(w.name, w.shape, &v)
            }
            Part::HeadRows {
                file,
                skip_rows,
                head_rows,
            } => {
                let w = self.need(&file)?;
                // A vector is one row per element.
                let w = if w.shape.len() == 1 {
                    let v = w.float_values("a DeltaNet parameter")?;
                    Self::f32s(w.name, vec![v.len(), 1], &v)
                } else {
                    w
                };
                let one_d = !name.ends_with(".weight");
                let mut w = self.untile_rows(w, skip_rows, head_rows)?;
                if one_d {
                    w.shape = vec![sh.v_heads];
                }
                w
            }
            Part::HeadCols(file) => self.untile_cols(self.need(&file)?)?,
            Part::NegExpA(file) => {
                let w = self.need(&file)?;
                let a = w.float_values("ssm_a")?;
                if a.len() != sh.v_heads || a.iter().any(|&x| !(x < 0.0 && x.is_finite())) {
                    return Err(
                        self.bad(&w, format!("needs {} negative finite values", sh.v_heads))
                    );
                }
                let a_log: Vec<f32> = (0..sh.v_heads)
                    .map(|hv| (-a[self.tiled(hv)]).ln())
                    .collect();
                Self::f32s(w.name, vec![sh.v_heads], &a_log)
            }
            Part::Conv(file) => {
                let w = self.need(&file)?;
                let v = w.float_values("ssm_conv1d")?;
                let channels = sh.conv_dim();
                if v.len() != channels * sh.conv_kernel {
                    return Err(self.bad(
                        &w,
                        format!(
                            "shape {:?} is not [{channels}, {}]",
                            w.shape, sh.conv_kernel
                        ),
                    ));
                }
                let as_rows = Self::f32s(w.name, vec![channels, sh.conv_kernel], &v);
                let mut w = self.untile_rows(as_rows, 2 * sh.k_heads * sh.k_dim, sh.v_dim)?;
                w.shape = vec![channels, 1, sh.conv_kernel];
                w
            }
        };
        Ok(Some(w))
    }

    fn contains(&self, name: &str) -> bool {
        match self.part(name) {
            Part::Same => self.file.contains(name),
            Part::OffsetNorm(f)
            | Part::HeadRows { file: f, .. }
            | Part::HeadCols(f)
            | Part::NegExpA(f)
            | Part::Conv(f)
            | Part::Renamed(f) => self.file.contains(&f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiled_positions_invert_the_converters_reorder() {
        // llama.cpp: reshape(k, r, d), swap the first two axes: position j*k + g holds the
        // checkpoint's head g*r + j.
        let shape = DeltaShape {
            k_heads: 2,
            v_heads: 6,
            k_dim: 4,
            v_dim: 4,
            conv_kernel: 4,
        };
        struct Empty;
        impl WeightSource for Empty {
            fn source_name(&self) -> String {
                "empty".into()
            }
            fn get(&self, _: &str) -> Result<Option<HostWeight<'_>>> {
                Ok(None)
            }
            fn contains(&self, _: &str) -> bool {
                false
            }
        }
        let view = Qwen35Gguf::new(&Empty, shape);
        let (k, r) = (2, 3);
        let mut file_order = Vec::new();
        for j in 0..r {
            for g in 0..k {
                file_order.push(g * r + j);
            }
        }
        for hv in 0..6 {
            assert_eq!(file_order[view.tiled(hv)], hv);
        }
    }
}
