//! wick's prompt cache: agents never re-prefill, restarts lose nothing.
//!
//! How the parts fit:
//! - [`value`] is the seam to the engine: a cached KV state is an opaque
//!   [`CacheValue`] (length, trimmability, fork of a prefix, size, host copy); the engine
//!   rebuilds values from a [`KvSnapshot`] through a [`ValueLoader`]. A paged block pool
//!   implements `fork` by sharing blocks; nothing here changes.
//! - [`prefix_index`] finds the longest shared prefix by chained block hashes.
//! - [`ram`] is the byte-capped LRU tier of live values, per namespace ([`namespace`]),
//!   with superseding and eviction.
//! - [`ssd`] is the cold tier: a self-checking `.wkv` file per entry and `.wkc` chunk files
//!   that entries sharing a prefix share (a conversation is stored once), atomic writes, a
//!   start-up scan that rebuilds the index and reference counts, LRU by modification time.
//! - [`durability`] is the background writer: spills, debounced write-behind while the
//!   engine is idle, generation checkpoints, and `flush`.
//! - [`checkpoint`] keys and records in-flight generations for resume after a crash.
//! - [`PromptCache`] puts it together for the engine and the server.
//!
//! ```
//! use wick_cache::{CacheValue, KvSnapshot, LayerSnapshot, PromptCache, PromptCacheConfig, ValueLoader};
//!
//! // A toy value: the host snapshot itself.
//! struct Kv(KvSnapshot);
//! impl CacheValue for Kv {
//!     fn len(&self) -> usize { self.0.len() }
//!     fn can_trim_to(&self, len: usize) -> bool { self.0.can_trim_to(len) }
//!     fn fork(&self, len: usize) -> wick_cache::Result<Self> {
//!         let mut s = self.0.clone();
//!         s.trim(len)?;
//!         Ok(Kv(s))
//!     }
//!     fn byte_size(&self) -> usize { self.0.byte_size() }
//!     fn to_host(&self) -> wick_cache::Result<KvSnapshot> { Ok(self.0.clone()) }
//! }
//! struct Loader;
//! impl ValueLoader<Kv> for Loader {
//!     fn load(&self, s: KvSnapshot) -> wick_cache::Result<Kv> { Ok(Kv(s)) }
//! }
//! fn kv(n: usize) -> Kv {
//!     Kv(KvSnapshot { recurrent: Vec::new(), layers: vec![LayerSnapshot {
//!         start: 0, len: n, kv_heads: 1, head_dim: 1, window: None,
//!         keys: vec![0.0; n], values: vec![0.0; n],
//!     }] })
//! }
//!
//! let cache = PromptCache::new(PromptCacheConfig::default())?;
//! let turn1: Vec<u32> = (0..100).collect();
//! assert!(cache.lookup("", &turn1, &Loader).value.is_none());
//! cache.put("", &turn1, kv(100));
//! let mut turn2 = turn1.clone();
//! turn2.extend([7, 8, 9]);
//! let hit = cache.lookup("", &turn2, &Loader);
//! assert_eq!(hit.cached, 100);
//! assert_eq!(cache.stats().hits, 1);
//! # Ok::<(), wick_cache::CacheError>(())
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
pub mod durability;
mod error;
pub mod namespace;
pub mod prefix_index;
mod prompt_cache;
pub mod ram;
pub mod ssd;
mod stats;
pub mod value;

pub use checkpoint::{CheckpointKey, CheckpointMeta, KeyBuilder, Resume};
pub use durability::dirty::Timing;
pub use error::{CacheError, Result};
pub use prompt_cache::{
    HitSource, Lookup, PromptCache, PromptCacheConfig, DEFAULT_WRITE_QUEUE_BYTES,
};
pub use ram::MissReason;
pub use ssd::{ScanReport, SsdConfig};
pub use stats::{CacheStats, FlushReport, SsdStats};
pub use value::{CacheValue, KvSnapshot, LayerSnapshot, StateSnapshot, ValueLoader};
