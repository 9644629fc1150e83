//! Errors of the tokenizer: each names the model file or directory and what was wrong with it.
use std::path::PathBuf;

/// Everything that can go wrong building a tokenizer or turning text into ids and back.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The GGUF file could not be read, or a metadata value has the wrong type.
    #[error(transparent)]
    Gguf(#[from] wick_gguf::GgufError),
    /// A `tokenizer.ggml.*` value is present but unusable (wrong length, out-of-range id …).
    #[error("{path}: tokenizer metadata '{key}' is invalid: {reason}")]
    InvalidMetadata {
        /// The model file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer family wick does not implement.
    #[error(
        "{path}: tokenizer model '{model}' is not supported (supported: gpt2, llama, gemma4, bert)"
    )]
    UnsupportedModel {
        /// The model file.
        path: PathBuf,
        /// The value of `tokenizer.ggml.model`.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer wick does not implement.
    #[error("{path}: pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported")]
    UnsupportedPreTokenizer {
        /// The model file.
        path: PathBuf,
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
    },
    /// The same piece appears twice in the vocabulary (llama.cpp refuses such files too).
    #[error("{path}: token {token:?} appears twice in the vocabulary (ids {first} and {second})")]
    DuplicateToken {
        /// The model file.
        path: PathBuf,
        /// The duplicated piece.
        token: String,
        /// Its first id.
        first: u32,
        /// Its second id.
        second: u32,
    },
    /// A part of the `tokenizers` pipeline could not be built from the vocabulary.
    #[error("{path}: cannot build the tokenizer's {part}: {reason}")]
    Build {
        /// The model file or directory.
        path: PathBuf,
        /// Which part (model, pre-tokenizer, normalizer …).
        part: &'static str,
        /// What the `tokenizers` crate reported.
        reason: String,
    },
    /// A file of a Hugging Face model directory could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A Hugging Face tokenizer file is not what it should be.
    #[error("{path}: {reason}")]
    HfConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A token id outside the vocabulary was given to decode.
    #[error("token id {id} is outside the vocabulary ({vocab_size} tokens)")]
    IdOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The `tokenizers` pipeline failed on some input text.
    #[error("cannot encode text: {reason}")]
    Encode {
        /// What the `tokenizers` crate reported.
        reason: String,
    },
    /// The `tokenizers` pipeline failed on some ids.
    #[error("cannot decode token ids: {reason}")]
    Decode {
        /// What the `tokenizers` crate reported.
        reason: String,
    },
}

impl TokenizerError {
    /// A stable machine-readable name of the error kind.
    pub fn error_type(&self) -> &'static str {
        match self {
            TokenizerError::Gguf(_) => "gguf",
            TokenizerError::InvalidMetadata { .. } => "invalid_tokenizer_metadata",
            TokenizerError::UnsupportedModel { .. } => "unsupported_tokenizer_model",
            TokenizerError::UnsupportedPreTokenizer { .. } => "unsupported_pre_tokenizer",
            TokenizerError::DuplicateToken { .. } => "duplicate_token",
            TokenizerError::Build { .. } => "tokenizer_build",
            TokenizerError::Io { .. } => "io",
            TokenizerError::HfConfig { .. } => "hf_tokenizer_config",
            TokenizerError::IdOutOfRange { .. } => "token_id_out_of_range",
            TokenizerError::Encode { .. } => "encode",
            TokenizerError::Decode { .. } => "decode",
        }
    }
}
