//! Mixture-of-experts feed-forward blocks: routing (softmax, top-k, renormalised weights)
//! and the expert products. A backend runs them through [`Backend::moe`]; by default
//! (here, [`Experts::forward_on_host`]) the router's logits are read to the host, routed
//! there, and the experts run gather-style: the rows routed to one expert are gathered and
//! multiplied together, so each expert's weights are read once per forward pass instead of
//! once per token. A backend that routes on the device keeps the experts stacked
//! ([`Backend::moe_weights`], [`MoeTensors`]) instead of one matrix each.
use std::borrow::Cow;

use wick_gguf::GgmlType;

use crate::adapters::{ExpertPart, LoraBatch};
use crate::backend::{Activation, Backend, HostWeight, LowRankDelta};
use crate::{EngineError, Result};

/// Which experts each row goes to, and with what weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per row.
    pub top_k: usize,
    /// `[rows][top_k]` expert indices.
    pub experts: Vec<usize>,
    /// `[rows][top_k]` weights of the experts' outputs.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Rows routed.
    pub fn rows(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }

    /// Gemma 4's router on logits `[rows][experts]`: softmax over the experts, the `top_k`
    /// most probable (the earlier expert first among equals), their probabilities
    /// renormalised to sum to one, each then multiplied by its expert's `per_expert_scale`.
    pub fn softmax_top_k(
        logits: &[f32],
        n_experts: usize,
        top_k: usize,
        per_expert_scale: &[f32],
    ) -> Result<Routing> {
        if n_experts == 0
            || top_k == 0
            || top_k > n_experts
            || !logits.len().is_multiple_of(n_experts)
            || per_expert_scale.len() != n_experts
        {
            return Err(EngineError::InvalidInput(format!(
                "routing {} logits over {n_experts} experts, top {top_k}, {} scales",
                logits.len(),
                per_expert_scale.len()
            )));
        }
        let rows = logits.len() / n_experts;
        let mut experts = Vec::with_capacity(rows * top_k);
        let mut weights = Vec::with_capacity(rows * top_k);
        let mut order: Vec<usize> = Vec::with_capacity(n_experts);
        let mut probs = vec![0f32; n_experts];
        for row in logits.chunks_exact(n_experts) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, &l) in probs.iter_mut().zip(row) {
                *p = (l - max).exp();
                sum += *p;
            }
            probs.iter_mut().for_each(|p| *p /= sum);
            order.clear();
            order.extend(0..n_experts);
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let top = &order[..top_k];
            let total: f32 = top.iter().map(|&e| probs[e]).sum();
            for &e in top {
                experts.push(e);
                weights.push(probs[e] / total * per_expert_scale[e]);
            }
        }
        Ok(Routing {
            top_k,
            experts,
            weights,
        })
    }
}

/// A layer's experts as a backend that routes on the device keeps them
/// ([`Backend::moe_weights`]).
pub struct MoeTensors<B: Backend> {
    /// Every expert's `[gate; up]`, stacked: `[experts * 2 * intermediate, hidden]`.
    pub gate_up: B::Matrix,
    /// Every expert's down projection, stacked: `[experts * hidden, intermediate]`.
    pub down: B::Matrix,
    /// The per-expert output scale, `[1, experts]`.
    pub scale: B::Tensor,
}

/// The experts of one layer: each a gated MLP `down(act(gate(x)) * up(x))`, with gate and
/// up stacked in one matrix `[2 * intermediate, hidden]`, and the router's choice of
/// `top_k` of them per row ([`Routing::softmax_top_k`]).
pub struct Experts<B: Backend> {
    /// One matrix per expert (empty where the backend keeps them stacked).
    gate_up: Vec<B::Matrix>,
    down: Vec<B::Matrix>,
    /// The backend's stacked copy, where it routes on the device.
    stacked: Option<MoeTensors<B>>,
    n_experts: usize,
    top_k: usize,
    per_expert_scale: Vec<f32>,
    hidden: usize,
    intermediate: usize,
    activation: Activation,
}

