//! [`SsdTier`]: the cold tier on disk. The files are the database: one `.wkv` entry file per
//! stored prefix and the `.wkc` chunk files entries share, no sidecar index.
//!
//! Layout: `<root>/<fingerprint>/<namespace dir>/<entry>.wkv` and
//! `<root>/<fingerprint>/chunks/<chunk>.wkc`, where the fingerprint names the model, its
//! configuration and tokenizer, and the namespace directory is
//! [`crate::namespace::dir_name`]. Only our fingerprint's directory is ever read or
//! changed; another model's directory beside it is never touched.
//!
//! - A conversation is stored once. The KV of each run of [`CHUNK_TOKENS`] positions lives in
//!   a chunk file named by a chained hash of every token up to its end ([`chunks`]), so every
//!   entry whose tokens pass through it names the same file; an entry file holds its tokens,
//!   the rows outside whole chunks, and what cannot be split by position (a hybrid model's
//!   recurrent state). A turn that extends the previous one writes the chunks its new tokens
//!   complete and a small entry file. Chunks are reference-counted in memory from the entry
//!   files; one no entry refers to is removed.
//! - Writes are atomic: a `.tmp` file is written, fsynced, renamed over the final name, and
//!   the directory fsynced; a store writes its new chunks that way first, then its entry
//!   file. A crash at any point leaves the old state or the new one, plus orphan `.tmp`
//!   files and chunks no entry refers to, which the next scan removes. A torn write is never
//!   read: only complete, synced files are ever renamed into place, and every read checks
//!   hashes.
//! - The directory may be shared by several processes (replicas, also on several hosts
//!   over a shared filesystem). Each writes only its own `.tmp` files ([`owner`]: an owner
//!   id with a held lock file) and renames them into place; entry names are the hash of
//!   namespace and tokens and chunk names the chained hash of their prefix, so two replicas
//!   storing one prefix write the same names and the last rename wins with an equivalent
//!   file. A store holds a shared lock on `<fingerprint>/.chunks.lock` from checking which
//!   chunks exist until its entry file is in place; chunks are removed only under the
//!   exclusive lock, after re-reading the directory for entries other processes wrote, so
//!   no process removes a chunk another one's entry refers to. A tier opened with
//!   [`SsdTier::open_in_background`] re-reads the directory every [`REFRESH_INTERVAL`]
//!   ([`SsdTier::refresh`]): entries another process wrote become restorable, and entries
//!   another process removed leave the index. Removing a file (eviction, supersession) is
//!   safe while another process reads it: a reader that has it open keeps its data, one
//!   that opens it after the removal gets a quiet miss.
//! - Start-up scan rebuilds the index and the chunks' reference counts from the headers
//!   (hash-checked), removing orphans, corrupt files, other format versions, files of
//!   another fingerprint or namespace, entries whose chunks are gone, and chunks no entry
//!   refers to. [`SsdTier::open_in_background`] runs it on its own thread: entries become
//!   restorable one by one as it indexes them, and a lookup meanwhile misses instead of
//!   waiting. With `verify`, every payload is hash-checked too; payloads are always checked
//!   when an entry is restored, so a damaged entry is never restored.
//! - Nothing outside the tier's own files is touched ([`guard`]): the fingerprint directory
//!   must be a real directory of this user (never a link), only directories the tier names
//!   itself are entered, links are never followed, and a file is removed only when it is a
//!   regular file of ours with the tier's own name shape (and for entries and chunks its
//!   magic).
//! - The byte cap evicts least-recently-used entries by modification time (a restore
//!   touches the entry file; the time is read again from the file before an eviction, so
//!   another process's restores count); an eviction frees the entry file and the chunks no
//!   other entry refers to. A full disk evicts the oldest entries and retries once.
//! - Every failure is a miss or a warning: a bad file is removed, a failed write is
//!   cleaned up and counted, and serving goes on.
pub mod chunks;
pub mod format;
mod guard;
pub mod owner;
mod refresh;
mod scan;

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::checkpoint::{CheckpointKey, CheckpointMeta};
use crate::namespace::{self, dir_name};
use crate::prefix_index::PrefixIndex;
use crate::ram::EntryId;
use crate::value::{KvSnapshot, LayerSnapshot};
use crate::{CacheError, Result};
use chunks::ChunkRef;
pub use chunks::{ChunkId, CHUNK_TOKENS};
use format::{ChunkHeader, ChunkLabel, ChunkRefs, EntryLabel, FileHeader, EXTENSION};
use owner::Owner;
pub use refresh::{RefreshReport, REFRESH_INTERVAL};

