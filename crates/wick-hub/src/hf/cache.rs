//! The Hugging Face cache layout, written the way `huggingface_hub` writes it:
//!
//! ```text
//! <HF_HUB_CACHE>/models--ORG--NAME/
//!   blobs/<etag>                 file contents, named by LFS sha256 or git blob sha1
//!   blobs/<etag>.incomplete      a download in progress (resumed with a Range request)
//!   snapshots/<commit>/<path>    relative symlinks into ../../blobs/
//!   refs/<revision>              the commit a branch or tag named when fetched
//! <HF_HUB_CACHE>/.locks/models--ORG--NAME/<etag>.wick-lock   one downloader per blob
//! ```
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use sha1::Digest as _;

use super::client::Check;
use super::error::GetError;

/// A lock older than this is stale even when its pid is alive (pids are reused).
const LOCK_MAX_AGE: Duration = Duration::from_secs(3600);

/// How long to wait for another process's download of the same blob.
const LOCK_WAIT: Duration = Duration::from_secs(3600);

/// One repository's folder in the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    /// `models--ORG--NAME`.
    pub dir: PathBuf,
    locks: PathBuf,
}

/// `ORG/NAME` → `models--ORG--NAME`.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

impl RepoCache {
    /// The folder of `repo` under the hub cache `root`.
    pub fn new(root: &Path, repo: &str) -> RepoCache {
        let folder = repo_folder(repo);
        RepoCache {
            dir: root.join(&folder),
            locks: root.join(".locks").join(folder),
        }
    }

    /// `blobs/`.
    pub fn blobs(&self) -> PathBuf {
        self.dir.join("blobs")
    }

    /// `blobs/<etag>`.
    pub fn blob(&self, etag: &str) -> PathBuf {
        self.blobs().join(etag)
    }

    /// `blobs/<etag>.incomplete`.
    pub fn incomplete(&self, etag: &str) -> PathBuf {
        self.blobs().join(format!("{etag}.incomplete"))
    }

