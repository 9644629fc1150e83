//! The gated DeltaNet token mixer of Qwen 3.5's linear-attention layers, on host memory:
//! the causal depthwise convolution over the q/k/v projections (with its carried state),
//! the gating, the gated delta rule (chunked for prompts, recurrent for single tokens), and
//! the gated RMS norm of its output.
//!
//! The delta rule keeps, per value head, a `[key_dim][value_dim]` state `S`; token `t`
//! decays it by `exp(g_t)` and writes `β_t k_t ⊗ (v_t − Sᵀk_t)`; its output is `Sᵀq_t`.
//! [`chunked`] computes the same thing 64 tokens at a time (the UT-transform form): inside
//! a chunk every interaction is a small dense product, and the state is read and written
//! once per chunk instead of once per token.
use rayon::prelude::*;
use wick_kernels::{elementwise, Isa};

use crate::backend::{Backend, DeltaInputs, DeltaSegment, DeltaStore};
use crate::EngineError;

pub use crate::config::qwen35::DeltaShape;

/// Tokens per chunk of the chunked form (transformers' and flash-linear-attention's).
pub const CHUNK: usize = 64;

/// `x / sqrt(sum x² + 1e-6)` in place (flash-linear-attention's l2norm).
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

use wick_kernels::elementwise::exp as fast_exp;

/// Rows of one parallel block of the convolution.
const CONV_BLOCK: usize = 64;
/// Tokens of one parallel block of the output's gated norm.
const NORM_BLOCK: usize = 32;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// torch's softplus (linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Causal depthwise convolution of `x` `[n][channels]` (then SiLU), continuing from
/// `state` (the previous `kernel - 1` inputs, oldest first, `[kernel-1][channels]`), which
/// is replaced by the last `kernel - 1` inputs. `weight` is `[channels][kernel]`.
pub fn conv1d_silu(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
) -> wick_kernels::Result<Vec<f32>> {
    let n = x.len() / channels;
    let hist = kernel - 1;
    // Tap-major weights, so the kernel's inner loop runs over contiguous channels.
    let mut taps = vec![0.0f32; kernel * channels];
    for c in 0..channels {
        for j in 0..kernel {
            taps[j * channels + c] = weight[c * kernel + j];
        }
    }
    let mut out = vec![0.0f32; n * channels];
    // Blocks of rows in parallel: a block's history is the state (first block) or the
    // `hist` input rows before it, so every block reads only what it needs.
    let block = CONV_BLOCK.max(hist);
    let isa = Isa::best();
    out.par_chunks_mut(block * channels)
        .enumerate()
        .try_for_each(|(i, o)| {
            let t0 = i * block;
            let rows = o.len() / channels;
            let history = if t0 == 0 {
                &state[..]
            } else {
                &x[(t0 - hist) * channels..t0 * channels]
            };
            let input = &x[t0 * channels..(t0 + rows) * channels];
            elementwise::causal_conv1d_silu(isa, history, input, channels, &taps, o)
        })?;
    // The new state: the last `hist` rows of the extended input (state, then x).
    let mut next = vec![0.0f32; hist * channels];
    for (i, dst) in next.chunks_exact_mut(channels).enumerate() {
        let t = n + i;
        dst.copy_from_slice(if t < hist {
            &state[t * channels..(t + 1) * channels]
        } else {
            &x[(t - hist) * channels..(t - hist + 1) * channels]
        });
    }
    state.copy_from_slice(&next);
    Ok(out)
}

/// One value head's inputs for the delta rule, `n` tokens.
pub struct HeadInputs<'a> {
    /// Queries `[n][k_dim]`, l2-normalized and scaled by `k_dim^-0.5`.
    pub q: &'a [f32],
    /// Keys `[n][k_dim]`, l2-normalized.
    pub k: &'a [f32],
    /// Values `[n][v_dim]`.
    pub v: &'a [f32],
    /// Log decays `[n]` (≤ 0).
    pub g: &'a [f32],
    /// Write strengths `[n]`.
    pub beta: &'a [f32],
}

