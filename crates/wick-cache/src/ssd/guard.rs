//! What the SSD tier may touch: its own directories (never through a symbolic link, owned by
//! this process's user) and, for removal, only files it wrote (a regular file of ours whose
//! name has the tier's own shape and, for entries and chunks, whose first bytes are the
//! tier's magic).
//!
//! The cache root may be shared (replicas, `docs/deploy.md`), so anyone who can write it
//! could plant `<root>/<fingerprint>` (a predictable name) as a link to another directory,
//! or put files of their own among ours. The tier refuses a fingerprint directory that is a
//! link or belongs to another user, enters only the subdirectories it names itself, never
//! follows a link inside them, and removes nothing it cannot tell is its own.
use std::fs::{self, File, Metadata, OpenOptions};
use std::path::{Path, PathBuf};

use super::chunks::is_hex32;
use super::format::EXTENSION;
use crate::{CacheError, Result};

/// Whether this process's user owns the file described by `meta`.
fn ours(meta: &Metadata) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid has no preconditions and cannot fail.
        meta.uid() == unsafe { libc::geteuid() }
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        true
    }
}

fn owner_of(meta: &Metadata) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: as in `ours`.
        format!("uid {}, this process runs as uid {}", meta.uid(), unsafe {
            libc::geteuid()
        })
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        String::new()
    }
}

fn unsafe_dir(path: &Path, reason: String) -> CacheError {
    CacheError::Unsafe {
        path: path.to_path_buf(),
        reason,
    }
}

/// Checks that `dir` is a directory (not a link to one) owned by this process's user.
pub fn check_own_dir(dir: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(dir).map_err(CacheError::io("stat", dir))?;
    if meta.file_type().is_symlink() {
        return Err(unsafe_dir(
            dir,
            "is a symbolic link; the SSD cache never follows links inside its root".into(),
        ));
    }
    if !meta.is_dir() {
        return Err(unsafe_dir(dir, "is not a directory".into()));
    }
    if !ours(&meta) {
        return Err(unsafe_dir(
            dir,
            format!("belongs to another user ({})", owner_of(&meta)),
        ));
    }
    Ok(())
}

/// Creates `dir` (its parent must exist) unless it exists, then checks it as
/// [`check_own_dir`] does. Returns whether it was created. A link planted at the name is
/// never followed: `mkdir` does not follow it, and the check refuses it.
pub fn own_dir(dir: &Path) -> Result<bool> {
    let mut builder = fs::DirBuilder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        // Not writable by others: nobody else can put links or files among ours.
        builder.mode(0o755);
    }
    let created = match builder.create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(CacheError::io("create", dir)(e)),
    };
    check_own_dir(dir)?;
    Ok(created)
}

/// Warns (once per directory) when others may write into `dir`: the tier still never follows
/// their links nor removes their files, but they could fill it.
pub fn warn_if_shared_writable(dir: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = fs::symlink_metadata(dir) {
            if m.permissions().mode() & 0o022 != 0 {
                tracing::warn!(
                    dir = %dir.display(),
                    mode = format!("{:o}", m.permissions().mode() & 0o777),
                    "the SSD cache directory is writable by other users; chmod go-w it"
                );
            }
        }
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// Opens an existing regular file for writing (to set its time), never through a link at
/// its name and never blocking on a FIFO.
pub fn open_write(path: &Path) -> Option<File> {
    super::owner::open_lock_file(path, false).ok()
}

/// Opens `path` read-write without following a link or blocking on a FIFO; `None` unless it
/// is a regular file of ours.
fn open_ours(path: &Path) -> Option<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW);
    }
    let f = options.open(path).ok()?;
    let meta = f.metadata().ok()?;
    (meta.is_file() && ours(&meta)).then_some(f)
}

/// Whether the entry at `path` (a directory listing's) is a regular file of ours, judged
/// without following a link.
pub fn is_our_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && ours(&m))
}

/// Whether the directory `path` lies in is one of ours (not a link).
fn in_own_dir(path: &Path) -> bool {
    path.parent().is_some_and(|d| check_own_dir(d).is_ok())
}

/// Removes `path` if it is a file the tier wrote: a regular file of ours (not a link), in a
/// directory of ours (not a link), whose first eight bytes are `magic`. Returns whether it
/// was removed.
pub fn remove_ours(path: &Path, magic: &[u8; 8]) -> bool {
    if !in_own_dir(path) {
        tracing::warn!(path = %path.display(), "not in a directory of the SSD cache; left alone");
        return false;
    }
    let Some(mut f) = open_ours(path) else {
        tracing::debug!(path = %path.display(), "not a file of the SSD cache; left alone");
        return false;
    };
    if !super::format::has_magic(&mut f, magic) {
        tracing::warn!(path = %path.display(), "a file named like an SSD cache file but not written by it; left alone");
        return false;
    }
    drop(f);
    remove(path)
}

