//! [`Owner`]: who writes into a shared SSD cache directory, and whether a writer is alive.
//!
//! Several processes (replicas, possibly on several hosts over a shared filesystem) may use
//! one fingerprint directory. Each takes an owner id (host, process id and a random part)
//! and holds an exclusive lock on `<fingerprint>/.owner-<id>.lock` for as long as its tier
//! is open; its temporary files are named `<entry>.<id>.<seq>.tmp`. A `.tmp` file whose
//! owner holds no lock is a write a crash interrupted, and anyone may remove it; a live
//! owner's `.tmp` files are never touched. The lock goes away with the process (the kernel
//! drops it on exit, even on `kill -9`); a stale lock file is removed by the next scan.
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{CacheError, Result};

/// File name prefix of owner lock files (inside the fingerprint directory).
const LOCK_PREFIX: &str = ".owner-";
/// File name suffix of owner lock files.
const LOCK_SUFFIX: &str = ".lock";
/// Attempts at taking a fresh owner id (a collision with a live owner, or a scan removing
/// the file between our create and lock, makes us pick another).
const ACQUIRE_ATTEMPTS: usize = 8;

/// This process's ownership of a fingerprint directory: its id and the held lock.
#[derive(Debug)]
pub struct Owner {
    id: String,
    path: PathBuf,
    _lock: File,
}

/// Whether the owner of a `.tmp` file is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// This very tier.
    Us,
    /// Another process holds its lock.
    Alive,
    /// No process holds its lock: the file is an orphan.
    Dead,
}

fn lock_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{LOCK_PREFIX}{id}{LOCK_SUFFIX}"))
}

/// The host name, reduced to file-name-safe characters (`-` for the rest).
fn host_label() -> String {
    let raw = fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let label: String = raw
        .trim()
        .chars()
        .take(32)
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    if label.is_empty() {
        "host".into()
    } else {
        label
    }
}

/// A fresh id: host, process id and 32 bits from the clock, the attempt and a stack address.
fn fresh_id(attempt: usize) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let local = 0u8;
    let seed = format!("{nanos}:{attempt}:{:p}", &local);
    let r = xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) as u32;
    format!("{}-{}-{r:08x}", host_label(), std::process::id())
}

/// Opens (with `create`, creating) a lock file for writing, never through a symbolic link
/// and never blocking on a FIFO planted at its name.
pub(super) fn open_lock_file(path: &Path, create: bool) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.write(true).create(create).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let f = options.open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(f)
}

/// Whether the file at `path` is the file open as `f` (not replaced or removed since).
fn same_file(f: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (f.metadata(), fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = f;
        path.is_file()
    }
}

impl Owner {
    /// Takes a fresh owner id in `dir` and holds its lock.
    pub fn acquire(dir: &Path) -> Result<Owner> {
        let mut last = None;
        for attempt in 0..ACQUIRE_ATTEMPTS {
            let id = fresh_id(attempt);
            let path = lock_path(dir, &id);
            let f = open_lock_file(&path, true).map_err(CacheError::io("open", &path))?;
            match f.try_lock() {
                // A scan may have removed the file between our open and lock: then the lock
                // is on a file nobody can find, and we try again.
                Ok(()) if same_file(&f, &path) => return Ok(Owner { id, path, _lock: f }),
                Ok(()) => last = None,
                Err(std::fs::TryLockError::WouldBlock) => last = None,
                Err(std::fs::TryLockError::Error(e)) => {
                    last = Some(CacheError::Io {
                        op: "lock",
                        path: path.clone(),
                        source: e,
                    })
                }
            }
        }
        Err(last.unwrap_or(CacheError::Locked {
            path: dir.to_path_buf(),
        }))
    }

    /// The owner id (file-name safe, no dots).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The name of our `seq`-th temporary file for entry file `name`.
    pub fn tmp_name(&self, name: &str, seq: u64) -> String {
        format!("{name}.{}.{seq}.tmp", self.id)
    }

