//! Rotary embeddings on MLX. One position a row: one `fast::rope` call per tensor, every
//! row its own batch entry with its own position, so any mix of sequences and positions is
//! one kernel. Several position components a row (M-RoPE, a vision tower's 2-D rotary),
//! which `fast::rope` cannot take: cosines and sines computed on the host in f64, as the
//! other backends do, and the halves rotated with element-wise ops.
use wick_mlx::{Array, RopeOffset, Stream};

use super::mlx_err;
use crate::backend::candle::CpuRope;
use crate::backend::{RopeSpec, RopeStyle};
use crate::{EngineError, Result};

/// Positions and frequencies of one forward pass.
#[derive(Debug, Clone)]
pub struct MlxRope {
    angles: Angles,
    rows: usize,
    dims: usize,
}

#[derive(Debug, Clone)]
enum Angles {
    /// One position a row, for `fast::rope`.
    Positions {
        /// Position of every row, int32 `[n]`.
        positions: Array,
        /// Periods `1 / inv_freq`, float32 `[dims / 2]`.
        periods: Array,
        traditional: bool,
        scale: f32,
        /// Cosines and sines are multiplied by this (YaRN, LongRoPE; 1 otherwise).
        attention_factor: f32,
    },
    /// Every row's cosines, sines and negated sines, float32 `[n, 1, dims / 2]`, the
    /// attention factor applied (halves paired, Hugging Face's `rotate_half`).
    Tables {
        cos: Array,
        sin: Array,
        neg_sin: Array,
    },
}

impl MlxRope {
    pub(crate) fn new(positions: &[usize], spec: &RopeSpec) -> Result<Self> {
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let periods: Vec<f32> = spec.inv_freq.iter().map(|f| 1.0 / f).collect();
        Ok(MlxRope {
            angles: Angles::Positions {
                positions: Array::from_slice(&pos, &[pos.len() as i32]).map_err(mlx_err)?,
                periods: Array::from_slice(&periods, &[periods.len() as i32]).map_err(mlx_err)?,
                traditional: spec.style == RopeStyle::Interleaved,
                scale: spec.position_scale,
                attention_factor: spec.attention_factor,
            },
            rows: positions.len(),
            dims: spec.dims,
        })
    }

