//! Rotary position embeddings on host memory.
use crate::backend::{RopeSpec, RopeStyle};

/// Cosines and sines for each row of a batch.
#[derive(Debug, Clone)]
pub struct CpuRope {
    pub(crate) style: RopeStyle,
    pub(crate) dims: usize,
    /// `[rows][dims/2]`
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

impl CpuRope {
    pub(crate) fn new(positions: &[usize], spec: &RopeSpec) -> Self {
        let half = spec.dims / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let p = p as f64 * spec.position_scale as f64;
            for &f in &spec.inv_freq {
                let (s, c) = (p * f as f64).sin_cos();
                cos.push(c as f32 * spec.attention_factor);
                sin.push(s as f32 * spec.attention_factor);
            }
        }
        CpuRope {
            style: spec.style,
            dims: spec.dims,
            cos,
            sin,
        }
    }

    /// Angles where frequency `i` of row `r` turns with `positions[r][axes[i]]`.
    pub(crate) fn with_axes(positions: &[[usize; 3]], axes: &[u8], spec: &RopeSpec) -> Self {
        let half = spec.dims / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for p in positions {
            for (&f, &axis) in spec.inv_freq.iter().zip(axes) {
                let p = p[axis as usize] as f64 * spec.position_scale as f64;
                let (s, c) = (p * f as f64).sin_cos();
                cos.push(c as f32 * spec.attention_factor);
                sin.push(s as f32 * spec.attention_factor);
            }
        }
        CpuRope {
            style: spec.style,
            dims: spec.dims,
            cos,
            sin,
        }
    }

    /// Rotates `x` (`[rows][heads][head_dim]`) in place.
    pub(crate) fn apply(&self, x: &mut [f32], heads: usize) {
        let half = self.dims / 2;
        let rows = self.cos.len() / half.max(1);
        if rows == 0 {
            return;
        }
        let head_dim = x.len() / rows / heads;
        for (r, row) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let cos = &self.cos[r * half..(r + 1) * half];
            let sin = &self.sin[r * half..(r + 1) * half];
            for head in row.chunks_exact_mut(head_dim) {
                match self.style {
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = a * cos[i] - b * sin[i];
                            head[2 * i + 1] = a * sin[i] + b * cos[i];
                        }
                    }
                    RopeStyle::Neox => {
                        let (lo, hi) = head[..self.dims].split_at_mut(half);
                        for i in 0..half {
                            let (a, b) = (lo[i], hi[i]);
                            lo[i] = a * cos[i] - b * sin[i];
                            hi[i] = a * sin[i] + b * cos[i];
                        }
                    }
                }
            }
        }
    }
}
