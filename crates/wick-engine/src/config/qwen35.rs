//! Qwen 3.5's hybrid layout (gated DeltaNet layers between full-attention layers), read
//! from `config.json` by [`crate::models::qwen35`].

/// What Qwen 3.5 adds to [`ModelConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    /// Per layer: a linear-attention (DeltaNet) layer, else full attention.
    pub linear_layers: Vec<bool>,
    /// Shape of every DeltaNet layer.
    pub delta: DeltaShape,
}

impl Qwen35Config {
    /// Layers of each kind: `(full, linear)`.
    pub fn counts(&self) -> (usize, usize) {
        let linear = self.linear_layers.iter().filter(|&&l| l).count();
        (self.linear_layers.len() - linear, linear)
    }
}

/// Shape of one DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`; each key head serves `v_heads / k_heads`).
    pub v_heads: usize,
    /// Query/key head dimension.
    pub k_dim: usize,
    /// Value head dimension.
    pub v_dim: usize,
    /// Convolution kernel width.
    pub conv_kernel: usize,
}

impl DeltaShape {
    /// Channels of the convolution (q, k and v side by side).
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Floats of the convolution state (the last `conv_kernel - 1` inputs).
    pub fn conv_state_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_dim()
    }

    /// Floats of the delta-rule state (all value heads).
    pub fn ssm_state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}
