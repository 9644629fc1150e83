//! Gemma 4's per-layer layout, read from `config.json` by [`crate::models::gemma4`].
use super::media::Gemma4VisionConfig;
use crate::backend::RopeSpec;

/// One layer's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layer {
    /// Sliding-window attention (else full attention).
    pub sliding: bool,
    /// Head dimension.
    pub head_dim: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// The earlier layer whose K/V this one reuses (KV sharing).
    pub kv_source: Option<usize>,
    /// Values are the key projection.
    pub k_eq_v: bool,
    /// Dense MLP inner size.
    pub intermediate: usize,
}

/// The mixture-of-experts block's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeShape {
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Inner size of one expert.
    pub intermediate: usize,
}

/// What Gemma 4 needs beyond [`ModelConfig`]'s common fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Params {
    /// Per-layer shapes.
    pub layers: Vec<Gemma4Layer>,
    /// Per-layer input size (0: no PLE).
    pub ple_dim: usize,
    /// Rows of the per-layer embedding table.
    pub ple_vocab: usize,
    /// Experts, when the model has them.
    pub moe: Option<MoeShape>,
    /// The id per-layer inputs use for tokens outside their table.
    pub pad_id: u32,
    /// Rotary embedding of sliding layers.
    pub rope_sliding: RopeSpec,
    /// Rotary embedding of full layers.
    pub rope_full: RopeSpec,
    /// `use_bidirectional_attention: "vision"`: an image's soft tokens see each other both
    /// ways on the sliding layers (full layers stay causal, as transformers masks them).
    pub bidirectional_vision: bool,
    /// The vision tower of a `gemma4` multimodal checkpoint (`vision_config`), when
    /// `config.json` describes one; whether its weights are present is checked at load.
    pub vision: Option<Gemma4VisionConfig>,
}

impl Gemma4Params {
    /// Layers that own a KV cache: all before the first KV-shared one.
    pub fn cache_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.kv_source.is_none()).count()
    }
}
