//! [`SsdTier`]: the cold tier on disk. The files are the database: one `.wkv` file per
//! entry, no sidecar index.
//!
//! Layout: `<root>/<fingerprint>/<namespace dir>/<entry>.wkv`, where the fingerprint
//! names the model, its configuration and tokenizer, and the namespace directory is
//! [`crate::namespace::dir_name`]. Only our fingerprint's directory is ever read or
//! changed; another model's directory beside it is never touched.
//!
//! - Writes are atomic: a `.tmp` file is written, fsynced, renamed over the final name,
//!   and the directory fsynced. A crash at any point leaves the old state or the new
//!   one, plus at most an orphan `.tmp` that the next scan removes.
//! - The directory may be shared by several processes (replicas, also on several hosts
//!   over a shared filesystem). Each writes only its own `.tmp` files ([`owner`]: an owner
//!   id with a held lock file) and renames them into place; entry names are the hash of
//!   namespace and tokens, so two replicas storing one prefix write the same name and
//!   the last rename wins with an equivalent file. A tier opened with
//!   [`SsdTier::open_in_background`] re-reads the directory every
//!   [`REFRESH_INTERVAL`] ([`SsdTier::refresh`]): entries another process wrote become
//!   restorable, and entries another process removed leave the index. Removing a file
//!   (eviction, supersession) is safe while another process reads it: a reader that has
//!   it open keeps its data, one that opens it after the removal gets a quiet miss.
//! - Start-up scan rebuilds the index from the headers (hash-checked), removing orphans,
//!   corrupt files, other format versions and files of another fingerprint or namespace.
//!   [`SsdTier::open_in_background`] runs it on its own thread: entries become restorable
//!   one by one as it indexes them, and a lookup meanwhile misses instead of waiting.
//!   With `verify`, every payload is hash-checked too; payloads are always checked when
//!   an entry is restored, so a damaged entry is never restored.
//! - The byte cap evicts least-recently-used files by modification time (a restore
//!   touches the file; the time is read again from the file before an eviction, so
//!   another process's restores count). A full disk evicts the oldest entries and
//!   retries once.
//! - Every failure is a miss or a warning: a bad file is removed, a failed write is
//!   cleaned up and counted, and serving goes on.
pub mod format;
pub mod owner;
mod refresh;

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::checkpoint::{CheckpointKey, CheckpointMeta};
use crate::namespace::{self, dir_name};
use crate::prefix_index::PrefixIndex;
use crate::ram::EntryId;
use crate::value::KvSnapshot;
use crate::{CacheError, Result};
use format::{EntryLabel, FileHeader, EXTENSION};
use owner::{Liveness, Owner};
pub use refresh::{RefreshReport, REFRESH_INTERVAL};

/// Where and how the SSD tier keeps its files.
#[derive(Debug, Clone)]
pub struct SsdConfig {
    /// The cache root (`--ssd-cache DIR`); entries go under `<root>/<fingerprint>/`.
    pub root: PathBuf,
    /// The model/config/tokenizer fingerprint (a file-name-safe string).
    pub fingerprint: String,
    /// Model display name, written into headers.
    pub model: String,
    /// Byte cap (`--ssd-cache-max`); 0 = unlimited.
    pub max_bytes: u64,
    /// Hash-check every payload during the start-up scan (`--ssd-cache-verify`).
    pub verify: bool,
}

/// What the start-up scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Entries indexed.
    pub entries: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Orphan `.tmp` files removed (writes a crash interrupted).
    pub removed_orphans: usize,
    /// Damaged files removed.
    pub removed_corrupt: usize,
    /// Files of another format version removed.
    pub removed_unsupported: usize,
    /// Files of another fingerprint or namespace removed.
    pub removed_mismatched: usize,
    /// Entries evicted to meet the byte cap.
    pub evicted: usize,
    /// Paths that are not regular files (directories, FIFOs, sockets, devices, symbolic
    /// links), left alone.
    pub skipped_not_files: usize,
    /// Lock files of owners that died, removed.
    pub removed_stale_locks: usize,
}

