//! Adapter deltas on a backend, and the grouped low-rank product of one batch.
//!
//! A forward pass runs each base projection once over every row of the batch; then, for
//! each adapter some row uses, one `(x_rows · Aᵀ) · Bᵀ` over just those rows, added back
//! at those rows. Rows of the base model cost nothing more; rows sharing an adapter share
//! its two small products.
use std::ops::Range;

use wick_gguf::GgmlType;

use super::precision::factor_bytes;
use super::{ExpertPart, FactorDtype, HostAdapter, Target};
use crate::backend::candle::CandleBackend;
#[cfg(feature = "cuda")]
use crate::backend::cuda::CudaBackend;
#[cfg(feature = "mlx")]
use crate::backend::mlx::MlxBackend;
use crate::backend::{Backend, HostWeight, LowRankDelta};
use crate::{EngineError, Result};

/// One projection's delta on a backend: `A` `[rank, in]` and `scale · B` `[out, rank]`.
pub struct LoraPair<B: Backend> {
    a: B::Matrix,
    b: B::Matrix,
}

/// An adapter's deltas on a backend, per layer and [`Target`].
pub struct LoraWeights<B: Backend> {
    layers: Vec<[Option<LoraPair<B>>; Target::COUNT]>,
    /// Per layer and [`ExpertPart`], each expert's pair (empty: none).
    experts: Vec<[Vec<LoraPair<B>>; 2]>,
}

fn upload<B: Backend>(
    be: &B,
    name: String,
    shape: [usize; 2],
    v: &[f32],
    dtype: FactorDtype,
) -> Result<B::Matrix> {
    be.matrix(HostWeight {
        name,
        dtype: match dtype {
            FactorDtype::F32 => GgmlType::F32,
            FactorDtype::F16 => GgmlType::F16,
            FactorDtype::Bf16 => GgmlType::Bf16,
        },
        shape: shape.to_vec(),
        bytes: factor_bytes(v, dtype),
    })
}

