//! Multimodal rotary positions (Qwen-VL's M-RoPE), read from `config.json` by
//! [`crate::models::mrope`].

/// Which of the three position components each rotary frequency turns with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mrope {
    /// One entry (0 temporal, 1 row, 2 column) per frequency of the rotated dimensions.
    pub axes: Vec<u8>,
}