/// The recurrent form, token by token: returns `[n][v_dim]` and updates `s` `[k_dim][v_dim]`.
pub fn recurrent(h: &HeadInputs<'_>, k_dim: usize, v_dim: usize, s: &mut [f32]) -> Vec<f32> {
    let n = h.g.len();
    let mut out = vec![0.0f32; n * v_dim];
    let mut kv = vec![0.0f32; v_dim];
    for t in 0..n {
        let (q, k, v) = (
            &h.q[t * k_dim..(t + 1) * k_dim],
            &h.k[t * k_dim..(t + 1) * k_dim],
            &h.v[t * v_dim..(t + 1) * v_dim],
        );
        let decay = h.g[t].exp();
        kv.fill(0.0);
        for (i, srow) in s.chunks_exact_mut(v_dim).enumerate() {
            let ki = k[i];
            for (sv, m) in srow.iter_mut().zip(kv.iter_mut()) {
                *sv *= decay;
                *m += *sv * ki;
            }
        }
        let beta = h.beta[t];
        for (m, &vv) in kv.iter_mut().zip(v) {
            *m = (vv - *m) * beta;
        }
        let o = &mut out[t * v_dim..(t + 1) * v_dim];
        for (i, srow) in s.chunks_exact_mut(v_dim).enumerate() {
            let (ki, qi) = (k[i], q[i]);
            for ((sv, &d), ov) in srow.iter_mut().zip(kv.iter()).zip(o.iter_mut()) {
                *sv += ki * d;
                *ov += *sv * qi;
            }
        }
    }
    out
}

/// `out[..] += a * b[..]`
#[inline]
fn axpy(out: &mut [f32], a: f32, b: &[f32]) {
    for (o, &x) in out.iter_mut().zip(b) {
        *o += a * x;
    }
}

/// A row-major matrix operand of [`mm`]: `rows × cols`, or the transpose of a row-major
/// `cols × rows` buffer.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    data: &'a [f32],
    transposed: bool,
}

pub(super) fn plain(data: &[f32]) -> Operand<'_> {
    Operand {
        data,
        transposed: false,
    }
}

pub(super) fn transposed(data: &[f32]) -> Operand<'_> {
    Operand {
        data,
        transposed: true,
    }
}