/// Expert `e` of a `[experts, rows, cols]` float tensor, as a matrix weight.
fn expert_slice<'a>(w: &'a HostWeight<'_>, e: usize) -> Result<HostWeight<'a>> {
    let (rows, cols) = (w.shape[1], w.shape[2]);
    let elem = match w.dtype {
        GgmlType::F32 => 4,
        GgmlType::F16 | GgmlType::Bf16 => 2,
        other => {
            return Err(EngineError::UnsupportedDtype {
                source_name: "expert weights".into(),
                tensor: w.name.clone(),
                dtype: other.to_string(),
            })
        }
    };
    let size = rows * cols * elem;
    Ok(HostWeight {
        name: format!("{}[{e}]", w.name),
        dtype: w.dtype,
        shape: vec![rows, cols],
        bytes: Cow::Borrowed(&w.bytes[e * size..(e + 1) * size]),
    })
}

impl<B: Backend> Experts<B> {
    /// Uploads stacked expert weights: `gate_up` `[experts, 2 * intermediate, hidden]` and
    /// `down` `[experts, hidden, intermediate]` (float types; shapes checked by the
    /// caller), routed `top_k` to a row with each expert's output times its
    /// `per_expert_scale`. The backend keeps them stacked where it routes on the device
    /// ([`Backend::moe_weights`]), else one matrix per expert. Returns the experts and the
    /// bytes their matrices take.
    pub fn upload(
        be: &B,
        gate_up: &HostWeight<'_>,
        down: &HostWeight<'_>,
        per_expert_scale: Vec<f32>,
        top_k: usize,
        activation: Activation,
    ) -> Result<(Self, usize)> {
        let bad = |what: String| EngineError::InvalidInput(format!("expert weights: {what}"));
        let [n, two_i, hidden] = gate_up.shape[..] else {
            return Err(bad(format!("gate_up shape {:?} is not 3-D", gate_up.shape)));
        };
        let intermediate = two_i / 2;
        if !two_i.is_multiple_of(2)
            || down.shape != [n, hidden, intermediate]
            || gate_up.dtype != down.dtype
        {
            return Err(bad(format!(
                "gate_up {:?} and down {:?} do not fit together",
                gate_up.shape, down.shape
            )));
        }
        if per_expert_scale.len() != n || top_k == 0 || top_k > n {
            return Err(bad(format!(
                "{} per-expert scales and top {top_k} for {n} experts",
                per_expert_scale.len()
            )));
        }
        if let Some(t) = be.moe_weights(gate_up, down, &per_expert_scale)? {
            let bytes = be.matrix_bytes(&t.gate_up) + be.matrix_bytes(&t.down);
            let experts = Experts {
                gate_up: Vec::new(),
                down: Vec::new(),
                stacked: Some(t),
                n_experts: n,
                top_k,
                per_expert_scale,
                hidden,
                intermediate,
                activation,
            };
            return Ok((experts, bytes));
        }
        let mut bytes = 0;
        let mut up_mats = Vec::with_capacity(n);
        let mut down_mats = Vec::with_capacity(n);
        for e in 0..n {
            let m = be.matrix(expert_slice(gate_up, e)?)?;
            bytes += be.matrix_bytes(&m);
            up_mats.push(m);
            let m = be.matrix(expert_slice(down, e)?)?;
            bytes += be.matrix_bytes(&m);
            down_mats.push(m);
        }
        Ok((
            Experts {
                gate_up: up_mats,
                down: down_mats,
                stacked: None,
                n_experts: n,
                top_k,
                per_expert_scale,
                hidden,
                intermediate,
                activation,
            },
            bytes,
        ))
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.n_experts
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.n_experts == 0
    }

    /// Experts per row.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Each expert's output scale.
    pub fn per_expert_scale(&self) -> &[f32] {
        &self.per_expert_scale
    }

    /// The hidden size (each expert's input and output width).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Each expert's inner width.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// The gate's activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// The backend's stacked copy ([`Backend::moe_weights`]), where it made one.
    pub fn stacked(&self) -> Option<&MoeTensors<B>> {
        self.stacked.as_ref()
    }

