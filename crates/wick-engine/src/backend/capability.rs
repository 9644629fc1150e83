//! What each backend can run and what each model needs of it, checked in one place.
//!
//! A backend declares its [`Capabilities`]: the ops beyond the core surface of
//! [`Backend`](super::Backend) it implements, the largest attention head it takes, and how
//! it prefers to work. A model family declares its [`Need`]s from its configuration
//! ([`crate::models::needs`]): each names a [`Requirement`], the [`Part`] of the model it is
//! for (the text model, a media tower, adapters, speculative decoding) and why. [`check`]
//! holds one against the other: a text need that is missing refuses the model at load with
//! one error ([`Unsupported`]); a tower whose needs are missing is left out (the model
//! reads text only), and adapters or speculation whose needs are missing are refused when
//! asked for, each with the same message.
//!
//! The declarations are constants of this module rather than methods of a live backend, so
//! the backend × family table in the README (`tests/support_table.rs`) is written from
//! them on machines without a GPU.
use std::fmt;

use super::BackendKind;

/// An op, or a variant of one, that only some backends implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capability {
    /// [`Backend::layer_norm`](super::Backend::layer_norm): LayerNorm with a bias.
    LayerNorm,
    /// [`Backend::activation`](super::Backend::activation): an activation outside a gated MLP.
    Activation,
    /// Rotary cos/sin scaled by an attention factor other than 1 (YaRN, LongRoPE).
    RopeAttentionFactor,
    /// [`Backend::attention_to`](super::Backend::attention_to): rows that see keys past
    /// their own position (an image's soft tokens see each other both ways).
    AttentionTo,
    /// [`Backend::rope_table_axes`](super::Backend::rope_table_axes): rotary positions of
    /// several components (M-RoPE, a vision tower's 2-D rotary).
    RopeAxes,
    /// [`Backend::tensor_from_host`](super::Backend::tensor_from_host): activations
    /// computed on the host enter the pass (layers that run partly on the host).
    HostTensors,
    /// [`Backend::attention_shared`](super::Backend::attention_shared) with no new rows:
    /// a layer attends to the KV cache of an earlier layer.
    SharedKv,
    /// [`Backend::add_rows`](super::Backend::add_rows): a delta added to some rows of a
    /// batch, so sequences on different adapters share a step.
    RowDeltas,
    /// Adapter factors kept in f16/bf16 (else f32).
    HalfAdapterFactors,
    /// Adapter deltas on a mixture-of-experts layer's stacked expert weights (PEFT's
    /// `target_parameters`), which run on the host-routed path with one matrix per expert.
    ExpertAdapters,
    /// Drafted rows verified in a step and trimmed off the caches again.
    Speculation,
    /// Rows verifying drafts beside rows decoding plainly, in one step.
    BatchedSpeculation,
    /// [`Backend::delta_net`](super::Backend::delta_net): a gated DeltaNet layer's mixer
    /// over per-sequence recurrent states (by default on the host, with host activations
    /// uploaded into the pass).
    DeltaNet,
    /// [`Backend::sigmoid_gate`](super::Backend::sigmoid_gate): an attention output gate
    /// (by default on the host, likewise).
    SigmoidGate,
}

impl Capability {
    /// What the capability is, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Capability::LayerNorm => "LayerNorm",
            Capability::Activation => "an activation outside a gated MLP",
            Capability::RopeAttentionFactor => "rotary cos/sin scaling (YaRN, LongRoPE)",
            Capability::AttentionTo => "bidirectional attention inside an image",
            Capability::RopeAxes => "multimodal rotary positions (M-RoPE)",
            Capability::HostTensors => "host activations uploaded into a pass",
            Capability::SharedKv => "KV caches shared between layers",
            Capability::RowDeltas => "adapter deltas on some rows of a batch",
            Capability::HalfAdapterFactors => "half-precision adapter factors",
            Capability::ExpertAdapters => "adapter deltas on mixture-of-experts weights",
            Capability::Speculation => "speculative decoding (verifying drafts, trimming caches)",
            Capability::BatchedSpeculation => "drafts verified beside plainly decoding rows",
            Capability::DeltaNet => "the gated DeltaNet mixer",
            Capability::SigmoidGate => "a sigmoid output gate",
        }
    }
}

/// What one backend implements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capabilities {
    /// The backend's name (as `--backend` takes it).
    pub backend: &'static str,
    /// The optional ops it implements.
    pub ops: &'static [Capability],
    /// The largest attention head size its attention takes.
    pub max_head_dim: usize,
    /// Logits live in device memory: greedy rows under a grammar are better picked by the
    /// backend's masked argmax than sampled on the host.
    pub device_logits: bool,
    /// Tokens a step of prompt chunks alone carries by default (at least the step
    /// budget): long chunks where the backend's products and attention get faster with
    /// more rows (a GPU); `None`, the step budget, where they do not.
    pub lone_prompt_tokens: Option<usize>,
    /// The default bound on decoding rows' inter-token gap while a prompt arrives, as a
    /// multiple of a decode-only step (`None`: prompt chunks of the step budget). Off on
    /// the CPU, where chunks of a few dozen rows would lose the tile kernels' speed and a
    /// prompt would take many times longer.
    pub itl_factor: Option<f64>,
}