impl<B: Backend> LoraWeights<B> {
    /// Uploads `host`'s deltas for a model of `layers` layers, the factors in `dtype`.
    pub fn upload(be: &B, host: &HostAdapter, layers: usize, dtype: FactorDtype) -> Result<Self> {
        let mut out: Vec<[Option<LoraPair<B>>; Target::COUNT]> =
            (0..layers).map(|_| std::array::from_fn(|_| None)).collect();
        for d in &host.deltas {
            let slot = out
                .get_mut(d.layer)
                .ok_or_else(|| EngineError::InvalidInput(format!("layer {}", d.layer)))?;
            let name = format!("lora.{}.{:?}", d.layer, d.target);
            slot[d.target.index()] = Some(LoraPair {
                a: upload(be, format!("{name}.a"), [d.rank, d.in_dim], &d.a, dtype)?,
                b: upload(be, format!("{name}.b"), [d.out_dim, d.rank], &d.b, dtype)?,
            });
        }
        let mut experts: Vec<[Vec<LoraPair<B>>; 2]> =
            (0..layers).map(|_| [Vec::new(), Vec::new()]).collect();
        for d in &host.expert_deltas {
            let slot = experts
                .get_mut(d.layer)
                .ok_or_else(|| EngineError::InvalidInput(format!("layer {}", d.layer)))?;
            let pairs = (0..d.experts)
                .map(|e| {
                    let name = format!("lora.{}.{:?}[{e}]", d.layer, d.part);
                    let (a, b) = d.pair(e);
                    Ok(LoraPair {
                        a: upload(be, format!("{name}.a"), [d.rank, d.in_dim], a, dtype)?,
                        b: upload(be, format!("{name}.b"), [d.out_dim, d.rank], b, dtype)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            slot[d.part.index()] = pairs;
        }
        Ok(LoraWeights {
            layers: out,
            experts,
        })
    }

    /// Deltas of matrices already on the backend: `layers[l][target.index()]` holds
    /// `(A [rank, in], scale · B [out, rank])` (a trainer's parameters, for one).
    #[allow(clippy::type_complexity)]
    pub fn from_matrices(layers: Vec<[Option<(B::Matrix, B::Matrix)>; Target::COUNT]>) -> Self {
        LoraWeights {
            experts: layers.iter().map(|_| [Vec::new(), Vec::new()]).collect(),
            layers: layers
                .into_iter()
                .map(|slots| slots.map(|p| p.map(|(a, b)| LoraPair { a, b })))
                .collect(),
        }
    }

    /// The same deltas with one pair per expert beside `part` of `layer`'s experts:
    /// `pairs[e]` = `(A [rank, in], scale · B [out, rank])` on the backend already (a
    /// trainer's parameters, for one).
    pub fn with_expert_pairs(
        mut self,
        layer: usize,
        part: ExpertPart,
        pairs: Vec<(B::Matrix, B::Matrix)>,
    ) -> Result<Self> {
        let slot = self
            .experts
            .get_mut(layer)
            .ok_or_else(|| EngineError::InvalidInput(format!("layer {layer}")))?;
        slot[part.index()] = pairs.into_iter().map(|(a, b)| LoraPair { a, b }).collect();
        Ok(self)
    }

    /// Whether `layer` has a delta beside `t`.
    pub fn has(&self, layer: usize, t: Target) -> bool {
        self.pair(layer, t).is_some()
    }

    fn pair(&self, layer: usize, t: Target) -> Option<&LoraPair<B>> {
        self.layers.get(layer)?[t.index()].as_ref()
    }

    /// Whether `layer`'s experts have deltas.
    pub fn has_experts(&self, layer: usize) -> bool {
        self.experts
            .get(layer)
            .is_some_and(|parts| parts.iter().any(|p| !p.is_empty()))
    }

    fn expert_pair(&self, layer: usize, part: ExpertPart, e: usize) -> Option<&LoraPair<B>> {
        self.experts.get(layer)?[part.index()].get(e)
    }
}

/// An adapter's deltas on whichever backend the model runs on.
pub enum AnyLora {
    /// The CPU backend.
    Candle(LoraWeights<CandleBackend>),
    /// The MLX backend.
    #[cfg(feature = "mlx")]
    Mlx(LoraWeights<MlxBackend>),
    /// The CUDA backend.
    #[cfg(feature = "cuda")]
    Cuda(LoraWeights<CudaBackend>),
}

/// Backend-specific access to [`AnyLora`].
pub trait LoraOf: Backend + Sized {
    /// Wraps this backend's deltas.
    fn wrap_lora(w: LoraWeights<Self>) -> AnyLora;
    /// This backend's deltas, or an error for another backend's.
    fn lora_of(w: &AnyLora) -> Result<&LoraWeights<Self>>;
}

impl LoraOf for CandleBackend {
    fn wrap_lora(w: LoraWeights<Self>) -> AnyLora {
        AnyLora::Candle(w)
    }
    fn lora_of(w: &AnyLora) -> Result<&LoraWeights<Self>> {
        match w {
            AnyLora::Candle(w) => Ok(w),
            #[cfg(any(feature = "mlx", feature = "cuda"))]
            _ => Err(EngineError::InvalidInput(
                "the adapter was loaded for another backend".into(),
            )),
        }
    }
}

#[cfg(feature = "mlx")]
impl LoraOf for MlxBackend {
    fn wrap_lora(w: LoraWeights<Self>) -> AnyLora {
        AnyLora::Mlx(w)
    }
    fn lora_of(w: &AnyLora) -> Result<&LoraWeights<Self>> {
        match w {
            AnyLora::Mlx(w) => Ok(w),
            _ => Err(EngineError::InvalidInput(
                "the adapter was loaded for another backend".into(),
            )),
        }
    }
}

#[cfg(feature = "cuda")]
impl LoraOf for CudaBackend {
    fn wrap_lora(w: LoraWeights<Self>) -> AnyLora {
        AnyLora::Cuda(w)
    }
    fn lora_of(w: &AnyLora) -> Result<&LoraWeights<Self>> {
        match w {
            AnyLora::Cuda(w) => Ok(w),
            #[allow(unreachable_patterns)]
            _ => Err(EngineError::InvalidInput(
                "the adapter was loaded for another backend".into(),
            )),
        }
    }
}

/// One adapter's rows in a batch.
struct Group<'a, B: Backend> {
    weights: &'a LoraWeights<B>,
    rows: Vec<usize>,
    /// Whether `rows` is every row of the batch, in order.
    all: bool,
}

/// The adapters of one forward pass, grouped: for each distinct adapter, the batch rows
/// that use it.
pub struct LoraBatch<'a, B: Backend> {
    groups: Vec<Group<'a, B>>,
}

impl<'a, B: Backend> LoraBatch<'a, B> {
    /// No adapter on any row.
    pub fn empty() -> Self {
        LoraBatch { groups: Vec::new() }
    }

    /// Groups the rows `ranges[i]` of each sequence under each adapter of `stacks[i]`
    /// (a sequence past the end of `stacks` runs the base model).
    pub fn new(stacks: &[Vec<&'a LoraWeights<B>>], ranges: &[Range<usize>]) -> Self {
        let total = ranges.last().map_or(0, |r| r.end);
        let mut groups: Vec<Group<'a, B>> = Vec::new();
        for (stack, range) in stacks.iter().zip(ranges) {
            for &w in stack {
                let at = match groups.iter().position(|g| std::ptr::eq(g.weights, w)) {
                    Some(at) => at,
                    None => {
                        groups.push(Group {
                            weights: w,
                            rows: Vec::new(),
                            all: false,
                        });
                        groups.len() - 1
                    }
                };
                groups[at].rows.extend(range.clone());
            }
        }
        for g in &mut groups {
            g.all = g.rows.len() == total && g.rows.iter().enumerate().all(|(i, &r)| i == r);
        }
        LoraBatch { groups }
    }

    /// Whether no row uses an adapter.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Whether some row's adapter has a delta beside `target` of `layer` (where none has,
    /// the product may be fused with what follows it).
    pub fn touches(&self, layer: usize, target: Target) -> bool {
        self.groups.iter().any(|g| g.weights.has(layer, target))
    }

    /// Whether some row's adapter has deltas on `layer`'s experts.
    pub fn touches_experts(&self, layer: usize) -> bool {
        self.groups.iter().any(|g| g.weights.has_experts(layer))
    }

    /// The deltas on expert `e`'s `part` of `layer`: each adapter's `(A, scale · B)` and
    /// the batch rows that use it, ascending.
    pub fn expert_deltas(
        &self,
        layer: usize,
        part: ExpertPart,
        e: usize,
    ) -> Vec<(&B::Matrix, &B::Matrix, &[usize])> {
        self.groups
            .iter()
            .filter_map(|g| {
                let p = g.weights.expert_pair(layer, part, e)?;
                Some((&p.a, &p.b, g.rows.as_slice()))
            })
            .collect()
    }

    /// `y` (the base product of `x` for `target` of `layer`) plus every adapter's delta
    /// at the rows that use it.
    pub fn apply(
        &self,
        be: &B,
        layer: usize,
        target: Target,
        x: &B::Tensor,
        y: B::Tensor,
    ) -> Result<B::Tensor> {
        let [y] = self.apply_many(be, layer, [target], x, [y])?;
        Ok(y)
    }

    /// The deltas of `targets` of `layer`, per target.
    fn deltas<const N: usize>(
        &self,
        layer: usize,
        targets: [Target; N],
    ) -> [Vec<LowRankDelta<'_, B>>; N] {
        targets.map(|t| {
            self.groups
                .iter()
                .filter_map(|g| {
                    let p = g.weights.pair(layer, t)?;
                    Some(LowRankDelta {
                        a: &p.a,
                        b: &p.b,
                        rows: &g.rows,
                        all: g.all,
                    })
                })
                .collect()
        })
    }

    /// [`LoraBatch::apply`] for several projections of one input (q/k/v, gate/up), in one
    /// backend call.
    pub fn apply_many<const N: usize>(
        &self,
        be: &B,
        layer: usize,
        targets: [Target; N],
        x: &B::Tensor,
        ys: [B::Tensor; N],
    ) -> Result<[B::Tensor; N]> {
        let deltas = self.deltas(layer, targets);
        if deltas.iter().all(Vec::is_empty) {
            return Ok(ys);
        }
        let refs: Vec<&[LowRankDelta<'_, B>]> = deltas.iter().map(Vec::as_slice).collect();
        let out = be.low_rank_add(x, ys.into(), &refs)?;
        out.try_into().map_err(|_| EngineError::Backend {
            backend: be.name(),
            message: "low_rank_add returned another number of outputs".into(),
        })
    }
}
