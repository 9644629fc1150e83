//! Reading members out of PyPI archives: one file from a wheel (zip), a directory
//! prefix from an sdist (tar.gz).
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};

use crate::digest::{HashingWriter, TreeEntry};
use crate::error::HubError;

/// Bytes moved per read while copying a member.
const COPY_CHUNK: usize = 1 << 20;

/// Copies `reader` into `out`, calling `on_bytes` with each chunk's length. Read errors
/// are charged to `archive`, write errors to `dest`.
fn copy_counting(
    reader: &mut dyn Read,
    out: &mut dyn Write,
    archive: &Path,
    dest: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<u64, HubError> {
    let mut buf = vec![0u8; COPY_CHUNK];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(HubError::io("decompress", archive)(e)),
        };
        out.write_all(&buf[..n])
            .map_err(HubError::io("write", dest))?;
        total += n as u64;
        on_bytes(n as u64);
    }
    Ok(total)
}

/// Appends the wheel member `member` of `archive` to `out` (whose file is `dest`, for
/// errors) and returns its length.
pub(crate) fn copy_wheel_member(
    archive: &Path,
    member: &str,
    out: &mut dyn Write,
    dest: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<u64, HubError> {
    let zip_err = |source| HubError::Zip {
        archive: archive.to_path_buf(),
        source,
    };
    let file = File::open(archive).map_err(HubError::io("open", archive))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(file)).map_err(zip_err)?;
    let mut entry = match zip.by_name(member) {
        Ok(entry) if entry.is_file() => entry,
        Ok(_) | Err(zip::result::ZipError::FileNotFound) => {
            return Err(HubError::MemberMissing {
                archive: archive.to_path_buf(),
                member: member.to_string(),
            })
        }
        Err(e) => return Err(zip_err(e)),
    };
    copy_counting(&mut entry, out, archive, dest, on_bytes)
}

/// The path of `entry` relative to `prefix`, checked to stay inside the destination:
/// `None` when the entry is outside the prefix (or the prefix itself).
fn relative_inside(
    archive: &Path,
    entry: &Path,
    prefix: &str,
) -> Result<Option<PathBuf>, HubError> {
    let entry_str = entry.to_string_lossy();
    let Some(rest) = entry_str.strip_prefix(prefix) else {
        return Ok(None);
    };
    let mut rel = PathBuf::new();
    for component in Path::new(rest).components() {
        match component {
            Component::Normal(part) => rel.push(part),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(HubError::UnsafeEntry {
                    archive: archive.to_path_buf(),
                    entry: entry_str.into_owned(),
                    reason: "path leaves the destination directory",
                })
            }
        }
    }
    Ok((!rel.as_os_str().is_empty()).then_some(rel))
}

/// Extracts every entry of the sdist `archive` under `prefix` (which ends in `/`) into
/// `dest`, prefix removed. Each file is hashed as it is written and synced to disk. Links
/// and special files are refused. Returns the files written, for [`crate::tree_digest`].
pub(crate) fn extract_sdist_tree(
    archive: &Path,
    prefix: &str,
    dest: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<Vec<TreeEntry>, HubError> {
    let file = File::open(archive).map_err(HubError::io("open", archive))?;
    let gz = flate2::read::GzDecoder::new(BufReader::new(file));
    let mut tar = tar::Archive::new(gz);
    let mut written = Vec::new();
    let entries = tar.entries().map_err(HubError::io("read tar", archive))?;
    for entry in entries {
        let mut entry = entry.map_err(HubError::io("read tar", archive))?;
        let entry_path = entry
            .path()
            .map_err(HubError::io("read tar", archive))?
            .into_owned();
        let Some(rel) = relative_inside(archive, &entry_path, prefix)? else {
            continue;
        };
        let target = dest.join(&rel);
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            std::fs::create_dir_all(&target).map_err(HubError::io("create directory", &target))?;
            continue;
        }
        if !kind.is_file() {
            return Err(HubError::UnsafeEntry {
                archive: archive.to_path_buf(),
                entry: entry_path.to_string_lossy().into_owned(),
                reason: "only regular files and directories are extracted",
            });
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io("create directory", parent))?;
        }
        let out = File::create(&target).map_err(HubError::io("create", &target))?;
        let mut writer = HashingWriter::new(BufWriter::new(out));
        copy_counting(&mut entry, &mut writer, archive, &target, on_bytes)?;
        let (buffered, sha256, bytes) = writer.finish();
        let out = buffered
            .into_inner()
            .map_err(|e| HubError::io("write", &target)(e.into_error()))?;
        out.sync_all().map_err(HubError::io("sync", &target))?;
        let path = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        written.push(TreeEntry {
            path,
            bytes,
            sha256,
        });
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_stripping_refuses_escapes() {
        let a = Path::new("a.tar.gz");
        let rel = |p: &str| relative_inside(a, Path::new(p), "pkg/models/");
        assert_eq!(
            rel("pkg/models/x/y.txt").unwrap(),
            Some(PathBuf::from("x/y.txt"))
        );
        assert_eq!(rel("pkg/models/").unwrap(), None);
        assert_eq!(rel("pkg/other/y.txt").unwrap(), None);
        assert_eq!(rel("pkg/models/./z").unwrap(), Some(PathBuf::from("z")));
        let err = rel("pkg/models/../../etc/passwd").unwrap_err();
        assert_eq!(err.kind(), "unsafe_archive_entry");
    }
}