/// `c = (accumulate ? c : 0) + s · a · b` with `a` `m × k`, `b` `k × n` and `c` `m × n`,
/// all row-major (an operand may be given transposed), on the calling thread.
pub(super) fn mm(
    c: &mut [f32],
    a: Operand<'_>,
    b: Operand<'_>,
    (m, n, k): (usize, usize, usize),
    s: f32,
    accumulate: bool,
) {
    assert!(
        c.len() >= m * n && a.data.len() >= m * k && b.data.len() >= k * n,
        "matrix buffers smaller than their shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    // (column stride, row stride) of each operand.
    let (a_cs, a_rs) = if a.transposed { (m, 1) } else { (1, k) };
    let (b_cs, b_rs) = if b.transposed { (k, 1) } else { (1, n) };
    // SAFETY: every operand's buffer holds at least its `rows × cols` elements (checked
    // above), and the strides above address exactly the elements of those shapes; `c`
    // does not alias `a` or `b` (one `&mut` and two `&` borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.data.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            s,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The chunked form: the same result as [`recurrent`] (up to rounding), `CHUNK` tokens
/// at a time. Inside a chunk of `L` tokens, with `G` the cumulative log decay:
/// `A = strict_lower(β K Kᵀ ⊙ exp(Gᵢ − Gⱼ))`, `(I + A) U = β V`, `(I + A) W = β K exp(G)`,
/// `V' = U − W S`, `O = exp(G) Q S + lower(Q Kᵀ ⊙ exp(Gᵢ − Gⱼ)) V'`, and the state moves to
/// `exp(G_L) S + (K exp(G_L − G))ᵀ V'`: a handful of dense products per chunk.
pub fn chunked(h: &HeadInputs<'_>, k_dim: usize, v_dim: usize, s: &mut [f32]) -> Vec<f32> {
    let n = h.g.len();
    let mut out = vec![0.0f32; n * v_dim];
    let (mut a, mut p) = (vec![0.0f32; CHUNK * CHUNK], vec![0.0f32; CHUNK * CHUNK]);
    let mut kb = vec![0.0f32; CHUNK * k_dim];
    let mut u = vec![0.0f32; CHUNK * v_dim];
    let mut v_new = vec![0.0f32; CHUNK * v_dim];
    let mut tinv = vec![0.0f32; CHUNK * CHUNK];
    let mut w = vec![0.0f32; CHUNK * k_dim];
    let mut cg = vec![0.0f32; CHUNK];
    let mut c0 = 0;
    while c0 < n {
        let l = CHUNK.min(n - c0);
        let q = &h.q[c0 * k_dim..(c0 + l) * k_dim];
        let k = &h.k[c0 * k_dim..(c0 + l) * k_dim];
        let v = &h.v[c0 * v_dim..(c0 + l) * v_dim];
        let beta = &h.beta[c0..c0 + l];
        let mut acc = 0.0f32;
        for (c, &g) in cg.iter_mut().zip(&h.g[c0..c0 + l]) {
            acc += g;
            *c = acc;
        }
        for i in 0..l {
            for (x, &y) in kb[i * k_dim..(i + 1) * k_dim]
                .iter_mut()
                .zip(&k[i * k_dim..(i + 1) * k_dim])
            {
                *x = y * beta[i];
            }
        }
        let (a, p) = (&mut a[..l * l], &mut p[..l * l]);
        mm(
            a,
            plain(&kb[..l * k_dim]),
            transposed(k),
            (l, l, k_dim),
            1.0,
            false,
        );
        mm(p, plain(q), transposed(k), (l, l, k_dim), 1.0, false);
        for i in 0..l {
            for j in 0..l {
                let decay = if j <= i { fast_exp(cg[i] - cg[j]) } else { 0.0 };
                p[i * l + j] *= decay;
                a[i * l + j] = if j < i { a[i * l + j] * decay } else { 0.0 };
            }
        }
        // T = (I + A)⁻¹ by forward substitution (unit lower triangular, L³/6 products),
        // then V' = U − W S = T (β V − β K exp(G) S): two dense products.
        let t = &mut tinv[..l * l];
        t.fill(0.0);
        for i in 0..l {
            let (done, rest) = t.split_at_mut(i * l);
            let ti = &mut rest[..l];
            ti[i] = 1.0;
            for j in 0..i {
                let aij = a[i * l + j];
                if aij != 0.0 {
                    axpy(&mut ti[..i], -aij, &done[j * l..j * l + i]);
                }
            }
        }
        let (m, w) = (&mut u[..l * v_dim], &mut w[..l * k_dim]);
        for i in 0..l {
            for (x, &vv) in m[i * v_dim..(i + 1) * v_dim]
                .iter_mut()
                .zip(&v[i * v_dim..(i + 1) * v_dim])
            {
                *x = vv * beta[i];
            }
            let e = fast_exp(cg[i]);
            for (x, &y) in w[i * k_dim..(i + 1) * k_dim]
                .iter_mut()
                .zip(&kb[i * k_dim..(i + 1) * k_dim])
            {
                *x = y * e;
            }
        }
        mm(m, plain(w), plain(s), (l, v_dim, k_dim), -1.0, true);
        let u = &mut v_new[..l * v_dim];
        mm(u, plain(t), plain(m), (l, v_dim, l), 1.0, false);
        // O = exp(G) (Q S) + P V'.
        let o = &mut out[c0 * v_dim..(c0 + l) * v_dim];
        mm(o, plain(q), plain(s), (l, v_dim, k_dim), 1.0, false);
        for i in 0..l {
            let e = cg[i].exp();
            o[i * v_dim..(i + 1) * v_dim]
                .iter_mut()
                .for_each(|x| *x *= e);
        }
        mm(o, plain(p), plain(u), (l, v_dim, l), 1.0, true);
        // S = exp(G_last) S + (K exp(G_last − G))ᵀ V'.
        let last = cg[l - 1];
        let chunk_decay = last.exp();
        s.iter_mut().for_each(|x| *x *= chunk_decay);
        for i in 0..l {
            let f = (last - cg[i]).exp();
            for (x, &y) in w[i * k_dim..(i + 1) * k_dim]
                .iter_mut()
                .zip(&k[i * k_dim..(i + 1) * k_dim])
            {
                *x = y * f;
            }
        }
        mm(s, transposed(w), plain(u), (k_dim, v_dim, l), 1.0, true);
        c0 += l;
    }
    out
}

/// One sequence's DeltaNet state in one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaState {
    /// The convolution's last `conv_kernel - 1` inputs, `[kernel-1][conv_dim]`.
    pub conv: Vec<f32>,
    /// The delta-rule state of every value head, `[v_heads][k_dim][v_dim]`.
    pub ssm: Vec<f32>,
}

impl DeltaState {
    /// The zero state of a layer of `shape`.
    pub fn new(shape: &DeltaShape) -> Self {
        DeltaState {
            conv: vec![0.0; shape.conv_state_len()],
            ssm: vec![0.0; shape.ssm_state_len()],
        }
    }
}

/// Host weights of one DeltaNet layer that are not matrices.
pub struct DeltaParams<'a> {
    /// Layer shape.
    pub shape: DeltaShape,
    /// Convolution weight `[conv_dim][kernel]`.
    pub conv: &'a [f32],
    /// `-exp(A_log)` per value head.
    pub neg_a: &'a [f32],
    /// `dt_bias` per value head.
    pub dt_bias: &'a [f32],
    /// Gated norm weight `[v_dim]`.
    pub norm: &'a [f32],
    /// Norm epsilon.
    pub eps: f32,
}