/// One indexed file.
#[derive(Debug, Clone)]
pub struct SsdEntry {
    /// Namespace.
    pub ns: Arc<str>,
    /// Tokens the KV holds.
    pub tokens: Arc<[u32]>,
    /// The file.
    pub path: PathBuf,
    /// File length.
    pub bytes: u64,
    /// Last use (file modification time).
    pub mtime: SystemTime,
    /// Shortest length the entry can be cut back to.
    pub trim_floor: usize,
    /// Set on generation checkpoints.
    pub checkpoint: Option<CheckpointMeta>,
}

impl SsdEntry {
    /// Whether the entry can be cut back to `len` tokens.
    pub fn can_trim_to(&self, len: usize) -> bool {
        len <= self.tokens.len() && len >= self.trim_floor
    }
}

/// A usable prefix found by [`SsdTier::find`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdMatch {
    /// The entry.
    pub id: EntryId,
    /// Tokens it can give.
    pub usable: usize,
}

/// What a store did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Written.
    Stored {
        /// File length.
        bytes: u64,
        /// Stored ancestors removed because the new entry covers them.
        superseded: usize,
        /// Entries evicted to stay under the cap.
        evicted: usize,
    },
    /// An entry already on disk covers these tokens; nothing was written.
    AlreadyDurable,
}

/// Counters of the SSD tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SsdCounters {
    /// Entries indexed (checkpoints included).
    pub entries: usize,
    /// Generation checkpoints among them.
    pub checkpoints: usize,
    /// Bytes on disk.
    pub bytes: u64,
    /// The byte cap (0 = unlimited).
    pub max_bytes: u64,
    /// Entries restored, all time.
    pub restores: u64,
    /// Restores that failed (the file was removed; the request missed).
    pub restore_failures: u64,
    /// Entries written, all time.
    pub stores: u64,
    /// Writes that failed (full disk, I/O error).
    pub store_failures: u64,
    /// Entries evicted for space.
    pub evictions: u64,
    /// Entries removed because a longer stored entry covers them.
    pub superseded: u64,
    /// Milliseconds the last restore took.
    pub restore_ms_last: u64,
    /// The longest prefix (tokens) on disk, checkpoints aside.
    pub longest_durable_prefix_tokens: usize,
}

#[derive(Default)]
struct Index {
    entries: HashMap<EntryId, SsdEntry>,
    prefix: PrefixIndex<EntryId>,
    next_id: EntryId,
    bytes: u64,
}

impl Index {
    fn insert(&mut self, e: SsdEntry) -> EntryId {
        self.next_id += 1;
        let id = self.next_id;
        self.bytes += e.bytes;
        self.prefix.insert(id, e.ns.clone(), e.tokens.clone());
        self.entries.insert(id, e);
        id
    }

    fn remove(&mut self, id: EntryId) -> Option<SsdEntry> {
        let e = self.entries.remove(&id)?;
        self.bytes -= e.bytes;
        self.prefix.remove(id);
        Some(e)
    }

    /// Removes the entry and its file.
    fn delete(&mut self, id: EntryId) {
        if let Some(e) = self.remove(id) {
            remove_quietly(&e.path);
        }
    }

    fn oldest(&self, except: Option<EntryId>) -> Option<EntryId> {
        self.entries
            .iter()
            .filter(|(id, _)| Some(**id) != except)
            .min_by_key(|(_, e)| e.mtime)
            .map(|(id, _)| *id)
    }
}

/// Opens a cache file for reading without ever blocking: `O_NONBLOCK` (a FIFO or device put in
/// the directory would otherwise hang the open) and `O_NOFOLLOW`, then `fstat` must say it is a
/// regular file. Anything else is [`CacheError::NotAFile`].
fn open_regular(path: &Path) -> Result<(File, fs::Metadata)> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW);
    }
    let f = options.open(path).map_err(|source| {
        // O_NOFOLLOW on a symbolic link fails with ELOOP.
        #[cfg(unix)]
        if source.raw_os_error() == Some(libc::ELOOP) {
            return CacheError::NotAFile {
                path: path.to_path_buf(),
            };
        }
        CacheError::Io {
            op: "open",
            path: path.to_path_buf(),
            source,
        }
    })?;
    let meta = f.metadata().map_err(CacheError::io("stat", path))?;
    if !meta.is_file() {
        return Err(CacheError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    Ok((f, meta))
}

/// Removes a crashed writer's `.tmp`; false when it was already gone (or cannot be removed).
fn remove_orphan(path: &Path) -> bool {
    match fs::remove_file(path) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an orphan cache file");
            false
        }
    }
}

