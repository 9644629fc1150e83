//! What can go wrong fetching a repository from the Hub.
use std::path::PathBuf;

/// A failed `wick get`.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    /// The repository argument is not `ORG/NAME[@REVISION]`.
    #[error("'{arg}' is not a Hugging Face repository id: {reason} (expected ORG/NAME or ORG/NAME@REVISION)")]
    BadRepoId {
        /// The argument.
        arg: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The Hub refused the request for lack of (or a bad) token.
    #[error("{repo}: the Hub answered {status}: {}", if *had_token { "the token (HF_TOKEN or ~/.cache/huggingface/token) has no access to this repository; for a gated model accept its terms on the model page first" } else { "the repository is private, gated or does not exist; set HF_TOKEN (or run `huggingface-cli login`) with a token that can read it" })]
    Unauthorized {
        /// The repository.
        repo: String,
        /// 401 or 403.
        status: u16,
        /// Whether a token was sent.
        had_token: bool,
    },
    /// The repository, revision or file does not exist.
    #[error("{url}: not found (404); check the repository name and revision")]
    NotFound {
        /// What was asked for.
        url: String,
    },
    /// Another HTTP status, after the retries.
    #[error("{url}: the server answered HTTP {status}")]
    Status {
        /// What was asked for.
        url: String,
        /// The status (0: no answer at all).
        status: u16,
    },
    /// The connection failed or was cut, after the retries.
    #[error("{url}: {detail}")]
    Network {
        /// What was asked for.
        url: String,
        /// The transport's error.
        detail: String,
    },
    /// A listing could not be read.
    #[error("{url}: unexpected answer: {detail}")]
    BadListing {
        /// What was asked for.
        url: String,
        /// What is wrong.
        detail: String,
    },
    /// The downloaded bytes do not have the digest the Hub published; the partial file
    /// was deleted and nothing was published.
    #[error("{file}: downloaded content does not match the Hub's {algorithm} (expected {expected}, got {actual}, {bytes} bytes); the partial download was deleted, nothing was published")]
    Corrupt {
        /// The repository file.
        file: String,
        /// sha256 or git-blob sha1.
        algorithm: &'static str,
        /// The published digest.
        expected: String,
        /// The digest of what was received.
        actual: String,
        /// How many bytes were received.
        bytes: u64,
    },
    /// No file of the revision matches the `--include` patterns.
    #[error("no file of {repo} matches {}; it has: {}", patterns.join(", "), files.join(", "))]
    NothingMatches {
        /// The repository.
        repo: String,
        /// The patterns.
        patterns: Vec<String>,
        /// Files of the revision.
        files: Vec<String>,
    },
    /// An `--include` pattern is not a valid glob.
    #[error("bad --include pattern '{pattern}': {detail}")]
    BadPattern {
        /// The pattern.
        pattern: String,
        /// Why.
        detail: String,
    },
    /// A GGUF repository holds several quantizations and none was chosen.
    #[error("{repo} has {} GGUF files; choose one with --include, e.g. --include '*{}*':\n{}", choices.len(), choices.first().map(|c| c.quant.as_str()).unwrap_or("Q4_K_M"), choices.iter().map(|c| format!("  {} ({:.1} MB)", c.file, c.bytes as f64 / 1e6)).collect::<Vec<_>>().join("\n"))]
    ChooseQuant {
        /// The repository.
        repo: String,
        /// The candidates.
        choices: Vec<QuantChoice>,
    },
    /// The disk has too little room for what is left to download.
    #[error("{dir}: {needed} bytes are needed ({missing} to download plus a 1 GiB margin) but only {available} are free")]
    NoSpace {
        /// The cache directory.
        dir: PathBuf,
        /// Bytes to download.
        missing: u64,
        /// Missing plus the margin.
        needed: u64,
        /// Free bytes.
        available: u64,
    },
    /// Another process holds a blob's lock for too long.
    #[error(
        "{lock}: another wick (pid {pid}) is downloading this file; try again when it is done"
    )]
    Locked {
        /// The lock file.
        lock: PathBuf,
        /// Its owner.
        pid: u32,
    },
    /// A file-system operation failed.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A repository path would land outside the snapshot directory.
    #[error("refusing repository path '{path}': {reason}")]
    UnsafePath {
        /// The path.
        path: String,
        /// Why.
        reason: &'static str,
    },
}

/// One GGUF file (or split set) of a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantChoice {
    /// Its first (or only) file.
    pub file: String,
    /// The quantization its name says (`Q4_K_M`), or the file stem.
    pub quant: String,
    /// Bytes, all shards together.
    pub bytes: u64,
}

impl GetError {
    pub(crate) fn network(url: &str, e: ureq::Error) -> GetError {
        GetError::Network {
            url: url.to_string(),
            detail: e.to_string(),
        }
    }

    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> GetError {
        let path = path.into();
        move |source| GetError::Io { op, path, source }
    }

    /// Whether trying again may help (network trouble, server errors).
    pub fn is_transient(&self) -> bool {
        match self {
            GetError::Network { .. } => true,
            GetError::Status { status, .. } => *status == 0 || *status == 429 || *status >= 500,
            _ => false,
        }
    }
}
