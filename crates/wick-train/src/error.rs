//! What can go wrong while training.
use std::path::PathBuf;

/// Errors of the trainer and the adapter tools: bad base models, bad data, bad flags,
/// adapters that do not fit, I/O.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The engine could not read the base model, its tokenizer or template.
    #[error(transparent)]
    Engine(#[from] wick_engine::EngineError),
    /// The base model is one the trainer has no backward for.
    #[error("training does not support this model: {0}")]
    Unsupported(String),
    /// A dataset row is malformed.
    #[error("{path}:{line}: {reason}")]
    Data {
        /// The JSONL file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A dataset as a whole is unusable (missing file, no rows, mixed formats).
    #[error("dataset {path}: {reason}")]
    Dataset {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A training option is out of range.
    #[error("invalid training option: {0}")]
    Config(String),
    /// A checkpoint to resume from does not fit this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint directory.
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// An adapter could not be read, or does not fit the base model.
    #[error(transparent)]
    Adapter(#[from] wick_engine::adapters::AdapterError),
    /// An adapter cannot be folded into this base model, or the output cannot be written.
    #[error("cannot fuse into {path}: {reason}")]
    Fuse {
        /// The base model, or the output folder.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The run was cancelled from outside.
    #[error("training cancelled")]
    Cancelled,
}

/// Results of the trainer.
pub type Result<T> = std::result::Result<T, TrainError>;

/// Maps an I/O error to [`TrainError::Io`] for `path`.
pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}
