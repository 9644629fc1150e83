//! The tape and the backward rule of each op it records.
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::attention::{self, AttnShape};
use super::deltanet::{self, Mixer, Segment};
use super::dropout::Dropout;
use super::products::{linear_back_input, linear_back_weight};
use super::{activate, ParamGrads, Stored, TapeRope};
use crate::backend::Activation;
use crate::Result;

/// One recorded op: what its backward needs. Inputs are node ids; `None` where the input
/// depends on no parameter (no gradient flows there).
#[derive(Debug)]
pub(super) enum Op {
    /// `y = x·Wᵀ (+ bias)`; `x_val` kept where `W` is a parameter (its gradient `dyᵀ·x`).
    Linear {
        x: Option<usize>,
        x_val: Option<Arc<Vec<f32>>>,
        w: Arc<Stored>,
        n: usize,
        inp: usize,
        out: usize,
    },
    Add {
        a: Option<usize>,
        b: Option<usize>,
    },
    /// `y + x·Wᵀ` (a LoRA branch's `B` product added to the base output): a [`Op::Linear`]
    /// whose output gradient also flows to `y` unchanged.
    LinearAdd {
        y: Option<usize>,
        x: Option<usize>,
        x_val: Option<Arc<Vec<f32>>>,
        w: Arc<Stored>,
        n: usize,
        inp: usize,
        out: usize,
    },
    Scale {
        x: usize,
        s: f32,
    },
    /// RMS norm in groups of `w.len()`; `inv` the reciprocal RMS of each group.
    RmsNorm {
        x: usize,
        x_val: Arc<Vec<f32>>,
        w: Arc<Vec<f32>>,
        inv: Vec<f32>,
    },
    /// LayerNorm in groups of `w.len()` (its bias, frozen, has no backward part);
    /// `stats` the mean and reciprocal standard deviation of each group.
    LayerNorm {
        x: usize,
        x_val: Arc<Vec<f32>>,
        w: Arc<Vec<f32>>,
        stats: Vec<(f32, f32)>,
    },
    /// An activation outside a gated MLP, of the input values `x_val`.
    Activation {
        x: usize,
        x_val: Arc<Vec<f32>>,
        act: Activation,
    },
    /// Columns `at..at + width` of an input `cols` wide.
    Columns {
        x: usize,
        cols: usize,
        at: usize,
        width: usize,
    },
    Glu {
        gate: Option<usize>,
        up: Option<usize>,
        g: Arc<Vec<f32>>,
        u: Arc<Vec<f32>>,
        act: Activation,
    },
    Softcap {
        x: usize,
        y: Arc<Vec<f32>>,
        cap: f32,
    },
    Rope {
        x: usize,
        heads: usize,
        table: Arc<TapeRope>,
    },
    Attention {
        q: Option<usize>,
        k: Option<usize>,
        v: Option<usize>,
        q_val: Arc<Vec<f32>>,
        k_val: Arc<Vec<f32>>,
        v_val: Arc<Vec<f32>>,
        probs: Vec<Vec<f32>>,
        segments: Vec<Range<usize>>,
        shape: AttnShape,
        rows: usize,
    },
    SelectRows {
        x: usize,
        rows: Vec<usize>,
        src_len: usize,
        cols: usize,
    },
    AddRows {
        y: Option<usize>,
        d: Option<usize>,
        rows: Vec<usize>,
        cols: usize,
    },
    /// `log p(label)` of each row of `x` through the output head
    /// ([`super::TapeBackend::label_log_probs`]); `dx` `[rows, cols]` holds each
    /// log-probability's gradient with respect to its row.
    LabelLogProb {
        x: usize,
        dx: Vec<f32>,
        cols: usize,
    },
    /// Mixture-of-experts routing weights `[rows, k]` from the router's logits
    /// `[rows, n]`: `w = scale[e]·p[e] / Σ_top p`, `p` the softmax (`probs`), `experts`
    /// the picked expert of each slot.
    RouteWeights {
        logits: usize,
        probs: Vec<f32>,
        experts: Vec<usize>,
        scale: Vec<f32>,
        n: usize,
        k: usize,
    },
    /// Row `i` of `y` times value `slots[i]` of `w`.
    WeightedRows {
        y: Option<usize>,
        w: Option<usize>,
        y_val: Arc<Vec<f32>>,
        w_val: Arc<Vec<f32>>,
        slots: Vec<usize>,
        cols: usize,
    },
    /// A gated DeltaNet layer's mixer ([`deltanet`]) of the projections `qkv`, `z`, `b`
    /// and `a` (their values in `vals`, that order), each sequence of `segments` from its
    /// starting state.
    DeltaNet {
        inputs: [Option<usize>; 4],
        vals: [Arc<Vec<f32>>; 4],
        mixer: Box<Mixer>,
        segments: Vec<Segment>,
    },
    /// `x · σ(gate)` elementwise.
    SigmoidGate {
        x: Option<usize>,
        gate: Option<usize>,
        x_val: Arc<Vec<f32>>,
        gate_val: Arc<Vec<f32>>,
    },
    /// The input of a recorded span, whose gradient is returned under `id`.
    Input {
        id: usize,
    },
    /// LoRA dropout of a branch input (`[_, width]`).
    Dropout {
        x: usize,
        d: Dropout,
        layer: usize,
        slot: usize,
        width: usize,
    },
}

