//! [`PromptCache`]: the RAM tier, the SSD tier and the writer behind one handle — what
//! the engine calls at admission (lookup, resume), after prefill and generation (put,
//! checkpoints), and what the server calls for stats and flush.
//!
//! A lookup takes the SSD entry only when it gives strictly more tokens than RAM; any
//! failure on the SSD path is a fallback to RAM or a miss, never an error.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::checkpoint::{CheckpointKey, CheckpointMeta, Resume};
use crate::durability::dirty::Timing;
use crate::durability::Durability;
use crate::ram::{MissReason, RamTier};
use crate::ssd::{ScanReport, SsdConfig, SsdTier};
use crate::stats::{CacheStats, FlushReport, SsdStats};
use crate::value::{CacheValue, KvSnapshot, ValueLoader};
use crate::{CacheError, Result};

/// Default byte cap of the writer's queue (2 GiB).
pub const DEFAULT_WRITE_QUEUE_BYTES: usize = 2 << 30;

/// How the prompt cache is set up.
#[derive(Debug, Clone)]
pub struct PromptCacheConfig {
    /// RAM tier byte cap (`--prompt-cache` GiB); 0 turns the cache off.
    pub ram_bytes: usize,
    /// The SSD tier (`--ssd-cache DIR` …); needs the RAM tier.
    pub ssd: Option<SsdConfig>,
    /// Snapshot RAM entries to the SSD after each put (debounced, when idle).
    pub write_behind: bool,
    /// Write-behind timing.
    pub timing: Timing,
    /// Byte cap of the queue of pending SSD writes.
    pub write_queue_bytes: usize,
}

impl Default for PromptCacheConfig {
    fn default() -> Self {
        PromptCacheConfig {
            ram_bytes: 8 << 30,
            ssd: None,
            write_behind: true,
            timing: Timing::default(),
            write_queue_bytes: DEFAULT_WRITE_QUEUE_BYTES,
        }
    }
}

/// Where a hit came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitSource {
    /// A live RAM entry (forked).
    Ram,
    /// A file of the SSD tier (read and rebuilt).
    Ssd,
}

/// The result of a lookup.
pub struct Lookup<V> {
    /// The reused prefix's KV, when there was a hit.
    pub value: Option<V>,
    /// Prompt tokens it holds (`usage.prompt_tokens_details.cached_tokens`).
    pub cached: usize,
    /// Where it came from.
    pub source: Option<HitSource>,
    /// Why nothing was reused, on a miss.
    pub miss: Option<MissReason>,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    ram_hits: AtomicU64,
    ssd_hits: AtomicU64,
    cached_tokens: AtomicU64,
    resumed: AtomicU64,
    /// Misses by [`MissReason`], in [`MissReason::ALL`]'s order.
    miss_reasons: [AtomicU64; 4],
}

/// The prompt cache.
pub struct PromptCache<V: CacheValue> {
    ram: Arc<Mutex<RamTier<V>>>,
    ssd: Option<Arc<SsdTier>>,
    durability: Option<Durability<V>>,
    enabled: bool,
    counters: Counters,
    ssd_unavailable: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V: CacheValue> PromptCache<V> {
    /// Sets the tiers up: opens the SSD directory, starts its scan in the background (its
    /// entries become restorable as they are indexed) and starts its writer. A directory
    /// that cannot be used (read-only, not creatable, a link, another user's) leaves the
    /// cache without the SSD tier, with a warning ([`PromptCache::ssd_unavailable`]).
    pub fn new(cfg: PromptCacheConfig) -> Result<Self> {
        if cfg.ssd.is_some() && cfg.ram_bytes == 0 {
            return Err(CacheError::Config(
                "the SSD cache needs the RAM prompt cache: --ssd-cache with --prompt-cache 0"
                    .into(),
            ));
        }
        let ram = Arc::new(Mutex::new(RamTier::new(cfg.ram_bytes)));
        let mut ssd_unavailable = None;
        let tier = match cfg.ssd {
            Some(s) => {
                let root = s.root.clone();
                match SsdTier::open_in_background(s) {
                    Ok(tier) => Some(tier),
                    // A directory that cannot be written (read-only, full, another user's) or
                    // is not safe to use costs the tier, never the server.
                    Err(
                        e @ (CacheError::Io { .. }
                        | CacheError::Unsafe { .. }
                        | CacheError::Locked { .. }),
                    ) => {
                        tracing::warn!(
                            dir = %root.display(),
                            error = %e,
                            "the SSD cache directory cannot be used; serving without the SSD tier (RAM prompt cache only)"
                        );
                        ssd_unavailable = Some(e.to_string());
                        None
                    }
                    Err(e) => return Err(e),
                }
            }
            None => None,
        };
        let (ssd, durability) = match tier {
            Some(tier) => {
                let d = Durability::start(
                    ram.clone(),
                    tier.clone(),
                    cfg.timing,
                    cfg.write_behind,
                    cfg.write_queue_bytes,
                )?;
                (Some(tier), Some(d))
            }
            None => (None, None),
        };
        Ok(PromptCache {
            ram,
            ssd,
            durability,
            enabled: cfg.ram_bytes > 0,
            counters: Counters::default(),
            ssd_unavailable,
        })
    }

    /// Why an SSD tier that was asked for is not there (its directory could not be used);
    /// `None` when it is, or none was asked for.
    pub fn ssd_unavailable(&self) -> Option<&str> {
        self.ssd_unavailable.as_deref()
    }

    /// Whether the cache is on (RAM cap above 0).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Whether the SSD tier is on.
    pub fn has_ssd(&self) -> bool {
        self.ssd.is_some()
    }

    /// What the start-up scan of the SSD tier found; `None` without an SSD tier or while
    /// the scan is running.
    pub fn scan_report(&self) -> Option<ScanReport> {
        self.ssd.as_ref().and_then(|s| s.scan_report())
    }

    /// Waits up to `timeout` for the SSD tier's start-up scan; its report (`None` without
    /// an SSD tier or when the scan is still running).
    pub fn wait_for_scan(&self, timeout: Duration) -> Option<ScanReport> {
        self.ssd.as_ref().and_then(|s| s.wait_for_scan(timeout))
    }

    /// Whether the SSD tier's start-up scan is still indexing entries.
    pub fn is_scanning(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.scan_report().is_none())
    }

