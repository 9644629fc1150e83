//! The forward pass over a packed batch, keeping what the backward reads.
use rayon::prelude::*;
use wick_engine::adapters::Target;

use super::attention::{self, AttnShape};
use super::{rms_norm, sigmoid, Batch, Rotary};
use crate::base::BaseWeights;
use crate::error::{Result, TrainError};
use crate::linalg::{gemm, linear, Layout};
use crate::lora::{LoraPair, LoraParams};

/// LoRA factors applied in a pass, with their multiplier `s`.
#[derive(Debug, Clone, Copy)]
pub struct AdapterRef<'a> {
    /// The factors.
    pub params: &'a LoraParams,
    /// `s` of `y = W·x + s·B·A·x`.
    pub multiplier: f32,
}

/// One layer's saved activations.
#[derive(Debug)]
pub(super) struct LayerActs {
    pub x_in: Vec<f32>,
    pub r1: Vec<f32>,
    pub h1: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub probs: Vec<Vec<f32>>,
    pub attn: Vec<f32>,
    pub x_mid: Vec<f32>,
    pub r2: Vec<f32>,
    pub h2: Vec<f32>,
    pub g: Vec<f32>,
    pub u: Vec<f32>,
    pub act: Vec<f32>,
    /// `x·Aᵀ` of each adapted projection (`[rows, rank]`).
    pub xa: [Option<Vec<f32>>; 7],
}

/// Everything the backward of one pass needs.
#[derive(Debug)]
pub struct Activations {
    pub(super) layers: Vec<LayerActs>,
    pub(super) x_out: Vec<f32>,
    pub(super) rf: Vec<f32>,
    /// Softmax of the target rows' logits, `[targets, vocab]`.
    pub(super) probs: Vec<f32>,
}

/// The result of a forward pass: `log p(label)` per target, and the saved activations.
#[derive(Debug)]
pub struct Forward {
    /// Per `Batch::targets` entry.
    pub logp: Vec<f32>,
    /// For [`TrainDecoder::backward`].
    pub acts: Activations,
}

/// The training decoder over one frozen base.
#[derive(Debug)]
pub struct TrainDecoder<'a> {
    pub(super) base: &'a BaseWeights,
    pub(super) rotary: Rotary,
    pub(super) shape: AttnShape,
}

/// `x·Wᵀ (+ s·(x·Aᵀ)·Bᵀ)`; returns the output and `x·Aᵀ`.
pub(super) fn project(
    x: &[f32],
    n: usize,
    w: &[f32],
    out: usize,
    inp: usize,
    lora: Option<(&LoraPair, f32)>,
    rank: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut y = linear(x, n, w, out, inp);
    let xa = lora.map(|(p, s)| {
        let xa = linear(x, n, &p.a, rank, inp);
        gemm(
            n,
            out,
            rank,
            &xa,
            Layout::Plain,
            &p.b,
            Layout::Transposed,
            &mut y,
            true,
            s,
            true,
        );
        xa
    });
    (y, xa)
}

