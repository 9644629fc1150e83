//! Qwen 3.5's gated DeltaNet mixer on the training backend and its backward: the causal
//! depthwise convolution of the q/k/v projections with its SiLU, the l2-normalized queries
//! (scaled by `k_dim^-0.5`) and keys, the gates (`β = σ(b)`, `g = −exp(A_log)·softplus(a +
//! dt_bias)`), the gated delta rule, and the gated RMS norm of its output
//! (`w · x / rms(x) · silu(z)`), each sequence of a packed batch from its own state.
//!
//! The delta rule keeps, per value head, a `[k_dim][v_dim]` state `S`; token `t` decays it
//! to `D = exp(g)·S`, writes `S' = D + k ⊗ δ` with `δ = β·(v − Dᵀk)`, and reads
//! `o = S'ᵀq`. It runs token by token in f32 (what the engine's chunked form computes, up
//! to rounding). The forward keeps nothing but the op's inputs; the backward runs each
//! sequence again, keeping the state at the start of every span of [`SPAN`] tokens, then
//! takes the spans back from the last, each one's states recomputed from its start: the
//! memory is `(n / SPAN + SPAN)` states per value head, not one per token.
use std::ops::Range;

use rayon::prelude::*;

use crate::backend::DeltaParams;
use crate::models::deltanet::DeltaShape;

/// Tokens whose states the backward holds at once (per value head).
pub(super) const SPAN: usize = 64;

/// `+1e-6` under the square root of the queries' and keys' l2 norms (transformers' and
/// flash-linear-attention's).
const L2_EPS: f32 = 1e-6;

/// A layer's frozen DeltaNet vectors, owned by the op that records them.
#[derive(Debug, Clone)]
pub(super) struct Mixer {
    pub(super) shape: DeltaShape,
    /// `[conv_dim][kernel]`.
    pub(super) conv: Vec<f32>,
    pub(super) neg_a: Vec<f32>,
    pub(super) dt_bias: Vec<f32>,
    pub(super) norm: Vec<f32>,
    pub(super) eps: f32,
}

impl Mixer {
    pub(super) fn of(p: &DeltaParams<'_>) -> Self {
        Mixer {
            shape: p.shape,
            conv: p.conv.to_vec(),
            neg_a: p.neg_a.to_vec(),
            dt_bias: p.dt_bias.to_vec(),
            norm: p.norm.to_vec(),
            eps: p.eps,
        }
    }
}

/// One sequence of a batch: its rows and its state before them (`None`: zero, a fresh
/// sequence, which is what training passes run).
#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub(super) rows: Range<usize>,
    pub(super) conv: Option<Vec<f32>>,
    pub(super) ssm: Option<Vec<f32>>,
}

