//! Turning the MODEL argument into a loaded model: resolve it in the store, pulling a
//! catalog model that is not downloaded yet.
use std::path::PathBuf;

use anyhow::Context;
use wick_hub::hf::{GetOptions, RepoRef};
use wick_hub::{catalog, HubError, PullEvent, PullOptions, Store};

/// Resolves `arg` (default: the embedded default model) to a path, pulling catalog
/// models on first use.
pub fn resolve(arg: Option<&str>) -> anyhow::Result<PathBuf> {
    resolve_named(arg).map(|r| r.path)
}

/// A resolved model argument.
pub struct Resolved {
    /// The GGUF file or model directory.
    pub path: PathBuf,
    /// The canonical name of what a query matched (the store's or Hugging Face cache's
    /// name, a catalog name), or the file name for a path.
    pub name: String,
    /// The argument was a path, not a name.
    pub is_path: bool,
}

/// [`resolve`], keeping the name the argument resolved to.
pub fn resolve_named(arg: Option<&str>) -> anyhow::Result<Resolved> {
    let store = Store::from_env()?;
    let query = arg.unwrap_or(catalog::DEFAULT_MODEL);
    let is_path = !query.is_empty() && std::path::Path::new(query).exists();
    let looks_repo = !is_path && RepoRef::looks_like_repo(query);
    match store.resolve(query) {
        // `ORG/NAME` names one repository: a substring hit on another one is not it.
        Ok(m) if looks_repo && !same_repo(&m.name, query) => fetch_repo(&store, query),
        Ok(m) => Ok(Resolved {
            path: m.path,
            name: m.name,
            is_path,
        }),
        Err(HubError::NotDownloaded { item, .. }) => {
            eprintln!(
                "{} is not downloaded yet: fetching it ({:.0} MB)…",
                item.name,
                item.download_bytes() as f64 / 1e6
            );
            let pulled = store.pull(item, &PullOptions::default(), &mut print_progress)?;
            Ok(Resolved {
                path: pulled.path,
                name: item.name.to_string(),
                is_path: false,
            })
        }
        Err(HubError::NotFound { .. }) if RepoRef::looks_like_repo(query) => {
            fetch_repo(&store, query)
        }
        Err(e) => Err(e).with_context(|| format!("cannot find model '{query}'")),
    }
}

/// Whether a local model's name is the repository `query` (or one GGUF file of it).
fn same_repo(name: &str, query: &str) -> bool {
    let (name, query) = (name.to_lowercase(), query.to_lowercase());
    name == query || name.starts_with(&format!("{query}/"))
}

/// A Hugging Face repository id that is not in the cache yet (or `ORG/NAME@REV` of a
/// revision not fetched yet): fetch what is missing, then load its snapshot.
fn fetch_repo(store: &Store, query: &str) -> anyhow::Result<Resolved> {
    let repo = RepoRef::parse(query)?;
    let cache = wick_hub::hf::RepoCache::new(store.hf_cache(), &repo.repo);
    let local = repo
        .revision
        .as_deref()
        .map(|rev| cache.read_ref(rev).unwrap_or_else(|| rev.to_string()))
        .map(|commit| cache.snapshot(&commit))
        .filter(|dir| dir.is_dir());
    let snapshot = match local {
        Some(dir) => dir,
        None => {
            eprintln!(
                "wick: {} is not in the Hugging Face cache: fetching it",
                repo.repo
            );
            crate::commands::get::fetch(&repo, &GetOptions::default())?.snapshot
        }
    };
    let model = store
        .resolve(&snapshot.to_string_lossy())
        .with_context(|| format!("{} was fetched but holds no model wick can load", repo.repo))?;
    Ok(Resolved {
        path: model.path,
        name: repo.repo,
        is_path: false,
    })
}

/// Resolves `arg` when it names a model; `Ok(None)` when nothing matches it (so a caller
/// may read it as something else), errors for ambiguity and other failures.
pub fn resolve_if_model(arg: &str) -> anyhow::Result<Option<PathBuf>> {
    let store = Store::from_env()?;
    match store.resolve(arg) {
        Err(HubError::NotFound { .. }) | Err(HubError::NotAModel { .. }) => Ok(None),
        _ => resolve(Some(arg)).map(Some),
    }
}

/// Prints pull progress on stderr.
pub fn print_progress(event: PullEvent) {
    match event {
        PullEvent::AlreadyPresent { path, verified } => {
            eprintln!(
                "already present{}: {}",
                if verified { " (verified)" } else { "" },
                path.display()
            )
        }
        PullEvent::Replacing { path, reason } => {
            eprintln!("replacing {}: {reason}", path.display())
        }
        PullEvent::Downloading {
            index,
            count,
            package,
        } => eprintln!("[{index}/{count}] downloading {package}"),
        PullEvent::Cached {
            index,
            count,
            archive,
        } => eprintln!("[{index}/{count}] cached {}", archive.display()),
        PullEvent::Verifying { path } => eprintln!("verifying {}", path.display()),
        PullEvent::Extracting {
            done_bytes,
            total_bytes,
        } => {
            let pct = (done_bytes * 100).checked_div(total_bytes).unwrap_or(100);
            eprint!(
                "\rextracting {pct:3}% ({:.1}/{:.1} MB)",
                done_bytes as f64 / 1e6,
                total_bytes as f64 / 1e6
            );
            if done_bytes >= total_bytes {
                eprintln!();
            }
        }
        PullEvent::Installed { path } => eprintln!("installed {}", path.display()),
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

/// The `--kv-type` flag: `None` leaves the choice to the model format.
pub fn kv_dtype(
    arg: Option<&str>,
) -> anyhow::Result<Option<wick_engine::backend::candle::KvDtype>> {
    arg.map(|s| s.parse().map_err(anyhow::Error::msg))
        .transpose()
}