/// The lock file that orders chunk removal after stores (inside the fingerprint directory).
const CHUNK_LOCK: &str = ".chunks.lock";
/// Chunk files a store writes at once.
const CHUNK_WRITERS: usize = 8;
/// How long a store waits for other processes' stores before removing the chunks its
/// evictions freed (they are removed later otherwise).
const GC_WAIT: Duration = Duration::from_secs(2);

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
    /// Chunk files their entries share.
    pub chunks: usize,
    /// Bytes of both.
    pub bytes: u64,
    /// Orphan `.tmp` files removed (writes a crash interrupted).
    pub removed_orphans: usize,
    /// Chunk files no entry refers to, removed (a crash between a store's chunks and its
    /// entry, or entries removed since).
    pub removed_unreferenced_chunks: usize,
    /// Damaged files removed (entries whose chunks are missing or damaged included).
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

/// One indexed entry file.
#[derive(Debug, Clone)]
pub struct SsdEntry {
    /// Namespace.
    pub ns: Arc<str>,
    /// Tokens the KV holds.
    pub tokens: Arc<[u32]>,
    /// The entry file.
    pub path: PathBuf,
    /// The entry file's length (its chunks are counted apart).
    pub bytes: u64,
    /// Last use (file modification time).
    pub mtime: SystemTime,
    /// Shortest length the entry can be cut back to.
    pub trim_floor: usize,
    /// Set on generation checkpoints.
    pub checkpoint: Option<CheckpointMeta>,
    /// The chunks it refers to.
    pub chunks: Arc<[ChunkId]>,
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
        /// Bytes written: the entry file and the chunks no stored entry had yet.
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
    /// Chunk files indexed.
    pub chunks: usize,
    /// Bytes on disk (entry and chunk files).
    pub bytes: u64,
    /// The byte cap (0 = unlimited).
    pub max_bytes: u64,
    /// Entries restored, all time.
    pub restores: u64,
    /// Restores that failed (the file was removed; the request missed).
    pub restore_failures: u64,
    /// Entries written, all time.
    pub stores: u64,
    /// Bytes written, all time (entry files and new chunks).
    pub bytes_written: u64,
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

/// A chunk file's size and how many indexed entries refer to it.
#[derive(Debug, Clone, Copy)]
struct ChunkInfo {
    bytes: u64,
    refs: usize,
}

#[derive(Default)]
struct Index {
    entries: HashMap<EntryId, SsdEntry>,
    prefix: PrefixIndex<EntryId>,
    next_id: EntryId,
    chunks: HashMap<ChunkId, ChunkInfo>,
    /// Chunks no indexed entry refers to, not yet removed.
    garbage: HashSet<ChunkId>,
    /// Bytes of entry files and of the chunks they refer to (what the cap counts).
    bytes: u64,
    /// Bytes of `garbage`.
    garbage_bytes: u64,
}

impl Index {
    /// Indexes `e`, whose chunk `i` is `sizes[i]` bytes.
    fn insert(&mut self, e: SsdEntry, sizes: &[u64]) -> EntryId {
        for (&c, &b) in e.chunks.iter().zip(sizes) {
            self.add_ref(c, b);
        }
        self.next_id += 1;
        let id = self.next_id;
        self.bytes += e.bytes;
        self.prefix.insert(id, e.ns.clone(), e.tokens.clone());
        self.entries.insert(id, e);
        id
    }

    fn add_ref(&mut self, c: ChunkId, bytes: u64) {
        match self.chunks.get_mut(&c) {
            Some(info) => {
                if info.refs == 0 {
                    self.garbage.remove(&c);
                    self.garbage_bytes -= info.bytes;
                } else {
                    self.bytes -= info.bytes;
                }
                self.bytes += bytes;
                info.bytes = bytes;
                info.refs += 1;
            }
            None => {
                self.chunks.insert(c, ChunkInfo { bytes, refs: 1 });
                self.bytes += bytes;
            }
        }
    }

    fn drop_ref(&mut self, c: ChunkId) {
        if let Some(info) = self.chunks.get_mut(&c) {
            if info.refs == 0 {
                return;
            }
            info.refs -= 1;
            if info.refs == 0 {
                self.bytes -= info.bytes;
                self.garbage_bytes += info.bytes;
                self.garbage.insert(c);
            }
        }
    }

    /// A chunk file on disk that no entry refers to (a crash's leftover, or a failed store's).
    fn add_unreferenced(&mut self, c: ChunkId, bytes: u64) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.chunks.entry(c) {
            v.insert(ChunkInfo { bytes, refs: 0 });
            self.garbage.insert(c);
            self.garbage_bytes += bytes;
        }
    }

    /// Unreferenced chunks, out of the index (their files are for the caller to remove).
    fn take_garbage(&mut self) -> Vec<ChunkId> {
        let ids: Vec<ChunkId> = self.garbage.drain().collect();
        for c in &ids {
            if let Some(info) = self.chunks.remove(c) {
                self.garbage_bytes -= info.bytes;
            }
        }
        ids
    }

    /// A chunk whose file was removed (damaged): it holds no bytes any more.
    fn forget_chunk(&mut self, c: ChunkId) {
        if let Some(info) = self.chunks.get_mut(&c) {
            if info.refs == 0 {
                self.garbage_bytes -= info.bytes;
            } else {
                self.bytes -= info.bytes;
            }
            info.bytes = 0;
        }
    }