impl Capabilities {
    /// Whether the backend implements `c`.
    pub fn has(&self, c: Capability) -> bool {
        self.ops.contains(&c)
    }

    /// Whether it meets `r`.
    pub fn meets(&self, r: Requirement) -> bool {
        match r {
            Requirement::Op(c) => self.has(c),
            Requirement::HeadDim(d) => d <= self.max_head_dim,
            Requirement::NotBuilt(_) => false,
        }
    }
}

/// The CPU backend (`backend/candle`): every op.
pub const CPU: Capabilities = Capabilities {
    backend: "cpu",
    ops: &[
        Capability::LayerNorm,
        Capability::Activation,
        Capability::RopeAttentionFactor,
        Capability::AttentionTo,
        Capability::RopeAxes,
        Capability::HostTensors,
        Capability::SharedKv,
        Capability::RowDeltas,
        Capability::HalfAdapterFactors,
        Capability::ExpertAdapters,
        Capability::Speculation,
        Capability::BatchedSpeculation,
        Capability::DeltaNet,
        Capability::SigmoidGate,
    ],
    max_head_dim: usize::MAX,
    device_logits: false,
    // A long prompt's chunks each convert every earlier key and value for the prompt
    // attention's products, so fewer chunks take less time: a 19,000-token prompt
    // (Qwen2.5-Coder-0.5B, 2 threads, AMX) 44.2 s in chunks of 512, 40.1 s of 1,024,
    // 39.6 s of 2,048, 44.0 s of 4,096 (the activations leave the caches).
    lone_prompt_tokens: Some(2048),
    itl_factor: None,
};

/// The CUDA backend (`backend/cuda`).
pub const CUDA: Capabilities = Capabilities {
    backend: "cuda",
    ops: &[
        Capability::LayerNorm,
        Capability::Activation,
        Capability::RopeAxes,
        Capability::RopeAttentionFactor,
        Capability::AttentionTo,
        Capability::HostTensors,
        Capability::SharedKv,
        Capability::RowDeltas,
        Capability::DeltaNet,
        Capability::SigmoidGate,
    ],
    // The attention kernels' widest variant (`MAX_HEAD_DIM` of `backend/cuda`).
    max_head_dim: 512,
    device_logits: true,
    lone_prompt_tokens: Some(8192),
    itl_factor: Some(2.0),
};

/// The MLX backend (`backend/mlx`).
pub const MLX: Capabilities = Capabilities {
    backend: "mlx",
    ops: &[
        Capability::LayerNorm,
        Capability::Activation,
        Capability::RopeAttentionFactor,
        Capability::AttentionTo,
        Capability::RopeAxes,
        Capability::HostTensors,
        Capability::SharedKv,
        Capability::RowDeltas,
        Capability::ExpertAdapters,
        Capability::Speculation,
        Capability::DeltaNet,
        Capability::SigmoidGate,
    ],
    max_head_dim: usize::MAX,
    device_logits: true,
    lone_prompt_tokens: Some(2048),
    itl_factor: Some(2.0),
};

/// The training backend (`backend/tape`): the ops of the dense decoder, each with a
/// backward rule, LayerNorm and the ungated MLP (StarCoder 2) included, and Gemma 4's:
/// layers reading an earlier layer's keys and values, and the experts routed on the host
/// (its values are host memory), and Qwen 3.5's: the gated DeltaNet mixer and the attention
/// output gate. Image attention has no backward yet: it returns an error naming it.
pub const TRAIN: Capabilities = Capabilities {
    backend: "train",
    ops: &[
        Capability::LayerNorm,
        Capability::Activation,
        Capability::RopeAttentionFactor,
        Capability::RowDeltas,
        Capability::SharedKv,
        Capability::HostTensors,
        Capability::DeltaNet,
        Capability::SigmoidGate,
    ],
    max_head_dim: usize::MAX,
    device_logits: false,
    lone_prompt_tokens: None,
    itl_factor: None,
};

impl BackendKind {
    /// What the backend implements (known without starting it).
    pub fn capabilities(self) -> &'static Capabilities {
        match self {
            BackendKind::Candle => &CPU,
            BackendKind::Cuda => &CUDA,
            BackendKind::Mlx => &MLX,
        }
    }
}

/// One thing a model needs of its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    /// An optional op.
    Op(Capability),
    /// Attention heads of this size.
    HeadDim(usize),
    /// Something wick does not implement for this family on any backend yet.
    NotBuilt(&'static str),
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Op(c) => f.write_str(c.describe()),
            Requirement::HeadDim(d) => write!(f, "attention heads of size {d}"),
            Requirement::NotBuilt(what) => f.write_str(what),
        }
    }
}

/// Which part of a model a need is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The text model: without it nothing loads.
    Text,
    /// The vision tower (images).
    Vision,
    /// The audio tower (audio clips).
    Audio,
    /// LoRA adapters.
    Adapters,
    /// Speculative decoding.
    Speculation,
}

