//! Errors of the model store: each names the file, package or query it is about.
use std::path::PathBuf;

use crate::catalog::CatalogItem;

/// Everything that can go wrong locating, pulling or resolving a model.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Neither `$WICK_HOME` nor `$HOME` is set, so there is no default store location.
    #[error("cannot locate the model store: set WICK_HOME (or HOME)")]
    NoHome,
    /// A file-system operation failed.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// What was being done ("create directory", "read", "rename" …).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `wick pull` was given a name that is not in the catalog.
    #[error("'{name}' is not a pullable item; known items: {}", known.join(", "))]
    UnknownItem {
        /// The name asked for.
        name: String,
        /// Catalog names and aliases.
        known: Vec<&'static str>,
    },
    /// The Python interpreter used to run pip could not be started.
    #[error("cannot run '{python}' ({source}); pulling models needs Python 3 with pip on PATH")]
    PythonMissing {
        /// The interpreter that was tried.
        python: String,
        /// Why it could not be started.
        source: std::io::Error,
    },
    /// The interpreter runs but has no pip module.
    #[error("'{python} -m pip' does not work ({detail}); install pip (e.g. `python3 -m ensurepip --user` or the python3-pip package)")]
    PipMissing {
        /// The interpreter that was tried.
        python: String,
        /// The interpreter's complaint.
        detail: String,
    },
    /// pip could not reach the package index.
    #[error("cannot reach the package index (PyPI) to download {package}: {detail}")]
    IndexUnreachable {
        /// `name==version` that was being downloaded.
        package: String,
        /// The network error pip reported.
        detail: String,
    },
    /// The index answered but has no such package or version.
    #[error("the package index has no {package}: {detail}")]
    PackageNotFound {
        /// `name==version` that was asked for.
        package: String,
        /// pip's message.
        detail: String,
    },
    /// pip failed for another reason.
    #[error("pip download {package} failed ({status}): {detail}")]
    PipFailed {
        /// `name==version` that was being downloaded.
        package: String,
        /// pip's exit status.
        status: String,
        /// The end of pip's error output.
        detail: String,
    },
    /// pip reported success but the expected archive is not in the download directory.
    #[error("pip downloaded {package} but {expected} is not there (found: {})", found.join(", "))]
    DownloadMissing {
        /// `name==version` that was downloaded.
        package: String,
        /// The archive that should have appeared.
        expected: PathBuf,
        /// Archives that are in the download directory.
        found: Vec<String>,
    },
    /// Content does not have the pinned sha256 (or size); nothing was installed.
    #[error("{path}: sha256 mismatch: expected {expected} ({expected_bytes} bytes), got {actual} ({actual_bytes} bytes)")]
    HashMismatch {
        /// The archive or the item's target that failed the check.
        path: PathBuf,
        /// The pinned sha256 (lowercase hex).
        expected: String,
        /// The sha256 of what was actually read.
        actual: String,
        /// The pinned size.
        expected_bytes: u64,
        /// The size actually read.
        actual_bytes: u64,
    },
    /// A wheel could not be read as a zip archive.
    #[error("{archive}: cannot read zip archive: {source}")]
    Zip {
        /// The wheel.
        archive: PathBuf,
        /// The zip reader's error.
        source: zip::result::ZipError,
    },
    /// An archive lacks a member the catalog expects.
    #[error("{archive}: has no member '{member}'")]
    MemberMissing {
        /// The archive.
        archive: PathBuf,
        /// The member path inside it.
        member: String,
    },
    /// An archive entry would land outside its destination or is not a plain file/directory.
    #[error("{archive}: refusing entry '{entry}': {reason}")]
    UnsafeEntry {
        /// The archive.
        archive: PathBuf,
        /// The entry's path inside it.
        entry: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A path given as a model argument is not something wick can load.
    #[error("{path}: not a model: {reason}")]
    NotAModel {
        /// The path.
        path: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// No local model and no catalog item matches the query.
    #[error("no model matches '{query}' (searched {}); `wick ls` lists local models, `wick pull <item>` fetches catalog models", searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    NotFound {
        /// The query.
        query: String,
        /// Where models were looked for.
        searched: Vec<PathBuf>,
    },
    /// Several models match the query and none matches exactly.
    #[error("'{query}' is ambiguous; it matches: {}", candidates.join(", "))]
    Ambiguous {
        /// The query.
        query: String,
        /// Names of every match.
        candidates: Vec<String>,
    },
    /// The query names a catalog item that has not been pulled yet.
    #[error("'{}' is not downloaded; run `wick pull {}`", item.name, item.name)]
    NotDownloaded {
        /// The query.
        query: String,
        /// The catalog item it names.
        item: &'static CatalogItem,
    },
    /// Fetching from the Hugging Face Hub failed.
    #[error(transparent)]
    Get(#[from] crate::hf::GetError),
}

impl HubError {
    /// A stable machine-readable name for the variant (for logs and API error bodies).
    pub fn kind(&self) -> &'static str {
        match self {
            HubError::NoHome => "no_home",
            HubError::Io { .. } => "io",
            HubError::UnknownItem { .. } => "unknown_item",
            HubError::PythonMissing { .. } => "python_missing",
            HubError::PipMissing { .. } => "pip_missing",
            HubError::IndexUnreachable { .. } => "index_unreachable",
            HubError::PackageNotFound { .. } => "package_not_found",
            HubError::PipFailed { .. } => "pip_failed",
            HubError::DownloadMissing { .. } => "download_missing",
            HubError::HashMismatch { .. } => "hash_mismatch",
            HubError::Zip { .. } => "bad_archive",
            HubError::MemberMissing { .. } => "member_missing",
            HubError::UnsafeEntry { .. } => "unsafe_archive_entry",
            HubError::NotAModel { .. } => "not_a_model",
            HubError::NotFound { .. } => "model_not_found",
            HubError::Ambiguous { .. } => "ambiguous_model",
            HubError::NotDownloaded { .. } => "model_not_downloaded",
            HubError::Get(_) => "hub_download",
        }
    }

    /// Wraps an I/O error with the operation and path it concerns.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> HubError {
        let path = path.into();
        move |source| HubError::Io { op, path, source }
    }
}