    /// [`Backend::moe`] on the host: the logits `[rows, experts]` read back, routed by
    /// [`Routing::softmax_top_k`], and the experts run by [`Experts::forward_grouped`].
    pub fn forward_on_host(
        &self,
        be: &B,
        x: &B::Tensor,
        logits: &B::Tensor,
        rows: usize,
    ) -> Result<B::Tensor> {
        let logits = be.rows_to_host(logits, &[rows])?.pop().unwrap_or_default();
        let routing =
            Routing::softmax_top_k(&logits, self.n_experts, self.top_k, &self.per_expert_scale)?;
        self.forward_grouped(be, x, &routing)
    }

    pub(crate) fn check(&self, routing: &Routing) -> Result<()> {
        if self.gate_up.len() != self.n_experts {
            return Err(EngineError::Backend {
                backend: "moe",
                message: "the experts are stacked on the device; they run through Backend::moe"
                    .into(),
            });
        }
        if let Some(&e) = routing.experts.iter().find(|&&e| e >= self.len()) {
            return Err(EngineError::InvalidInput(format!(
                "routed to expert {e} of {}",
                self.len()
            )));
        }
        Ok(())
    }

    /// One expert on the rows `x` `[m, hidden]` (batch rows `picked`), with the adapters'
    /// deltas on it, to the host.
    fn expert(
        &self,
        be: &B,
        x: &B::Tensor,
        e: usize,
        picked: &[usize],
        lora: Option<(&LoraBatch<'_, B>, usize)>,
    ) -> Result<Vec<f32>> {
        let y = match lora {
            Some((lora, layer)) => self.expert_with_deltas(be, x, e, picked, lora, layer)?,
            None => self.expert_output(be, x, e)?,
        };
        Ok(be
            .rows_to_host(&y, &[picked.len()])?
            .pop()
            .unwrap_or_default())
    }

    /// One expert on the rows `x` `[m, hidden]`, `[m, hidden]` on the backend.
    pub(crate) fn expert_output(&self, be: &B, x: &B::Tensor, e: usize) -> Result<B::Tensor> {
        self.expert_with_deltas(be, x, e, &[], &LoraBatch::empty(), 0)
    }

    /// [`Experts::expert_output`] with each adapter's deltas beside expert `e`'s two
    /// products (PEFT's `target_parameters` on the stacked weights), at the rows of `x`
    /// whose batch rows (`picked`, one per row of `x`) use that adapter.
    pub(crate) fn expert_with_deltas(
        &self,
        be: &B,
        x: &B::Tensor,
        e: usize,
        picked: &[usize],
        lora: &LoraBatch<'_, B>,
        layer: usize,
    ) -> Result<B::Tensor> {
        // Each adapter's rows among the expert's, ascending (`picked` is ascending).
        let deltas = |part: ExpertPart| -> Vec<_> {
            lora.expert_deltas(layer, part, e)
                .into_iter()
                .filter_map(|(a, b, rows)| {
                    let at: Vec<usize> = picked
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| rows.binary_search(r).is_ok())
                        .map(|(i, _)| i)
                        .collect();
                    (!at.is_empty()).then_some((a, b, at))
                })
                .collect()
        };
        let add = |x: &B::Tensor, y: B::Tensor, d: &[(&B::Matrix, &B::Matrix, Vec<usize>)]| {
            if d.is_empty() {
                return Ok(y);
            }
            let list: Vec<LowRankDelta<'_, B>> = d
                .iter()
                .map(|&(a, b, ref at)| LowRankDelta {
                    a,
                    b,
                    rows: at,
                    all: at.len() == picked.len(),
                })
                .collect();
            be.low_rank_add(x, vec![y], &[&list])?
                .pop()
                .ok_or_else(|| EngineError::Backend {
                    backend: be.name(),
                    message: "low_rank_add returned no output".into(),
                })
        };
        let i = self.intermediate;
        let both = be.linear(x, &self.gate_up[e], None)?;
        let both = add(x, both, &deltas(ExpertPart::GateUp))?;
        let parts = be.split_columns(&both, &[i, i])?;
        let [gate, up] = parts.as_slice() else {
            return Err(EngineError::Backend {
                backend: be.name(),
                message: "split_columns returned too few parts".into(),
            });
        };
        let act = be.glu(gate, up, self.activation)?;
        let y = be.linear(&act, &self.down[e], None)?;
        add(&act, y, &deltas(ExpertPart::Down))
    }

