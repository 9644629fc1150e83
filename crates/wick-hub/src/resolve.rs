//! Resolving a user's model argument: a path, or a name/substring query over local
//! models and the catalog.
//!
//! Order of the rules (first that applies wins):
//! 1. An existing `.gguf` file, or a directory with `config.json` or exactly one GGUF.
//! 2. An exact name (case-insensitive) of a local model: the store's, then the HF cache's
//!    (`ORG/NAME`, or just `NAME`).
//! 3. An exact catalog name or alias: its installed copy, else [`HubError::NotDownloaded`].
//! 4. A substring of any of those names: one match wins, several are
//!    [`HubError::Ambiguous`], none is [`HubError::NotFound`].
use std::path::{Path, PathBuf};

use crate::catalog::{CatalogItem, CATALOG};
use crate::error::HubError;
use crate::local_model::{gguf_files, gguf_stem, ModelKind};
use crate::store::Store;

/// A model argument resolved to something on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModel {
    /// Display name: the local model's name, or the file/directory name for a path.
    pub name: String,
    /// The GGUF file, or the HF model directory.
    pub path: PathBuf,
    /// How to load it.
    pub kind: ModelKind,
}

/// One thing a query can select, with every name it answers to.
struct Candidate {
    display: String,
    names: Vec<String>,
    answer: Answer,
}

enum Answer {
    Local(ResolvedModel),
    Missing(&'static CatalogItem),
}

impl Candidate {
    fn into_result(self, query: &str) -> Result<ResolvedModel, HubError> {
        match self.answer {
            Answer::Local(model) => Ok(model),
            Answer::Missing(item) => Err(HubError::NotDownloaded {
                query: query.to_string(),
                item,
            }),
        }
    }
}

/// Whether `arg` can only be meant as a path (so a missing one is an error, not a query).
/// `ORG/NAME` is not: it is how Hugging Face models are named.
fn looks_like_path(arg: &str) -> bool {
    arg.starts_with('/')
        || arg.starts_with("./")
        || arg.starts_with("../")
        || arg.starts_with("~/")
        || arg == "."
        || arg == ".."
        || arg.to_ascii_lowercase().ends_with(".gguf")
}

fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// Resolves an existing path; `Err(reason)` when it is not a loadable model.
fn resolve_path(path: &Path) -> Result<Result<ResolvedModel, String>, HubError> {
    let meta = std::fs::metadata(path).map_err(HubError::io("stat", path))?;
    if meta.is_file() {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Ok(Ok(ResolvedModel {
                name: gguf_stem(path),
                path: path.to_path_buf(),
                kind: ModelKind::Gguf,
            }));
        }
        return Ok(Err("a file that is not .gguf".to_string()));
    }
    if path.join("config.json").is_file() {
        return Ok(Ok(ResolvedModel {
            name: display_name(&std::fs::canonicalize(path).unwrap_or(path.to_path_buf())),
            path: path.to_path_buf(),
            kind: ModelKind::HfDir,
        }));
    }
    let ggufs = gguf_files(path, 0);
    match ggufs.as_slice() {
        [one] => Ok(Ok(ResolvedModel {
            name: gguf_stem(one),
            path: one.clone(),
            kind: ModelKind::Gguf,
        })),
        [] => Ok(Err(
            "a directory with neither config.json nor a .gguf file".to_string()
        )),
        several => Err(HubError::Ambiguous {
            query: path.display().to_string(),
            candidates: several.iter().map(|p| p.display().to_string()).collect(),
        }),
    }
}

impl Store {
    /// Resolves a model argument (a path or a query; see the module docs for the rules).
    ///
    /// A query naming a catalog item that is not pulled yet answers
    /// [`HubError::NotDownloaded`], so a caller can pull it and resolve again.
    pub fn resolve(&self, arg: &str) -> Result<ResolvedModel, HubError> {
        let path = Path::new(arg);
        if !arg.is_empty() && path.exists() {
            match resolve_path(path)? {
                Ok(model) => return Ok(model),
                Err(reason) if looks_like_path(arg) => {
                    return Err(HubError::NotAModel {
                        path: path.to_path_buf(),
                        reason,
                    })
                }
                // A bare word that happens to name some unrelated file here: a query.
                Err(_) => {}
            }
        } else if looks_like_path(arg) {
            return Err(HubError::NotAModel {
                path: path.to_path_buf(),
                reason: "no such file or directory".to_string(),
            });
        }
        self.resolve_query(arg)
    }

    /// Every candidate a query can select: local models (installed catalog items also
    /// answer to their aliases), then catalog items not yet pulled.
    fn candidates(&self) -> Vec<Candidate> {
        let mut candidates: Vec<Candidate> = self
            .scan_store()
            .into_iter()
            .chain(self.scan_hf_cache())
            .map(|found| {
                let mut names = vec![found.name.clone()];
                names.extend(found.short_names);
                Candidate {
                    display: found.name.clone(),
                    names,
                    answer: Answer::Local(ResolvedModel {
                        name: found.name,
                        path: found.path,
                        kind: found.kind,
                    }),
                }
            })
            .collect();
        for item in CATALOG.iter().filter(|item| item.is_model()) {
            let installed = self.installed(item);
            let local = candidates.iter_mut().find(|c| match &c.answer {
                Answer::Local(model) => match &installed {
                    Some(path) => &model.path == path,
                    None => model.name == item.name,
                },
                Answer::Missing(_) => false,
            });
            match local {
                Some(local) => local
                    .names
                    .extend(item.aliases.iter().map(|a| a.to_string())),
                None => candidates.push(Candidate {
                    display: format!("{} (not downloaded)", item.name),
                    names: item.names().map(str::to_string).collect(),
                    answer: Answer::Missing(item),
                }),
            }
        }
        candidates
    }

    fn resolve_query(&self, query: &str) -> Result<ResolvedModel, HubError> {
        let searched = vec![self.models_dir(), self.hf_cache().to_path_buf()];
        let needle = query.trim().to_lowercase();
        if needle.is_empty() {
            return Err(HubError::NotFound {
                query: query.to_string(),
                searched,
            });
        }
        // Exact names first; candidates are ordered store, HF cache, catalog.
        let (exact, others): (Vec<Candidate>, Vec<Candidate>) = self
            .candidates()
            .into_iter()
            .partition(|c| c.names.iter().any(|n| n.to_lowercase() == needle));
        if let Some(first) = exact.into_iter().next() {
            return first.into_result(query);
        }
        let mut matches: Vec<Candidate> = others
            .into_iter()
            .filter(|c| c.names.iter().any(|n| n.to_lowercase().contains(&needle)))
            .collect();
        if matches.len() > 1 {
            return Err(HubError::Ambiguous {
                query: query.to_string(),
                candidates: matches.into_iter().map(|c| c.display).collect(),
            });
        }
        match matches.pop() {
            Some(only) => only.into_result(query),
            None => Err(HubError::NotFound {
                query: query.to_string(),
                searched,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_shapes() {
        assert!(looks_like_path("/abs/model"));
        assert!(looks_like_path("./m"));
        assert!(looks_like_path("x.GGUF"));
        assert!(!looks_like_path("Qwen/Qwen2.5-0.5B"));
        assert!(!looks_like_path("smollm2"));
    }
}
