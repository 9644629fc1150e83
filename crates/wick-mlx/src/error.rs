//! The error type of wick-mlx.

/// What went wrong in a call into MLX.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MlxError {
    /// MLX threw while running `op` (shape mismatch, unsupported dtype, out of memory …).
    #[error("MLX {op} failed: {message}")]
    Op {
        /// The shim function that failed.
        op: &'static str,
        /// MLX's exception text.
        message: String,
    },
    /// wick-mlx was compiled without its `runtime` feature, so no MLX is linked.
    #[error(
        "wick-mlx was built without the MLX runtime (cargo feature `runtime`); see docs/mlx.md"
    )]
    NotLinked,
    /// The caller's data does not fit the requested array.
    #[error("MLX {op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// Why the arguments were refused.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, MlxError>;