    /// Frequency `i` of row `r` turns with component `axes[i]` of `positions[r]`.
    pub(crate) fn with_axes(
        positions: &[[usize; 3]],
        axes: &[u8],
        spec: &RopeSpec,
    ) -> Result<Self> {
        let half = spec.dims / 2;
        if spec.inv_freq.len() != half || axes.len() != half || axes.iter().any(|&a| a > 2) {
            return Err(EngineError::InvalidInput(format!(
                "{} rotary axes (each 0..=2) for {} frequencies of {} dimensions",
                axes.len(),
                spec.inv_freq.len(),
                spec.dims
            )));
        }
        if spec.style != RopeStyle::Neox {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: "multimodal rotary positions pair halves of a head (rotate_half) only"
                    .into(),
            });
        }
        // The CPU backend's tables, computed the same way on every backend.
        let CpuRope { cos, sin, .. } = CpuRope::with_axes(positions, axes, spec);
        let rows = positions.len();
        let neg_sin: Vec<f32> = sin.iter().map(|s| -s).collect();
        let shape = [rows as i32, 1, half as i32];
        let table = |v: &[f32]| Array::from_slice(v, &shape).map_err(mlx_err);
        Ok(MlxRope {
            angles: Angles::Tables {
                cos: table(&cos)?,
                sin: table(&sin)?,
                neg_sin: table(&neg_sin)?,
            },
            rows,
            dims: spec.dims,
        })
    }

    /// Rotates `x` `[n, heads * head_dim]`.
    pub(crate) fn apply(&self, s: &Stream, x: &Array, heads: usize) -> Result<Array> {
        let shape = x.shape();
        let cols = shape.get(1).copied().unwrap_or(0) as usize;
        let head_dim = cols / heads.max(1);
        if shape.first().copied() != Some(self.rows as i32)
            || heads == 0
            || !cols.is_multiple_of(heads)
            || self.dims > head_dim
        {
            return Err(EngineError::Backend {
                backend: "mlx",
                message: format!(
                    "rope: a table of {} rows and {} dimensions for {shape:?} in {heads} heads",
                    self.rows, self.dims
                ),
            });
        }
        let y = match &self.angles {
            Angles::Positions {
                positions,
                periods,
                traditional,
                scale,
                attention_factor,
            } => {
                let x4 = s
                    .reshape(x, &[self.rows as i32, heads as i32, 1, head_dim as i32])
                    .map_err(mlx_err)?;
                let y = s
                    .rope(
                        &x4,
                        self.dims as i32,
                        *traditional,
                        0.0,
                        *scale,
                        RopeOffset::PerBatch(positions),
                        Some(periods),
                    )
                    .map_err(mlx_err)?;
                self.attention_scaled(s, y, head_dim, *attention_factor)?
            }
            Angles::Tables { cos, sin, neg_sin } => {
                self.rotate_halves(s, x, heads, head_dim, [cos, sin, neg_sin])?
            }
        };
        s.reshape(&y, &[self.rows as i32, cols as i32])
            .map_err(mlx_err)
    }

    /// `y` `[n, heads, 1, head_dim]` with its rotated dimensions times the attention factor:
    /// `fast::rope` has no factor, and `factor · (x cos + x' sin)` is the same rotation with
    /// its cosines and sines scaled.
    fn attention_scaled(&self, s: &Stream, y: Array, head_dim: usize, f: f32) -> Result<Array> {
        if f == 1.0 {
            return Ok(y);
        }
        if self.dims >= head_dim {
            return s.scale(&y, f).map_err(mlx_err);
        }
        // Partial rotary: the dimensions past `dims` pass through unscaled.
        let factors: Vec<f32> = (0..head_dim)
            .map(|i| if i < self.dims { f } else { 1.0 })
            .collect();
        let factors = Array::from_slice(&factors, &[head_dim as i32]).map_err(mlx_err)?;
        let factors = s.astype(&factors, y.dtype()).map_err(mlx_err)?;
        s.multiply(&y, &factors).map_err(mlx_err)
    }

    /// `(x₁ cos − x₂ sin, x₂ cos + x₁ sin)` for the halves `x₁`, `x₂` of each head's first
    /// `dims` values; the rest pass through. Returns `[n, heads, head_dim]`.
    fn rotate_halves(
        &self,
        s: &Stream,
        x: &Array,
        heads: usize,
        head_dim: usize,
        [cos, sin, neg_sin]: [&Array; 3],
    ) -> Result<Array> {
        let (n, h, half) = (self.rows as i32, heads as i32, (self.dims / 2) as i32);
        let x3 = s.reshape(x, &[n, h, head_dim as i32]).map_err(mlx_err)?;
        let part = |from: i32, to: i32| s.slice(&x3, &[0, 0, from], &[n, h, to]).map_err(mlx_err);
        let (x1, x2) = (part(0, half)?, part(half, 2 * half)?);
        let dtype = x.dtype();
        let cast = |t: &Array| s.astype(t, dtype).map_err(mlx_err);
        let (cos, sin, neg_sin) = (cast(cos)?, cast(sin)?, cast(neg_sin)?);
        let mul = |a: &Array, b: &Array| s.multiply(a, b).map_err(mlx_err);
        let y1 = s
            .add(&mul(&x1, &cos)?, &mul(&x2, &neg_sin)?)
            .map_err(mlx_err)?;
        let y2 = s.add(&mul(&x2, &cos)?, &mul(&x1, &sin)?).map_err(mlx_err)?;
        if 2 * half as usize == head_dim {
            return s.concatenate(&[&y1, &y2], 2).map_err(mlx_err);
        }
        let rest = part(2 * half, head_dim as i32)?;
        s.concatenate(&[&y1, &y2, &rest], 2).map_err(mlx_err)
    }
}