/// A recorded op and the length of its output.
#[derive(Debug)]
pub(super) struct Node {
    pub(super) op: Op,
    pub(super) len: usize,
}

/// The ops of the pass being recorded.
#[derive(Debug)]
pub(super) struct Tape {
    pub(super) nodes: Vec<Node>,
    pub(super) recording: bool,
    /// The most nodes held at once since it was last read.
    pub(super) peak: usize,
}

impl Default for Tape {
    fn default() -> Self {
        Tape {
            nodes: Vec::new(),
            recording: true,
            peak: 0,
        }
    }
}

/// RMS norm of each `w.len()`-wide group: `y = x · r · w` with `r = 1/√(mean(x²) + eps)`;
/// returns `(y, r)`.
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let h = w.len();
    let mut y = vec![0.0; x.len()];
    let inv = y
        .par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .with_min_len(16)
        .map(|(yr, xr)| {
            let ms: f32 = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * r * g;
            }
            r
        })
        .collect();
    (y, inv)
}

/// The input gradient of [`rms_norm`] for output gradient `dy`:
/// `dx = r·g − x·r³·mean(g·x)` with `g = dy·w`.
fn rms_norm_back(x: &[f32], w: &[f32], inv: &[f32], dy: &[f32]) -> Vec<f32> {
    let h = w.len();
    let mut dx = vec![0.0; x.len()];
    dx.par_chunks_mut(h * 64)
        .zip(x.par_chunks(h * 64))
        .zip(dy.par_chunks(h * 64))
        .zip(inv.par_chunks(64))
        .for_each(|(((dxc, xc), dyc), invc)| {
            for (((dxr, xr), dyr), &r) in dxc
                .chunks_exact_mut(h)
                .zip(xc.chunks_exact(h))
                .zip(dyc.chunks_exact(h))
                .zip(invc)
            {
                let dot: f32 = xr
                    .iter()
                    .zip(dyr)
                    .zip(w)
                    .map(|((&xv, &d), &g)| xv * d * g)
                    .sum();
                let k = r * r * r * dot / h as f32;
                for (((o, &xv), &d), &g) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
                    *o = r * d * g - xv * k;
                }
            }
        });
    dx
}

/// LayerNorm of each `w.len()`-wide group: `y = (x − μ)·r·w + b` with
/// `r = 1/√(var(x) + eps)`, the statistics in f64 as the CPU backend takes them; returns
/// `(y, [(μ, r)])`.
pub(super) fn layer_norm(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
) -> (Vec<f32>, Vec<(f32, f32)>) {
    let h = w.len();
    let mut y = vec![0.0; x.len()];
    let mut stats = Vec::with_capacity(x.len() / h);
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / h as f64;
        let var = xr
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / h as f64;
        let r = 1.0 / (var + f64::from(eps)).sqrt();
        for (i, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
            let bias = b.map_or(0.0, |b| f64::from(b[i]));
            *o = ((f64::from(v) - mean) * r * f64::from(w[i]) + bias) as f32;
        }
        stats.push((mean as f32, r as f32));
    }
    (y, stats)
}

/// The input gradient of [`layer_norm`] for output gradient `dy`, with `x̂ = (x − μ)·r`
/// and `g = dy·w`: `dx = r·(g − mean(g) − x̂·mean(g·x̂))`.
fn layer_norm_back(x: &[f32], w: &[f32], stats: &[(f32, f32)], dy: &[f32]) -> Vec<f32> {
    let h = w.len();
    let mut dx = vec![0.0; x.len()];
    dx.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .zip(dy.par_chunks(h))
        .zip(stats.par_iter())
        .for_each(|(((dxr, xr), dyr), &(mean, r))| {
            let (mut sum_g, mut sum_gx) = (0.0f32, 0.0f32);
            for ((&xv, &d), &wv) in xr.iter().zip(dyr).zip(w) {
                let g = d * wv;
                sum_g += g;
                sum_gx += g * (xv - mean) * r;
            }
            let (mg, mgx) = (sum_g / h as f32, sum_gx / h as f32);
            for (((o, &xv), &d), &wv) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
                let xhat = (xv - mean) * r;
                *o = r * (d * wv - mg - xhat * mgx);
            }
        });
    dx
}

