//! The media towers' parameters, read from `config.json` and the processor configs by
//! [`crate::models::vision`] and [`crate::models::audio`].

/// Gemma 3's vision tower (SigLIP) and projector, from `config.json`'s `vision_config` and
/// the multimodal fields beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Width of the encoder.
    pub hidden_size: usize,
    /// Inner width of the encoder's MLP.
    pub intermediate_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels (3).
    pub channels: usize,
    /// Side of the square image the tower reads, in pixels.
    pub image_size: usize,
    /// Side of a patch, in pixels.
    pub patch_size: usize,
    /// Epsilon of the encoder's LayerNorms and of the projector's RMSNorm.
    pub eps: f32,
    /// Soft tokens per image (a square number: the pooled patch grid).
    pub tokens_per_image: usize,
    /// The soft token an image's rows stand for.
    pub image_token_id: u32,
    /// Begin-of-image token.
    pub boi_token_id: u32,
    /// End-of-image token.
    pub eoi_token_id: u32,
}

/// Which Qwen tower a checkpoint has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QwenTower {
    /// Qwen 3.5 (`qwen3_5`): learned positions, LayerNorm, GELU MLP, full attention.
    Qwen35,
    /// Qwen2.5-VL (`qwen2_5_vl`): RMSNorm, SwiGLU MLP, window attention.
    Qwen25 {
        /// Side of an attention window in pixels.
        window_size: usize,
        /// Blocks that attend over the whole image instead of their window.
        full_blocks: Vec<usize>,
    },
}

/// A Qwen vision tower, from `config.json`'s `vision_config`, the token ids beside it and
/// the image processor's `preprocessor_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVisionConfig {
    /// Which generation.
    pub tower: QwenTower,
    /// Blocks.
    pub depth: usize,
    /// Width of the blocks.
    pub hidden_size: usize,
    /// Inner width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels (3).
    pub channels: usize,
    /// Side of a patch, in pixels.
    pub patch_size: usize,
    /// Frames per patch cube (a still image repeats its frame this many times).
    pub temporal_patch_size: usize,
    /// Patches per side of the window the merger joins into one soft token.
    pub merge_size: usize,
    /// Width of the merger's output (the text model's hidden size).
    pub out_hidden_size: usize,
    /// Learned positions (a square grid; 0 for towers without them).
    pub num_position_embeddings: usize,
    /// Base of the blocks' 2-D rotary.
    pub rope_theta: f64,
    /// The soft token an image's rows stand for.
    pub image_token_id: u32,
    /// `<|vision_start|>`.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`.
    pub vision_end_token_id: u32,
    /// The processor's pixel budget: fewest pixels after resizing.
    pub min_pixels: usize,
    /// Most pixels after resizing.
    pub max_pixels: usize,
    /// Per-channel mean subtracted after rescaling to `[0, 1]`.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by.
    pub image_std: [f32; 3],
}

/// The Gemma 4 vision tower and its embedder, from `config.json`'s `vision_config`, the
/// multimodal token ids beside it and the image processor's budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4VisionConfig {
    /// Width of the encoder.
    pub hidden_size: usize,
    /// Inner width of the encoder's MLP.
    pub intermediate_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
    /// Side of a patch, in pixels.
    pub patch_size: usize,
    /// Patches per side of the block one soft token averages.
    pub pool: usize,
    /// Rows of each of the x and y position tables.
    pub position_rows: usize,
    /// Rotary base of the axial embeddings.
    pub rope_theta: f64,
    /// Epsilon of every RMS norm of the tower and embedder.
    pub eps: f32,
    /// Pooled rows are standardized with `std_bias` / `std_scale`.
    pub standardize: bool,
    /// Linear layers clamp their inputs and outputs (`use_clipped_linears`).
    pub clipped_linears: bool,
    /// Most soft tokens per image (`max_soft_tokens` of the image processor).
    pub max_soft_tokens: usize,
    /// The soft token an image's rows stand for.
    pub image_token_id: u32,
    /// Begin-of-image token.
    pub boi_token_id: u32,
    /// End-of-image token.
    pub eoi_token_id: u32,
}

/// Gemma 4's audio Conformer, from `config.json`'s `audio_config` and the token ids beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioConfig {
    /// Width of the Conformer.
    pub hidden_size: usize,
    /// Conformer layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Output channels of the subsampler's two convolutions.
    pub conv_channels: [usize; 2],
    /// Kernel of the light depthwise convolution.
    pub conv_kernel: usize,
    /// Scale of a feed-forward's output before its residual (½ in Gemma 4).
    pub residual_weight: f32,
    /// Queries per attention chunk.
    pub chunk: usize,
    /// Left context of a chunk (keys `0 ..= left − 2` frames back are seen).
    pub context_left: usize,
    /// Right context (keys up to `right − 1` frames ahead are seen).
    pub context_right: usize,
    /// Soft cap of the attention logits.
    pub logit_cap: f32,
    /// The logit a masked key gets.
    pub invalid_logit: f32,
    /// Whether the linears clamp their inputs and outputs to bounds stored with the weights.
    pub clipped_linears: bool,
    /// Epsilon of the RMSNorms and LayerNorms.
    pub eps: f32,
    /// Bound of the activations' clamps.
    pub gradient_clipping: f32,
    /// Width of the tower's output projection (`embed_audio`'s input).
    pub output_dims: usize,
    /// The soft token each audio row stands for.
    pub audio_token_id: u32,
    /// Begin-of-audio token.
    pub boa_token_id: u32,
    /// End-of-audio token.
    pub eoa_token_id: u32,
}