impl Part {
    /// The part's name, for messages and the support table.
    pub fn name(self) -> &'static str {
        match self {
            Part::Text => "the text model",
            Part::Vision => "images",
            Part::Audio => "audio",
            Part::Adapters => "adapters",
            Part::Speculation => "speculative decoding",
        }
    }
}

/// A need, the part it is for, and what in the model asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// What is needed.
    pub requirement: Requirement,
    /// For which part.
    pub part: Part,
    /// What asks for it (e.g. "StarCoder 2's norms").
    pub why: &'static str,
}

impl Need {
    /// `requirement` for `part`, asked for by `why`.
    pub const fn new(requirement: Requirement, part: Part, why: &'static str) -> Self {
        Need {
            requirement,
            part,
            why,
        }
    }

    /// The op `c` for `part`.
    pub const fn op(c: Capability, part: Part, why: &'static str) -> Self {
        Need::new(Requirement::Op(c), part, why)
    }
}

/// A part of a model a backend cannot run, and the first need it misses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {backend} backend cannot run {part} of {family} models: {why} needs {requirement}, which {}", missing_hint(.requirement, .backend))]
pub struct Unsupported {
    /// The backend.
    pub backend: &'static str,
    /// The model family.
    pub family: String,
    /// The part.
    pub part: &'static str,
    /// What the part needs.
    pub requirement: Requirement,
    /// What asks for it.
    pub why: &'static str,
}

fn missing_hint(r: &Requirement, backend: &str) -> String {
    match r {
        Requirement::NotBuilt(_) => "wick does not implement yet".into(),
        _ if backend == CPU.backend => "this backend does not implement yet".into(),
        _ => "this backend does not implement yet; --backend cpu runs it".into(),
    }
}

/// What of a model a backend runs: the text model (else the model does not load), and each
/// optional part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Support {
    /// The text model.
    pub text: Result<(), Unsupported>,
    /// Images: `None` when the model has no vision tower.
    pub vision: Option<Result<(), Unsupported>>,
    /// Audio: `None` when the model has no audio tower.
    pub audio: Option<Result<(), Unsupported>>,
    /// LoRA adapters.
    pub adapters: Result<(), Unsupported>,
    /// Speculative decoding.
    pub speculation: Result<(), Unsupported>,
}

/// Holds `needs` (of a `family` model, as [`crate::models::needs`] lists them) against
/// `caps`. `towers` says which towers the model has (`vision`, `audio`).
pub fn check(caps: &Capabilities, family: &str, needs: &[Need], towers: [bool; 2]) -> Support {
    let part = |p: Part| -> Result<(), Unsupported> {
        match needs
            .iter()
            .find(|n| n.part == p && !caps.meets(n.requirement))
        {
            None => Ok(()),
            Some(n) => Err(Unsupported {
                backend: caps.backend,
                family: family.to_string(),
                part: p.name(),
                requirement: n.requirement,
                why: n.why,
            }),
        }
    };
    let text = part(Part::Text);
    // A part beyond the text model needs the text model too.
    let with_text = |r: Result<(), Unsupported>| text.clone().and(r);
    Support {
        vision: towers[0].then(|| with_text(part(Part::Vision))),
        audio: towers[1].then(|| with_text(part(Part::Audio))),
        adapters: with_text(part(Part::Adapters)),
        speculation: with_text(part(Part::Speculation)),
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_text_need_refuses_the_model_and_every_part() {
        let needs = [
            Need::op(Capability::HalfAdapterFactors, Part::Text, "the layers"),
            Need::op(Capability::AttentionTo, Part::Vision, "the vision tower"),
        ];
        let s = check(&CUDA, "Fake", &needs, [true, false]);
        let e = s.text.clone().unwrap_err();
        assert_eq!(e.part, "the text model");
        assert_eq!(
            e.to_string(),
            "the cuda backend cannot run the text model of Fake models: the layers needs half-precision adapter factors, which this backend does not implement yet; --backend cpu runs it"
        );
        assert_eq!(s.vision, Some(Err(e.clone())));
        assert_eq!(s.audio, None);
        assert_eq!(s.adapters, Err(e));
        assert!(check(&CPU, "Fake", &needs, [true, false]).vision == Some(Ok(())));
    }

    #[test]
    fn head_sizes_and_unbuilt_parts_are_needs_like_ops() {
        let needs = [
            Need::new(
                Requirement::HeadDim(1024),
                Part::Text,
                "full-attention layers",
            ),
            Need::new(
                Requirement::NotBuilt("adapter deltas in its layers"),
                Part::Adapters,
                "Fake's layer stack",
            ),
        ];
        assert!(check(&CUDA, "Fake", &needs, [false, false]).text.is_err());
        let cpu = check(&CPU, "Fake", &needs, [false, false]);
        assert!(cpu.text.is_ok());
        assert!(cpu
            .adapters
            .unwrap_err()
            .to_string()
            .ends_with("which wick does not implement yet"));
    }
}