/// The logits' gradient of the routing weights `w_j = scale[e_j]·p[e_j] / S`, `S` the sum
/// of the picked experts' probabilities, for the weights' gradient `dw` `[rows, k]`: to the
/// probabilities `dp[e_j] = dw_j·scale[e_j]/S − Σ_i dw_i·scale[e_i]·p[e_i] / S²` (0 for the
/// experts not picked), then through the softmax `dl = p ⊙ (dp − Σ p·dp)`.
fn route_weights_back(
    probs: &[f32],
    experts: &[usize],
    scale: &[f32],
    n: usize,
    k: usize,
    dw: &[f32],
) -> Vec<f32> {
    let mut dl = vec![0.0; probs.len()];
    let mut dp = vec![0.0f32; n];
    for (((p, e), d), out) in probs
        .chunks_exact(n.max(1))
        .zip(experts.chunks_exact(k.max(1)))
        .zip(dw.chunks_exact(k.max(1)))
        .zip(dl.chunks_exact_mut(n.max(1)))
    {
        let s: f32 = e.iter().map(|&j| p[j]).sum();
        let mixed: f32 = e
            .iter()
            .zip(d)
            .map(|(&j, &dj)| dj * scale[j] * p[j])
            .sum::<f32>()
            / (s * s);
        dp.fill(0.0);
        for (&j, &dj) in e.iter().zip(d) {
            dp[j] += dj * scale[j] / s - mixed;
        }
        let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for ((o, &pv), &dv) in out.iter_mut().zip(p).zip(&dp) {
            *o = pv * (dv - dot);
        }
    }
    dl
}

/// Adds `g` into node `id`'s gradient.
fn accumulate(grads: &mut [Option<Vec<f32>>], id: usize, g: Vec<f32>) {
    match &mut grads[id] {
        Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
        slot @ None => *slot = Some(g),
    }
}

fn add_param(params: &mut ParamGrads, id: usize, g: Vec<f32>) {
    match params.get_mut(&id) {
        Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
        None => {
            params.insert(id, g);
        }
    }
}

/// The backward of `x·Wᵀ` for output gradient `g`: `W`'s gradient where it is a
/// parameter (from the saved input `x_val`), and `x`'s, into its gradient where another
/// consumer started it (no buffer to zero and add afterwards).
#[allow(clippy::too_many_arguments)]
fn linear_back(
    grads: &mut [Option<Vec<f32>>],
    params: &mut ParamGrads,
    g: &[f32],
    x: Option<usize>,
    x_val: Option<&Vec<f32>>,
    w: &Stored,
    n: usize,
    inp: usize,
    out: usize,
) -> Result<()> {
    if let (Stored::Param { id: pid, .. }, Some(xv)) = (w, x_val) {
        let mut dw = vec![0.0; out * inp];
        linear_back_weight(g, n, out, xv, inp, &mut dw, 1.0);
        add_param(params, *pid, dw);
    }
    if let Some(x) = x {
        let w = w.values()?;
        match &mut grads[x] {
            Some(acc) => linear_back_input(g, n, &w, out, inp, acc, 1.0),
            slot @ None => {
                let mut dx = vec![0.0; n * inp];
                linear_back_input(g, n, &w, out, inp, &mut dx, 1.0);
                *slot = Some(dx);
            }
        }
    }
    Ok(())
}

