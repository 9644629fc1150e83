//! Rotary embeddings on MLX: one `fast::rope` call per tensor, every row its own batch
//! entry with its own position, so any mix of sequences and positions is one kernel.
use wick_mlx::{Array, RopeOffset, Stream};

use super::mlx_err;
use crate::backend::{RopeSpec, RopeStyle};
use crate::Result;

/// Positions and frequencies of one forward pass.
#[derive(Debug, Clone)]
pub struct MlxRope {
    /// Position of every row, int32 `[n]`.
    positions: Array,
    /// Periods `1 / inv_freq`, float32 `[dims / 2]`.
    periods: Array,
    rows: usize,
    dims: usize,
    traditional: bool,
    scale: f32,
    /// Cosines and sines are multiplied by this (YaRN, LongRoPE; 1 otherwise).
    attention_factor: f32,
}

impl MlxRope {
    pub(crate) fn new(positions: &[usize], spec: &RopeSpec) -> Result<Self> {
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let periods: Vec<f32> = spec.inv_freq.iter().map(|f| 1.0 / f).collect();
        Ok(MlxRope {
            positions: Array::from_slice(&pos, &[pos.len() as i32]).map_err(mlx_err)?,
            periods: Array::from_slice(&periods, &[periods.len() as i32]).map_err(mlx_err)?,
            rows: positions.len(),
            dims: spec.dims,
            traditional: spec.style == RopeStyle::Interleaved,
            scale: spec.position_scale,
            attention_factor: spec.attention_factor,
        })
    }

    /// Rotates `x` `[n, heads * head_dim]`.
    pub(crate) fn apply(&self, s: &Stream, x: &Array, heads: usize) -> Result<Array> {
        let shape = x.shape();
        let cols = shape.get(1).copied().unwrap_or(0) as usize;
        let head_dim = cols / heads.max(1);
        let x4 = s
            .reshape(x, &[self.rows as i32, heads as i32, 1, head_dim as i32])
            .map_err(mlx_err)?;
        let y = s
            .rope(
                &x4,
                self.dims as i32,
                self.traditional,
                0.0,
                self.scale,
                RopeOffset::PerBatch(&self.positions),
                Some(&self.periods),
            )
            .map_err(mlx_err)?;
        let y = self.attention_scaled(s, y, head_dim)?;
        s.reshape(&y, &[self.rows as i32, cols as i32])
            .map_err(mlx_err)
    }

    /// `y` `[n, heads, 1, head_dim]` with its rotated dimensions times the attention factor:
    /// `fast::rope` has no factor, and `factor · (x cos + x' sin)` is the same rotation with
    /// its cosines and sines scaled.
    fn attention_scaled(&self, s: &Stream, y: Array, head_dim: usize) -> Result<Array> {
        let f = self.attention_factor;
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
}