/// The mixer's inputs over the whole batch: `qkv` `[n, conv_dim]`, `z` `[n, v_heads·v_dim]`,
/// `b` and `a` `[n, v_heads]`.
#[derive(Clone, Copy)]
pub(super) struct Inputs<'a> {
    pub(super) qkv: &'a [f32],
    pub(super) z: &'a [f32],
    pub(super) b: &'a [f32],
    pub(super) a: &'a [f32],
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (linear above 20) and its derivative.
fn softplus(x: f32) -> (f32, f32) {
    if x > 20.0 {
        (x, 1.0)
    } else {
        (x.exp().ln_1p(), sigmoid(x))
    }
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// What one sequence's mixer computes before the delta rule.
struct Prepared {
    n: usize,
    /// The convolution's output before its SiLU, `[n][conv_dim]`.
    pre: Vec<f32>,
    /// Per key head, the l2-normalized queries (unscaled) and keys, `[n][k_dim]`.
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    /// Per key head, the reciprocal norms of each token's raw query and key.
    q_inv: Vec<Vec<f32>>,
    k_inv: Vec<Vec<f32>>,
    /// Per value head: `[n][v_dim]` values, `[n]` log decays and write strengths, and the
    /// softplus derivative and `β` for the gates' backward.
    v: Vec<Vec<f32>>,
    g: Vec<Vec<f32>>,
    beta: Vec<Vec<f32>>,
    dsoftplus: Vec<Vec<f32>>,
}

/// The convolution, normalization and gates of one sequence (rows `rows` of `x`).
fn prepare(m: &Mixer, x: Inputs<'_>, seg: &Segment) -> Prepared {
    let sh = m.shape;
    let (cd, kernel) = (sh.conv_dim(), sh.conv_kernel);
    let hist = kernel - 1;
    let rows = seg.rows.clone();
    let n = rows.len();
    let input = &x.qkv[rows.start * cd..rows.end * cd];
    // ext[i] = state row i (i < hist), else input row i − hist.
    let ext = |i: usize, c: usize| -> f32 {
        if i < hist {
            seg.conv.as_ref().map_or(0.0, |s| s[i * cd + c])
        } else {
            input[(i - hist) * cd + c]
        }
    };
    let mut pre = vec![0.0f32; n * cd];
    for t in 0..n {
        for c in 0..cd {
            let w = &m.conv[c * kernel..(c + 1) * kernel];
            pre[t * cd + c] = (0..kernel).map(|j| w[j] * ext(t + j, c)).sum();
        }
    }
    let mixed: Vec<f32> = pre.iter().map(|&v| silu(v)).collect();
    let (kd_all, kd, vd) = (sh.k_heads * sh.k_dim, sh.k_dim, sh.v_dim);
    let norm = |off: usize| -> (Vec<f32>, Vec<f32>) {
        let mut out = Vec::with_capacity(n * kd);
        let mut inv = Vec::with_capacity(n);
        for t in 0..n {
            let raw = &mixed[t * cd + off..t * cd + off + kd];
            let r = 1.0 / (raw.iter().map(|v| v * v).sum::<f32>() + L2_EPS).sqrt();
            out.extend(raw.iter().map(|v| v * r));
            inv.push(r);
        }
        (out, inv)
    };
    let (mut q, mut k, mut q_inv, mut k_inv) = (vec![], vec![], vec![], vec![]);
    for hk in 0..sh.k_heads {
        let (qn, qi) = norm(hk * kd);
        let (kn, ki) = norm(kd_all + hk * kd);
        q.push(qn);
        q_inv.push(qi);
        k.push(kn);
        k_inv.push(ki);
    }
    let (mut v, mut g, mut beta, mut dsoftplus) = (vec![], vec![], vec![], vec![]);
    for hv in 0..sh.v_heads {
        let off = 2 * kd_all + hv * vd;
        let mut vh = Vec::with_capacity(n * vd);
        let (mut gh, mut bh, mut dh) = (vec![], vec![], vec![]);
        for t in rows.clone() {
            let local = t - rows.start;
            vh.extend_from_slice(&mixed[local * cd + off..local * cd + off + vd]);
            let (sp, dsp) = softplus(x.a[t * sh.v_heads + hv] + m.dt_bias[hv]);
            gh.push(m.neg_a[hv] * sp);
            dh.push(dsp);
            bh.push(sigmoid(x.b[t * sh.v_heads + hv]));
        }
        v.push(vh);
        g.push(gh);
        beta.push(bh);
        dsoftplus.push(dh);
    }
    Prepared {
        n,
        pre,
        q,
        k,
        q_inv,
        k_inv,
        v,
        g,
        beta,
        dsoftplus,
    }
}

/// One value head's delta-rule inputs: queries already scaled.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    kd: usize,
    vd: usize,
    scale: f32,
}