impl<'a> TrainDecoder<'a> {
    /// A decoder over `base` for sequences of at most `max_len` tokens.
    pub fn new(base: &'a BaseWeights, max_len: usize) -> TrainDecoder<'a> {
        let cfg = &base.cfg;
        let window = cfg.layer_windows.iter().flatten().copied().min();
        TrainDecoder {
            base,
            rotary: Rotary::new(cfg, max_len.max(1)),
            shape: AttnShape {
                heads: cfg.num_heads,
                kv_heads: cfg.num_kv_heads,
                hd: cfg.head_dim,
                scale: cfg.attn_scale,
                window,
            },
        }
    }

    /// The longest sequence the rotary tables cover.
    pub fn max_len(&self) -> usize {
        self.rotary.cos.len() / self.rotary.half.max(1)
    }

    fn check(&self, batch: &Batch) -> Result<()> {
        let vocab = self.base.cfg.vocab_size;
        if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(TrainError::Config(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        for w in batch.starts.windows(2) {
            if w[1] - w[0] > self.max_len() {
                return Err(TrainError::Config(format!(
                    "a sequence of {} tokens exceeds the trainer's {}",
                    w[1] - w[0],
                    self.max_len()
                )));
            }
        }
        Ok(())
    }

    /// The decoder stack up to the final norm: `(activations, normed hidden [rows, h])`.
    fn hidden(
        &self,
        adapter: Option<AdapterRef<'_>>,
        batch: &Batch,
    ) -> Result<(Activations, Vec<f32>)> {
        self.check(batch)?;
        let cfg = &self.base.cfg;
        let (n, h, f) = (batch.rows(), cfg.hidden_size, cfg.intermediate_size);
        let hd = cfg.head_dim;
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let rank = adapter.map_or(0, |a| a.params.rank);
        let eps = cfg.rms_eps;
        let mut x = Vec::with_capacity(n * h);
        for &t in &batch.tokens {
            x.extend_from_slice(&self.base.embed[t as usize * h..(t as usize + 1) * h]);
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, lw) in self.base.layers.iter().enumerate() {
            let slot = |t: Target| {
                adapter.and_then(|a| {
                    a.params.layers[l][t.index()]
                        .as_ref()
                        .map(|p| (p, a.multiplier))
                })
            };
            let (h1, r1) = rms_norm(&x, &lw.attn_norm, eps);
            let (mut q, xa_q) = project(&h1, n, &lw.wq, qd, h, slot(Target::Q), rank);
            let (mut k, xa_k) = project(&h1, n, &lw.wk, kvd, h, slot(Target::K), rank);
            let (v, xa_v) = project(&h1, n, &lw.wv, kvd, h, slot(Target::V), rank);
            self.rotary.apply(&mut q, qd, hd, &batch.starts, 1.0);
            self.rotary.apply(&mut k, kvd, hd, &batch.starts, 1.0);
            let (attn, probs) = attention::forward(self.shape, &q, &k, &v, &batch.starts);
            let (o, xa_o) = project(&attn, n, &lw.wo, h, qd, slot(Target::O), rank);
            let x_mid: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
            let (h2, r2) = rms_norm(&x_mid, &lw.ffn_norm, eps);
            let (g, xa_g) = project(&h2, n, &lw.wg, f, h, slot(Target::Gate), rank);
            let (u, xa_u) = project(&h2, n, &lw.wu, f, h, slot(Target::Up), rank);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&gv, &uv)| gv * sigmoid(gv) * uv)
                .collect();
            let (d, xa_d) = project(&act, n, &lw.wd, h, f, slot(Target::Down), rank);
            let x_next: Vec<f32> = x_mid.iter().zip(&d).map(|(a, b)| a + b).collect();
            layers.push(LayerActs {
                x_in: std::mem::replace(&mut x, x_next),
                r1,
                h1,
                q,
                k,
                v,
                probs,
                attn,
                x_mid,
                r2,
                h2,
                g,
                u,
                act,
                xa: [xa_q, xa_k, xa_v, xa_o, xa_g, xa_u, xa_d],
            });
        }
        let (hf, rf) = rms_norm(&x, &self.base.final_norm, eps);
        Ok((
            Activations {
                layers,
                x_out: x,
                rf,
                probs: Vec::new(),
            },
            hf,
        ))
    }

    /// Logits of `rows` of the normed hidden states `hf`, `[rows.len(), vocab]`.
    fn head_logits(&self, hf: &[f32], rows: impl Iterator<Item = usize>) -> Vec<f32> {
        let (h, vocab) = (self.base.cfg.hidden_size, self.base.cfg.vocab_size);
        let mut picked = Vec::new();
        for r in rows {
            picked.extend_from_slice(&hf[r * h..(r + 1) * h]);
        }
        linear(&picked, picked.len() / h, self.base.head(), vocab, h)
    }

    /// Every position's logits, `[rows, vocab]` (for parity tests and evaluation).
    pub fn logits(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Vec<f32>> {
        let (_, hf) = self.hidden(adapter, batch)?;
        Ok(self.head_logits(&hf, 0..batch.rows()))
    }

    /// The forward pass: `log p(label)` of every target, activations kept.
    pub fn forward(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Forward> {
        let (mut acts, hf) = self.hidden(adapter, batch)?;
        let vocab = self.base.cfg.vocab_size;
        let mut probs = self.head_logits(&hf, batch.targets.iter().map(|t| t.0));
        let logp: Vec<f32> = probs
            .par_chunks_exact_mut(vocab)
            .zip(&batch.targets)
            .map(|(z, &(_, label))| {
                let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = z.iter().map(|&v| f64::from((v - max).exp())).sum();
                let lse = max + sum.ln() as f32;
                let logp = z[label as usize] - lse;
                z.iter_mut().for_each(|v| *v = (*v - lse).exp());
                logp
            })
            .collect();
        acts.probs = probs;
        Ok(Forward { logp, acts })
    }

    /// `log p(label)` of every target without keeping activations (a reference policy).
    pub fn logp(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Vec<f32>> {
        Ok(self.forward(adapter, batch)?.logp)
    }
}