/// Which form of the delta rule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Chunked for more than one token, recurrent for one (what the model uses).
    Auto,
    /// Token by token always (a reference, and the baseline of the benchmark).
    Recurrent,
}

/// The mixer of one sequence: from the projections `qkv` `[n][conv_dim]`, `z`
/// `[n][v_heads*v_dim]`, `b` and `a` `[n][v_heads]` to the normed, gated output
/// `[n][v_heads*v_dim]` (what `out_proj` multiplies), updating `state`.
pub fn mix(
    p: &DeltaParams<'_>,
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    state: &mut DeltaState,
    form: Form,
) -> wick_kernels::Result<Vec<f32>> {
    let sh = p.shape;
    let cd = sh.conv_dim();
    let n = qkv.len() / cd;
    let mixed = conv1d_silu(qkv, cd, p.conv, sh.conv_kernel, &mut state.conv)?;
    let (kd, vd) = (sh.k_heads * sh.k_dim, sh.v_heads * sh.v_dim);
    let per_k = sh.v_heads / sh.k_heads;
    let scale = (sh.k_dim as f32).powf(-0.5);
    // Per key head: normalized q (scaled) and k, [n][k_dim] each.
    let heads_qk: Vec<(Vec<f32>, Vec<f32>)> = (0..sh.k_heads)
        .into_par_iter()
        .map(|hk| {
            let mut q = Vec::with_capacity(n * sh.k_dim);
            let mut k = Vec::with_capacity(n * sh.k_dim);
            for t in 0..n {
                let row = &mixed[t * cd..(t + 1) * cd];
                let off = hk * sh.k_dim;
                let start = q.len();
                q.extend_from_slice(&row[off..off + sh.k_dim]);
                l2norm(&mut q[start..]);
                q[start..].iter_mut().for_each(|x| *x *= scale);
                let start = k.len();
                k.extend_from_slice(&row[kd + off..kd + off + sh.k_dim]);
                l2norm(&mut k[start..]);
            }
            (q, k)
        })
        .collect();
    let states: Vec<&mut [f32]> = state.ssm.chunks_exact_mut(sh.k_dim * sh.v_dim).collect();
    let outs: Vec<Vec<f32>> = states
        .into_par_iter()
        .enumerate()
        .map(|(hv, s)| {
            let (q, k) = &heads_qk[hv / per_k];
            let mut v = Vec::with_capacity(n * sh.v_dim);
            let mut g = Vec::with_capacity(n);
            let mut beta = Vec::with_capacity(n);
            for t in 0..n {
                let off = 2 * kd + hv * sh.v_dim;
                v.extend_from_slice(&mixed[t * cd + off..t * cd + off + sh.v_dim]);
                beta.push(sigmoid(b[t * sh.v_heads + hv]));
                g.push(p.neg_a[hv] * softplus(a[t * sh.v_heads + hv] + p.dt_bias[hv]));
            }
            let inputs = HeadInputs {
                q,
                k,
                v: &v,
                g: &g,
                beta: &beta,
            };
            if form == Form::Recurrent || n == 1 {
                recurrent(&inputs, sh.k_dim, sh.v_dim, s)
            } else {
                chunked(&inputs, sh.k_dim, sh.v_dim, s)
            }
        })
        .collect();
    // Gated RMS norm per head: w · x / rms(x) · silu(z), blocks of tokens in parallel.
    let mut out = z.to_vec();
    let isa = Isa::best();
    out.par_chunks_mut(NORM_BLOCK * vd)
        .enumerate()
        .for_each(|(block, rows)| {
            elementwise::silu_in_place(isa, rows);
            for (i, row) in rows.chunks_exact_mut(vd).enumerate() {
                let t = block * NORM_BLOCK + i;
                for (o, y) in outs.iter().zip(row.chunks_exact_mut(sh.v_dim)) {
                    let x = &o[t * sh.v_dim..(t + 1) * sh.v_dim];
                    let ms = x.iter().map(|v| v * v).sum::<f32>() / sh.v_dim as f32;
                    let inv = 1.0 / (ms + p.eps).sqrt();
                    for ((y, &w), &x) in y.iter_mut().zip(p.norm).zip(x) {
                        *y *= w * (x * inv);
                    }
                }
            }
        });
    Ok(out)
}

