//! What the cache reports: [`CacheStats`] for `/stats` and `/metrics`, and
//! [`FlushReport`] for `POST /admin/cache/flush`.
use serde::Serialize;

/// Counters of the prompt cache (`/stats.prompt_cache`, with `ssd` as `/stats.ssd_cache`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CacheStats {
    /// Whether the RAM tier is on.
    pub enabled: bool,
    /// RAM entries.
    pub entries: usize,
    /// RAM bytes.
    pub bytes: u64,
    /// RAM byte cap.
    pub max_bytes: u64,
    /// Lookups that reused a prefix (from either tier).
    pub hits: u64,
    /// Lookups that reused nothing.
    pub misses: u64,
    /// Hits served from RAM.
    pub ram_hits: u64,
    /// Hits served from the SSD.
    pub ssd_hits: u64,
    /// Prompt tokens reused, all time.
    pub cached_tokens_total: u64,
    /// RAM entries evicted for space.
    pub evictions: u64,
    /// RAM entries dropped because a longer entry covers them.
    pub superseded: u64,
    /// RAM entries pinned now (`cache_control` breakpoints).
    pub pinned_entries: usize,
    /// Bytes of the pinned entries.
    pub pinned_bytes: u64,
    /// Misses by reason (`no_entry`, `untrimmable`, `namespace`, `evicted`), all time.
    pub misses_by_reason: Vec<(&'static str, u64)>,
    /// The SSD tier, when configured.
    pub ssd: Option<SsdStats>,
}

/// Counters of the SSD tier and its writer.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SsdStats {
    /// Entries on disk (checkpoints included).
    pub entries: usize,
    /// Bytes on disk.
    pub bytes: u64,
    /// Byte cap (0 = unlimited).
    pub max_bytes: u64,
    /// Entries restored into a request.
    pub restores: u64,
    /// Restores that failed (file removed, request missed).
    pub restore_failures: u64,
    /// Bytes written to the tier's files (entries, chunks, checkpoints), all time.
    pub bytes_written: u64,
    /// Entries written (spills, write-behind and flush snapshots).
    pub spills: u64,
    /// Milliseconds the last restore took.
    pub restore_ms_last: u64,
    /// Dirty RAM entries not yet durable.
    pub pending_snapshots: usize,
    /// Writes queued or in progress.
    pub pending_spills: usize,
    /// Bytes of queued writes.
    pub pending_spill_bytes: u64,
    /// Writes dropped because the queue was full.
    pub dropped_spills: u64,
    /// Writes that failed (full disk, I/O errors).
    pub failed_spills: u64,
    /// SSD entries evicted for space.
    pub evictions: u64,
    /// SSD entries removed because a longer entry covers them.
    pub superseded: u64,
    /// The longest prefix on disk, in tokens.
    pub longest_durable_prefix_tokens: usize,
    /// Generation checkpoints on disk.
    pub checkpoints: usize,
    /// Generation checkpoints written.
    pub checkpoints_saved: u64,
    /// Generations resumed from a checkpoint.
    pub checkpoints_resumed: u64,
    /// The start-up scan is still indexing the directory (entries not yet reached miss).
    pub scanning: bool,
}

/// The answer of a flush: `durable` is true only when nothing is pending, nothing was
/// dropped or failed during the flush, and no dirty entry was lost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FlushReport {
    /// Whether an SSD tier exists (without one there is nothing to flush, and `durable`
    /// is true).
    pub enabled: bool,
    /// Everything put into the cache is on disk.
    pub durable: bool,
    /// The timeout ran out first.
    pub timed_out: bool,
    /// RAM entries written by this flush.
    pub flushed_snapshots: usize,
    /// Dirty entries that had left RAM without reaching the disk (lost, now forgotten).
    pub missing_snapshots: usize,
    /// Milliseconds the flush took.
    pub elapsed_ms: u64,
    /// Dirty entries still not durable.
    pub pending_snapshots: usize,
    /// Writes still queued or in progress.
    pub pending_spills: usize,
    /// Their bytes.
    pub pending_spill_bytes: u64,
    /// Writes dropped during the flush.
    pub dropped_spills: u64,
    /// Writes failed during the flush.
    pub failed_spills: u64,
}