    /// `snapshots/<commit>/`.
    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// Records that `revision` named `commit` (`refs/<revision>`); a commit id names itself
    /// and gets no ref.
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), GetError> {
        if revision == commit {
            return Ok(());
        }
        let path = self.dir.join("refs").join(revision);
        safe_relative(revision)?;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(GetError::io("create directory", parent))?;
        }
        // No trailing newline: huggingface_hub writes the bare commit.
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        fs::write(&tmp, commit).map_err(GetError::io("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(GetError::io("rename", &path))
    }

    /// The commit `refs/<revision>` names, if any.
    pub fn read_ref(&self, revision: &str) -> Option<String> {
        safe_relative(revision).ok()?;
        let text = fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        let text = text.trim();
        (!text.is_empty()).then(|| text.to_string())
    }

    /// Links `snapshots/<commit>/<path>` to `blobs/<etag>` with a relative symlink.
    pub fn link(&self, commit: &str, path: &str, etag: &str) -> Result<PathBuf, GetError> {
        safe_relative(path)?;
        let link = self.snapshot(commit).join(path);
        let parent = link.parent().unwrap_or(&self.dir).to_path_buf();
        fs::create_dir_all(&parent).map_err(GetError::io("create directory", &parent))?;
        // snapshots/<commit>/ plus one level per directory in `path`.
        let depth = 2 + path.split('/').count() - 1;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        match fs::symlink_metadata(&link) {
            Ok(_) => fs::remove_file(&link).map_err(GetError::io("replace", &link))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(GetError::io("stat", &link)(e)),
        }
        std::os::unix::fs::symlink(&target, &link).map_err(GetError::io("symlink", &link))?;
        Ok(link)
    }

    /// Takes the lock of `etag`'s blob, waiting while a live process holds it.
    pub fn lock(&self, etag: &str) -> Result<BlobLock, GetError> {
        fs::create_dir_all(&self.locks).map_err(GetError::io("create directory", &self.locks))?;
        let path = self.locks.join(format!("{etag}.wick-lock"));
        let started = Instant::now();
        loop {
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut file) => {
                    write!(file, "{}", std::process::id()).map_err(GetError::io("write", &path))?;
                    return Ok(BlobLock { path });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    let owner = lock_owner(&path);
                    if lock_is_stale(&path, owner) {
                        tracing::info!(lock = %path.display(), ?owner, "removing a stale lock");
                        let _ = fs::remove_file(&path);
                        continue;
                    }
                    if started.elapsed() > LOCK_WAIT {
                        return Err(GetError::Locked {
                            lock: path,
                            pid: owner.unwrap_or(0),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(GetError::io("create", &path)(e)),
            }
        }
    }
}

/// A held blob lock; dropping it releases it.
#[derive(Debug)]
pub struct BlobLock {
    path: PathBuf,
}

impl Drop for BlobLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn lock_owner(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether process `pid` exists (signal 0 probes without sending anything).
pub(crate) fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for the process; it has no memory effects.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn lock_is_stale(path: &Path, owner: Option<u32>) -> bool {
    let age = fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .unwrap_or_default();
    match owner {
        Some(pid) => !pid_alive(pid) || age > LOCK_MAX_AGE,
        // A lock being written has no pid for a moment; an old empty one is stale.
        None => age > Duration::from_secs(5),
    }
}

/// Refuses absolute paths, `..` and other components that could leave the snapshot.
pub(crate) fn safe_relative(path: &str) -> Result<(), GetError> {
    let bad = |reason| {
        Err(GetError::UnsafePath {
            path: path.to_string(),
            reason,
        })
    };
    if path.is_empty() || path.contains('\0') || path.contains('\\') {
        return bad("empty, NUL or backslash");
    }
    for c in Path::new(path).components() {
        match c {
            Component::Normal(_) => {}
            _ => return bad("not a plain relative path"),
        }
    }
    Ok(())
}

/// A failed check: (expected, algorithm, actual).
pub(crate) type Mismatch = (String, &'static str, String);

/// Verifies a finished download: its size and digest.
pub(crate) fn verify(
    path: &Path,
    size: u64,
    check: &Check,
) -> Result<Result<(), Mismatch>, GetError> {
    let mut file = File::open(path).map_err(GetError::io("open", path))?;
    let len = file.metadata().map_err(GetError::io("stat", path))?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut sha256 = sha2::Sha256::new();
    let mut sha1 = sha1::Sha1::new();
    if matches!(check, Check::GitBlobSha1(_)) {
        sha1.update(format!("blob {len}\0").as_bytes());
    }
    loop {
        let n = file.read(&mut buf).map_err(GetError::io("read", path))?;
        if n == 0 {
            break;
        }
        match check {
            Check::Sha256(_) => sha256.update(&buf[..n]),
            Check::GitBlobSha1(_) => sha1.update(&buf[..n]),
            Check::Unverifiable => {}
        }
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let (expected, algorithm, actual) = match check {
        Check::Sha256(e) => (e.clone(), "sha256", hex(&sha256.finalize())),
        Check::GitBlobSha1(e) => (e.clone(), "git blob sha1", hex(&sha1.finalize())),
        Check::Unverifiable => {
            return Ok(if len == size {
                Ok(())
            } else {
                Err((format!("{size} bytes"), "size", format!("{len} bytes")))
            })
        }
    };
    if len != size {
        return Ok(Err((
            format!("{expected} ({size} bytes)"),
            algorithm,
            format!("{actual} ({len} bytes)"),
        )));
    }
    Ok(if actual == expected {
        Ok(())
    } else {
        Err((expected, algorithm, actual))
    })
}

/// Free bytes for an unprivileged user on the file system holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` is a properly sized out-parameter.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded and filled the struct.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)]
    let (blocks, block_size) = (st.f_bavail as u64, st.f_frsize as u64);
    Some(blocks.saturating_mul(block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_huggingface_hub() {
        let dir = tempfile::tempdir().unwrap();
        let cache = RepoCache::new(dir.path(), "org/tiny");
        assert_eq!(cache.dir, dir.path().join("models--org--tiny"));
        fs::create_dir_all(cache.blobs()).unwrap();
        fs::write(cache.blob("abc"), b"x").unwrap();
        let link = cache.link("c0ffee", "sub/dir/f.json", "abc").unwrap();
        assert_eq!(
            fs::read_link(&link).unwrap(),
            Path::new("../../../../blobs/abc")
        );
        assert_eq!(fs::read(&link).unwrap(), b"x");
        cache.write_ref("main", "c0ffee").unwrap();
        assert_eq!(
            fs::read_to_string(cache.dir.join("refs/main")).unwrap(),
            "c0ffee"
        );
        assert_eq!(cache.read_ref("main").as_deref(), Some("c0ffee"));
        assert!(cache.link("c0ffee", "../escape", "abc").is_err());
        assert!(cache.link("c0ffee", "/abs", "abc").is_err());
    }

    #[test]
    fn git_blob_sha1_and_sha256() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, b"hello\n").unwrap();
        // `git hash-object` of "hello\n".
        let git = Check::GitBlobSha1("ce013625030ba8dba906f756967f9e9ca394464a".into());
        assert!(verify(&p, 6, &git).unwrap().is_ok());
        let sha = Check::Sha256(
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03".into(),
        );
        assert!(verify(&p, 6, &sha).unwrap().is_ok());
        fs::write(&p, b"hellO\n").unwrap();
        let (_, algo, _) = verify(&p, 6, &sha).unwrap().unwrap_err();
        assert_eq!(algo, "sha256");
        assert!(verify(&p, 7, &git).unwrap().is_err());
    }

    #[test]
    fn stale_locks_are_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let cache = RepoCache::new(dir.path(), "o/r");
        fs::create_dir_all(&cache.locks).unwrap();
        let path = cache.locks.join("e.wick-lock");
        // A pid that cannot exist: the lock is stale.
        fs::write(&path, "4194304000").unwrap();
        let lock = cache.lock("e").unwrap();
        assert_eq!(lock_owner(&path), Some(std::process::id()));
        drop(lock);
        assert!(!path.exists());
        assert!(pid_alive(std::process::id()));
    }
}