    /// [`Experts::forward_on_host`] with the deltas `lora`'s adapters put on `layer`'s
    /// experts (each row's own adapters'): what a layer runs when some row's adapter
    /// targets the stacked expert weights. The backend must keep one matrix per expert
    /// (not [`Backend::moe_weights`]'s stacked copy).
    pub fn forward_on_host_with_deltas(
        &self,
        be: &B,
        x: &B::Tensor,
        logits: &B::Tensor,
        rows: usize,
        lora: &LoraBatch<'_, B>,
        layer: usize,
    ) -> Result<B::Tensor> {
        let logits = be.rows_to_host(logits, &[rows])?.pop().unwrap_or_default();
        let routing =
            Routing::softmax_top_k(&logits, self.n_experts, self.top_k, &self.per_expert_scale)?;
        self.grouped(be, x, &routing, Some((lora, layer)))
    }

    /// The weighted sum of each row's experts, `[rows, hidden]`: every expert gathers the
    /// rows routed to it and runs them as one product.
    pub fn forward_grouped(&self, be: &B, x: &B::Tensor, routing: &Routing) -> Result<B::Tensor> {
        self.grouped(be, x, routing, None)
    }

    fn grouped(
        &self,
        be: &B,
        x: &B::Tensor,
        routing: &Routing,
        lora: Option<(&LoraBatch<'_, B>, usize)>,
    ) -> Result<B::Tensor> {
        self.check(routing)?;
        let rows = routing.rows();
        let h = self.hidden;
        let mut members: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.len()];
        for (slot, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            members[e].push((slot / routing.top_k, w));
        }
        let mut out = vec![0f32; rows * h];
        for (e, list) in members.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let picked: Vec<usize> = list.iter().map(|&(r, _)| r).collect();
            let xs = be.select_rows(x, &picked)?;
            let y = self.expert(be, &xs, e, &picked, lora)?;
            for (&(r, w), yr) in list.iter().zip(y.chunks_exact(h)) {
                for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(yr) {
                    *o += w * v;
                }
            }
        }
        be.tensor_from_host(out, rows, h)
    }

    /// The same sum one row and one expert at a time (the reference the grouped form is
    /// measured against).
    pub fn forward_per_token(&self, be: &B, x: &B::Tensor, routing: &Routing) -> Result<B::Tensor> {
        self.check(routing)?;
        let rows = routing.rows();
        let h = self.hidden;
        let mut out = vec![0f32; rows * h];
        for r in 0..rows {
            let xr = be.select_rows(x, &[r])?;
            for k in 0..routing.top_k {
                let (e, w) = (
                    routing.experts[r * routing.top_k + k],
                    routing.weights[r * routing.top_k + k],
                );
                let y = self.expert(be, &xr, e, &[r], None)?;
                for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(&y) {
                    *o += w * v;
                }
            }
        }
        be.tensor_from_host(out, rows, h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::candle::CandleBackend;

    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn weight(name: &str, shape: Vec<usize>, values: &[f32]) -> HostWeight<'static> {
        HostWeight {
            name: name.into(),
            dtype: GgmlType::F32,
            shape,
            bytes: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        }
    }

    #[test]
    fn routing_picks_the_most_probable_and_renormalises() {
        let logits = [0.0, 2.0, 1.0, -1.0, 3.0, 3.0, 0.0, 0.0];
        let r = Routing::softmax_top_k(&logits, 4, 2, &[1.0, 2.0, 1.0, 1.0]).unwrap();
        assert_eq!(r.experts, vec![1, 2, 0, 1]);
        let (e1, e2) = (2f32.exp(), 1f32.exp());
        assert!((r.weights[0] - 2.0 * e1 / (e1 + e2)).abs() < 1e-6);
        assert!((r.weights[1] - e2 / (e1 + e2)).abs() < 1e-6);
        // Equal probabilities: the lower index first, each half.
        assert!((r.weights[2] - 0.5).abs() < 1e-6 && (r.weights[3] - 1.0).abs() < 1e-6);
        assert!(Routing::softmax_top_k(&logits, 4, 5, &[1.0; 4]).is_err());
        assert!(Routing::softmax_top_k(&logits, 3, 1, &[1.0; 3]).is_err());
    }

    #[test]
    fn grouped_experts_equal_the_per_token_loop() {
        let be = CandleBackend::cpu();
        let (n, h, i, rows, k) = (6, 16, 8, 9, 2);
        let gu = weight("gate_up", vec![n, 2 * i, h], &noise(1, n * 2 * i * h));
        let down = weight("down", vec![n, h, i], &noise(2, n * h * i));
        let scale = vec![1.5; n];
        let (experts, _) =
            Experts::upload(&be, &gu, &down, scale.clone(), k, Activation::GeluTanh).unwrap();
        let x = be.tensor_from_host(noise(3, rows * h), rows, h).unwrap();
        let logits = noise(4, rows * n);
        let routing = Routing::softmax_top_k(&logits, n, k, &scale).unwrap();
        let a = experts.forward_grouped(&be, &x, &routing).unwrap();
        let b = experts.forward_per_token(&be, &x, &routing).unwrap();
        let (a, b) = (a.data(), b.data());
        assert!(a.iter().any(|v| v.abs() > 1e-3));
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        let bad = Routing {
            top_k: 1,
            experts: vec![n],
            weights: vec![1.0],
        };
        assert!(experts.forward_grouped(&be, &x, &bad).is_err());
    }

    /// [`Backend::moe`]'s default (what the CPU and MLX backends run) is the path Gemma 4
    /// took before the op existed: the logits routed on the host, each row's experts run
    /// one at a time and summed with their weights.
    #[test]
    fn the_default_moe_op_equals_host_routing_and_the_per_token_loop() {
        let be = CandleBackend::cpu();
        let (n, h, i, rows, k) = (8, 24, 12, 5, 3);
        let gu = weight("gate_up", vec![n, 2 * i, h], &noise(5, n * 2 * i * h));
        let down = weight("down", vec![n, h, i], &noise(6, n * h * i));
        let scale: Vec<f32> = noise(7, n).iter().map(|s| 1.0 + s).collect();
        let (experts, _) =
            Experts::upload(&be, &gu, &down, scale.clone(), k, Activation::Silu).unwrap();
        assert!(
            experts.stacked().is_none(),
            "the CPU keeps one matrix per expert"
        );
        let x = be.tensor_from_host(noise(8, rows * h), rows, h).unwrap();
        let raw = noise(9, rows * n);
        let logits = be.tensor_from_host(raw.clone(), rows, n).unwrap();
        let got = be.moe(&experts, &x, &logits, rows).unwrap();
        let routing = Routing::softmax_top_k(&raw, n, k, &scale).unwrap();
        let want = experts.forward_per_token(&be, &x, &routing).unwrap();
        let (got, want) = (got.data(), want.data());
        assert_eq!(got.len(), rows * h);
        assert!(want.iter().any(|v| v.abs() > 1e-3));
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // A router of the wrong width is refused, not misread.
        let narrow = be.tensor_from_host(noise(10, rows * 3), rows, 3).unwrap();
        assert!(be.moe(&experts, &x, &narrow, rows).is_err());
        // The scales and top-k are checked at upload.
        assert!(Experts::upload(&be, &gu, &down, vec![1.0; n - 1], k, Activation::Silu).is_err());
        assert!(Experts::upload(&be, &gu, &down, scale, n + 1, Activation::Silu).is_err());
    }
}
