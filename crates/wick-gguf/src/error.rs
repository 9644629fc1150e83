//! Errors of the GGUF reader: each names the file and what was wrong with it.
use std::path::PathBuf;

/// Everything that can go wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The bytes found instead.
        found: String,
    },
    /// A GGUF version this reader does not understand.
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version in the header.
        version: u32,
    },
    /// The header is damaged: a length or count runs past the end, a type is unknown …
    #[error("{path}: corrupt GGUF header at byte {offset}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Byte offset where the problem was found.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
    /// The file ends before the data it announces (a partial download, usually).
    #[error("{path}: truncated: tensor '{tensor}' needs bytes up to {needed} but the file has {len} (incomplete download?)")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// First tensor that does not fit.
        tensor: String,
        /// End offset that tensor needs.
        needed: u64,
        /// Actual file length.
        len: u64,
    },
    /// A ggml tensor type id this reader does not know.
    #[error("{path}: tensor '{tensor}' has unknown ggml type id {id}")]
    UnknownType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The type id.
        id: u32,
    },
    /// A metadata key that was asked for is absent.
    #[error("{path}: metadata key '{key}' is missing")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata key holds a value of another type than asked for.
    #[error("{path}: metadata key '{key}' is {found}, expected {expected}")]
    WrongType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What the file holds.
        found: &'static str,
        /// What the caller asked for.
        expected: &'static str,
    },
    /// A tensor that was asked for is absent.
    #[error("{path}: tensor '{name}' is missing")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
    },
}