impl Head<'_> {
    /// Token `t` on `s` in place; `o` (if any) gets `Sᵀq`.
    fn step(&self, t: usize, s: &mut [f32], kv: &mut [f32], o: Option<&mut [f32]>) {
        let (kd, vd) = (self.kd, self.vd);
        let q = &self.q[t * kd..(t + 1) * kd];
        let k = &self.k[t * kd..(t + 1) * kd];
        let v = &self.v[t * vd..(t + 1) * vd];
        let decay = self.g[t].exp();
        kv.fill(0.0);
        for (srow, &ki) in s.chunks_exact_mut(vd).zip(k) {
            for (sv, m) in srow.iter_mut().zip(kv.iter_mut()) {
                *sv *= decay;
                *m += *sv * ki;
            }
        }
        let beta = self.beta[t];
        for (m, &vv) in kv.iter_mut().zip(v) {
            *m = beta * (vv - *m);
        }
        for (srow, &ki) in s.chunks_exact_mut(vd).zip(k) {
            for (sv, &d) in srow.iter_mut().zip(kv.iter()) {
                *sv += ki * d;
            }
        }
        if let Some(o) = o {
            o.fill(0.0);
            for (srow, &qi) in s.chunks_exact(vd).zip(q) {
                for (ov, &sv) in o.iter_mut().zip(srow) {
                    *ov += sv * qi * self.scale;
                }
            }
        }
    }

    /// The outputs `[n][v_dim]` from state `s` (updated), and the state at the start of
    /// every `span` tokens when `starts` is asked for.
    fn forward(&self, s: &mut [f32], span: usize, starts: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
        let n = self.g.len();
        let mut out = vec![0.0f32; n * self.vd];
        let mut kv = vec![0.0f32; self.vd];
        let mut kept = Vec::new();
        for (t, o) in out.chunks_exact_mut(self.vd).enumerate() {
            if starts && t % span == 0 {
                kept.push(s.to_vec());
            }
            self.step(t, s, &mut kv, Some(o));
        }
        (out, kept)
    }

    /// The gradients `(dq, dk, dv, dg, dβ)` (`dq` of the unscaled query) for the outputs'
    /// gradient `dout`, from the span starts `starts` that [`Head::forward`] kept.
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        starts: &[Vec<f32>],
        dout: &[f32],
        span: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (kd, vd) = (self.kd, self.vd);
        let n = self.g.len();
        let sz = kd * vd;
        let (mut dq, mut dk) = (vec![0.0f32; n * kd], vec![0.0f32; n * kd]);
        let mut dv = vec![0.0f32; n * vd];
        let (mut dg, mut dbeta) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut ds = vec![0.0f32; sz];
        let mut states = vec![0.0f32; (span + 1) * sz];
        let mut kv = vec![0.0f32; vd];
        let (mut delta, mut ddelta, mut dkv) =
            (vec![0.0f32; vd], vec![0.0f32; vd], vec![0.0f32; vd]);
        for (c, start) in starts.iter().enumerate().rev() {
            let t0 = c * span;
            let t1 = n.min(t0 + span);
            // states[i]: the state before token t0 + i.
            states[..sz].copy_from_slice(start);
            for t in t0..t1 {
                let i = t - t0;
                let (before, after) = states.split_at_mut((i + 1) * sz);
                after[..sz].copy_from_slice(&before[i * sz..]);
                self.step(t, &mut after[..sz], &mut kv, None);
            }
            for t in (t0..t1).rev() {
                let i = t - t0;
                let prev = &states[i * sz..(i + 1) * sz];
                let cur = &states[(i + 1) * sz..(i + 2) * sz];
                let q = &self.q[t * kd..(t + 1) * kd];
                let k = &self.k[t * kd..(t + 1) * kd];
                let v = &self.v[t * vd..(t + 1) * vd];
                let d_o = &dout[t * vd..(t + 1) * vd];
                let e = self.g[t].exp();
                let beta = self.beta[t];
                // o = S'ᵀ(scale·q): dq = scale·S'·do, dS' += scale·q ⊗ do.
                for a in 0..kd {
                    let row = &cur[a * vd..(a + 1) * vd];
                    dq[t * kd + a] =
                        self.scale * row.iter().zip(d_o).map(|(x, y)| x * y).sum::<f32>();
                    let qa = self.scale * q[a];
                    for (dsv, &d) in ds[a * vd..(a + 1) * vd].iter_mut().zip(d_o) {
                        *dsv += qa * d;
                    }
                }
                // δ = β (v − e·prevᵀk).
                kv.fill(0.0);
                for (row, &ka) in prev.chunks_exact(vd).zip(k) {
                    for (m, &p) in kv.iter_mut().zip(row) {
                        *m += e * p * ka;
                    }
                }
                for ((d, &vv), &m) in delta.iter_mut().zip(v).zip(kv.iter()) {
                    *d = beta * (vv - m);
                }
                // S' = D + k ⊗ δ: dk += dS'·δ, dδ = dS'ᵀk.
                ddelta.fill(0.0);
                for a in 0..kd {
                    let row = &ds[a * vd..(a + 1) * vd];
                    dk[t * kd + a] += row.iter().zip(&delta).map(|(x, y)| x * y).sum::<f32>();
                    for (dd, &x) in ddelta.iter_mut().zip(row) {
                        *dd += x * k[a];
                    }
                }
                let mut db = 0.0f32;
                for j in 0..vd {
                    db += ddelta[j] * (v[j] - kv[j]);
                    dv[t * vd + j] = beta * ddelta[j];
                    dkv[j] = -beta * ddelta[j];
                }
                dbeta[t] = db;
                // kv = Dᵀk: dD = dS' + k ⊗ dkv, dk += D·dkv; D = e·prev: dg = Σ dD ⊙ D,
                // and the state before gets e·dD.
                let mut dgt = 0.0f32;
                for a in 0..kd {
                    let row = &prev[a * vd..(a + 1) * vd];
                    dk[t * kd + a] +=
                        e * row.iter().zip(dkv.iter()).map(|(x, y)| x * y).sum::<f32>();
                    let dsr = &mut ds[a * vd..(a + 1) * vd];
                    for ((dsv, &p), &dkvj) in dsr.iter_mut().zip(row).zip(dkv.iter()) {
                        let d_d = *dsv + k[a] * dkvj;
                        dgt += d_d * e * p;
                        *dsv = e * d_d;
                    }
                }
                dg[t] = dgt;
            }
        }
        (dq, dk, dv, dg, dbeta)
    }
}