/// Removes a temporary file of ours (a write a crash interrupted: it may be empty, so no
/// magic is asked), if it is a regular file of ours named as the tier names them.
pub fn remove_our_tmp(path: &Path) -> bool {
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| tmp_target(n).is_some());
    if !named || !in_own_dir(path) || !is_our_file(path) {
        tracing::debug!(path = %path.display(), "not a temporary file of the SSD cache; left alone");
        return false;
    }
    remove(path)
}

fn remove(path: &Path) -> bool {
    match fs::remove_file(path) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an SSD cache file");
            false
        }
    }
}

/// Whether `name` is an entry file's name as the tier gives them (32 hex digits, `.wkv`).
pub fn is_entry_name(name: &str) -> bool {
    name.strip_suffix(EXTENSION)
        .and_then(|s| s.strip_suffix('.'))
        .is_some_and(is_hex32)
}

/// The file a temporary file's name says it becomes (`<32 hex>.wkv` or `<32 hex>.wkc`),
/// and its owner: `<file>.<owner>.<seq>.tmp`. `None` for any other name.
pub fn tmp_target(name: &str) -> Option<(&str, &str)> {
    let stem = name.strip_suffix(".tmp")?;
    let (rest, seq) = stem.rsplit_once('.')?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (file, owner) = rest.rsplit_once('.')?;
    let owner_ok = !owner.is_empty()
        && owner
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    let file_ok = is_entry_name(file) || super::chunks::parse_file_name(file).is_some();
    (owner_ok && file_ok).then_some((file, owner))
}

/// The chunk directory of a fingerprint directory.
pub fn chunk_dir(fingerprint_dir: &Path) -> PathBuf {
    fingerprint_dir.join(CHUNK_DIR)
}

/// The name of the directory of chunk files inside a fingerprint directory (no namespace
/// directory can have it: those are `base` and `ns-<16 hex>`).
pub const CHUNK_DIR: &str = "chunks";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_tiers_own_names_count() {
        let e = format!("{}.wkv", "0a".repeat(16));
        let c = format!("{}.wkc", "0a".repeat(16));
        assert!(is_entry_name(&e));
        assert!(!is_entry_name("deadbeef.wkv"));
        assert!(!is_entry_name(&c));
        assert_eq!(
            tmp_target(&format!("{e}.host-1-0a.3.tmp")),
            Some((e.as_str(), "host-1-0a"))
        );
        assert_eq!(
            tmp_target(&format!("{c}.12345.0.tmp")),
            Some((c.as_str(), "12345"))
        );
        assert_eq!(tmp_target("x.wkv.1.1.tmp"), None);
        assert_eq!(tmp_target(&format!("{e}.tmp")), None);
        assert_eq!(tmp_target(&format!("{e}.a.b.tmp")), None);
        assert_eq!(tmp_target(&format!("{e}.a/b.1.tmp")), None);
        assert_eq!(tmp_target("passwd.tmp"), None);
    }

    #[cfg(unix)]
    #[test]
    fn links_and_foreign_files_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let link = root.path().join("fp");
        std::os::unix::fs::symlink(elsewhere.path(), &link).unwrap();
        assert!(matches!(own_dir(&link), Err(CacheError::Unsafe { .. })));
        let file = root.path().join("f");
        fs::write(&file, b"x").unwrap();
        assert!(matches!(own_dir(&file), Err(CacheError::Unsafe { .. })));
        let real = root.path().join("real");
        assert!(own_dir(&real).unwrap());
        assert!(!own_dir(&real).unwrap());

        // A file without the magic, a link to a file with it: neither is removed.
        let plain = root.path().join("plain.wkv");
        fs::write(&plain, b"not ours at all").unwrap();
        assert!(!remove_ours(&plain, super::super::format::MAGIC));
        let target = elsewhere.path().join("t.wkv");
        fs::write(&target, super::super::format::MAGIC).unwrap();
        let to_target = root.path().join("l.wkv");
        std::os::unix::fs::symlink(&target, &to_target).unwrap();
        assert!(!remove_ours(&to_target, super::super::format::MAGIC));
        assert!(plain.exists() && target.exists() && to_target.exists());
        let mine = root.path().join("mine.wkv");
        fs::write(&mine, super::super::format::MAGIC).unwrap();
        assert!(remove_ours(&mine, super::super::format::MAGIC));
        assert!(!mine.exists());
    }
}
