//! The forward pass over a packed batch, keeping what the backward reads.
use rayon::prelude::*;
use wick_engine::adapters::Target;

use super::attention::{self, AttnShape};
use super::dropout::Dropout;
use super::{rms_norm, sigmoid, Batch, Rotary};
use crate::base::BaseWeights;
use crate::base::Matrix;
use crate::error::{Result, TrainError};
use crate::linalg::{gemm, linear, Layout};
use crate::lora::{LoraPair, LoraParams};

/// LoRA factors applied in a pass, with their multiplier `s` and, in training, the
/// pass's dropout.
#[derive(Debug, Clone, Copy)]
pub struct AdapterRef<'a> {
    /// The factors.
    pub params: &'a LoraParams,
    /// `s` of `y = W·x + s·B·A·x`.
    pub multiplier: f32,
    /// LoRA dropout on the adapter branch's input (`None`: off, as in evaluation).
    pub dropout: Option<Dropout>,
}

impl<'a> AdapterRef<'a> {
    /// `params` at multiplier `multiplier`, without dropout.
    pub fn new(params: &'a LoraParams, multiplier: f32) -> AdapterRef<'a> {
        AdapterRef {
            params,
            multiplier,
            dropout: None,
        }
    }

    /// The same adapter with `dropout` on its branch inputs.
    pub fn with_dropout(self, dropout: Option<Dropout>) -> AdapterRef<'a> {
        AdapterRef { dropout, ..self }
    }

    /// Projection `target` of `layer`, if adapted.
    pub(super) fn site(&self, layer: usize, target: Target) -> Option<LoraSite<'a>> {
        self.params.layers[layer][target.index()]
            .as_ref()
            .map(|pair| LoraSite {
                pair,
                s: self.multiplier,
                dropout: self.dropout,
                layer,
                slot: target.index(),
            })
    }
}

/// One adapted projection in a pass.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoraSite<'a> {
    pub pair: &'a LoraPair,
    pub s: f32,
    pub dropout: Option<Dropout>,
    pub layer: usize,
    pub slot: usize,
}

impl LoraSite<'_> {
    /// The adapter branch's input: `x`, or `drop(x)` under dropout.
    pub(super) fn input<'x>(&self, x: &'x [f32], width: usize) -> std::borrow::Cow<'x, [f32]> {
        match self.dropout {
            Some(d) => d.apply(x, width, self.layer, self.slot).into(),
            None => x.into(),
        }
    }
}

/// What a forward pass keeps for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every activation of every layer.
    All,
    /// Only each layer's input; the backward recomputes the rest one layer at a time
    /// (gradient checkpointing: memory of one layer instead of all, one more forward).
    Inputs,
    /// Nothing (no backward follows).
    Nothing,
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

/// One layer's part of [`Activations`].
#[derive(Debug)]
pub(super) enum Saved {
    /// Everything the backward reads.
    Full(Box<LayerActs>),
    /// The layer's input only, to recompute from.
    Input(Vec<f32>),
}

/// Everything the backward of one pass needs.
#[derive(Debug)]
pub struct Activations {
    pub(super) layers: Vec<Saved>,
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
    /// What a training forward keeps ([`Keep::All`] or, checkpointing, [`Keep::Inputs`]).
    pub(super) keep: Keep,
}

/// `x·Wᵀ (+ s·(drop(x)·Aᵀ)·Bᵀ)`; returns the output and `drop(x)·Aᵀ`.
pub(super) fn project(
    x: &[f32],
    n: usize,
    w: &Matrix,
    out: usize,
    inp: usize,
    lora: Option<LoraSite<'_>>,
    rank: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut y = linear(x, n, &w.values(), out, inp);
    let xa = lora.map(|site| {
        let (p, s) = (site.pair, site.s);
        let xa = linear(&site.input(x, inp), n, &p.a, rank, inp);
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
            keep: Keep::All,
        }
    }

    /// Gradient checkpointing: a training forward keeps only each layer's input and the
    /// backward recomputes the layer (same results, one more forward, far less memory).
    pub fn with_checkpointing(mut self, on: bool) -> TrainDecoder<'a> {
        self.keep = if on { Keep::Inputs } else { Keep::All };
        self
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
        keep: Keep,
    ) -> Result<(Activations, Vec<f32>)> {
        self.check(batch)?;
        let cfg = &self.base.cfg;
        let (n, h) = (batch.rows(), cfg.hidden_size);
        let eps = cfg.rms_eps;
        let mut x = Vec::with_capacity(n * h);
        for &t in &batch.tokens {
            x.extend_from_slice(&self.base.embed[t as usize * h..(t as usize + 1) * h]);
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..self.base.layers.len() {
            let (acts, x_next) = self.layer_forward(l, x, adapter, batch);
            layers.push(match keep {
                Keep::All => Saved::Full(Box::new(acts)),
                Keep::Inputs => Saved::Input(acts.x_in),
                Keep::Nothing => Saved::Input(Vec::new()),
            });
            x = x_next;
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

    /// Layer `l` on its input `x`: its activations (which own `x`) and its output.
    pub(super) fn layer_forward(
        &self,
        l: usize,
        x: Vec<f32>,
        adapter: Option<AdapterRef<'_>>,
        batch: &Batch,
    ) -> (LayerActs, Vec<f32>) {
        let cfg = &self.base.cfg;
        let lw = &self.base.layers[l];
        let (n, h, f) = (batch.rows(), cfg.hidden_size, cfg.intermediate_size);
        let hd = cfg.head_dim;
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let rank = adapter.map_or(0, |a| a.params.rank);
        let eps = cfg.rms_eps;
        let slot = |t: Target| adapter.and_then(|a| a.site(l, t));
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
        let acts = LayerActs {
            x_in: x,
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
        };
        (acts, x_next)
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
        let (_, hf) = self.hidden(adapter, batch, Keep::Nothing)?;
        Ok(self.head_logits(&hf, 0..batch.rows()))
    }

    /// The forward pass: `log p(label)` of every target, activations kept.
    pub fn forward(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Forward> {
        self.forward_keeping(adapter, batch, self.keep)
    }

    /// [`Self::forward`] keeping `keep`.
    pub fn forward_keeping(
        &self,
        adapter: Option<AdapterRef<'_>>,
        batch: &Batch,
        keep: Keep,
    ) -> Result<Forward> {
        let (mut acts, hf) = self.hidden(adapter, batch, keep)?;
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
        Ok(self.forward_keeping(adapter, batch, Keep::Nothing)?.logp)
    }
}