/// The heads of one prepared sequence.
fn heads<'a>(m: &Mixer, p: &'a Prepared) -> Vec<Head<'a>> {
    let sh = m.shape;
    let per_k = sh.v_heads / sh.k_heads;
    (0..sh.v_heads)
        .map(|hv| Head {
            q: &p.q[hv / per_k],
            k: &p.k[hv / per_k],
            v: &p.v[hv],
            g: &p.g[hv],
            beta: &p.beta[hv],
            kd: sh.k_dim,
            vd: sh.v_dim,
            scale: (sh.k_dim as f32).powf(-0.5),
        })
        .collect()
}

/// The initial delta-rule state of value head `hv`.
fn head_state(m: &Mixer, seg: &Segment, hv: usize) -> Vec<f32> {
    let sz = m.shape.k_dim * m.shape.v_dim;
    seg.ssm
        .as_ref()
        .map_or_else(|| vec![0.0; sz], |s| s[hv * sz..(hv + 1) * sz].to_vec())
}

/// The gated RMS norm of head outputs `o` (per value head `[n][v_dim]`) under gate `z`
/// (the sequence's rows, `[n][v_heads·v_dim]`): `[n][v_heads·v_dim]`, and each (token,
/// head)'s reciprocal RMS.
fn gated_norm(m: &Mixer, o: &[Vec<f32>], z: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let (vh, vd) = (m.shape.v_heads, m.shape.v_dim);
    let mut out = vec![0.0f32; n * vh * vd];
    let mut inv = vec![0.0f32; n * vh];
    for t in 0..n {
        for (h, oh) in o.iter().enumerate() {
            let x = &oh[t * vd..(t + 1) * vd];
            let ms = x.iter().map(|v| v * v).sum::<f32>() / vd as f32;
            let r = 1.0 / (ms + m.eps).sqrt();
            inv[t * vh + h] = r;
            let at = t * vh * vd + h * vd;
            for j in 0..vd {
                out[at + j] = m.norm[j] * x[j] * r * silu(z[at + j]);
            }
        }
    }
    (out, inv)
}

/// One sequence's output `[n][v_heads·v_dim]` and its state after (`conv`, `ssm`).
pub(super) fn forward(m: &Mixer, x: Inputs<'_>, seg: &Segment) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let sh = m.shape;
    let (cd, hist) = (sh.conv_dim(), sh.conv_kernel - 1);
    let p = prepare(m, x, seg);
    let hs = heads(m, &p);
    let runs: Vec<(Vec<f32>, Vec<f32>)> = hs
        .par_iter()
        .enumerate()
        .map(|(hv, h)| {
            let mut s = head_state(m, seg, hv);
            let (o, _) = h.forward(&mut s, SPAN, false);
            (o, s)
        })
        .collect();
    let (o, ssm): (Vec<Vec<f32>>, Vec<Vec<f32>>) = runs.into_iter().unzip();
    let z = &x.z[seg.rows.start * sh.v_heads * sh.v_dim..seg.rows.end * sh.v_heads * sh.v_dim];
    let (out, _) = gated_norm(m, &o, z, p.n);
    // The convolution's state after: the last `hist` rows of (state, input).
    let input = &x.qkv[seg.rows.start * cd..seg.rows.end * cd];
    let mut conv = vec![0.0f32; hist * cd];
    for (i, dst) in conv.chunks_exact_mut(cd.max(1)).enumerate() {
        let t = p.n + i;
        if t < hist {
            if let Some(s) = &seg.conv {
                dst.copy_from_slice(&s[t * cd..(t + 1) * cd]);
            }
        } else {
            dst.copy_from_slice(&input[(t - hist) * cd..(t - hist + 1) * cd]);
        }
    }
    (out, conv, ssm.concat())
}