    /// The SSD tier, if any (tests and diagnostics).
    pub fn ssd(&self) -> Option<&SsdTier> {
        self.ssd.as_deref()
    }

    /// The longest reusable prefix of `prompt` under `ns`, from RAM, or from the SSD when
    /// that gives strictly more. At most `prompt.len() - 1` tokens are reused.
    pub fn lookup(&self, ns: &str, prompt: &[u32], loader: &dyn ValueLoader<V>) -> Lookup<V> {
        if !self.enabled {
            return Lookup {
                value: None,
                cached: 0,
                source: None,
                miss: None,
            };
        }
        let ssd_match = self.ssd.as_ref().and_then(|s| s.find(ns, prompt));
        let ram_usable = lock(&self.ram)
            .best_match(ns, prompt)
            .map_or(0, |m| m.usable);
        if let (Some(ssd), Some(m)) = (&self.ssd, ssd_match) {
            if m.usable > ram_usable {
                match ssd.load(&m).and_then(|snap| loader.load(snap)) {
                    Ok(value) if value.len() == m.usable => {
                        return self.hit(value, m.usable, HitSource::Ssd);
                    }
                    Ok(value) => {
                        tracing::warn!(
                            expected = m.usable,
                            got = value.len(),
                            "SSD cache entry rebuilt to a wrong length; ignored"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "SSD cache restore failed; using RAM or prefilling");
                    }
                }
            }
        }
        let mut ram = lock(&self.ram);
        if let Some(m) = ram.best_match(ns, prompt) {
            match ram.take(&m) {
                Ok(value) => {
                    drop(ram);
                    return self.hit(value, m.usable, HitSource::Ram);
                }
                Err(e) => tracing::warn!(error = %e, "RAM cache fork failed; prefilling"),
            }
        }
        let reason = ram.miss_reason(ns, prompt);
        drop(ram);
        let c = &self.counters;
        c.misses.fetch_add(1, Ordering::Relaxed);
        if let Some(i) = MissReason::ALL.iter().position(|r| *r == reason) {
            c.miss_reasons[i].fetch_add(1, Ordering::Relaxed);
        }
        Lookup {
            value: None,
            cached: 0,
            source: None,
            miss: Some(reason),
        }
    }

    /// Pins the entry holding `tokens` of `ns` (or a longer one that serves them) in RAM
    /// until `until` (see [`RamTier::pin`]). Returns whether one was found.
    pub fn pin(&self, ns: &str, tokens: &[u32], until: std::time::Instant) -> bool {
        self.enabled && lock(&self.ram).pin(ns, tokens, until)
    }

    fn hit(&self, value: V, cached: usize, source: HitSource) -> Lookup<V> {
        let c = &self.counters;
        c.hits.fetch_add(1, Ordering::Relaxed);
        c.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        match source {
            HitSource::Ram => c.ram_hits.fetch_add(1, Ordering::Relaxed),
            HitSource::Ssd => c.ssd_hits.fetch_add(1, Ordering::Relaxed),
        };
        Lookup {
            value: Some(value),
            cached,
            source: Some(source),
            miss: None,
        }
    }

    /// Stores `value`, which holds exactly `tokens`, under `ns`: evicted entries spill to
    /// the SSD, and the entry is snapshotted there after the debounce. Never fails.
    pub fn put(&self, ns: &str, tokens: &[u32], value: V) {
        if !self.enabled {
            return;
        }
        let out = match lock(&self.ram).put(ns, tokens, value) {
            Ok(out) => out,
            Err(e) => {
                tracing::warn!(error = %e, "prompt cache put refused");
                return;
            }
        };
        if let Some(d) = &self.durability {
            for e in out.evicted {
                d.spill(e);
            }
            if out.stored {
                d.schedule(ns.into(), tokens.into());
            }
        }
    }

