//! `wick get ORG/NAME[@REV]`: fetching a repository from the Hugging Face Hub into the
//! Hugging Face cache, in the layout `huggingface_hub` writes ([`cache`]), so
//! transformers, mlx-lm and `huggingface_hub` itself see the same files.
//!
//! The revision is resolved to a commit (`/api/models/{repo}/revision/{rev}`), the files
//! are listed with their blob ids (`/api/models/{repo}/tree/{commit}`, or a HEAD of each
//! file when the server has no tree listing), then every missing blob is downloaded
//! (several at once) from `/{repo}/resolve/{commit}/{path}` into `blobs/<etag>.incomplete`,
//! resumed with `Range` after a cut connection or a killed process, retried with back-off,
//! verified (sha256 for LFS files, git blob sha1 for the rest) and only then renamed to
//! `blobs/<etag>` and linked from `snapshots/<commit>/`.
pub mod cache;
pub mod client;
pub mod downloads;
pub mod error;
mod select;

use std::collections::VecDeque;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

pub use cache::{repo_folder, RepoCache};
pub use client::{Check, HubClient, RemoteFile};
pub use downloads::{recent_downloads, DownloadState, DownloadStatus};
pub use error::{GetError, QuantChoice};

/// Attempts per request before giving up (transient failures only).
pub(crate) const RETRIES: u32 = 6;

/// Files downloaded at once when [`GetOptions::parallel`] is 0.
const DEFAULT_PARALLEL: usize = 4;

/// Free space kept on top of what a download needs.
const DISK_MARGIN: u64 = 1 << 30;

/// The wait before attempt `attempt` (1-based): 0.5 s doubling, at most 8 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << attempt.saturating_sub(1).min(4)))
}

/// A repository id with an optional revision: `ORG/NAME[@REV]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    /// `ORG/NAME` (or `NAME` for the few repositories without an org).
    pub repo: String,
    /// The revision after `@`, if given.
    pub revision: Option<String>,
}

impl RepoRef {
    /// Parses `ORG/NAME[@REV]`.
    pub fn parse(arg: &str) -> Result<RepoRef, GetError> {
        let bad = |reason| GetError::BadRepoId {
            arg: arg.to_string(),
            reason,
        };
        let (repo, revision) = match arg.split_once('@') {
            Some((_, "")) => return Err(bad("empty revision after '@'")),
            Some((r, rev)) => (r, Some(rev.to_string())),
            None => (arg, None),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() != 2 {
            return Err(bad("it must have exactly one '/'"));
        }
        let ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 96
                && !s.starts_with('.')
                && !s.contains("--")
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        };
        if !parts.iter().all(|p| ok(p)) {
            return Err(bad("names use letters, digits, '-', '_' and '.' only"));
        }
        if let Some(rev) = &revision {
            cache::safe_relative(rev).map_err(|_| bad("the revision is not a plain name"))?;
        }
        Ok(RepoRef {
            repo: repo.to_string(),
            revision,
        })
    }

    /// Whether `arg` has the shape of a Hub repository id (so `wick serve` may fetch it).
    pub fn looks_like_repo(arg: &str) -> bool {
        !std::path::Path::new(arg).exists() && RepoRef::parse(arg).is_ok()
    }
}

/// What to fetch and how.
#[derive(Debug, Clone, Default)]
pub struct GetOptions {
    /// The revision (branch, tag or commit); default `main`.
    pub revision: Option<String>,
    /// Glob patterns (`*` crosses `/`, as in `huggingface_hub`); only matching files are
    /// fetched. Empty: the files a model needs (see the module docs of `select`).
    pub include: Vec<String>,
    /// Files downloaded at once (0: 4).
    pub parallel: usize,
}

