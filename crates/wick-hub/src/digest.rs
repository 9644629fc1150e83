//! sha256 digests: of a stream as it is written, of a file, and of a directory tree.
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::HubError;

/// Lowercase hex of a digest.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A writer that hashes and counts every byte on its way to `inner`.
pub(crate) struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// The sha256 (hex) and length of everything written, and the inner writer.
    pub(crate) fn finish(self) -> (W, String, u64) {
        (self.inner, hex(&self.hasher.finalize()), self.bytes)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// sha256 (hex) and length of a file.
pub fn sha256_file(path: &Path) -> Result<(String, u64), HubError> {
    let mut file = File::open(path).map_err(HubError::io("open", path))?;
    let mut sink = HashingWriter::new(io::sink());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(HubError::io("read", path))?;
        if n == 0 {
            break;
        }
        // Writing to a sink cannot fail.
        let _ = sink.write_all(&buf[..n]);
    }
    let (_, sha, bytes) = sink.finish();
    Ok((sha, bytes))
}

/// One regular file of a directory tree, as recorded in a tree digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeEntry {
    /// Path relative to the tree's root, components joined with `/`.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// sha256 of the contents (lowercase hex).
    pub sha256: String,
}

/// The digest of a set of files: the sha256 of one line `"<sha256>  <bytes>  <path>\n"`
/// per file, in byte order of `path`. It pins a whole extracted directory with one hash
/// and does not depend on extraction order, timestamps or permissions.
pub fn tree_digest(entries: &[TreeEntry]) -> String {
    let mut sorted: Vec<&TreeEntry> = entries.iter().collect();
    sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut hasher = Sha256::new();
    for entry in sorted {
        hasher.update(format!("{}  {}  {}\n", entry.sha256, entry.bytes, entry.path).as_bytes());
    }
    hex(&hasher.finalize())
}

/// Every regular file under `root` (recursively, symlinks followed), hashed.
pub fn scan_tree(root: &Path) -> Result<Vec<TreeEntry>, HubError> {
    let mut entries = Vec::new();
    let mut pending: Vec<(PathBuf, String)> = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = pending.pop() {
        let listing = std::fs::read_dir(&dir).map_err(HubError::io("list", &dir))?;
        for entry in listing {
            let entry = entry.map_err(HubError::io("list", &dir))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let meta = std::fs::metadata(&path).map_err(HubError::io("stat", &path))?;
            if meta.is_dir() {
                pending.push((path, rel));
            } else if meta.is_file() {
                let (sha256, bytes) = sha256_file(&path)?;
                entries.push(TreeEntry {
                    path: rel,
                    bytes,
                    sha256,
                });
            }
        }
    }
    Ok(entries)
}

/// File count and total size of the regular files under `root`, without hashing; `None`
/// when `root` is not a readable directory.
pub(crate) fn tree_size(root: &Path) -> Option<(usize, u64)> {
    let mut files = 0usize;
    let mut bytes = 0u64;
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).ok()? {
            let path = entry.ok()?.path();
            let meta = std::fs::metadata(&path).ok()?;
            if meta.is_dir() {
                pending.push(path);
            } else if meta.is_file() {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    Some((files, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_sha256_values() {
        let (_, sha, n) = HashingWriter::new(io::sink()).finish();
        assert_eq!(
            sha,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(n, 0);
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(b"ab").unwrap();
        w.write_all(b"c").unwrap();
        let (inner, sha, n) = w.finish();
        assert_eq!(inner, b"abc");
        assert_eq!(n, 3);
        assert_eq!(
            sha,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn tree_digest_is_order_independent_and_content_sensitive() {
        let a = TreeEntry {
            path: "a.txt".into(),
            bytes: 1,
            sha256: "00".into(),
        };
        let b = TreeEntry {
            path: "dir/b.txt".into(),
            bytes: 2,
            sha256: "11".into(),
        };
        let one = tree_digest(&[a.clone(), b.clone()]);
        assert_eq!(one, tree_digest(&[b.clone(), a.clone()]));
        let renamed = TreeEntry {
            path: "dir/c.txt".into(),
            ..b.clone()
        };
        assert_ne!(one, tree_digest(&[a.clone(), renamed]));
        assert_ne!(one, tree_digest(&[a]));
    }

    #[test]
    fn scan_matches_written_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sub/deeper")).unwrap();
        std::fs::write(dir.path().join("top"), b"abc").unwrap();
        std::fs::write(dir.path().join("sub/deeper/x"), b"").unwrap();
        let mut entries = scan_tree(dir.path()).unwrap();
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].path, "sub/deeper/x");
        assert_eq!(entries[1].path, "top");
        assert_eq!(entries[1].bytes, 3);
        assert_eq!(tree_size(dir.path()), Some((2, 3)));
        assert_eq!(tree_size(&dir.path().join("missing")), None);
    }
}