    /// Whoever wrote the temporary file `name` (`<file>.<owner>.<seq>.tmp`), alive or not;
    /// `None` when the name is not one the tier gives (not ours: never removed).
    pub fn liveness_of_tmp(&self, dir: &Path, name: &str) -> Option<Liveness> {
        let owner = tmp_owner(name)?;
        Some(self.liveness_of(dir, owner))
    }

    fn liveness_of(&self, dir: &Path, owner: &str) -> Liveness {
        if owner == self.id {
            return Liveness::Us;
        }
        if is_held(dir, owner) {
            Liveness::Alive
        } else {
            Liveness::Dead
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        // Removed while still locked, so no scan can take it for a dead owner's file first.
        let _ = fs::remove_file(&self.path);
    }
}

/// The owner part of a temporary file's name, if the name is one the tier gives.
fn tmp_owner(name: &str) -> Option<&str> {
    super::guard::tmp_target(name).map(|(_, owner)| owner)
}

/// Whether a live process holds the lock of owner `id` in `dir`.
fn is_held(dir: &Path, id: &str) -> bool {
    if id.contains('/') || id.contains('\\') || id.starts_with('.') {
        return false;
    }
    let Ok(f) = open_lock_file(&lock_path(dir, id), false) else {
        return false;
    };
    matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock))
}

/// Removes owner lock files in `dir` that no process holds (owners that died); returns how
/// many.
pub fn remove_stale_locks(dir: &Path, ours: &Owner) -> usize {
    let Ok(list) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in list.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(id) = name
            .strip_prefix(LOCK_PREFIX)
            .and_then(|n| n.strip_suffix(LOCK_SUFFIX))
        else {
            continue;
        };
        if id == ours.id || !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let Ok(f) = open_lock_file(&e.path(), false) else {
            continue;
        };
        // Held while removing, so the owner (had it just created the file) finds it gone
        // and picks another id.
        if f.try_lock().is_ok() && fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> String {
        format!("{}.wkv", "ab".repeat(16))
    }

    #[test]
    fn tmp_names_carry_the_owner() {
        let e = entry();
        assert_eq!(tmp_owner(&format!("{e}.h-1-0a.7.tmp")), Some("h-1-0a"));
        assert_eq!(tmp_owner(&format!("{e}.1.1.tmp")), Some("1"));
        assert_eq!(tmp_owner(&format!("{e}.tmp")), None);
        assert_eq!(tmp_owner(&format!("{e}.x.y.tmp")), None);
        // Not a name the tier gives: no owner, never taken for an orphan.
        assert_eq!(tmp_owner("abc.wkv.h-1-0a.7.tmp"), None);
    }

    #[test]
    fn live_owners_are_told_from_dead_ones() {
        let dir = tempfile::tempdir().unwrap();
        let a = Owner::acquire(dir.path()).unwrap();
        let b = Owner::acquire(dir.path()).unwrap();
        assert_ne!(a.id(), b.id());
        assert!(!a.id().contains('.'));
        let a_tmp = a.tmp_name(&entry(), 3);
        assert_eq!(a.liveness_of_tmp(dir.path(), &a_tmp), Some(Liveness::Us));
        assert_eq!(b.liveness_of_tmp(dir.path(), &a_tmp), Some(Liveness::Alive));
        // A crashed owner: its lock file is there but nobody holds it.
        fs::write(lock_path(dir.path(), "gone-1-0"), b"").unwrap();
        assert_eq!(
            b.liveness_of_tmp(dir.path(), &format!("{}.gone-1-0.0.tmp", entry())),
            Some(Liveness::Dead)
        );
        assert_eq!(remove_stale_locks(dir.path(), &b), 1);
        assert!(!lock_path(dir.path(), "gone-1-0").exists());
        // a's file is held: not stale.
        assert!(lock_path(dir.path(), a.id()).exists());
        let a_id = a.id().to_string();
        drop(a);
        assert!(!lock_path(dir.path(), &a_id).exists());
        assert_eq!(b.liveness_of_tmp(dir.path(), &a_tmp), Some(Liveness::Dead));
    }
}