/// The file's modification time now; `None` when it is gone.
fn fresh_mtime(path: &Path) -> Option<SystemTime> {
    match fs::symlink_metadata(path) {
        Ok(m) => Some(m.modified().unwrap_or(UNIX_EPOCH)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(_) => Some(UNIX_EPOCH),
    }
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a cache file");
        }
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CacheError::io("fsync", dir))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn entry_file_name(ns: &str, tokens: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(ns.len() + 8 + tokens.len() * 4);
    bytes.extend_from_slice(&(ns.len() as u64).to_le_bytes());
    bytes.extend_from_slice(ns.as_bytes());
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    format!("{:032x}.{EXTENSION}", xxhash_rust::xxh3::xxh3_128(&bytes))
}

/// The SSD tier.
pub struct SsdTier {
    dir: PathBuf,
    cfg: SsdConfig,
    index: Mutex<Index>,
    /// Our owner id and its held lock (who may remove which `.tmp` file).
    owner: Owner,
    restores: AtomicU64,
    restore_failures: AtomicU64,
    stores: AtomicU64,
    store_failures: AtomicU64,
    evictions: AtomicU64,
    superseded: AtomicU64,
    restore_ms_last: AtomicU64,
    warned: AtomicBool,
    tmp_seq: AtomicU64,
    /// Files [`SsdTier::refresh`] could not index (not read again while they stay).
    unreadable: Mutex<std::collections::HashSet<PathBuf>>,
    /// The start-up scan's report, once it is done.
    scan: Mutex<Option<ScanReport>>,
    scan_done: Condvar,
}

impl SsdTier {
    /// Opens (creating) `<root>/<fingerprint>/`, takes an owner id in it, and scans it.
    /// Other processes may use the same directory at the same time.
    pub fn open(cfg: SsdConfig) -> Result<(SsdTier, ScanReport)> {
        let tier = SsdTier::open_unscanned(cfg)?;
        let report = tier.run_scan();
        Ok((tier, report))
    }