/// The gradients of the batch's `qkv`, `z`, `b` and `a` for the output's gradient `dy`
/// `[n, v_heads·v_dim]`, each sequence taken back from its own starting state.
pub(super) fn backward(
    m: &Mixer,
    x: Inputs<'_>,
    segments: &[Segment],
    dy: &[f32],
) -> [Vec<f32>; 4] {
    backward_in_spans(m, x, segments, dy, SPAN)
}

pub(super) fn backward_in_spans(
    m: &Mixer,
    x: Inputs<'_>,
    segments: &[Segment],
    dy: &[f32],
    span: usize,
) -> [Vec<f32>; 4] {
    let sh = m.shape;
    let (cd, kernel) = (sh.conv_dim(), sh.conv_kernel);
    let hist = kernel - 1;
    let (vh, vd, kd, kd_all) = (sh.v_heads, sh.v_dim, sh.k_dim, sh.k_heads * sh.k_dim);
    let w = vh * vd;
    let mut dqkv = vec![0.0f32; x.qkv.len()];
    let mut dz = vec![0.0f32; x.z.len()];
    let mut db = vec![0.0f32; x.b.len()];
    let mut da = vec![0.0f32; x.a.len()];
    let per_k = vh / sh.k_heads;
    for seg in segments {
        let r0 = seg.rows.start;
        let p = prepare(m, x, seg);
        let n = p.n;
        let hs = heads(m, &p);
        let runs: Vec<(Vec<f32>, Vec<Vec<f32>>)> = hs
            .par_iter()
            .enumerate()
            .map(|(hv, h)| {
                let mut s = head_state(m, seg, hv);
                h.forward(&mut s, span, true)
            })
            .collect();
        // The gated norm: dz, and each head's output gradient.
        let z = &x.z[r0 * w..(r0 + n) * w];
        let g_out = &dy[r0 * w..(r0 + n) * w];
        let mut d_o: Vec<Vec<f32>> = vec![vec![0.0f32; n * vd]; vh];
        for t in 0..n {
            for (h, (o, _)) in runs.iter().enumerate() {
                let xo = &o[t * vd..(t + 1) * vd];
                let ms = xo.iter().map(|v| v * v).sum::<f32>() / vd as f32;
                let r = 1.0 / (ms + m.eps).sqrt();
                let at = t * w + h * vd;
                let mut dot = 0.0f32;
                let dxh = &mut d_o[h][t * vd..(t + 1) * vd];
                for j in 0..vd {
                    let (zj, gj) = (z[at + j], g_out[at + j]);
                    let xhat = xo[j] * r;
                    dz[(r0 * w) + at + j] = gj * m.norm[j] * xhat * silu_grad(zj);
                    let d = gj * m.norm[j] * silu(zj);
                    dxh[j] = d;
                    dot += d * xhat;
                }
                let mean = dot / vd as f32;
                for j in 0..vd {
                    dxh[j] = r * (dxh[j] - xo[j] * r * mean);
                }
            }
        }
        // The delta rule, head by head.
        let grads: Vec<_> = hs
            .par_iter()
            .zip(runs.par_iter())
            .zip(d_o.par_iter())
            .map(|((h, (_, starts)), dout)| h.backward(starts, dout, span))
            .collect();
        // Back through the gates, the l2 norms and the SiLU to the convolution's output.
        let mut dmixed = vec![0.0f32; n * cd];
        let mut dq_heads = vec![vec![0.0f32; n * kd]; sh.k_heads];
        let mut dk_heads = vec![vec![0.0f32; n * kd]; sh.k_heads];
        for (hv, (dq, dk, dv, dg, dbeta)) in grads.into_iter().enumerate() {
            let hk = hv / per_k;
            dq_heads[hk].iter_mut().zip(&dq).for_each(|(a, b)| *a += b);
            dk_heads[hk].iter_mut().zip(&dk).for_each(|(a, b)| *a += b);
            let off = 2 * kd_all + hv * vd;
            for t in 0..n {
                dmixed[t * cd + off..t * cd + off + vd].copy_from_slice(&dv[t * vd..(t + 1) * vd]);
                let row = (r0 + t) * vh + hv;
                let beta = p.beta[hv][t];
                db[row] = dbeta[t] * beta * (1.0 - beta);
                da[row] = dg[t] * m.neg_a[hv] * p.dsoftplus[hv][t];
            }
        }
        // `dq` is of the unscaled normalized query (the head's backward folds `scale` in).
        for hk in 0..sh.k_heads {
            for (which, (dn, (y, inv))) in [
                (&dq_heads[hk], (&p.q[hk], &p.q_inv[hk])),
                (&dk_heads[hk], (&p.k[hk], &p.k_inv[hk])),
            ]
            .into_iter()
            .enumerate()
            {
                let off = which * kd_all + hk * kd;
                for t in 0..n {
                    let (dyt, yt) = (&dn[t * kd..(t + 1) * kd], &y[t * kd..(t + 1) * kd]);
                    let dot: f32 = dyt.iter().zip(yt).map(|(a, b)| a * b).sum();
                    for j in 0..kd {
                        dmixed[t * cd + off + j] = inv[t] * (dyt[j] - yt[j] * dot);
                    }
                }
            }
        }
        let dpre: Vec<f32> = dmixed
            .iter()
            .zip(&p.pre)
            .map(|(&d, &v)| d * silu_grad(v))
            .collect();
        // pre[t] = Σ_j w[j]·ext[t + j], ext[hist + u] = input row u: input row u gets
        // Σ_j w[j]·dpre[u + hist − j] over the valid t.
        for u in 0..n {
            for c in 0..cd {
                let wc = &m.conv[c * kernel..(c + 1) * kernel];
                let mut acc = 0.0f32;
                for (j, &wj) in wc.iter().enumerate() {
                    let Some(t) = (u + hist).checked_sub(j) else {
                        continue;
                    };
                    if t < n {
                        acc += wj * dpre[t * cd + c];
                    }
                }
                dqkv[(r0 + u) * cd + c] = acc;
            }
        }
    }
    [dqkv, dz, db, da]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::tape::tests::values;
    use crate::models::deltanet::{mix, DeltaState, Form};

    const SHAPE: DeltaShape = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        k_dim: 3,
        v_dim: 4,
        conv_kernel: 3,
    };

    fn mixer() -> Mixer {
        let sh = SHAPE;
        Mixer {
            shape: sh,
            conv: values(sh.conv_dim() * sh.conv_kernel, 1)
                .iter()
                .map(|v| 1.5 * v)
                .collect(),
            neg_a: values(sh.v_heads, 2).iter().map(|v| -(v + 0.8)).collect(),
            dt_bias: values(sh.v_heads, 3),
            norm: values(sh.v_dim, 4).iter().map(|v| 1.0 + v).collect(),
            eps: 1e-6,
        }
    }

    /// The batch's four inputs for `n` rows (scaled so the gates are spread).
    fn inputs(n: usize) -> [Vec<f32>; 4] {
        let sh = SHAPE;
        let big = |v: Vec<f32>| v.iter().map(|x| 3.0 * x).collect();
        [
            big(values(n * sh.conv_dim(), 5)),
            big(values(n * sh.v_heads * sh.v_dim, 6)),
            big(values(n * sh.v_heads, 7)),
            big(values(n * sh.v_heads, 8)),
        ]
    }

    fn of(x: &[Vec<f32>; 4]) -> Inputs<'_> {
        Inputs {
            qkv: &x[0],
            z: &x[1],
            b: &x[2],
            a: &x[3],
        }
    }

    /// Two packed sequences, the second from a state a previous pass left.
    fn segments() -> Vec<Segment> {
        let sh = SHAPE;
        vec![
            Segment {
                rows: 0..7,
                conv: None,
                ssm: None,
            },
            Segment {
                rows: 7..12,
                conv: Some(values(sh.conv_state_len(), 9)),
                ssm: Some(values(sh.ssm_state_len(), 10)),
            },
        ]
    }

    fn loss(m: &Mixer, x: &[Vec<f32>; 4], segs: &[Segment], r: &[f32]) -> f64 {
        let mut out = Vec::new();
        for s in segs {
            out.extend(forward(m, of(x), s).0);
        }
        out.iter()
            .zip(r)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    }

    /// The forward is the engine's serving mixer (its recurrent and chunked forms), the
    /// states after included.
    #[test]
    fn forward_matches_the_engines_mixer() {
        let m = mixer();
        let sh = SHAPE;
        let n = 70;
        let x = inputs(n);
        let seg = Segment {
            rows: 0..n,
            conv: Some(values(sh.conv_state_len(), 11)),
            ssm: Some(values(sh.ssm_state_len(), 12)),
        };
        let (out, conv, ssm) = forward(&m, of(&x), &seg);
        let p = DeltaParams {
            shape: sh,
            conv: &m.conv,
            neg_a: &m.neg_a,
            dt_bias: &m.dt_bias,
            norm: &m.norm,
            eps: m.eps,
        };
        for form in [Form::Recurrent, Form::Auto] {
            let mut st = DeltaState {
                conv: seg.conv.clone().unwrap(),
                ssm: seg.ssm.clone().unwrap(),
            };
            let want = mix(&p, &x[0], &x[1], &x[2], &x[3], &mut st, form).unwrap();
            let diff = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max)
            };
            assert!(diff(&out, &want) < 1e-4, "{form:?}: {}", diff(&out, &want));
            assert_eq!(conv, st.conv);
            assert!(diff(&ssm, &st.ssm) < 1e-4, "{form:?} state");
        }
    }

    /// Every input's gradient against central differences of `Σ r ⊙ out`, over two packed
    /// sequences (one from a carried state) in spans of 3 tokens, so the backward crosses
    /// span boundaries.
    #[test]
    fn backward_matches_finite_differences() {
        let m = mixer();
        let segs = segments();
        let x = inputs(12);
        let r = values(12 * SHAPE.v_heads * SHAPE.v_dim, 13);
        let grads = backward_in_spans(&m, of(&x), &segs, &r, 3);
        let mut checked = 0;
        for (which, g) in grads.iter().enumerate() {
            let len = x[which].len();
            for idx in (0..len).step_by(len / 23 + 1).chain([len - 1]) {
                let eps = 1e-2f32;
                let bump = |d: f32| {
                    let mut x = x.clone();
                    x[which][idx] += d;
                    loss(&m, &x, &segs, &r)
                };
                let numeric = (bump(eps) - bump(-eps)) / (2.0 * f64::from(eps));
                let analytic = f64::from(g[idx]);
                assert!(
                    (numeric - analytic).abs() <= 2e-3 * numeric.abs().max(1.0),
                    "input {which}[{idx}]: numeric {numeric} analytic {analytic}"
                );
                checked += 1;
            }
        }
        assert!(checked > 80);
    }

    /// The span the backward recomputes in changes nothing but rounding.
    #[test]
    fn spans_do_not_change_the_gradient() {
        let m = mixer();
        let segs = segments();
        let x = inputs(12);
        let r = values(12 * SHAPE.v_heads * SHAPE.v_dim, 14);
        let whole = backward_in_spans(&m, of(&x), &segs, &r, SPAN);
        for span in [1, 2, 5] {
            let parts = backward_in_spans(&m, of(&x), &segs, &r, span);
            for (a, b) in whole.iter().zip(&parts) {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "span {span}");
                }
            }
        }
    }

    /// Packed sequences share nothing: the first's rows get no gradient from the second's
    /// outputs, and the second's outputs are what it gives alone.
    #[test]
    fn packed_sequences_do_not_leak() {
        let m = mixer();
        let segs = segments();
        let x = inputs(12);
        let w = SHAPE.v_heads * SHAPE.v_dim;
        let mut r = values(12 * w, 15);
        r[..7 * w].fill(0.0);
        let grads = backward(&m, of(&x), &segs, &r);
        let sh = SHAPE;
        for (g, cols) in grads.iter().zip([sh.conv_dim(), w, sh.v_heads, sh.v_heads]) {
            assert!(g[..7 * cols].iter().all(|&v| v == 0.0));
            assert!(g[7 * cols..].iter().any(|&v| v != 0.0));
        }
        // The second sequence alone, its rows first.
        let alone: [Vec<f32>; 4] = std::array::from_fn(|i| {
            let cols = x[i].len() / 12;
            x[i][7 * cols..].to_vec()
        });
        let seg = Segment {
            rows: 0..5,
            ..segs[1].clone()
        };
        assert_eq!(
            forward(&m, of(&alone), &seg).0,
            forward(&m, of(&x), &segs[1]).0
        );
    }
}
