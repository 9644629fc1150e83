//! The training forward and its hand-written backward over the Llama decoder, f32 on
//! the host: pre-norm RMS, rotary (`rotate_half`), grouped-query causal attention,
//! SwiGLU, with a LoRA pair beside any of the seven projections.
//!
//! The math is the engine's decoder (`wick_engine::models::decoder`) for the plain
//! Llama configuration, written out so every activation the backward needs is kept;
//! `tests/engine_parity.rs` holds the two to 1e-4 on the same weights. Only the LoRA
//! factors get gradients: the base is frozen, so a linear layer's backward is the input
//! gradient `dy·W` plus the two small factor products.
//!
//! - `forward.rs`: the pass over a packed batch, keeping [`Activations`];
//! - `backward.rs`: the reverse pass from per-target log-probability gradients;
//! - `attention.rs`: causal attention of one sequence and its backward;
//! - `dropout.rs`: LoRA dropout masks drawn from a key, so a recompute draws them again;
//! - this file: [`Batch`], rotary tables, RMS norm.
mod attention;
mod backward;
mod dropout;
mod forward;

pub use self::dropout::Dropout;
pub use self::forward::{Activations, AdapterRef, Forward, Keep, TrainDecoder};

use wick_engine::config::ModelConfig;

/// Sequences packed row after row (each attends only to itself, positions restart at 0),
/// and the rows whose next-token log-probability the loss reads.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// Every token, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Start row of each sequence, plus the total at the end.
    pub starts: Vec<usize>,
    /// `(row, label)`: the loss reads `log p(label | tokens up to row)`.
    pub targets: Vec<(usize, u32)>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch {
            tokens: Vec::new(),
            starts: vec![0],
            targets: Vec::new(),
        }
    }

    /// Appends a sequence; `labeled[t]` says whether token `t` is predicted by the loss
    /// (token 0 never is: nothing precedes it). Returns the index of the new sequence's
    /// first target.
    pub fn push(&mut self, tokens: &[u32], labeled: &[bool]) -> usize {
        let base = self.tokens.len();
        let first = self.targets.len();
        self.tokens.extend_from_slice(tokens);
        for (t, &token) in tokens.iter().enumerate().skip(1) {
            if labeled.get(t).copied().unwrap_or(false) {
                self.targets.push((base + t - 1, token));
            }
        }
        self.starts.push(self.tokens.len());
        first
    }

    /// Rows in all.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Sequences.
    pub fn sequences(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }
}

/// Cosines and sines of every position up to the longest sequence (`[pos][rd/2]`).
#[derive(Debug, Clone)]
pub(crate) struct Rotary {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half: usize,
}

impl Rotary {
    pub(crate) fn new(cfg: &ModelConfig, positions: usize) -> Rotary {
        let spec = cfg.rope.spec(cfg.rope_style, cfg.rotary_dims);
        let half = cfg.rotary_dims / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            let pos = p as f32 * spec.position_scale;
            for &f in &spec.inv_freq[..half] {
                let angle = f64::from(pos * f);
                cos.push(angle.cos() as f32 * spec.attention_factor);
                sin.push(angle.sin() as f32 * spec.attention_factor);
            }
        }
        Rotary { cos, sin, half }
    }

    /// Rotates the first `2·half` dims of each `hd`-wide head of the packed rows `x`
    /// (`[rows, width]`) in place; `sign` = 1 forward, −1 for the backward (the
    /// transpose of a rotation).
    pub(crate) fn apply(
        &self,
        x: &mut [f32],
        width: usize,
        hd: usize,
        starts: &[usize],
        sign: f32,
    ) {
        let half = self.half;
        for w in starts.windows(2) {
            for (pos, row) in (w[0]..w[1]).enumerate() {
                let c = &self.cos[pos * half..(pos + 1) * half];
                let s = &self.sin[pos * half..(pos + 1) * half];
                let r = &mut x[row * width..(row + 1) * width];
                for head in r.chunks_exact_mut(hd) {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        let si = sign * s[i];
                        head[i] = a * c[i] - b * si;
                        head[i + half] = b * c[i] + a * si;
                    }
                }
            }
        }
    }
}

/// RMS norm of each `h`-wide row: `y = x · r · w` with `r = 1/√(mean(x²) + eps)`;
/// returns `(y, r)`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let h = w.len();
    let mut y = vec![0.0; x.len()];
    let mut inv = Vec::with_capacity(x.len() / h);
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        let ms: f32 = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
        inv.push(r);
    }
    (y, inv)
}

/// Adds the input gradient of [`rms_norm`] for output gradient `dy` into `dx`:
/// `dx = r·g − x·r³·mean(g·x)` with `g = dy·w`.
pub(crate) fn rms_norm_back(x: &[f32], w: &[f32], inv: &[f32], dy: &[f32], dx: &mut [f32]) {
    let h = w.len();
    for (((xr, dyr), dxr), &r) in x
        .chunks_exact(h)
        .zip(dy.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
        .zip(inv)
    {
        let dot: f32 = xr
            .iter()
            .zip(dyr)
            .zip(w)
            .map(|((&xv, &d), &g)| xv * d * g)
            .sum();
        let k = r * r * r * dot / h as f32;
        for (((o, &xv), &d), &g) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
            *o += r * d * g - xv * k;
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let x = [0.3f32, -1.2, 0.7, 2.0];
        let w = [1.0f32, 0.5, -0.3, 2.0];
        let dy = [0.1f32, -0.4, 0.2, 0.3];
        let (_, inv) = rms_norm(&x, &w, 1e-5);
        let mut dx = vec![0.0; 4];
        rms_norm_back(&x, &w, &inv, &dy, &mut dx);
        for i in 0..4 {
            let f = |d: f32| {
                let mut xp = x;
                xp[i] += d;
                let (y, _) = rms_norm(&xp, &w, 1e-5);
                y.iter()
                    .zip(&dy)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>()
            };
            let num = (f(1e-3) - f(-1e-3)) / 2e-3;
            assert!(
                (num - f64::from(dx[i])).abs() < 1e-3,
                "{i}: {num} vs {}",
                dx[i]
            );
        }
    }
}