    /// Opens (creating) `<root>/<fingerprint>/` like [`SsdTier::open`], then scans it on a
    /// thread of its own and returns at once. Entries become restorable as the scan indexes
    /// them; until then a lookup misses. [`SsdTier::scan_report`] says when it is done.
    /// The same thread then re-reads the directory every [`REFRESH_INTERVAL`]
    /// ([`SsdTier::refresh`]) for as long as the tier lives, so entries other processes
    /// write into a shared directory become restorable here.
    pub fn open_in_background(cfg: SsdConfig) -> Result<Arc<SsdTier>> {
        let tier = Arc::new(SsdTier::open_unscanned(cfg)?);
        let scanning = tier.clone();
        let spawned = std::thread::Builder::new()
            .name("wick-ssd-scan".into())
            .spawn(move || {
                scanning.run_scan();
                // Only a weak handle from here on, so dropping the tier ends this thread.
                let weak = Arc::downgrade(&scanning);
                drop(scanning);
                refresh::keep_fresh(weak);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread for the SSD cache scan; scanning now");
            tier.run_scan();
        }
        Ok(tier)
    }

    /// What the start-up scan found; `None` while it is still running.
    pub fn scan_report(&self) -> Option<ScanReport> {
        self.scan.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits up to `timeout` for the start-up scan; its report, or `None` if it is still
    /// running.
    pub fn wait_for_scan(&self, timeout: Duration) -> Option<ScanReport> {
        let guard = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .scan_done
            .wait_timeout_while(guard, timeout, |r| r.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.clone()
    }

    fn open_unscanned(cfg: SsdConfig) -> Result<SsdTier> {
        if cfg.fingerprint.is_empty()
            || !cfg
                .fingerprint
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(CacheError::Config(format!(
                "fingerprint {:?} is not a plain file name",
                cfg.fingerprint
            )));
        }
        let dir = cfg.root.join(&cfg.fingerprint);
        fs::create_dir_all(&dir).map_err(CacheError::io("create", &dir))?;
        let owner = Owner::acquire(&dir)?;
        Ok(SsdTier {
            dir,
            cfg,
            index: Mutex::new(Index::default()),
            owner,
            restores: AtomicU64::new(0),
            restore_failures: AtomicU64::new(0),
            stores: AtomicU64::new(0),
            store_failures: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            superseded: AtomicU64::new(0),
            restore_ms_last: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            tmp_seq: AtomicU64::new(0),
            unreadable: Mutex::default(),
            scan: Mutex::new(None),
            scan_done: Condvar::new(),
        })
    }

    /// Indexes the fingerprint directory, entry by entry (the index is locked per entry
    /// only, so lookups and stores go on meanwhile), evicts to the cap and records the
    /// report.
    fn run_scan(&self) -> ScanReport {
        let started = Instant::now();
        let report = scan(&self.dir, &self.cfg, &self.owner, |entry| {
            let mut ix = self.index();
            // A store during the scan may have indexed this very file already.
            if ix.prefix.exact(&entry.ns, &entry.tokens).is_empty() {
                ix.insert(entry);
            }
        });
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot scan the SSD cache directory; it starts empty");
                ScanReport::default()
            }
        };
        let report = {
            let mut ix = self.index();
            let evicted = self.evict_to_cap(&mut ix, None);
            ScanReport {
                evicted,
                entries: ix.entries.len(),
                bytes: ix.bytes,
                ..report
            }
        };
        tracing::info!(
            dir = %self.dir.display(),
            entries = report.entries,
            mib = report.bytes >> 20,
            orphans = report.removed_orphans,
            corrupt = report.removed_corrupt,
            mismatched = report.removed_mismatched + report.removed_unsupported,
            skipped = report.skipped_not_files,
            took_ms = started.elapsed().as_millis() as u64,
            "SSD cache scanned"
        );
        *self.scan.lock().unwrap_or_else(|p| p.into_inner()) = Some(report.clone());
        self.scan_done.notify_all();
        report
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fingerprint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration.
    pub fn config(&self) -> &SsdConfig {
        &self.cfg
    }

    /// Counters.
    pub fn counters(&self) -> SsdCounters {
        let ix = self.index();
        let o = Ordering::Relaxed;
        SsdCounters {
            entries: ix.entries.len(),
            checkpoints: ix
                .entries
                .values()
                .filter(|e| e.checkpoint.is_some())
                .count(),
            bytes: ix.bytes,
            max_bytes: self.cfg.max_bytes,
            restores: self.restores.load(o),
            restore_failures: self.restore_failures.load(o),
            stores: self.stores.load(o),
            store_failures: self.store_failures.load(o),
            evictions: self.evictions.load(o),
            superseded: self.superseded.load(o),
            restore_ms_last: self.restore_ms_last.load(o),
            longest_durable_prefix_tokens: ix
                .entries
                .values()
                .filter(|e| e.checkpoint.is_none())
                .map(|e| e.tokens.len())
                .max()
                .unwrap_or(0),
        }
    }

    /// Every indexed entry (for tests and diagnostics).
    pub fn entries(&self) -> Vec<SsdEntry> {
        self.index().entries.values().cloned().collect()
    }

    /// The entry of `ns` that can give the most tokens of `prompt` (index only, no I/O),
    /// under the same rules as the RAM tier. Checkpoints never match.
    pub fn find(&self, ns: &str, prompt: &[u32]) -> Option<SsdMatch> {
        if namespace::is_checkpoint(ns) {
            return None;
        }
        let cap = prompt.len().checked_sub(1)?;
        let ix = self.index();
        let (id, usable) = ix.prefix.best(ns, prompt, |id, lcp| {
            let want = lcp.min(cap);
            let e = &ix.entries[&id];
            (want > 0 && e.checkpoint.is_none() && e.can_trim_to(want)).then_some(want)
        })?;
        Some(SsdMatch { id, usable })
    }

    /// Whether an entry of `ns` holds `tokens`, or holds more and can be cut back to them.
    pub fn covers(&self, ns: &str, tokens: &[u32]) -> bool {
        let ix = self.index();
        !ix.prefix.exact(ns, tokens).is_empty()
            || ix.prefix.descendants(ns, tokens).iter().any(|id| {
                ix.entries[id].checkpoint.is_none() && ix.entries[id].can_trim_to(tokens.len())
            })
    }

    /// Reads a matched entry, checks every hash and that the file is what the index says,
    /// and cuts it to `m.usable` tokens. Any failure removes the file and is a miss.
    pub fn load(&self, m: &SsdMatch) -> Result<KvSnapshot> {
        let started = Instant::now();
        let Some(entry) = self.index().entries.get(&m.id).cloned() else {
            return Err(CacheError::Value {
                op: "load",
                reason: "the entry left the SSD index".into(),
            });
        };
        match self.read_entry(&entry, m.usable) {
            Ok(snap) => {
                if let Ok(f) = OpenOptions::new().write(true).open(&entry.path) {
                    let now = SystemTime::now();
                    if f.set_modified(now).is_ok() {
                        if let Some(e) = self.index().entries.get_mut(&m.id) {
                            e.mtime = now;
                        }
                    }
                }
                self.restores.fetch_add(1, Ordering::Relaxed);
                self.restore_ms_last
                    .store(started.elapsed().as_millis() as u64, Ordering::Relaxed);
                Ok(snap)
            }
            // Another process sharing the directory removed it (evicted or superseded): a
            // miss, and the entry leaves our index.
            Err(CacheError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                tracing::debug!(path = %entry.path.display(), "SSD cache entry removed by another process");
                let mut ix = self.index();
                if ix.entries.get(&m.id).is_some_and(|x| x.path == entry.path) {
                    ix.remove(m.id);
                }
                Err(CacheError::Io {
                    op: "open",
                    path: entry.path.clone(),
                    source,
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "SSD cache entry unusable; removed");
                self.restore_failures.fetch_add(1, Ordering::Relaxed);
                let mut ix = self.index();
                if ix.entries.get(&m.id).is_some_and(|x| x.path == entry.path) {
                    ix.delete(m.id);
                }
                Err(e)
            }
        }
    }

    fn read_entry(&self, entry: &SsdEntry, usable: usize) -> Result<KvSnapshot> {
        let path = &entry.path;
        let (mut f, _) = open_regular(path)?;
        let h = format::read_header(&mut f, path)?;
        let mismatch = |field, found: String, expected: String| CacheError::Mismatch {
            path: path.clone(),
            field,
            found,
            expected,
        };
        if h.fingerprint != self.cfg.fingerprint {
            return Err(mismatch(
                "fingerprint",
                h.fingerprint,
                self.cfg.fingerprint.clone(),
            ));
        }
        if *h.namespace != *entry.ns {
            return Err(mismatch("namespace", h.namespace, entry.ns.to_string()));
        }
        if *h.tokens != *entry.tokens {
            return Err(mismatch(
                "tokens",
                format!("{} tokens", h.tokens.len()),
                format!("{} tokens", entry.tokens.len()),
            ));
        }
        let mut snap = format::read_payload(&mut f, path, &h)?;
        snap.validate()?;
        snap.trim(usable)?;
        Ok(snap)
    }

    /// Writes an entry for `tokens` of `ns` (a checkpoint when `checkpoint` is set),
    /// then supersedes stored ancestors it covers and evicts to the cap. A write error
    /// is cleaned up, counted, warned about once, and returned.
    pub fn store(
        &self,
        ns: &str,
        tokens: &[u32],
        snap: &KvSnapshot,
        checkpoint: Option<&CheckpointMeta>,
    ) -> Result<StoreOutcome> {
        let result = self.store_inner(ns, tokens, snap, checkpoint);
        match &result {
            Ok(StoreOutcome::Stored { .. }) => {
                self.stores.fetch_add(1, Ordering::Relaxed);
                self.warned.store(false, Ordering::Relaxed);
            }
            Ok(StoreOutcome::AlreadyDurable) => {}
            Err(e) => {
                self.store_failures.fetch_add(1, Ordering::Relaxed);
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "SSD cache write failed; serving continues without it");
                } else {
                    tracing::debug!(error = %e, "SSD cache write failed");
                }
            }
        }
        result
    }

