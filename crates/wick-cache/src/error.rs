//! [`CacheError`]: everything that can go wrong in the cache tiers.
//!
//! None of these reach a request: the tiers turn every failure into a miss or a warning.
//! They surface at start-up (an SSD directory that cannot be opened) and in the tiers'
//! own results, where callers and tests can tell the cases apart.
use std::path::PathBuf;

/// An error of the cache crate.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file system operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`create`, `write`, `rename`, `read` …).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A cache file is damaged: bad magic, a hash that does not match, a short file.
    #[error("corrupt cache file {}: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A cache file was written by another format version.
    #[error("cache file {} has format version {found}, this build reads {expected}", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version in the file.
        found: u32,
        /// The version this build writes and reads.
        expected: u32,
    },
    /// A cache file belongs to another model, namespace or token sequence.
    #[error("cache file {} has {field} {found:?}, expected {expected:?}", path.display())]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The header field that differs (`fingerprint`, `namespace`, `tokens` …).
        field: &'static str,
        /// What the file says.
        found: String,
        /// What the reader expected.
        expected: String,
    },
    /// A path in the cache directory is not a regular file (a directory, FIFO, socket, device
    /// or symbolic link): never opened for reading, never ours.
    #[error("{} is not a regular file", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// An entry is larger than the tier may hold.
    #[error("an entry of {bytes} bytes exceeds the {tier} limit of {limit} bytes")]
    TooLarge {
        /// Which tier refused (`ram`, `ssd`).
        tier: &'static str,
        /// The entry's size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// A snapshot's shape is inconsistent (buffer sizes, lengths across layers).
    #[error("invalid KV snapshot: {0}")]
    InvalidSnapshot(String),
    /// An entry's token list and cached value disagree on the length.
    #[error("an entry of {tokens} tokens was given a cache holding {cached}")]
    LengthMismatch {
        /// Tokens in the key.
        tokens: usize,
        /// Tokens in the value.
        cached: usize,
    },
    /// The engine's cache value failed an operation (fork, host copy, rebuild).
    #[error("cache value {op} failed: {reason}")]
    Value {
        /// The operation (`fork`, `to_host`, `load`).
        op: &'static str,
        /// The engine's message.
        reason: String,
    },
    /// No owner id could be taken in the SSD cache directory (every attempt collided with a
    /// live owner's lock).
    #[error("cannot take an owner lock in the SSD cache directory {}", path.display())]
    Locked {
        /// The fingerprint directory.
        path: PathBuf,
    },
    /// A directory of the SSD tier cannot be used safely: a symbolic link, not a directory,
    /// or owned by another user. The tier never follows links inside its root.
    #[error("{} cannot hold the SSD cache: it {reason}", path.display())]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The configuration is contradictory.
    #[error("invalid cache configuration: {0}")]
    Config(String),
}

impl CacheError {
    /// An [`CacheError::Io`] maker for `map_err`.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| CacheError::Io { op, path, source }
    }

    /// A stable machine name of the variant, for logs and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            CacheError::Io { .. } => "io",
            CacheError::Corrupt { .. } => "corrupt",
            CacheError::UnsupportedVersion { .. } => "unsupported_version",
            CacheError::Mismatch { .. } => "mismatch",
            CacheError::NotAFile { .. } => "not_a_file",
            CacheError::TooLarge { .. } => "too_large",
            CacheError::InvalidSnapshot(_) => "invalid_snapshot",
            CacheError::LengthMismatch { .. } => "length_mismatch",
            CacheError::Value { .. } => "value",
            CacheError::Locked { .. } => "locked",
            CacheError::Unsafe { .. } => "unsafe",
            CacheError::Config(_) => "config",
        }
    }

    /// Whether the error is a full disk or an exceeded quota.
    pub fn is_disk_full(&self) -> bool {
        match self {
            CacheError::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            ),
            _ => false,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = CacheError> = std::result::Result<T, E>;
