//! The reverse pass: from `∂L/∂log p(label)` of each target to the gradients of the LoRA
//! factors, layer by layer down to the lowest adapted one.
use rayon::prelude::*;

use super::attention;
use super::forward::{AdapterRef, Forward, LayerActs, LoraSite, Saved, TrainDecoder};
use super::{rms_norm_back, sigmoid, Batch};
use crate::base::Matrix;
use crate::linalg::{gemm, linear_back_input, linear_back_weight, Layout};
use crate::lora::{LoraPair, LoraParams};

/// A LoRA projection's part of the backward.
struct Slot<'a> {
    site: LoraSite<'a>,
    grad: &'a mut LoraPair,
    xa: &'a [f32],
}

/// Backward of `y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ` for output gradient `dy` `[n, out]`: adds
/// the input gradient into `dx` `[n, in]` and the factor gradients into the slot's `grad`.
#[allow(clippy::too_many_arguments)]
fn project_back(
    dy: &[f32],
    n: usize,
    x: &[f32],
    w: &Matrix,
    out: usize,
    inp: usize,
    lora: Option<Slot<'_>>,
    rank: usize,
    dx: &mut [f32],
) {
    linear_back_input(dy, n, &w.values(), out, inp, dx, 1.0);
    if let Some(Slot { site, grad, xa }) = lora {
        let (pair, s) = (site.pair, site.s);
        // dB += s·dyᵀ·xa; dxa = s·dy·B; dA += dxaᵀ·drop(x); dx += drop'(dxa·A).
        linear_back_weight(dy, n, out, xa, rank, &mut grad.b, s);
        let mut dxa = vec![0.0; n * rank];
        gemm(
            n,
            rank,
            out,
            dy,
            Layout::Plain,
            &pair.b,
            Layout::Plain,
            &mut dxa,
            false,
            s,
            true,
        );
        linear_back_weight(&dxa, n, rank, &site.input(x, inp), inp, &mut grad.a, 1.0);
        match site.dropout {
            None => linear_back_input(&dxa, n, &pair.a, rank, inp, dx, 1.0),
            Some(d) => {
                let mut dxd = vec![0.0; n * inp];
                linear_back_input(&dxa, n, &pair.a, rank, inp, &mut dxd, 1.0);
                d.scale_in_place(&mut dxd, inp, site.layer, site.slot);
                dx.iter_mut().zip(&dxd).for_each(|(a, b)| *a += b);
            }
        }
    }
}