    fn store_inner(
        &self,
        ns: &str,
        tokens: &[u32],
        snap: &KvSnapshot,
        checkpoint: Option<&CheckpointMeta>,
    ) -> Result<StoreOutcome> {
        if checkpoint.is_none() && self.covers(ns, tokens) {
            return Ok(StoreOutcome::AlreadyDurable);
        }
        let label = EntryLabel {
            fingerprint: &self.cfg.fingerprint,
            model: &self.cfg.model,
            namespace: ns,
            tokens,
            checkpoint,
        };
        let header = format::plan(&label, snap, now_ms())?;
        if self.cfg.max_bytes > 0 && header.file_bytes > self.cfg.max_bytes {
            return Err(CacheError::TooLarge {
                tier: "ssd",
                bytes: header.file_bytes,
                limit: self.cfg.max_bytes,
            });
        }
        let ns_dir = self.dir.join(dir_name(ns));
        if !ns_dir.is_dir() {
            fs::create_dir_all(&ns_dir).map_err(CacheError::io("create", &ns_dir))?;
            sync_dir(&self.dir)?;
        }
        let name = entry_file_name(ns, tokens);
        let path = match self.write_atomic(&ns_dir, &name, &header, snap) {
            Err(e) if e.is_disk_full() => {
                let freed = self.make_room(header.file_bytes);
                tracing::info!(freed, "SSD cache disk full: evicted old entries, retrying");
                self.write_atomic(&ns_dir, &name, &header, snap)?
            }
            other => other?,
        };
        let mtime = fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or_else(|_| SystemTime::now());
        let mut ix = self.index();
        for id in ix.prefix.exact(ns, tokens) {
            // The same name: the rename replaced that file.
            ix.remove(id);
        }
        let id = ix.insert(SsdEntry {
            ns: ns.into(),
            tokens: tokens.into(),
            path: path.clone(),
            bytes: header.file_bytes,
            mtime,
            trim_floor: header.trim_floor(),
            checkpoint: checkpoint.cloned(),
        });
        let mut superseded = 0;
        let new_floor = header.trim_floor();
        for anc in ix.prefix.ancestors(ns, tokens) {
            let len = ix.entries[&anc].tokens.len();
            // Older checkpoints of a key are replaced by the newest; plain entries only
            // when the new one can be cut back to them.
            let replace = if checkpoint.is_some() {
                true
            } else {
                ix.entries[&anc].checkpoint.is_none() && len >= new_floor
            };
            if replace {
                ix.delete(anc);
                superseded += 1;
            }
        }
        self.superseded
            .fetch_add(superseded as u64, Ordering::Relaxed);
        let evicted = self.evict_to_cap(&mut ix, Some(id));
        Ok(StoreOutcome::Stored {
            bytes: header.file_bytes,
            superseded,
            evicted,
        })
    }

