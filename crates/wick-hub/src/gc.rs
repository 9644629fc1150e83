//! `wick rm` and `wick gc`: removing a model, and finding what the Hugging Face cache and
//! the store hold that nothing uses.
//!
//! Garbage in the Hugging Face cache, per repository:
//! - snapshots no ref names, when the repository has refs (older revisions);
//! - blobs no remaining snapshot links to;
//! - `blobs/*.incomplete` partial downloads nobody is resuming (no live lock);
//! - lock files whose owner is gone.
//!
//! In the store: hidden temporaries pull leaves in `models/` after a crash.
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use crate::error::HubError;
use crate::hf::cache::pid_alive;
use crate::local_model::ModelOrigin;
use crate::store::Store;

/// One thing gc would remove.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Garbage {
    /// The file or directory.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Why it is garbage.
    pub reason: &'static str,
}

fn size_of(path: &Path) -> u64 {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => crate::digest::tree_size(path).map(|(_, b)| b).unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// Every file (not directory) under `dir`, symlinks not followed.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(list) = fs::read_dir(dir) else { return };
    for e in list.flatten() {
        let p = e.path();
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => walk(&p, out),
            Ok(_) => out.push(p),
            Err(_) => {}
        }
    }
}

fn sorted_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

impl Store {
    /// What `wick gc` would remove (nothing is removed).
    pub fn garbage(&self) -> Vec<Garbage> {
        let mut out = Vec::new();
        let hf = self.hf_cache();
        for repo in sorted_dirs(hf) {
            let name = repo
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if !name.starts_with("models--") {
                continue;
            }
            let mut refs = Vec::new();
            walk(&repo.join("refs"), &mut refs);
            let named: HashSet<String> = refs
                .iter()
                .filter_map(|r| fs::read_to_string(r).ok())
                .map(|s| s.trim().to_string())
                .collect();
            let mut kept = Vec::new();
            for snap in sorted_dirs(&repo.join("snapshots")) {
                let commit = snap
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if !named.is_empty() && !named.contains(&commit) {
                    out.push(Garbage {
                        bytes: 0,
                        path: snap,
                        reason: "snapshot of a revision no ref names",
                    });
                } else {
                    kept.push(snap);
                }
            }
            let mut used = HashSet::new();
            for snap in &kept {
                let mut links = Vec::new();
                walk(snap, &mut links);
                for l in links {
                    if let Ok(target) = fs::read_link(&l) {
                        if let Some(n) = target.file_name() {
                            used.insert(n.to_string_lossy().into_owned());
                        }
                    }
                }
            }
            let locks = hf.join(".locks").join(&name);
            for blob in fs::read_dir(repo.join("blobs"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let file = blob.file_name().to_string_lossy().into_owned();
                let path = blob.path();
                if let Some(etag) = file.strip_suffix(".incomplete") {
                    let lock = locks.join(format!("{etag}.wick-lock"));
                    let live = fs::read_to_string(&lock)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok())
                        .is_some_and(pid_alive);
                    if !live {
                        out.push(Garbage {
                            bytes: size_of(&path),
                            path,
                            reason: "partial download nobody is resuming",
                        });
                    }
                } else if !used.contains(&file) {
                    out.push(Garbage {
                        bytes: size_of(&path),
                        path,
                        reason: "blob no snapshot uses",
                    });
                }
            }
            for lock in fs::read_dir(&locks).into_iter().flatten().flatten() {
                let path = lock.path();
                let owner = fs::read_to_string(&path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                if path.extension().is_some_and(|e| e == "wick-lock")
                    && !owner.is_some_and(pid_alive)
                {
                    out.push(Garbage {
                        bytes: 0,
                        path,
                        reason: "lock of a process that is gone",
                    });
                }
            }
        }
        let mut store_files = Vec::new();
        walk(&self.models_dir(), &mut store_files);
        for f in store_files {
            let hidden = f.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with('.') && n.contains(".partial")
            });
            if hidden {
                out.push(Garbage {
                    bytes: size_of(&f),
                    path: f,
                    reason: "temporary of an interrupted pull",
                });
            }
        }
        out
    }

    /// Removes what [`Store::garbage`] listed; the bytes freed.
    pub fn collect_garbage(&self, items: &[Garbage]) -> Result<u64, HubError> {
        let mut freed = 0;
        for g in items {
            let r = if g.path.is_dir() && !g.path.is_symlink() {
                fs::remove_dir_all(&g.path)
            } else {
                fs::remove_file(&g.path)
            };
            match r {
                Ok(()) => freed += g.bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(HubError::io("remove", &g.path)(e)),
            }
        }
        Ok(freed)
    }

    /// Removes a local model by its exact name (as `wick ls` shows it): a store model's
    /// directory or file, or a Hugging Face cache repository (every revision). Returns
    /// what was removed and its size.
    pub fn remove(&self, name: &str) -> Result<(PathBuf, u64), HubError> {
        let models = self.list();
        let found = models
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| HubError::NotFound {
                query: name.to_string(),
                searched: vec![self.models_dir(), self.hf_cache().to_path_buf()],
            })?;
        let target = match found.origin {
            ModelOrigin::Store => {
                // The model's own directory under models/, else the loose file.
                let models_dir = self.models_dir();
                let rel = found.path.strip_prefix(&models_dir).ok();
                match rel.and_then(|r| r.components().next()) {
                    Some(first) if rel.is_some_and(|r| r.components().count() > 1) => {
                        models_dir.join(first)
                    }
                    _ => found.path.clone(),
                }
            }
            ModelOrigin::HfCache => {
                let repo_id = found.name.split('/').take(2).collect::<Vec<_>>().join("/");
                self.hf_cache().join(crate::hf::repo_folder(&repo_id))
            }
        };
        let bytes = size_of(&target);
        let r = if target.is_dir() {
            fs::remove_dir_all(&target)
        } else {
            fs::remove_file(&target)
        };
        r.map_err(HubError::io("remove", &target))?;
        Ok((target, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::RepoCache;

    #[test]
    fn gc_finds_orphans_partials_and_old_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("w"), dir.path().join("hf"));
        let cache = RepoCache::new(store.hf_cache(), "o/m");
        fs::create_dir_all(cache.blobs()).unwrap();
        for b in ["used", "old", "orphan"] {
            fs::write(cache.blob(b), b).unwrap();
        }
        fs::write(cache.incomplete("part"), b"xx").unwrap();
        cache.link("new", "config.json", "used").unwrap();
        cache.link("prev", "config.json", "old").unwrap();
        cache.write_ref("main", "new").unwrap();
        let g = store.garbage();
        let names: Vec<String> = g
            .iter()
            .map(|g| g.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&"prev".to_string()), "{names:?}");
        assert!(names.contains(&"old".to_string()), "{names:?}");
        assert!(names.contains(&"orphan".to_string()), "{names:?}");
        assert!(names.contains(&"part.incomplete".to_string()), "{names:?}");
        assert!(!names.contains(&"used".to_string()), "{names:?}");
        // Listing removed nothing; collecting does.
        assert!(cache.blob("orphan").exists());
        store.collect_garbage(&g).unwrap();
        assert!(!cache.blob("orphan").exists());
        assert!(cache.blob("used").exists());
        assert!(store.garbage().is_empty());
    }
}