/// Progress of a [`get`], reported from the downloading threads.
#[derive(Debug, Clone)]
pub enum GetEvent {
    /// The plan: every selected file with its size, and how much is still to download.
    Planned {
        /// The commit.
        commit: String,
        /// (path, size) of each selected file.
        files: Vec<(String, u64)>,
        /// Bytes not yet in the cache.
        missing_bytes: u64,
    },
    /// A file started (or resumed at `from`).
    Started {
        /// Repository path.
        path: String,
        /// Its size.
        size: u64,
        /// Bytes already there.
        from: u64,
    },
    /// Bytes of a file received so far.
    Progress {
        /// Repository path.
        path: String,
        /// Bytes received, the resumed part included.
        received: u64,
    },
    /// A transient failure; the file is retried (resuming) after `wait`.
    Retrying {
        /// Repository path.
        path: String,
        /// The next attempt (2-based).
        attempt: u32,
        /// What failed.
        error: String,
    },
    /// A file is verified and in place (or was already).
    Done {
        /// Repository path.
        path: String,
        /// Whether it was already in the cache.
        cached: bool,
    },
}

/// The result of a [`get`].
#[derive(Debug, Clone)]
pub struct Got {
    /// The repository.
    pub repo: String,
    /// The commit fetched.
    pub commit: String,
    /// `snapshots/<commit>/`.
    pub snapshot: PathBuf,
    /// The selected files' paths in the repository.
    pub files: Vec<String>,
    /// Bytes downloaded by this call.
    pub downloaded_bytes: u64,
}

/// Fetches `repo` (see the module docs) into the hub cache at `hub_cache`.
pub fn get(
    client: &HubClient,
    hub_cache: &std::path::Path,
    repo: &RepoRef,
    opts: &GetOptions,
    events: &(dyn Fn(GetEvent) + Sync),
) -> Result<Got, GetError> {
    let revision = match (&repo.revision, &opts.revision) {
        (Some(a), Some(b)) if a != b => {
            return Err(GetError::BadRepoId {
                arg: format!("{}@{a}", repo.repo),
                reason: "it names another revision than --revision",
            })
        }
        (Some(r), _) | (None, Some(r)) => r.clone(),
        (None, None) => "main".to_string(),
    };
    let status = downloads::start(&repo.repo);
    let result = get_inner(
        client, hub_cache, &repo.repo, &revision, opts, events, &status,
    );
    status.finish(result.as_ref().err().map(ToString::to_string));
    result
}

