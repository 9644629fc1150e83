//! Models on this machine: what a model directory or file is, and the models found in the
//! store's `models/` and in the Hugging Face cache.
use std::fmt;
use std::path::{Path, PathBuf};

use crate::store::Store;

/// How a model is stored, which decides how the engine loads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// A single GGUF file (`path` is the file).
    Gguf,
    /// A Hugging Face directory: `config.json` plus safetensors weights (`path` is the
    /// directory).
    HfDir,
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModelKind::Gguf => "gguf",
            ModelKind::HfDir => "safetensors",
        })
    }
}

/// Where a local model was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelOrigin {
    /// wick's store, `$WICK_HOME/models/`.
    Store,
    /// The Hugging Face hub cache.
    HfCache,
}

/// A model on disk, as `wick ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalModel {
    /// The name a model argument matches against: the directory under `models/`, or
    /// `ORG/NAME` for the Hugging Face cache (with `/<file stem>` appended when one
    /// directory holds several GGUF files).
    pub name: String,
    /// The GGUF file or the model directory.
    pub path: PathBuf,
    /// How it is stored.
    pub format: ModelKind,
    /// Where it was found.
    pub origin: ModelOrigin,
    /// Size on disk (a directory's files summed, symlinks followed).
    pub size_bytes: u64,
    /// Architecture: GGUF `general.architecture` or config.json `model_type`, when readable.
    pub arch: Option<String>,
}

/// A model found by a scan: its names and where it is, before sizes and architecture are
/// read (resolution needs no more).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    /// The primary name (see [`LocalModel::name`]).
    pub name: String,
    /// Shorter names that also match exactly (a Hugging Face repo without its org).
    pub short_names: Vec<String>,
    pub path: PathBuf,
    pub kind: ModelKind,
    pub origin: ModelOrigin,
}

/// Whether `name` is a file wick ignores: hidden files (pull's temporaries among them).
fn hidden(name: &str) -> bool {
    name.starts_with('.')
}

/// Whether `name` is a GGUF file that can be loaded on its own: `.gguf`, and for split
/// models (`…-00002-of-00005.gguf`) only the first shard.
fn loadable_gguf(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let Some(stem) = lower.strip_suffix(".gguf") else {
        return false;
    };
    if hidden(name) {
        return false;
    }
    // `<base>-NNNNN-of-MMMMM`
    let shard = stem
        .rsplit_once("-of-")
        .and_then(|(head, total)| head.rsplit_once('-').map(|(_, index)| (index, total)));
    match shard {
        Some((index, total))
            if index.len() == 5
                && total.len() == 5
                && index
                    .bytes()
                    .chain(total.bytes())
                    .all(|b| b.is_ascii_digit()) =>
        {
            index == "00001"
        }
        _ => true,
    }
}

/// Loadable GGUF files directly in `dir` and in its subdirectories up to `depth` levels,
/// sorted by path.
pub(crate) fn gguf_files(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(listing) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in listing.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if hidden(&name) {
            continue;
        }
        let path = entry.path();
        // metadata() follows symlinks: HF snapshots are symlinks into blobs/.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_file() && loadable_gguf(&name) {
            found.push(path);
        } else if meta.is_dir() && depth > 0 {
            found.extend(gguf_files(&path, depth - 1));
        }
    }
    found.sort();
    found
}

/// Whether `dir` holds a Hugging Face model: `config.json` and at least one
/// `.safetensors` file.
pub(crate) fn is_hf_model_dir(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    std::fs::read_dir(dir)
        .map(|listing| {
            listing
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        })
        .unwrap_or(false)
}

/// The file stem of a GGUF path (`model.Q4_K_M`).
pub(crate) fn gguf_stem(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .map(|n| match n.len().checked_sub(5) {
            Some(cut) if n.is_char_boundary(cut) && n[cut..].eq_ignore_ascii_case(".gguf") => {
                n[..cut].to_string()
            }
            _ => n,
        })
        .unwrap_or_default()
}

/// Sorted subdirectories of `dir` that are not hidden, with their names.
fn subdirs(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut dirs: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            (!hidden(&name) && path.is_dir()).then_some((name, path))
        })
        .collect();
    dirs.sort();
    dirs
}

/// The models in one directory: an HF model, else each loadable GGUF. `name` is the
/// directory's model name; with several GGUFs each gets `name/<stem>`.
fn models_in_dir(
    dir: &Path,
    name: &str,
    short: Option<&str>,
    origin: ModelOrigin,
    depth: usize,
) -> Vec<Found> {
    if is_hf_model_dir(dir) {
        return vec![Found {
            name: name.to_string(),
            short_names: short.map(str::to_string).into_iter().collect(),
            path: dir.to_path_buf(),
            kind: ModelKind::HfDir,
            origin,
        }];
    }
    let ggufs = gguf_files(dir, depth);
    let single = ggufs.len() == 1;
    ggufs
        .into_iter()
        .map(|path| {
            let stem = gguf_stem(&path);
            let (name, short_names) = if single {
                (
                    name.to_string(),
                    short.map(str::to_string).into_iter().collect(),
                )
            } else {
                let mut shorts = vec![stem.clone()];
                if let Some(short) = short {
                    shorts.push(format!("{short}/{stem}"));
                }
                (format!("{name}/{stem}"), shorts)
            };
            Found {
                name,
                short_names,
                path,
                kind: ModelKind::Gguf,
                origin,
            }
        })
        .collect()
}

