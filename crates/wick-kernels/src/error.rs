//! The error type of every fallible kernel entry point.
use crate::WeightFormat;

/// What went wrong in a kernel call: always a caller mistake (shapes, sizes, formats),
/// never a numeric condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A row length is not a whole number of the format's blocks.
    #[error("{format:?} rows need a multiple of {block} columns, got {cols}")]
    RaggedRow {
        /// Weight format.
        format: WeightFormat,
        /// Elements per block of the format.
        block: usize,
        /// Columns asked for.
        cols: usize,
    },
    /// A byte buffer does not hold exactly the data its shape needs.
    #[error("{what}: expected {expected} bytes, got {found}")]
    ByteLength {
        /// Which buffer.
        what: &'static str,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        found: usize,
    },
    /// Operand lengths or shapes that do not fit together.
    #[error("{op}: {what} has {found} elements, expected {expected}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// Which operand.
        what: &'static str,
        /// Elements the other operands imply.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// A row index past the end of a matrix.
    #[error("row {row} is outside a matrix of {rows} rows")]
    RowOutOfRange {
        /// Row asked for.
        row: usize,
        /// Rows of the matrix.
        rows: usize,
    },
    /// Matrices multiplied together by one call must share their input width.
    #[error("matrices of one product call must have the same columns: {first} and {other}")]
    MixedColumns {
        /// Columns of the first matrix.
        first: usize,
        /// Columns of a later one.
        other: usize,
    },
    /// An operand the call does not handle.
    #[error("not supported: {what}")]
    Unsupported {
        /// What was asked for.
        what: &'static str,
    },
}

/// Result of kernel calls.
pub type Result<T> = std::result::Result<T, KernelError>;