    /// Tells the writer whether the engine is computing.
    pub fn set_busy(&self, busy: bool) {
        if let Some(d) = &self.durability {
            d.set_busy(busy);
        }
    }

    /// Whether generation checkpoints can be saved (they need the SSD tier).
    pub fn checkpoints_available(&self) -> bool {
        self.durability.is_some()
    }

    /// Queues a checkpoint of generation `key`: `host` holds `prompt` and all of
    /// `generated` but the last token.
    pub fn save_checkpoint(
        &self,
        key: CheckpointKey,
        cache_ns: &str,
        prompt: &[u32],
        generated: &[u32],
        host: KvSnapshot,
    ) {
        let Some(d) = &self.durability else { return };
        if generated.is_empty() || host.len() + 1 != prompt.len() + generated.len() {
            tracing::warn!("checkpoint of the wrong length skipped");
            return;
        }
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(&generated[..generated.len() - 1]);
        let meta = CheckpointMeta {
            key: key.hex(),
            cache_namespace: cache_ns.to_string(),
            prompt_tokens: prompt.len(),
            generated: generated.to_vec(),
        };
        d.checkpoint(key, meta, tokens.into(), host);
    }

    /// The latest checkpoint of generation `key` for `prompt`, rebuilt.
    pub fn find_checkpoint(
        &self,
        key: CheckpointKey,
        cache_ns: &str,
        prompt: &[u32],
        loader: &dyn ValueLoader<V>,
    ) -> Option<Resume<V>> {
        let ssd = self.ssd.as_ref()?;
        let (m, meta) = ssd.find_checkpoint(key, cache_ns, prompt)?;
        match ssd.load(&m).and_then(|snap| loader.load(snap)) {
            Ok(value) => {
                self.counters.resumed.fetch_add(1, Ordering::Relaxed);
                Some(Resume {
                    value,
                    generated: meta.generated,
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "generation checkpoint unusable; starting over");
                None
            }
        }
    }

    /// Removes generation `key`'s checkpoints (after any still queued).
    pub fn remove_checkpoints(&self, key: CheckpointKey) {
        if let Some(d) = &self.durability {
            d.remove_checkpoints(key);
        }
    }

    /// Makes every RAM entry durable within `timeout` (see [`Durability::flush`]).
    pub fn flush(&self, timeout: Duration) -> FlushReport {
        match &self.durability {
            Some(d) => d.flush(timeout),
            None => FlushReport {
                enabled: false,
                durable: true,
                ..FlushReport::default()
            },
        }
    }

    /// Counters of both tiers.
    pub fn stats(&self) -> CacheStats {
        let ram = lock(&self.ram).counters();
        let c = &self.counters;
        let o = Ordering::Relaxed;
        let ssd = match (&self.ssd, &self.durability) {
            (Some(s), Some(d)) => {
                let scanning = s.scan_report().is_none();
                let s = s.counters();
                let d = d.counters();
                Some(SsdStats {
                    entries: s.entries,
                    bytes: s.bytes,
                    max_bytes: s.max_bytes,
                    restores: s.restores,
                    bytes_written: s.bytes_written,
                    restore_failures: s.restore_failures,
                    spills: s.stores.saturating_sub(d.checkpoints_saved),
                    restore_ms_last: s.restore_ms_last,
                    pending_snapshots: d.pending_snapshots,
                    pending_spills: d.pending_spills,
                    pending_spill_bytes: d.pending_spill_bytes,
                    dropped_spills: d.dropped_spills,
                    failed_spills: d.failed_spills,
                    evictions: s.evictions,
                    superseded: s.superseded,
                    longest_durable_prefix_tokens: s.longest_durable_prefix_tokens,
                    checkpoints: s.checkpoints,
                    checkpoints_saved: d.checkpoints_saved,
                    checkpoints_resumed: c.resumed.load(o),
                    scanning,
                })
            }
            _ => None,
        };
        CacheStats {
            enabled: self.enabled,
            entries: ram.entries,
            bytes: ram.bytes,
            max_bytes: ram.max_bytes,
            hits: c.hits.load(o),
            misses: c.misses.load(o),
            ram_hits: c.ram_hits.load(o),
            ssd_hits: c.ssd_hits.load(o),
            cached_tokens_total: c.cached_tokens.load(o),
            evictions: ram.evictions,
            superseded: ram.superseded,
            pinned_entries: ram.pinned_entries,
            pinned_bytes: ram.pinned_bytes,
            misses_by_reason: MissReason::ALL
                .iter()
                .zip(&c.miss_reasons)
                .map(|(r, n)| (r.label(), n.load(o)))
                .collect(),
            ssd,
        }
    }
}