    fn remove(&mut self, id: EntryId) -> Option<SsdEntry> {
        let e = self.entries.remove(&id)?;
        self.bytes -= e.bytes;
        self.prefix.remove(id);
        for &c in e.chunks.iter() {
            self.drop_ref(c);
        }
        Some(e)
    }

    /// Removes the entry and its file (its chunks become garbage when no entry is left).
    fn delete(&mut self, id: EntryId) {
        if let Some(e) = self.remove(id) {
            guard::remove_ours(&e.path, format::MAGIC);
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

/// Whether `path` still names the file open as `f` (not removed or replaced since).
fn still_there(f: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (f.metadata(), fs::symlink_metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = f;
        path.is_file()
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

/// Why a restore failed.
enum ReadFailure {
    /// The entry file itself.
    Entry(CacheError),
    /// A chunk the entry refers to; `entry_still_there` says whether the entry file we read is
    /// still in place (else another process removed it, and its chunks with it).
    Chunk {
        id: ChunkId,
        error: CacheError,
        entry_still_there: bool,
    },
}

/// The SSD tier.
pub struct SsdTier {
    dir: PathBuf,
    chunk_dir: PathBuf,
    cfg: SsdConfig,
    index: Mutex<Index>,
    /// Our owner id and its held lock (who may remove which `.tmp` file).
    owner: Owner,
    /// Tokens per chunk of new entries (0: each entry holds all of its rows).
    chunk_tokens: AtomicUsize,
    restores: AtomicU64,
    restore_failures: AtomicU64,
    stores: AtomicU64,
    bytes_written: AtomicU64,
    store_failures: AtomicU64,
    evictions: AtomicU64,
    superseded: AtomicU64,
    restore_ms_last: AtomicU64,
    warned: AtomicBool,
    tmp_seq: AtomicU64,
    /// Files [`SsdTier::refresh`] could not index (not read again while they stay).
    unreadable: Mutex<HashSet<PathBuf>>,
    /// Whether the start-up scan has indexed everything (chunk reference counts are complete
    /// only then, so no chunk is removed before).
    scanned: AtomicBool,
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
        // The root is the operator's path (it may be a link they made); everything below it
        // is ours and never a link.
        fs::create_dir_all(&cfg.root).map_err(CacheError::io("create", &cfg.root))?;
        let dir = cfg.root.join(&cfg.fingerprint);
        guard::own_dir(&dir)?;
        guard::warn_if_shared_writable(&dir);
        let owner = Owner::acquire(&dir)?;
        Ok(SsdTier {
            chunk_dir: guard::chunk_dir(&dir),
            dir,
            cfg,
            index: Mutex::new(Index::default()),
            owner,
            chunk_tokens: AtomicUsize::new(CHUNK_TOKENS),
            restores: AtomicU64::new(0),
            restore_failures: AtomicU64::new(0),
            stores: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            store_failures: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            superseded: AtomicU64::new(0),
            restore_ms_last: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            tmp_seq: AtomicU64::new(0),
            unreadable: Mutex::default(),
            scanned: AtomicBool::new(false),
            scan: Mutex::new(None),
            scan_done: Condvar::new(),
        })
    }

    /// Sets the chunk size of entries stored from now on, in tokens (default
    /// [`CHUNK_TOKENS`]); 0 makes each entry hold all of its rows, as format 2 did (for
    /// comparisons). Entries of any chunk size are read alike.
    pub fn set_chunk_tokens(&self, tokens: usize) {
        self.chunk_tokens
            .store(tokens.min(format::MAX_CHUNK_TOKENS), Ordering::Relaxed);
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

    fn chunk_path(&self, id: ChunkId) -> PathBuf {
        self.chunk_dir.join(chunks::file_name(id))
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
            chunks: ix.chunks.len(),
            bytes: ix.bytes + ix.garbage_bytes,
            max_bytes: self.cfg.max_bytes,
            restores: self.restores.load(o),
            restore_failures: self.restore_failures.load(o),
            stores: self.stores.load(o),
            bytes_written: self.bytes_written.load(o),
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

    /// How many indexed entries refer to chunk `id` (`None`: not indexed).
    pub fn chunk_refs(&self, id: ChunkId) -> Option<usize> {
        self.index().chunks.get(&id).map(|c| c.refs)
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

    /// Reads a matched entry and the chunks it needs, checks every hash and that the files
    /// are what the index says, and cuts it to `m.usable` tokens. A damaged entry or chunk is
    /// removed and the restore is a miss.
    pub fn load(&self, m: &SsdMatch) -> Result<KvSnapshot> {
        let started = Instant::now();
        let Some(entry) = self.index().entries.get(&m.id).cloned() else {
            return Err(CacheError::Value {
                op: "load",
                reason: "the entry left the SSD index".into(),
            });
        };
        let gone = |source: std::io::Error| {
            let mut ix = self.index();
            if ix.entries.get(&m.id).is_some_and(|x| x.path == entry.path) {
                ix.remove(m.id);
            }
            drop(ix);
            self.collect_garbage();
            CacheError::Io {
                op: "open",
                path: entry.path.clone(),
                source,
            }
        };
        match self.read_entry(&entry, m.usable) {
            Ok(snap) => {
                if let Some(f) = guard::open_write(&entry.path) {
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
            Err(ReadFailure::Entry(CacheError::Io { source, .. }))
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                tracing::debug!(path = %entry.path.display(), "SSD cache entry removed by another process");
                Err(gone(source))
            }
            // The entry went away while we read it, and its chunks with it: the same.
            Err(ReadFailure::Chunk {
                entry_still_there: false,
                ..
            }) => {
                tracing::debug!(path = %entry.path.display(), "SSD cache entry removed by another process while restored");
                let still = entry.path.exists();
                if still {
                    return Err(CacheError::Value {
                        op: "load",
                        reason: "the entry was replaced while restored".into(),
                    });
                }
                Err(gone(std::io::ErrorKind::NotFound.into()))
            }
            Err(ReadFailure::Entry(e)) => {
                tracing::warn!(error = %e, "SSD cache entry unusable; removed");
                self.restore_failures.fetch_add(1, Ordering::Relaxed);
                let mut ix = self.index();
                if ix.entries.get(&m.id).is_some_and(|x| x.path == entry.path) {
                    ix.delete(m.id);
                }
                drop(ix);
                self.collect_garbage();
                Err(e)
            }
            Err(ReadFailure::Chunk { id, error, .. }) => {
                tracing::warn!(error = %error, "SSD cache chunk unusable; the entry is removed");
                self.restore_failures.fetch_add(1, Ordering::Relaxed);
                let missing = matches!(&error, CacheError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound);
                let mut ix = self.index();
                if !missing && guard::remove_ours(&self.chunk_path(id), format::CHUNK_MAGIC) {
                    ix.forget_chunk(id);
                }
                if ix.entries.get(&m.id).is_some_and(|x| x.path == entry.path) {
                    ix.delete(m.id);
                }
                drop(ix);
                self.collect_garbage();
                Err(error)
            }
        }
    }

    /// Reads the entry file at `path` whole, with the chunks it refers to, checking every
    /// hash (for diagnostics and tests; nothing is indexed, touched or removed).
    pub fn read_entry_file(&self, path: &Path) -> Result<KvSnapshot> {
        let (mut f, _) = open_regular(path)?;
        let h = format::read_header(&mut f, path)?;
        let snap = self
            .assemble(&mut f, path, &h, h.tokens.len())
            .map_err(|e| match e {
                ReadFailure::Entry(e) | ReadFailure::Chunk { error: e, .. } => e,
            })?;
        snap.validate()?;
        Ok(snap)
    }

    fn read_entry(&self, entry: &SsdEntry, usable: usize) -> Result<KvSnapshot, ReadFailure> {
        let path = &entry.path;
        let (mut f, _) = open_regular(path).map_err(ReadFailure::Entry)?;
        let h = format::read_header(&mut f, path).map_err(ReadFailure::Entry)?;
        let mismatch = |field, found: String, expected: String| {
            ReadFailure::Entry(CacheError::Mismatch {
                path: path.clone(),
                field,
                found,
                expected,
            })
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
        let snap = self.assemble(&mut f, path, &h, usable)?;
        snap.validate().map_err(ReadFailure::Entry)?;
        Ok(snap)
    }

    /// The KV of the first `usable` tokens of entry `h` (open as `f`): the rows the entry
    /// holds, and those of the chunks it refers to up to `usable`.
    fn assemble(
        &self,
        f: &mut File,
        path: &Path,
        h: &FileHeader,
        usable: usize,
    ) -> Result<KvSnapshot, ReadFailure> {
        let max_start = h.layers.iter().map(|l| l.start).max().unwrap_or(0);
        if usable > h.tokens.len() || usable < h.trim_floor().max(max_start) {
            return Err(ReadFailure::Entry(CacheError::InvalidSnapshot(format!(
                "cannot cut {} tokens to {usable} (shortest possible {})",
                h.tokens.len(),
                h.trim_floor().max(max_start)
            ))));
        }
        let no_groups = Vec::new();
        let groups = h.chunks.as_ref().map_or(&no_groups, |c| &c.groups);
        let needed: Vec<ChunkRef> = chunks::refs(h)
            .into_iter()
            .filter(|r| r.from < usable)
            .collect();
        let chunk_failure = |f: &File, id, error| ReadFailure::Chunk {
            id,
            error,
            entry_still_there: still_there(f, path),
        };
        // Every chunk needed must be a file at least as long as the rows it is to give, so
        // nothing is allocated for rows no file holds.
        for r in &needed {
            let p = self.chunk_path(r.id);
            let len = match fs::symlink_metadata(&p) {
                Ok(m) if m.is_file() => m.len(),
                Ok(_) => return Err(chunk_failure(f, r.id, CacheError::NotAFile { path: p })),
                Err(e) => return Err(chunk_failure(f, r.id, CacheError::io("open", &p)(e))),
            };
            let claimed = groups[r.group]
                .layers
                .iter()
                .map(|&i| {
                    let l = &h.layers[i];
                    ((l.kv_heads * l.head_dim) as u64).saturating_mul(8 * (r.to - r.from) as u64)
                })
                .fold(0u64, u64::saturating_add);
            if claimed > len {
                let e = CacheError::Corrupt {
                    path: p,
                    reason: format!("{len} bytes cannot hold the {claimed} its entry needs"),
                };
                return Err(chunk_failure(f, r.id, e));
            }
        }
        if !needed.is_empty() {
            // Never read through a link put in place of the chunk directory.
            guard::check_own_dir(&self.chunk_dir).map_err(|e| ReadFailure::Chunk {
                id: needed[0].id,
                error: e,
                entry_still_there: false,
            })?;
        }
        let inline = format::read_inline(f, path, h).map_err(ReadFailure::Entry)?;
        let mut layers: Vec<LayerSnapshot> = Vec::with_capacity(h.layers.len());
        for (i, (l, (keys, values))) in h.layers.iter().zip(&inline.layers).enumerate() {
            let row = l.kv_heads * l.head_dim;
            let head_end = h.chunked(i).map_or(usable, |(from, _)| from.min(usable));
            let mut layer = LayerSnapshot {
                start: l.start,
                len: usable,
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                window: l.window,
                keys: Vec::with_capacity((usable - l.start) * row),
                values: Vec::with_capacity((usable - l.start) * row),
            };
            let head = (head_end - l.start) * row;
            layer.keys.extend_from_slice(&keys[..head]);
            layer.values.extend_from_slice(&values[..head]);
            layers.push(layer);
        }
        for r in &needed {
            let group = &groups[r.group];
            let data = self
                .read_chunk(h, r, group)
                .map_err(|e| chunk_failure(f, r.id, e))?;
            let take = r.to.min(usable) - r.from;
            for (&i, (keys, values)) in group.layers.iter().zip(data) {
                let n = take * layers[i].row();
                layers[i].keys.extend_from_slice(&keys[..n]);
                layers[i].values.extend_from_slice(&values[..n]);
            }
        }
        for (i, (l, (keys, values))) in h.layers.iter().zip(&inline.layers).enumerate() {
            if let Some((from, to)) = h.chunked(i) {
                if usable > to {
                    let row = l.kv_heads * l.head_dim;
                    let at = (from - l.start) * row;
                    let n = (usable - to) * row;
                    layers[i].keys.extend_from_slice(&keys[at..at + n]);
                    layers[i].values.extend_from_slice(&values[at..at + n]);
                }
            }
        }
        Ok(KvSnapshot {
            layers,
            recurrent: inline.recurrent,
        })
    }

    /// Reads chunk `r` of entry `h` and checks it is the one the entry means: fingerprint,
    /// namespace, position, tokens, the prefix before it, and the group's layers.
    fn read_chunk(
        &self,
        h: &FileHeader,
        r: &ChunkRef,
        group: &format::ChunkGroup,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let path = self.chunk_path(r.id);
        let (mut f, _) = open_regular(&path)?;
        let c = format::read_chunk_header(&mut f, &path)?;
        let refs = h.chunks.as_ref();
        let window = group.layers.first().and_then(|&i| h.layers[i].window);
        let shapes_match = c.layers.len() == group.layers.len()
            && c.layers.iter().zip(&group.layers).all(|(cl, &i)| {
                let l = &h.layers[i];
                cl.index == i && cl.kv_heads == l.kv_heads && cl.head_dim == l.head_dim
            });
        let checks: [(&'static str, bool); 6] = [
            ("fingerprint", c.fingerprint == self.cfg.fingerprint),
            (
                "namespace",
                refs.is_some_and(|x| x.kv_namespace == c.kv_namespace),
            ),
            ("position", c.from == r.from && c.to == r.to),
            ("tokens", c.tokens[..] == h.tokens[r.from..r.to]),
            ("prefix", c.parent == format!("{:032x}", r.parent)),
            ("layers", shapes_match && c.window == window),
        ];
        if let Some((field, _)) = checks.iter().find(|(_, ok)| !ok) {
            return Err(CacheError::Mismatch {
                path,
                field,
                found: "another chunk".into(),
                expected: "the entry's".into(),
            });
        }
        format::read_chunk_payload(&mut f, &path, &c)
    }

    /// Checks the chunk file at `path` on its own, payload included (for diagnostics and
    /// tests): it must be whole, of our fingerprint, and named by its contents.
    pub fn check_chunk_file(&self, path: &Path) -> Result<u64> {
        let id = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(chunks::parse_file_name)
            .ok_or_else(|| CacheError::Mismatch {
                path: path.to_path_buf(),
                field: "file name",
                found: path.display().to_string(),
                expected: "a chunk's name".into(),
            })?;
        self.check_chunk(id, path, true)
    }

    /// Reads a chunk file on its own: its header must be whole and name the file, and be of
    /// our fingerprint; with `verify`, its payload must match its hashes. Returns its length.
    fn check_chunk(&self, id: ChunkId, path: &Path, verify: bool) -> Result<u64> {
        let (mut f, meta) = open_regular(path)?;
        let c = format::read_chunk_header(&mut f, path)?;
        let parent = chunks::is_hex32(&c.parent)
            .then(|| u128::from_str_radix(&c.parent, 16).ok())
            .flatten();
        if parent.map(|p| chunks::link(p, &c.tokens)) != Some(id) {
            return Err(CacheError::Mismatch {
                path: path.to_path_buf(),
                field: "file name",
                found: chunks::file_name(id),
                expected: "the chunk's hash".into(),
            });
        }
        if c.fingerprint != self.cfg.fingerprint {
            return Err(CacheError::Mismatch {
                path: path.to_path_buf(),
                field: "fingerprint",
                found: c.fingerprint,
                expected: self.cfg.fingerprint.clone(),
            });
        }
        if verify {
            format::verify_chunk(&mut f, path, &c)?;
        }
        Ok(meta.len())
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
            Ok(StoreOutcome::Stored { bytes, .. }) => {
                self.stores.fetch_add(1, Ordering::Relaxed);
                self.bytes_written.fetch_add(*bytes, Ordering::Relaxed);
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
        let chunk_tokens = self.chunk_tokens.load(Ordering::Relaxed);
        // A checkpoint's prompt was computed under its cache namespace: its chunks are the
        // prompt's.
        let kv_namespace = checkpoint.map_or(ns, |c| c.cache_namespace.as_str());
        let refs = Some(ChunkRefs {
            chunk_tokens,
            kv_namespace: kv_namespace.to_string(),
            groups: chunks::groups(snap, chunk_tokens),
        });
        let header = format::plan(&label, snap, now_ms(), refs)?;
        let refs = chunks::refs(&header);
        let (id, bytes) = match self.commit(&header, &refs, snap) {
            Err(e) if e.is_disk_full() => {
                let freed = self.make_room(snap.byte_size() as u64 + header.file_bytes);
                tracing::info!(freed, "SSD cache disk full: evicted old entries, retrying");
                self.commit(&header, &refs, snap)?
            }
            other => other?,
        };
        let mut ix = self.index();
        let mut superseded = 0;
        let new_floor = header.trim_floor();
        for anc in ix.prefix.ancestors(ns, tokens) {
            let len = ix.entries[&anc].tokens.len();
            // Older checkpoints of a key are replaced by the newest; plain entries only
            // when the new one can be cut back to every length they serve (to the entry
            // itself is not enough: it may serve shorter prefixes that it superseded).
            let replace = if checkpoint.is_some() {
                true
            } else {
                let old = &ix.entries[&anc];
                old.checkpoint.is_none() && len >= new_floor && old.trim_floor >= new_floor
            };
            if replace {
                ix.delete(anc);
                superseded += 1;
            }
        }
        self.superseded
            .fetch_add(superseded as u64, Ordering::Relaxed);
        let evicted = self.evict_to_cap(&mut ix, Some(id));
        drop(ix);
        // The writer's own thread: it may wait a little for other stores, so the disk stays
        // under the cap.
        self.collect_garbage_within(GC_WAIT);
        Ok(StoreOutcome::Stored {
            bytes,
            superseded,
            evicted,
        })
    }

    /// Writes the chunks `refs` names that are not on disk yet, then the entry file, and
    /// indexes the entry, all under the shared chunk lock: no process removes a chunk this
    /// entry reuses before the entry is on disk and in the index. Returns the entry's id and
    /// the bytes written.
    fn commit(
        &self,
        header: &FileHeader,
        refs: &[ChunkRef],
        snap: &KvSnapshot,
    ) -> Result<(EntryId, u64)> {
        let ns = header.namespace.as_str();
        let ns_dir = self.dir.join(dir_name(ns));
        if guard::own_dir(&ns_dir)? {
            sync_dir(&self.dir)?;
        }
        let _shared = if refs.is_empty() {
            None
        } else {
            if guard::own_dir(&self.chunk_dir)? {
                sync_dir(&self.dir)?;
            }
            Some(self.lock_chunks_shared()?)
        };
        let known: Vec<bool> = {
            let ix = self.index();
            refs.iter()
                .map(|r| ix.chunks.get(&r.id).is_some_and(|c| c.bytes > 0))
                .collect()
        };
        // Which chunks are on disk already (another entry's, or another process's): those
        // are kept; the rest are planned.
        let mut sizes = Vec::with_capacity(refs.len());
        let mut new: Vec<(usize, ChunkHeader)> = Vec::new();
        let chunk_refs = header.chunks.as_ref();
        for (k, r) in refs.iter().enumerate() {
            let path = self.chunk_path(r.id);
            let on_disk = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() && known[k] => Some(m.len()),
                // Not indexed here: read before it is relied on.
                Ok(m) if m.is_file() => self.check_chunk(r.id, &path, false).ok(),
                Ok(_) => return Err(CacheError::NotAFile { path }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(CacheError::io("stat", &path)(e)),
            };
            match on_disk {
                Some(bytes) => sizes.push(bytes),
                None => {
                    let group = &chunk_refs.map_or(&[][..], |c| &c.groups[..])[r.group];
                    let label = ChunkLabel {
                        fingerprint: &self.cfg.fingerprint,
                        kv_namespace: chunk_refs.map_or("", |c| c.kv_namespace.as_str()),
                        parent: r.parent,
                        from: r.from,
                        tokens: &header.tokens[r.from..r.to],
                        window: header.layers[group.layers[0]].window,
                        layers: &group.layers,
                    };
                    let c = format::plan_chunk(&label, snap)?;
                    sizes.push(c.file_bytes);
                    new.push((k, c));
                }
            }
        }
        let footprint = header.file_bytes + sizes.iter().sum::<u64>();
        if self.cfg.max_bytes > 0 && footprint > self.cfg.max_bytes {
            return Err(CacheError::TooLarge {
                tier: "ssd",
                bytes: footprint,
                limit: self.cfg.max_bytes,
            });
        }
        let name = entry_file_name(ns, &header.tokens);
        let write_entry =
            || self.write_tmp(&ns_dir, &name, |f, p| format::write(f, p, header, snap));
        // The entry's temporary file is written and fsynced while the chunks are; it is
        // renamed into place only once they are.
        let (entry_tmp, (renamed, failed)) = if new.is_empty() {
            (write_entry(), (Vec::new(), None))
        } else {
            std::thread::scope(|s| {
                let entry = s.spawn(write_entry);
                let chunks = self.write_chunks(refs, &new, snap);
                let entry = entry.join().unwrap_or_else(|_| {
                    Err(CacheError::Value {
                        op: "write",
                        reason: "the entry writer panicked".into(),
                    })
                });
                (entry, chunks)
            })
        };
        let mut written: u64 = renamed.iter().map(|(_, b)| b).sum();
        let result = (|| {
            let tmp = entry_tmp?;
            let path = ns_dir.join(&name);
            let placed = (|| {
                if let Some(e) = failed {
                    return Err(e);
                }
                if !new.is_empty() {
                    sync_dir(&self.chunk_dir)?;
                }
                fs::rename(&tmp, &path).map_err(CacheError::io("rename", &tmp))
            })();
            if let Err(e) = placed {
                remove_quietly(&tmp);
                return Err(e);
            }
            if let Err(e) = sync_dir(&ns_dir) {
                remove_quietly(&path);
                return Err(e);
            }
            Ok(path)
        })();
        let path = match result {
            Ok(path) => path,
            Err(e) => {
                // Chunks already in place are left to the collector: another store may have
                // found them since.
                let mut ix = self.index();
                for (id, bytes) in renamed {
                    ix.add_unreferenced(id, bytes);
                }
                return Err(e);
            }
        };
        written += header.file_bytes;
        let mtime = fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or_else(|_| SystemTime::now());
        let mut ix = self.index();
        // The same name: the rename replaced that file (indexed first, so its chunks never
        // look unreferenced in between).
        let replaced = ix.prefix.exact(ns, &header.tokens);
        let id = ix.insert(
            SsdEntry {
                ns: ns.into(),
                tokens: header.tokens.clone().into(),
                path,
                bytes: header.file_bytes,
                mtime,
                trim_floor: header.trim_floor(),
                checkpoint: header.checkpoint.clone(),
                chunks: refs.iter().map(|r| r.id).collect(),
            },
            &sizes,
        );
        for old in replaced {
            ix.remove(old);
        }
        Ok((id, written))
    }

    /// Writes the chunk files `new` (planned chunks of `refs`) atomically, several at once
    /// (each is fsynced before its rename, and fsyncs of files written together cost about
    /// one). Returns the chunks now in place and the first error, if any.
    fn write_chunks(
        &self,
        refs: &[ChunkRef],
        new: &[(usize, ChunkHeader)],
        snap: &KvSnapshot,
    ) -> (Vec<(ChunkId, u64)>, Option<CacheError>) {
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let done = Mutex::new((Vec::with_capacity(new.len()), None));
        let work = || {
            while !stop.load(Ordering::Relaxed) {
                let Some((k, c)) = new.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                let id = refs[*k].id;
                let result = self.write_atomic(&self.chunk_dir, &chunks::file_name(id), |f, p| {
                    format::write_chunk(f, p, c, snap)
                });
                let mut done = done.lock().unwrap_or_else(|p| p.into_inner());
                match result {
                    Ok(_) => done.0.push((id, c.file_bytes)),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        done.1.get_or_insert(e);
                    }
                }
            }
        };
        let threads = new.len().min(CHUNK_WRITERS);
        if threads <= 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 1..threads {
                    s.spawn(work);
                }
                work();
            });
        }
        done.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `name` in `dir` atomically: a temporary file of ours, written by `write`,
    /// fsynced, then renamed into place. The directory is not fsynced here.
    fn write_atomic(
        &self,
        dir: &Path,
        name: &str,
        write: impl FnOnce(&mut File, &Path) -> Result<u64>,
    ) -> Result<PathBuf> {
        let tmp = self.write_tmp(dir, name, write)?;
        let path = dir.join(name);
        match fs::rename(&tmp, &path) {
            Ok(()) => Ok(path),
            Err(e) => {
                remove_quietly(&tmp);
                Err(CacheError::io("rename", &tmp)(e))
            }
        }
    }

    /// Writes a temporary file of ours for `name` in `dir` with `write` and fsyncs it;
    /// returns its path (it is removed on failure).
    fn write_tmp(
        &self,
        dir: &Path,
        name: &str,
        write: impl FnOnce(&mut File, &Path) -> Result<u64>,
    ) -> Result<PathBuf> {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(self.owner.tmp_name(name, seq));
        let result = (|| {
            // `create_new` never follows a link planted at the name.
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(CacheError::io("create", &tmp))?;
            write(&mut f, &tmp)?;
            f.sync_all().map_err(CacheError::io("fsync", &tmp))
        })();
        match result {
            Ok(()) => Ok(tmp),
            Err(e) => {
                remove_quietly(&tmp);
                Err(e)
            }
        }
    }

    fn chunk_lock_file(&self) -> Result<File> {
        let path = self.dir.join(CHUNK_LOCK);
        owner::open_lock_file(&path, true).map_err(CacheError::io("open", &path))
    }

    /// The shared chunk lock (held while a store relies on chunks being on disk).
    fn lock_chunks_shared(&self) -> Result<File> {
        let f = self.chunk_lock_file()?;
        f.lock_shared()
            .map_err(CacheError::io("lock", self.dir.join(CHUNK_LOCK)))?;
        Ok(f)
    }

    /// Removes the chunks no entry refers to, if the exclusive chunk lock is free now (else
    /// later; see [`SsdTier::collect_garbage_within`]).
    fn collect_garbage(&self) -> usize {
        self.collect_garbage_within(Duration::ZERO)
    }

    /// Removes the chunks no entry refers to, waiting up to `wait` for the exclusive chunk
    /// lock (other processes' stores hold it shared; if it stays taken, the chunks wait for a
    /// later call). Under the lock the directory is re-read first, so chunks that entries of
    /// other processes refer to are kept. Returns how many files were removed.
    fn collect_garbage_within(&self, wait: Duration) -> usize {
        if !self.scanned.load(Ordering::Acquire) || self.index().garbage.is_empty() {
            return 0;
        }
        let Ok(lock) = self.chunk_lock_file() else {
            return 0;
        };
        let deadline = Instant::now() + wait;
        while lock.try_lock().is_err() {
            if Instant::now() >= deadline {
                return 0;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.sync_with_disk();
        let victims = self.index().take_garbage();
        let removed = victims
            .into_iter()
            .filter(|&id| guard::remove_ours(&self.chunk_path(id), format::CHUNK_MAGIC))
            .count();
        drop(lock);
        removed
    }

    /// Evicts our oldest entries until `needed` bytes are freed (a full disk), and removes
    /// the chunks they alone referred to.
    fn make_room(&self, needed: u64) -> u64 {
        let mut ix = self.index();
        let mut freed = 0;
        while freed < needed {
            let Some(id) = ix.oldest(None) else { break };
            let before = ix.bytes;
            ix.delete(id);
            freed += before - ix.bytes;
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        drop(ix);
        self.collect_garbage_within(GC_WAIT);
        freed
    }

    fn evict_to_cap(&self, ix: &mut Index, keep: Option<EntryId>) -> usize {
        let mut n = 0;
        if self.cfg.max_bytes == 0 {
            return 0;
        }
        // Each entry's time is re-read at most once per call, so the loop ends.
        let mut rechecked = HashSet::new();
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
            self.collect_garbage();
        }
        ids.len()
    }
}

/// Reads and checks an entry file's header: our fingerprint, the namespace of its directory,
/// the name its namespace and tokens give, and a checkpoint record exactly where the
/// namespace says. With `cfg.verify`, the payload it holds itself is hash-checked too.
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