/// [`crate::backend::Backend::delta_net`] on the host (its default): each of the four
/// projections copied to the host per segment, [`mix`] run on each segment's host state in
/// turn, and the outputs uploaded as one `[n, v_heads * v_dim]` tensor. The segments must
/// cover the batch's rows in order.
pub(crate) fn mix_on_host<B: Backend>(
    be: &B,
    p: &DeltaParams<'_>,
    x: DeltaInputs<'_, B::Tensor>,
    segments: &mut [DeltaSegment<'_, B::DeltaState>],
) -> crate::Result<B::Tensor> {
    let counts: Vec<usize> = segments.iter().map(|s| s.rows.len()).collect();
    let mut at = 0;
    for s in segments.iter() {
        if s.rows.start != at {
            return Err(EngineError::InvalidInput(format!(
                "DeltaNet segments must cover the batch in order: rows {:?} after {at}",
                s.rows
            )));
        }
        at = s.rows.end;
    }
    let total = at;
    let mut p4 = [x.qkv, x.z, x.b, x.a]
        .into_iter()
        .map(|t| be.rows_to_host(t, &counts));
    let (Some(qkv), Some(z), Some(b), Some(a)) = (p4.next(), p4.next(), p4.next(), p4.next())
    else {
        return Err(EngineError::InvalidInput("DeltaNet inputs missing".into()));
    };
    let (qkv, z, b, a) = (qkv?, z?, b?, a?);
    let vd = p.shape.v_heads * p.shape.v_dim;
    let mut mixed = Vec::with_capacity(total * vd);
    for (i, s) in segments.iter_mut().enumerate() {
        let st = s.state.host_mut().ok_or_else(|| EngineError::Backend {
            backend: be.name(),
            message: "the DeltaNet state is not in host memory".into(),
        })?;
        mixed.extend(mix(p, &qkv[i], &z[i], &b[i], &a[i], st, Form::Auto)?);
    }
    be.tensor_from_host(mixed, total, vd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    #[test]
    fn chunked_equals_recurrent_across_chunk_boundaries() {
        let (kd, vd) = (8, 12);
        let mut seed = 7;
        for n in [1, 5, 64, 65, 150] {
            let mut vec_of =
                |len: usize| -> Vec<f32> { (0..len).map(|_| lcg(&mut seed)).collect() };
            let mut q = vec_of(n * kd);
            let mut k = vec_of(n * kd);
            for t in 0..n {
                l2norm(&mut q[t * kd..(t + 1) * kd]);
                l2norm(&mut k[t * kd..(t + 1) * kd]);
            }
            let v = vec_of(n * vd);
            let g: Vec<f32> = vec_of(n).iter().map(|x| -(x + 0.5) * 0.3).collect();
            let beta: Vec<f32> = vec_of(n).iter().map(|x| x + 0.5).collect();
            let init = vec_of(kd * vd);
            let h = HeadInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
            };
            let (mut s1, mut s2) = (init.clone(), init);
            let o1 = recurrent(&h, kd, vd, &mut s1);
            let o2 = chunked(&h, kd, vd, &mut s2);
            let max = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max)
            };
            assert!(
                max(&o1, &o2) < 1e-5,
                "n={n}: outputs differ by {}",
                max(&o1, &o2)
            );
            assert!(
                max(&s1, &s2) < 1e-5,
                "n={n}: states differ by {}",
                max(&s1, &s2)
            );
        }
    }

    #[test]
    fn convolution_state_carries_across_calls() {
        let (c, kernel) = (3, 4);
        let w: Vec<f32> = (0..c * kernel).map(|i| i as f32 * 0.1 - 0.5).collect();
        let x: Vec<f32> = (0..7 * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut s_all = vec![0.0; (kernel - 1) * c];
        let all = conv1d_silu(&x, c, &w, kernel, &mut s_all).unwrap();
        let mut s = vec![0.0; (kernel - 1) * c];
        let mut parts = conv1d_silu(&x[..2 * c], c, &w, kernel, &mut s).unwrap();
        parts.extend(conv1d_silu(&x[2 * c..3 * c], c, &w, kernel, &mut s).unwrap());
        parts.extend(conv1d_silu(&x[3 * c..], c, &w, kernel, &mut s).unwrap());
        assert_eq!(all, parts);
        assert_eq!(s_all, s);
    }
}