fn get_inner(
    client: &HubClient,
    hub_cache: &std::path::Path,
    repo: &str,
    revision: &str,
    opts: &GetOptions,
    events: &(dyn Fn(GetEvent) + Sync),
    status: &downloads::Tracker,
) -> Result<Got, GetError> {
    let cache = RepoCache::new(hub_cache, repo);
    let (commit, siblings) = client.revision(repo, revision)?;
    cache::safe_relative(&commit)?;
    let listed = match client.tree(repo, &commit)? {
        Some(files) => files,
        None => {
            // No tree listing: the siblings and one HEAD per selected file.
            let names = select::select(repo, &siblings_as_files(&siblings), &opts.include)?;
            names
                .iter()
                .map(|f| client.head(repo, &commit, &f.path))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    for f in &listed {
        cache::safe_relative(&f.path)?;
        cache::safe_relative(&f.etag)?;
    }
    let files = select::select(repo, &listed, &opts.include)?;
    let missing: Vec<&RemoteFile> = {
        let mut seen = std::collections::HashSet::new();
        files
            .iter()
            .filter(|f| !blob_complete(&cache, f))
            .filter(|f| seen.insert(f.etag.clone()))
            .collect()
    };
    let missing_bytes: u64 = missing
        .iter()
        .map(|f| {
            let have = fs::metadata(cache.incomplete(&f.etag))
                .map(|m| m.len())
                .unwrap_or(0);
            f.size.saturating_sub(have.min(f.size))
        })
        .sum();
    let total: u64 = files.iter().map(|f| f.size).sum();
    status.plan(files.len(), total, total - missing_bytes.min(total));
    events(GetEvent::Planned {
        commit: commit.clone(),
        files: files.iter().map(|f| (f.path.clone(), f.size)).collect(),
        missing_bytes,
    });
    fs::create_dir_all(cache.blobs()).map_err(GetError::io("create directory", cache.blobs()))?;
    if missing_bytes > 0 {
        if let Some(available) = cache::free_bytes(&cache.blobs()) {
            let needed = missing_bytes.saturating_add(DISK_MARGIN);
            if available < needed {
                return Err(GetError::NoSpace {
                    dir: cache.blobs(),
                    missing: missing_bytes,
                    needed,
                    available,
                });
            }
        }
    }
    // Files already complete are linked first, then the missing ones downloaded in parallel.
    for f in files
        .iter()
        .filter(|f| !missing.iter().any(|m| m.etag == f.etag))
    {
        status.file_done();
        events(GetEvent::Done {
            path: f.path.clone(),
            cached: true,
        });
    }
    let queue = Mutex::new(missing.iter().copied().collect::<VecDeque<_>>());
    let failure: Mutex<Option<GetError>> = Mutex::new(None);
    let downloaded = Mutex::new(0u64);
    let workers = match opts.parallel {
        0 => DEFAULT_PARALLEL,
        n => n,
    }
    .min(missing.len().max(1));
    let ctx = Ctx {
        client,
        cache: &cache,
        repo,
        commit: &commit,
        events,
        status,
    };
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                if failure
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_some()
                {
                    return;
                }
                let Some(file) = queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front()
                else {
                    return;
                };
                match ctx.fetch(file) {
                    Ok(bytes) => {
                        *downloaded.lock().unwrap_or_else(PoisonError::into_inner) += bytes;
                        // Every path with this content is done (one blob, several names).
                        for same in files.iter().filter(|f| f.etag == file.etag) {
                            status.file_done();
                            events(GetEvent::Done {
                                path: same.path.clone(),
                                cached: false,
                            });
                        }
                    }
                    Err(e) => {
                        let mut slot = failure.lock().unwrap_or_else(PoisonError::into_inner);
                        slot.get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    // Every selected file is a verified blob now: publish the snapshot and the ref.
    for f in &files {
        cache.link(&commit, &f.path, &f.etag)?;
    }
    cache.write_ref(revision, &commit)?;
    Ok(Got {
        repo: repo.to_string(),
        snapshot: cache.snapshot(&commit),
        commit,
        files: files.iter().map(|f| f.path.clone()).collect(),
        downloaded_bytes: downloaded
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
    })
}

fn siblings_as_files(siblings: &[String]) -> Vec<RemoteFile> {
    siblings
        .iter()
        .map(|s| RemoteFile {
            path: s.clone(),
            size: 0,
            etag: String::new(),
            check: Check::Unverifiable,
        })
        .collect()
}

fn blob_complete(cache: &RepoCache, f: &RemoteFile) -> bool {
    fs::metadata(cache.blob(&f.etag)).is_ok_and(|m| m.is_file() && m.len() == f.size)
}

struct Ctx<'a> {
    client: &'a HubClient,
    cache: &'a RepoCache,
    repo: &'a str,
    commit: &'a str,
    events: &'a (dyn Fn(GetEvent) + Sync),
    status: &'a downloads::Tracker,
}

impl Ctx<'_> {
    /// Downloads, verifies and publishes one blob; the bytes received.
    fn fetch(&self, file: &RemoteFile) -> Result<u64, GetError> {
        let _lock = self.cache.lock(&file.etag)?;
        // Another process may have finished it while we waited for the lock.
        if blob_complete(self.cache, file) {
            return Ok(0);
        }
        let part = self.cache.incomplete(&file.etag);
        let url = self.client.resolve_url(self.repo, self.commit, &file.path);
        let mut received_total = 0u64;
        let mut attempt = 1;
        loop {
            match self.attempt(file, &part, &url) {
                Ok(n) => {
                    received_total += n;
                    break;
                }
                Err((e, n)) => {
                    received_total += n;
                    if !e.is_transient() || attempt >= RETRIES {
                        return Err(e);
                    }
                    attempt += 1;
                    tracing::warn!(file = %file.path, attempt, error = %e, "retrying");
                    (self.events)(GetEvent::Retrying {
                        path: file.path.clone(),
                        attempt,
                        error: e.to_string(),
                    });
                    std::thread::sleep(backoff(attempt - 1));
                }
            }
        }
        match cache::verify(&part, file.size, &file.check)? {
            Ok(()) => {}
            Err((expected, algorithm, actual)) => {
                let bytes = fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
                let _ = fs::remove_file(&part);
                return Err(GetError::Corrupt {
                    file: file.path.clone(),
                    algorithm,
                    expected,
                    actual,
                    bytes,
                });
            }
        }
        let blob = self.cache.blob(&file.etag);
        fs::rename(&part, &blob).map_err(GetError::io("rename", &blob))?;
        Ok(received_total)
    }

    /// One request: resumes `part` from its length. Err carries the bytes received anyway.
    fn attempt(
        &self,
        file: &RemoteFile,
        part: &std::path::Path,
        url: &str,
    ) -> Result<u64, (GetError, u64)> {
        let mut have = fs::metadata(part).map(|m| m.len()).unwrap_or(0);
        if have > file.size {
            // Longer than the file can be: start over.
            have = 0;
        }
        if have == file.size && file.size > 0 {
            return Ok(0);
        }
        (self.events)(GetEvent::Started {
            path: file.path.clone(),
            size: file.size,
            from: have,
        });
        let resp = self.client.get(url, have).map_err(|e| (e, 0))?;
        let status = resp.status().as_u16();
        let append = match status {
            206 => true,
            200 => false,
            416 if have > 0 => {
                // The server has nothing past what we have: verification decides.
                return Ok(0);
            }
            _ => return Err((self.client.status_error(self.repo, url, status), 0)),
        };
        if !append {
            have = 0;
        }
        let mut out = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(part)
            .map_err(|e| (GetError::io("open", part)(e), 0))?;
        let mut reader = resp.into_body().into_reader();
        let mut buf = vec![0u8; 256 << 10];
        let mut received = 0u64;
        let mut reported = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let _ = out.flush();
                    return Err((
                        GetError::Network {
                            url: url.to_string(),
                            detail: format!(
                                "connection cut after {} of {} bytes: {e}",
                                have + received,
                                file.size
                            ),
                        },
                        received,
                    ));
                }
            };
            // Never write past the announced size (a server sending garbage at the end).
            if have + received + n as u64 > file.size {
                let _ = out.flush();
                return Ok(received);
            }
            out.write_all(&buf[..n])
                .map_err(|e| (GetError::io("write", part)(e), received))?;
            received += n as u64;
            self.status.add_bytes(&file.path, n as u64);
            if received - reported >= 1 << 20 {
                reported = received;
                (self.events)(GetEvent::Progress {
                    path: file.path.clone(),
                    received: have + received,
                });
            }
        }
        out.flush()
            .map_err(|e| (GetError::io("write", part)(e), received))?;
        (self.events)(GetEvent::Progress {
            path: file.path.clone(),
            received: have + received,
        });
        if have + received < file.size {
            return Err((
                GetError::Network {
                    url: url.to_string(),
                    detail: format!(
                        "connection closed after {} of {} bytes",
                        have + received,
                        file.size
                    ),
                },
                received,
            ));
        }
        Ok(received)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_refs() {
        assert_eq!(
            RepoRef::parse("HuggingFaceTB/SmolLM2-135M@v1.0").unwrap(),
            RepoRef {
                repo: "HuggingFaceTB/SmolLM2-135M".into(),
                revision: Some("v1.0".into())
            }
        );
        assert_eq!(RepoRef::parse("a/b").unwrap().revision, None);
        for bad in [
            "a", "a/b/c", "a/", "/b", "a/b@", "a/b c", "../x", "a/..", "a--b/c", "a/b@../x",
        ] {
            assert!(RepoRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_millis(1000));
        assert_eq!(backoff(20), Duration::from_millis(8000));
    }
}