    fn write_atomic(
        &self,
        dir: &Path,
        name: &str,
        header: &FileHeader,
        snap: &KvSnapshot,
    ) -> Result<PathBuf> {
        let path = dir.join(name);
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(self.owner.tmp_name(name, seq));
        let mut renamed = false;
        let result = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(CacheError::io("create", &tmp))?;
            format::write(&mut f, &tmp, header, snap)?;
            f.sync_all().map_err(CacheError::io("fsync", &tmp))?;
            drop(f);
            fs::rename(&tmp, &path).map_err(CacheError::io("rename", &tmp))?;
            renamed = true;
            sync_dir(dir)
        })();
        match result {
            Ok(()) => Ok(path),
            Err(e) => {
                remove_quietly(&tmp);
                if renamed {
                    remove_quietly(&path);
                }
                Err(e)
            }
        }
    }

    /// Evicts our oldest entries until `needed` bytes are freed (a full disk).
    fn make_room(&self, needed: u64) -> u64 {
        let mut ix = self.index();
        let mut freed = 0;
        while freed < needed {
            let Some(id) = ix.oldest(None) else { break };
            freed += ix.entries[&id].bytes;
            ix.delete(id);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        freed
    }

    fn evict_to_cap(&self, ix: &mut Index, keep: Option<EntryId>) -> usize {
        let mut n = 0;
        if self.cfg.max_bytes == 0 {
            return 0;
        }
        // Each entry's time is re-read at most once per call, so the loop ends.
        let mut rechecked = std::collections::HashSet::new();
        while ix.bytes > self.cfg.max_bytes {
            let Some(id) = ix.oldest(keep) else { break };
            if rechecked.insert(id) {
                match fresh_mtime(&ix.entries[&id].path) {
                    // Gone: another process removed it.
                    None => {
                        ix.remove(id);
                        continue;
                    }
                    // Another process restored it since we indexed it.
                    Some(t) if t > ix.entries[&id].mtime => {
                        if let Some(e) = ix.entries.get_mut(&id) {
                            e.mtime = t;
                        }
                        continue;
                    }
                    Some(_) => {}
                }
            }
            ix.delete(id);
            n += 1;
        }
        self.evictions.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// The longest checkpoint of generation `key` for `prompt` under `cache_ns`: it must
    /// record the same key, namespace and prompt length, start with the prompt, and hold
    /// more than the prompt.
    pub fn find_checkpoint(
        &self,
        key: CheckpointKey,
        cache_ns: &str,
        prompt: &[u32],
    ) -> Option<(SsdMatch, CheckpointMeta)> {
        let ns = key.namespace();
        let hex = key.hex();
        let ix = self.index();
        ix.prefix
            .ids_in(&ns)
            .into_iter()
            .filter_map(|id| {
                let e = &ix.entries[&id];
                let meta = e.checkpoint.as_ref()?;
                let ok = meta.key == hex
                    && meta.cache_namespace == cache_ns
                    && meta.prompt_tokens == prompt.len()
                    && e.tokens.len() >= prompt.len()
                    && !meta.generated.is_empty()
                    && e.tokens.len() + 1 == prompt.len() + meta.generated.len()
                    && e.tokens[..prompt.len()] == *prompt
                    && e.tokens[prompt.len()..] == meta.generated[..meta.generated.len() - 1];
                ok.then(|| (id, e.tokens.len(), meta.clone()))
            })
            .max_by_key(|(_, len, _)| *len)
            .map(|(id, len, meta)| (SsdMatch { id, usable: len }, meta))
    }

    /// Removes every checkpoint of generation `key`; returns how many.
    pub fn remove_checkpoints(&self, key: CheckpointKey) -> usize {
        let ns = key.namespace();
        let mut ix = self.index();
        let ids = ix.prefix.ids_in(&ns);
        for &id in &ids {
            ix.delete(id);
        }
        drop(ix);
        if !ids.is_empty() {
            // Only removes the directory when it is empty.
            let _ = fs::remove_dir(self.dir.join(dir_name(&ns)));
        }
        ids.len()
    }
}

/// Reads our fingerprint directory, handing each usable entry to `insert`. A `.tmp` file is a
/// write a crash interrupted and is removed, unless its owner is alive (this tier, or
/// another process sharing the directory that holds its owner lock).
fn scan(
    dir: &Path,
    cfg: &SsdConfig,
    owner: &Owner,
    mut insert: impl FnMut(SsdEntry),
) -> Result<ScanReport> {
    let mut report = ScanReport {
        removed_stale_locks: owner::remove_stale_locks(dir, owner),
        ..ScanReport::default()
    };
    let subdirs = fs::read_dir(dir).map_err(CacheError::io("list", dir))?;
    for sub in subdirs.flatten() {
        let sub_path = sub.path();
        if !sub.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Some(sub_name) = sub_path
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
        else {
            continue;
        };
        let Ok(files) = fs::read_dir(&sub_path) else {
            tracing::warn!(dir = %sub_path.display(), "cannot list an SSD cache directory");
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            let name = file.file_name().to_string_lossy().into_owned();
            // Only regular files are ours: a directory, FIFO, socket, device or symbolic link
            // (whatever its name) is left alone without a word. `open_regular` checks again
            // after opening, for a file swapped in between.
            if !file.file_type().is_ok_and(|t| t.is_file()) {
                tracing::debug!(path = %path.display(), "not a regular file; skipped");
                report.skipped_not_files += 1;
                continue;
            }
            if name.ends_with(".tmp") {
                if owner.liveness_of_tmp(dir, &name) == Liveness::Dead && remove_orphan(&path) {
                    report.removed_orphans += 1;
                }
                continue;
            }
            if !name.ends_with(&format!(".{EXTENSION}")) {
                continue;
            }
            match scan_file(&path, &sub_name, cfg) {
                Ok((header, meta)) => {
                    insert(SsdEntry {
                        ns: header.namespace.as_str().into(),
                        tokens: header.tokens.clone().into(),
                        path,
                        bytes: meta.len(),
                        mtime: meta.modified().unwrap_or(UNIX_EPOCH),
                        trim_floor: header.trim_floor(),
                        checkpoint: header.checkpoint,
                    });
                }
                // Removed by another process sharing the directory since the listing.
                Err(CacheError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(CacheError::Io { op, source, .. }) => {
                    tracing::warn!(path = %path.display(), op, error = %source, "cannot read an SSD cache file; skipped");
                }
                Err(CacheError::NotAFile { .. }) => {
                    tracing::debug!(path = %path.display(), "not a regular file; skipped");
                    report.skipped_not_files += 1;
                }
                Err(e) => {
                    match e {
                        CacheError::UnsupportedVersion { .. } => report.removed_unsupported += 1,
                        CacheError::Mismatch { .. } => report.removed_mismatched += 1,
                        _ => report.removed_corrupt += 1,
                    }
                    tracing::warn!(error = %e, "removing an unusable SSD cache file");
                    remove_quietly(&path);
                }
            }
        }
    }
    Ok(report)
}

fn scan_file(path: &Path, dir_label: &str, cfg: &SsdConfig) -> Result<(FileHeader, fs::Metadata)> {
    let (mut f, meta) = open_regular(path)?;
    let h = format::read_header(&mut f, path)?;
    let mismatch = |field, found: String, expected: String| CacheError::Mismatch {
        path: path.to_path_buf(),
        field,
        found,
        expected,
    };
    if h.fingerprint != cfg.fingerprint {
        return Err(mismatch(
            "fingerprint",
            h.fingerprint,
            cfg.fingerprint.clone(),
        ));
    }
    if dir_name(&h.namespace) != dir_label {
        return Err(mismatch("namespace", h.namespace, dir_label.to_string()));
    }
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    if file_name.as_deref() != Some(entry_file_name(&h.namespace, &h.tokens).as_str()) {
        return Err(mismatch(
            "file name",
            file_name.unwrap_or_default(),
            "the entry's hash".into(),
        ));
    }
    match &h.checkpoint {
        Some(c) => {
            let key = CheckpointKey::from_hex(&c.key);
            if key.map(|k| k.namespace()).as_deref() != Some(h.namespace.as_str()) {
                return Err(mismatch(
                    "checkpoint key",
                    c.key.clone(),
                    h.namespace.clone(),
                ));
            }
        }
        None if namespace::is_checkpoint(&h.namespace) => {
            return Err(mismatch("checkpoint", "none".into(), h.namespace.clone()));
        }
        None => {}
    }
    if cfg.verify {
        format::verify_payload(&mut f, path, &h)?;
    }
    Ok((h, meta))
}

#[cfg(test)]
mod tests;