/// Walks `nodes` back from the outputs of `seeds` (each node with its gradient; a node
/// seeded twice gets the sum), returning the parameters' gradients. Each node's saved
/// values are dropped once its rule has run.
pub(super) fn run(mut nodes: Vec<Node>, seeds: Vec<(usize, Vec<f32>)>) -> Result<ParamGrads> {
    let mut grads: Vec<Option<Vec<f32>>> = (0..nodes.len()).map(|_| None).collect();
    let mut last = 0;
    for (out, seed) in seeds {
        last = last.max(out + 1);
        accumulate(&mut grads, out, seed);
    }
    let mut params = ParamGrads::new();
    nodes.truncate(last);
    while let Some(node) = nodes.pop() {
        let id = nodes.len();
        let Some(g) = grads[id].take() else {
            continue;
        };
        debug_assert_eq!(g.len(), node.len);
        match node.op {
            Op::Linear {
                x,
                x_val,
                w,
                n,
                inp,
                out,
            } => linear_back(
                &mut grads,
                &mut params,
                &g,
                x,
                x_val.as_deref(),
                &w,
                n,
                inp,
                out,
            )?,
            Op::LinearAdd {
                y,
                x,
                x_val,
                w,
                n,
                inp,
                out,
            } => {
                linear_back(
                    &mut grads,
                    &mut params,
                    &g,
                    x,
                    x_val.as_deref(),
                    &w,
                    n,
                    inp,
                    out,
                )?;
                if let Some(y) = y {
                    accumulate(&mut grads, y, g);
                }
            }
            Op::Add { a, b } => match (a, b) {
                (Some(a), Some(b)) => {
                    accumulate(&mut grads, a, g.clone());
                    accumulate(&mut grads, b, g);
                }
                (Some(x), None) | (None, Some(x)) => accumulate(&mut grads, x, g),
                (None, None) => {}
            },
            Op::Scale { x, s } => {
                let mut g = g;
                g.iter_mut().for_each(|v| *v *= s);
                accumulate(&mut grads, x, g);
            }
            Op::RmsNorm { x, x_val, w, inv } => {
                accumulate(&mut grads, x, rms_norm_back(&x_val, &w, &inv, &g));
            }
            Op::LayerNorm { x, x_val, w, stats } => {
                accumulate(&mut grads, x, layer_norm_back(&x_val, &w, &stats, &g));
            }
            Op::Activation { x, x_val, act } => {
                let dx = g
                    .par_iter()
                    .zip(x_val.par_iter())
                    .map(|(&d, &v)| d * activate(act, v).1)
                    .collect();
                accumulate(&mut grads, x, dx);
            }
            Op::Columns { x, cols, at, width } => {
                let rows = g.len() / width.max(1);
                let mut dx = vec![0.0; rows * cols];
                for (dst, src) in dx.chunks_exact_mut(cols).zip(g.chunks_exact(width.max(1))) {
                    dst[at..at + width].copy_from_slice(src);
                }
                accumulate(&mut grads, x, dx);
            }
            Op::Glu {
                gate,
                up,
                g: gv,
                u,
                act,
            } => {
                let (dg, du): (Vec<f32>, Vec<f32>) = g
                    .par_iter()
                    .zip(gv.par_iter())
                    .zip(u.par_iter())
                    .map(|((&d, &gx), &ux)| {
                        let (a, da) = activate(act, gx);
                        (d * ux * da, d * a)
                    })
                    .unzip();
                if let Some(gate) = gate {
                    accumulate(&mut grads, gate, dg);
                }
                if let Some(up) = up {
                    accumulate(&mut grads, up, du);
                }
            }
            Op::Softcap { x, y, cap } => {
                let dx = g
                    .iter()
                    .zip(y.iter())
                    .map(|(&d, &yv)| {
                        let t = yv / cap;
                        d * (1.0 - t * t)
                    })
                    .collect();
                accumulate(&mut grads, x, dx);
            }
            Op::Rope { x, heads, table } => {
                let mut dx = g;
                table.back.apply(&mut dx, heads);
                accumulate(&mut grads, x, dx);
            }
            Op::Attention {
                q,
                k,
                v,
                q_val,
                k_val,
                v_val,
                probs,
                segments,
                shape,
                rows,
            } => {
                let (dq, dk, dv) =
                    attention::backward(shape, &q_val, &k_val, &v_val, &probs, &g, &segments, rows);
                for (node, d) in [(q, dq), (k, dk), (v, dv)] {
                    if let Some(node) = node {
                        accumulate(&mut grads, node, d);
                    }
                }
            }
            Op::SelectRows {
                x,
                rows,
                src_len,
                cols,
            } => {
                let mut dx = vec![0.0; src_len];
                for (&r, src) in rows.iter().zip(g.chunks_exact(cols.max(1))) {
                    dx[r * cols..(r + 1) * cols]
                        .iter_mut()
                        .zip(src)
                        .for_each(|(a, b)| *a += b);
                }
                accumulate(&mut grads, x, dx);
            }
            Op::AddRows { y, d, rows, cols } => {
                if let Some(d) = d {
                    let mut dd = Vec::with_capacity(rows.len() * cols);
                    for &r in &rows {
                        dd.extend_from_slice(&g[r * cols..(r + 1) * cols]);
                    }
                    accumulate(&mut grads, d, dd);
                }
                if let Some(y) = y {
                    accumulate(&mut grads, y, g);
                }
            }
            Op::LabelLogProb { x, mut dx, cols } => {
                dx.par_chunks_mut(cols.max(1))
                    .zip(g.par_iter())
                    .for_each(|(row, &d)| row.iter_mut().for_each(|v| *v *= d));
                accumulate(&mut grads, x, dx);
            }
            Op::RouteWeights {
                logits,
                probs,
                experts,
                scale,
                n,
                k,
            } => {
                accumulate(
                    &mut grads,
                    logits,
                    route_weights_back(&probs, &experts, &scale, n, k, &g),
                );
            }
            Op::WeightedRows {
                y,
                w,
                y_val,
                w_val,
                slots,
                cols,
            } => {
                let rows = g.chunks_exact(cols.max(1));
                if let Some(w) = w {
                    let mut dw = vec![0.0; w_val.len()];
                    for ((gr, yr), &s) in rows
                        .clone()
                        .zip(y_val.chunks_exact(cols.max(1)))
                        .zip(&slots)
                    {
                        dw[s] += gr.iter().zip(yr).map(|(a, b)| a * b).sum::<f32>();
                    }
                    accumulate(&mut grads, w, dw);
                }
                if let Some(y) = y {
                    let mut dy = Vec::with_capacity(g.len());
                    for (gr, &s) in rows.zip(&slots) {
                        dy.extend(gr.iter().map(|v| v * w_val[s]));
                    }
                    accumulate(&mut grads, y, dy);
                }
            }
            Op::DeltaNet {
                inputs,
                vals,
                mixer,
                segments,
            } => {
                let [qkv, z, b, a] = &vals;
                let x = deltanet::Inputs { qkv, z, b, a };
                let grads_in = deltanet::backward(&mixer, x, &segments, &g);
                for (node, d) in inputs.into_iter().zip(grads_in) {
                    if let Some(node) = node {
                        accumulate(&mut grads, node, d);
                    }
                }
            }
            Op::SigmoidGate {
                x,
                gate,
                x_val,
                gate_val,
            } => {
                let (dx, dgate): (Vec<f32>, Vec<f32>) = g
                    .par_iter()
                    .zip(x_val.par_iter())
                    .zip(gate_val.par_iter())
                    .map(|((&d, &xv), &gv)| {
                        let s = 1.0 / (1.0 + (-gv).exp());
                        (d * s, d * xv * s * (1.0 - s))
                    })
                    .unzip();
                if let Some(x) = x {
                    accumulate(&mut grads, x, dx);
                }
                if let Some(gate) = gate {
                    accumulate(&mut grads, gate, dgate);
                }
            }
            Op::Input { id } => add_param(&mut params, id, g),
            Op::Dropout {
                x,
                d,
                layer,
                slot,
                width,
            } => {
                let mut dx = g;
                d.scale_in_place(&mut dx, width, layer, slot);
                accumulate(&mut grads, x, dx);
            }
        }
    }
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::moe::Routing;

    /// The routing weights' logit gradient against central differences of
    /// `Σ dw ⊙ w(logits)` (the picked experts held, as a small step keeps them).
    #[test]
    fn route_weights_back_matches_finite_differences() {
        let (n, k) = (5, 2);
        let logits = [0.3f32, -1.2, 0.9, 0.1, 0.5, -0.4, 1.1, 0.2, -0.7, 0.6];
        let scale = [1.0f32, 0.7, 1.3, 0.9, 1.1];
        let dw = [0.8f32, -0.5, 0.3, 1.2];
        let routing = Routing::softmax_top_k(&logits, n, k, &scale).unwrap();
        let f = |l: &[f32]| -> f64 {
            let p = Routing::softmax_top_k(l, n, k, &scale).unwrap();
            assert_eq!(p.experts, routing.experts);
            p.weights
                .iter()
                .zip(&dw)
                .map(|(&w, &d)| f64::from(w) * f64::from(d))
                .sum()
        };
        let mut probs = logits.to_vec();
        for row in probs.chunks_exact_mut(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            row.iter_mut().for_each(|v| *v = (*v - max).exp());
            let sum: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= sum);
        }
        let got = route_weights_back(&probs, &routing.experts, &scale, n, k, &dw);
        for i in 0..logits.len() {
            let eps = 1e-3f32;
            let mut up = logits;
            up[i] += eps;
            let mut down = logits;
            down[i] -= eps;
            let numeric = (f(&up) - f(&down)) / (2.0 * f64::from(eps));
            assert!(
                (numeric - f64::from(got[i])).abs() < 1e-3,
                "logit {i}: numeric {numeric} analytic {}",
                got[i]
            );
        }
    }
}
