//! Errors of sampling parameters: each names the field, the bound and the value found.

/// A sampling parameter outside what the sampler accepts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A number outside its allowed range (or NaN / infinite where a finite value is needed).
    #[error("{field} must be {bound}, got {value}")]
    OutOfRange {
        /// The request field, e.g. `"top_p"`.
        field: &'static str,
        /// The allowed range in words, e.g. `"in (0, 1]"`.
        bound: &'static str,
        /// The value found.
        value: f64,
    },
    /// More top log-probabilities asked for than the sampler reports.
    #[error("top_logprobs must be at most {max}, got {requested}")]
    TooManyTopLogprobs {
        /// The count asked for.
        requested: usize,
        /// [`MAX_TOP_LOGPROBS`](super::MAX_TOP_LOGPROBS).
        max: usize,
    },
    /// A `logit_bias` entry whose bias is NaN or infinite.
    #[error("logit_bias for token {token} must be a finite number, got {bias}")]
    LogitBiasNotFinite {
        /// The token id.
        token: u32,
        /// The bias found.
        bias: f32,
    },
    /// A `logit_bias` entry for a token the model does not have.
    #[error("logit_bias names token {token}, but the vocabulary has {vocab_size} tokens")]
    LogitBiasTokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
}

impl SamplingError {
    /// A stable machine-readable name of the variant, for error bodies and metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            SamplingError::OutOfRange { .. } => "sampling_parameter_out_of_range",
            SamplingError::TooManyTopLogprobs { .. } => "too_many_top_logprobs",
            SamplingError::LogitBiasNotFinite { .. } => "logit_bias_not_finite",
            SamplingError::LogitBiasTokenOutOfVocab { .. } => "logit_bias_token_out_of_vocab",
        }
    }
}