/// The revision directory of an HF cache repo: `refs/main` names it; without a usable
/// ref, the most recently modified snapshot.
fn hf_snapshot(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let rev = rev.trim();
        let dir = snapshots.join(rev);
        if !rev.is_empty() && !rev.contains('/') && dir.is_dir() {
            return Some(dir);
        }
    }
    subdirs(&snapshots)
        .into_iter()
        .max_by_key(|(_, path)| {
            std::fs::metadata(path)
                .and_then(|m| m.modified())
                .unwrap_or(std::time::SystemTime::UNIX_EPOCH)
        })
        .map(|(_, path)| path)
}

/// `models--ORG--NAME` → (`ORG/NAME`, `NAME`).
fn hf_repo_id(dir_name: &str) -> Option<(String, String)> {
    let rest = dir_name.strip_prefix("models--")?;
    if rest.is_empty() {
        return None;
    }
    let id = rest.replace("--", "/");
    let short = id.rsplit('/').next().unwrap_or(&id).to_string();
    Some((id, short))
}

impl Store {
    /// Models in `models/`: each subdirectory (an HF model or its GGUF files) and loose
    /// `.gguf` files, sorted by name.
    pub(crate) fn scan_store(&self) -> Vec<Found> {
        let models = self.models_dir();
        let mut found = Vec::new();
        for (name, dir) in subdirs(&models) {
            found.extend(models_in_dir(&dir, &name, None, ModelOrigin::Store, 1));
        }
        for path in gguf_files(&models, 0) {
            found.push(Found {
                name: gguf_stem(&path),
                short_names: Vec::new(),
                path,
                kind: ModelKind::Gguf,
                origin: ModelOrigin::Store,
            });
        }
        found.sort_by_cached_key(|f| (f.name.to_lowercase(), f.name.clone()));
        found
    }

    /// Models in the Hugging Face cache: `models--ORG--NAME/snapshots/<rev>/` for the
    /// revision `refs/main` names, sorted by name.
    pub(crate) fn scan_hf_cache(&self) -> Vec<Found> {
        let mut found = Vec::new();
        for (dir_name, repo) in subdirs(self.hf_cache()) {
            let Some((id, short)) = hf_repo_id(&dir_name) else {
                continue;
            };
            let Some(snapshot) = hf_snapshot(&repo) else {
                continue;
            };
            found.extend(models_in_dir(
                &snapshot,
                &id,
                Some(&short),
                ModelOrigin::HfCache,
                2,
            ));
        }
        found.sort_by_cached_key(|f| (f.name.to_lowercase(), f.name.clone()));
        found
    }

    /// Every local model: the store's first, then the Hugging Face cache's, each sorted
    /// by name (case-insensitively). Missing directories simply contribute nothing.
    pub fn list(&self) -> Vec<LocalModel> {
        self.scan_store()
            .into_iter()
            .chain(self.scan_hf_cache())
            .map(|found| LocalModel {
                size_bytes: size_on_disk(&found.path),
                arch: read_arch(&found.path, found.kind),
                name: found.name,
                path: found.path,
                format: found.kind,
                origin: found.origin,
            })
            .collect()
    }
}

/// Size of a file, or of every file under a directory (symlinks followed).
fn size_on_disk(path: &Path) -> u64 {
    let Ok(meta) = std::fs::metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return meta.len();
    }
    crate::digest::tree_size(path)
        .map(|(_, bytes)| bytes)
        .unwrap_or(0)
}

/// The architecture a model declares, if it can be read.
pub(crate) fn read_arch(path: &Path, kind: ModelKind) -> Option<String> {
    match kind {
        ModelKind::Gguf => {
            let gguf = wick_gguf::GgufFile::open(path).ok()?;
            let arch = gguf.metadata().opt_str("general.architecture").ok()??;
            Some(arch.to_string())
        }
        ModelKind::HfDir => {
            let text = std::fs::read_to_string(path.join("config.json")).ok()?;
            let config: serde_json::Value = serde_json::from_str(&text).ok()?;
            config.get("model_type")?.as_str().map(str::to_string)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_after_the_first_are_not_loadable() {
        assert!(loadable_gguf("model.gguf"));
        assert!(loadable_gguf("Model.Q4_K_M.GGUF"));
        assert!(loadable_gguf("big-00001-of-00003.gguf"));
        assert!(!loadable_gguf("big-00002-of-00003.gguf"));
        assert!(loadable_gguf("v-2-of-3.gguf"));
        assert!(!loadable_gguf(".model.gguf.partial-x"));
        assert!(!loadable_gguf(".hidden.gguf"));
        assert!(!loadable_gguf("model.bin"));
    }

    #[test]
    fn hf_repo_ids() {
        assert_eq!(
            hf_repo_id("models--Qwen--Qwen2.5-0.5B"),
            Some(("Qwen/Qwen2.5-0.5B".into(), "Qwen2.5-0.5B".into()))
        );
        assert_eq!(
            hf_repo_id("models--gpt2"),
            Some(("gpt2".into(), "gpt2".into()))
        );
        assert_eq!(hf_repo_id("datasets--x--y"), None);
        assert_eq!(hf_repo_id("models--"), None);
    }

    #[test]
    fn stems() {
        assert_eq!(gguf_stem(Path::new("/a/b/Model.Q4_1.gguf")), "Model.Q4_1");
        assert_eq!(gguf_stem(Path::new("x.GGUF")), "x");
        assert_eq!(gguf_stem(Path::new("noext")), "noext");
    }
}