impl TrainDecoder<'_> {
    /// Adds `∂L/∂(A, B)` into `grads` given `dlogp[i] = ∂L/∂fwd.logp[i]`.
    pub fn backward(
        &self,
        adapter: AdapterRef<'_>,
        batch: &Batch,
        fwd: Forward,
        dlogp: &[f32],
        grads: &mut LoraParams,
    ) {
        let cfg = &self.base.cfg;
        let (n, h, f) = (batch.rows(), cfg.hidden_size, cfg.intermediate_size);
        let hd = cfg.head_dim;
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let vocab = cfg.vocab_size;
        let rank = adapter.params.rank;
        let Forward { acts, .. } = fwd;
        let mut dz = acts.probs;
        // ∂log p(label)/∂z = onehot(label) − softmax(z).
        dz.par_chunks_exact_mut(vocab)
            .zip(&batch.targets)
            .zip(dlogp)
            .for_each(|((z, &(_, label)), &g)| {
                z.iter_mut().for_each(|p| *p *= -g);
                z[label as usize] += g;
            });
        let r = batch.targets.len();
        let mut dpicked = vec![0.0; r * h];
        gemm(
            r,
            h,
            vocab,
            &dz,
            Layout::Plain,
            self.base.head(),
            Layout::Plain,
            &mut dpicked,
            false,
            1.0,
            true,
        );
        drop(dz);
        let mut dhf = vec![0.0; n * h];
        for (&(row, _), d) in batch.targets.iter().zip(dpicked.chunks_exact(h)) {
            dhf[row * h..(row + 1) * h]
                .iter_mut()
                .zip(d)
                .for_each(|(a, b)| *a += b);
        }
        let mut dx = vec![0.0; n * h];
        rms_norm_back(&acts.x_out, &self.base.final_norm, &acts.rf, &dhf, &mut dx);
        drop(dhf);
        let Some(first) = adapter
            .params
            .layers
            .iter()
            .position(|slots| slots.iter().any(Option::is_some))
        else {
            return;
        };
        for (l, saved) in acts.layers.into_iter().enumerate().skip(first).rev() {
            let a = match saved {
                Saved::Full(a) => *a,
                // The same input, factors and dropout keys: the same activations.
                Saved::Input(x_in) => self.layer_forward(l, x_in, Some(adapter), batch).0,
            };
            let mut grad_slots = grads.layers[l].iter_mut();
            let slots: [Option<Slot<'_>>; 7] = std::array::from_fn(|i| {
                let grad = grad_slots.next().and_then(Option::as_mut);
                let site = adapter.site(l, wick_engine::adapters::Target::ALL[i]);
                match (site, grad, a.xa[i].as_deref()) {
                    (Some(site), Some(grad), Some(xa)) => Some(Slot { site, grad, xa }),
                    _ => None,
                }
            });
            dx = self.layer_back(&a, l, dx, slots, (n, h, f, qd, kvd), rank, batch);
        }
    }

    /// One layer's backward: the gradient w.r.t. its input from the one w.r.t. its output.
    #[allow(clippy::too_many_arguments)]
    fn layer_back(
        &self,
        a: &LayerActs,
        l: usize,
        dx: Vec<f32>,
        slots: [Option<Slot<'_>>; 7],
        (n, h, f, qd, kvd): (usize, usize, usize, usize, usize),
        rank: usize,
        batch: &Batch,
    ) -> Vec<f32> {
        let lw = &self.base.layers[l];
        let hd = self.base.cfg.head_dim;
        let [sq, sk, sv, so, sg, su, sd] = slots;
        // x_next = x_mid + down(act): both branches see dx.
        let mut dact = vec![0.0; n * f];
        project_back(&dx, n, &a.act, &lw.wd, h, f, sd, rank, &mut dact);
        // act = silu(g)·u.
        let mut dg = vec![0.0; n * f];
        let mut du = vec![0.0; n * f];
        for i in 0..n * f {
            let (gv, uv, d) = (a.g[i], a.u[i], dact[i]);
            let sg = sigmoid(gv);
            du[i] = d * gv * sg;
            dg[i] = d * uv * sg * (1.0 + gv * (1.0 - sg));
        }
        drop(dact);
        let mut dh2 = vec![0.0; n * h];
        project_back(&dg, n, &a.h2, &lw.wg, f, h, sg, rank, &mut dh2);
        project_back(&du, n, &a.h2, &lw.wu, f, h, su, rank, &mut dh2);
        let mut dx_mid = dx;
        rms_norm_back(&a.x_mid, &lw.ffn_norm, &a.r2, &dh2, &mut dx_mid);
        // x_mid = x_in + o_proj(attn).
        let mut dattn = vec![0.0; n * qd];
        project_back(&dx_mid, n, &a.attn, &lw.wo, h, qd, so, rank, &mut dattn);
        let (mut dq, mut dk, dv) = attention::backward(
            self.shape,
            &a.q,
            &a.k,
            &a.v,
            &a.probs,
            &dattn,
            &batch.starts,
        );
        self.rotary.apply(&mut dq, qd, hd, &batch.starts, -1.0);
        self.rotary.apply(&mut dk, kvd, hd, &batch.starts, -1.0);
        let mut dh1 = vec![0.0; n * h];
        project_back(&dq, n, &a.h1, &lw.wq, qd, h, sq, rank, &mut dh1);
        project_back(&dk, n, &a.h1, &lw.wk, kvd, h, sk, rank, &mut dh1);
        project_back(&dv, n, &a.h1, &lw.wv, kvd, h, sv, rank, &mut dh1);
        let mut dx_in = dx_mid;
        rms_norm_back(&a.x_in, &lw.attn_norm, &a.r1, &dh1, &mut dx_in);
        dx_in
    }
}
