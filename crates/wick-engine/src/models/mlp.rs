//! The gated MLP's first half, `act(x · gateᵀ) · (x · upᵀ)`, for the model codes that hold
//! their layers themselves (Qwen 3.5, Gemma 4; the dense decoder has its own variants).

use crate::adapters::{LoraBatch, Target};
use crate::backend::{Activation, Backend};
use crate::{EngineError, Result};

/// A layer's gate and up projections: stacked into one matrix where the backend prefers it
/// ([`Backend::can_fuse`]: one product that applies the activation as it stores, instead of
/// two products and a GLU pass), else apart.
pub(crate) enum GateUp<B: Backend> {
    Fused { gate_up: B::Matrix, width: usize },
    Separate { gate: B::Matrix, up: B::Matrix },
}

impl<B: Backend> GateUp<B> {
    /// `gate` and `up` (`width` rows each), stacked if the backend prefers it.
    pub(crate) fn new(be: &B, gate: B::Matrix, up: B::Matrix, width: usize) -> Result<Self> {
        Ok(if be.can_fuse(&[&gate, &up]) {
            GateUp::Fused {
                gate_up: be.fuse_matrices(vec![gate, up])?,
                width,
            }
        } else {
            GateUp::Separate { gate, up }
        })
    }

    /// `act(x · gateᵀ) · (x · upᵀ)`, with layer `li`'s adapters on the gate and up outputs.
    pub(crate) fn apply(
        &self,
        be: &B,
        lora: &LoraBatch<'_, B>,
        li: usize,
        x: &B::Tensor,
        act: Activation,
    ) -> Result<B::Tensor> {
        match self {
            GateUp::Fused { gate_up, width } if lora.is_empty() => {
                be.linear_glu(x, gate_up, *width, act)
            }
            GateUp::Fused { gate_up, width } => {
                // Adapters add to the gate and up outputs, so they need them apart.
                let both = be.linear(x, gate_up, None)?;
                let gu = two(be, be.split_columns(&both, &[*width, *width])?)?;
                let [gate, up] = lora.apply_many(be, li, [Target::Gate, Target::Up], x, gu)?;
                be.glu(&gate, &up, act)
            }
            GateUp::Separate { gate, up } => {
                let gu = two(be, be.linear_many(x, &[(gate, None), (up, None)])?)?;
                let [gate, up] = lora.apply_many(be, li, [Target::Gate, Target::Up], x, gu)?;
                be.glu(&gate, &up, act)
            }
        }
    }
}

/// The two tensors of a backend call that was asked for two.
pub(crate) fn two<B: Backend>(be: &B, v: Vec<B::Tensor>) -> Result<[B::Tensor; 2]> {
    <[B::Tensor; 2]>::try_from(v).map_err(|v| EngineError::Backend {
        backend: be.name(),
        message: format!("{} products where 2 were asked for", v.len()),
    })
}
