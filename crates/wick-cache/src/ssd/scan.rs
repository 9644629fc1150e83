//! The start-up scan: the index and the chunks' reference counts, rebuilt from the files.
//!
//! Only the directories the tier names itself are entered (`chunks` and the namespace
//! directories, each a real directory of this user), nothing is followed through a link, and
//! a file is removed only when the tier can tell it wrote it ([`super::guard`]): a `.tmp`
//! file of the tier's naming whose owner died, an entry or chunk file of the tier's naming
//! and magic that is damaged, of another version, fingerprint or namespace, an entry whose
//! chunks are gone, and a chunk no entry refers to. Anything else is left as it is.
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Instant, UNIX_EPOCH};

use super::chunks::{self, ChunkId};
use super::owner::{self, Liveness};
use super::{format, guard, scan_file, ScanReport, SsdEntry, SsdTier};
use crate::{namespace, CacheError, Result};

/// What the scan knows of a chunk file.
#[derive(Clone, Copy)]
enum Chunk {
    /// Listed, not read yet.
    Listed(u64),
    /// Read and whole (its length), and whether an entry refers to it.
    Good(u64, bool),
    /// Missing or damaged (removed if it was ours).
    Bad,
    /// Not readable now (an I/O error, or its directory is not ours): entries that need it
    /// are neither indexed nor removed.
    Unreadable,
}

/// A regular file of a directory the scan entered.
struct Listed {
    name: String,
    path: PathBuf,
    bytes: u64,
}

impl SsdTier {
    /// Indexes the fingerprint directory, entry by entry (the index is locked per entry
    /// only, so lookups and stores go on meanwhile), evicts to the cap, removes the chunks
    /// no entry refers to, and records the report.
    pub(super) fn run_scan(&self) -> ScanReport {
        let started = Instant::now();
        let report = match self.scan_dir() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot scan the SSD cache directory; it starts empty");
                ScanReport::default()
            }
        };
        // Reference counts are complete: unreferenced chunks may go from now on.
        self.scanned.store(true, Ordering::Release);
        let evicted = {
            let mut ix = self.index();
            self.evict_to_cap(&mut ix, None)
        };
        let removed_chunks = self.collect_garbage();
        let report = {
            let ix = self.index();
            ScanReport {
                evicted,
                removed_unreferenced_chunks: removed_chunks,
                entries: ix.entries.len(),
                chunks: ix.chunks.len(),
                bytes: ix.bytes + ix.garbage_bytes,
                ..report
            }
        };
        tracing::info!(
            dir = %self.dir.display(),
            entries = report.entries,
            chunks = report.chunks,
            mib = report.bytes >> 20,
            orphans = report.removed_orphans + report.removed_unreferenced_chunks,
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

    pub(super) fn scan_dir(&self) -> Result<ScanReport> {
        guard::check_own_dir(&self.dir)?;
        let mut report = ScanReport {
            removed_stale_locks: owner::remove_stale_locks(&self.dir, &self.owner),
            ..ScanReport::default()
        };
        let mut ns_dirs = Vec::new();
        let mut has_chunks = false;
        for e in fs::read_dir(&self.dir)
            .map_err(CacheError::io("list", &self.dir))?
            .flatten()
        {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            // `file_type` does not follow links: a link named like our directories is not one.
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if name == guard::CHUNK_DIR {
                has_chunks = true;
            } else if namespace::is_dir_name(&name) {
                ns_dirs.push(name);
            }
        }
        // Chunk files first, so entries find theirs.
        let mut chunks: HashMap<ChunkId, Chunk> = HashMap::new();
        let chunks_usable = !has_chunks || guard::check_own_dir(&self.chunk_dir).is_ok();
        if has_chunks {
            for f in self.list_files(&self.chunk_dir, &mut report) {
                if let Some(id) = chunks::parse_file_name(&f.name) {
                    chunks.insert(id, Chunk::Listed(f.bytes));
                }
            }
        }
        for ns in ns_dirs {
            let dir = self.dir.join(&ns);
            for f in self.list_files(&dir, &mut report) {
                if guard::is_entry_name(&f.name) {
                    self.scan_entry(&f.path, &ns, chunks_usable, &mut chunks, &mut report);
                }
            }
        }
        // Chunk files no entry refers to: a crash between a store's chunks and its entry, or
        // entries removed since. Collected once the scan is done.
        let mut ix = self.index();
        for (id, c) in chunks {
            if let Chunk::Listed(bytes) | Chunk::Good(bytes, false) = c {
                ix.add_unreferenced(id, bytes);
            }
        }
        Ok(report)
    }

    /// The regular files of `dir` (one of ours, checked), after removing the temporary files
    /// of owners that died. Other kinds of file are counted and left alone.
    fn list_files(&self, dir: &Path, report: &mut ScanReport) -> Vec<Listed> {
        if let Err(e) = guard::check_own_dir(dir) {
            tracing::warn!(error = %e, "SSD cache directory not scanned");
            return Vec::new();
        }
        let Ok(list) = fs::read_dir(dir) else {
            tracing::warn!(dir = %dir.display(), "cannot list an SSD cache directory");
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in list.flatten() {
            let path = e.path();
            // Only regular files are ours: a directory, FIFO, socket, device or symbolic link
            // (whatever its name) is left alone without a word. `open_regular` checks again
            // after opening, for a file swapped in between.
            let meta = match e.metadata() {
                Ok(m) if m.is_file() => m,
                // Renamed or removed since the listing (a store's `.tmp` file becoming its
                // entry, another process evicting): nothing to skip.
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                _ => {
                    tracing::debug!(path = %path.display(), "not a regular file; skipped");
                    report.skipped_not_files += 1;
                    continue;
                }
            };
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            if name.ends_with(".tmp") {
                let dead = self.owner.liveness_of_tmp(&self.dir, &name) == Some(Liveness::Dead);
                if dead && guard::remove_our_tmp(&path) {
                    report.removed_orphans += 1;
                }
                continue;
            }
            out.push(Listed {
                name,
                path,
                bytes: meta.len(),
            });
        }
        out
    }

    /// Indexes one entry file, with the chunks it refers to; removes it (if ours) when it or
    /// one of its chunks is unusable.
    fn scan_entry(
        &self,
        path: &Path,
        ns_dir: &str,
        chunks_usable: bool,
        chunks: &mut HashMap<ChunkId, Chunk>,
        report: &mut ScanReport,
    ) {
        match scan_file(path, ns_dir, &self.cfg) {
            Ok((header, meta)) => {
                let refs = chunks::refs(&header);
                let mut sizes = Vec::with_capacity(refs.len());
                for r in &refs {
                    let state = match chunks.get(&r.id) {
                        _ if !chunks_usable => Chunk::Unreadable,
                        Some(&c) => c,
                        // Not listed: written since the listing (a store going on), or gone.
                        None => match fs::symlink_metadata(self.chunk_path(r.id)) {
                            Ok(m) if m.is_file() => Chunk::Listed(m.len()),
                            _ => Chunk::Bad,
                        },
                    };
                    let state = match state {
                        Chunk::Listed(_) => {
                            let p = self.chunk_path(r.id);
                            match self.check_chunk(r.id, &p, self.cfg.verify) {
                                Ok(bytes) => Chunk::Good(bytes, false),
                                Err(CacheError::Io { source, .. })
                                    if source.kind() != std::io::ErrorKind::NotFound =>
                                {
                                    tracing::warn!(path = %p.display(), error = %source, "cannot read an SSD cache chunk; its entries are skipped");
                                    Chunk::Unreadable
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, "removing an unusable SSD cache chunk");
                                    if guard::remove_ours(&p, format::CHUNK_MAGIC) {
                                        report.removed_corrupt += 1;
                                    }
                                    Chunk::Bad
                                }
                            }
                        }
                        other => other,
                    };
                    chunks.insert(r.id, state);
                    match state {
                        Chunk::Good(bytes, _) => sizes.push(bytes),
                        _ => break,
                    }
                }
                if sizes.len() < refs.len()
                    && refs
                        .iter()
                        .any(|r| matches!(chunks.get(&r.id), Some(Chunk::Unreadable)))
                {
                    // Skipped, not removed: its chunks are kept for a later scan.
                    for r in &refs {
                        if let Some(Chunk::Good(bytes, _)) = chunks.get(&r.id).copied() {
                            chunks.insert(r.id, Chunk::Good(bytes, true));
                        }
                    }
                    return;
                }
                if sizes.len() < refs.len() {
                    tracing::warn!(path = %path.display(), "removing an SSD cache entry whose chunks are gone or damaged");
                    if guard::remove_ours(path, format::MAGIC) {
                        report.removed_corrupt += 1;
                    }
                    return;
                }
                for (r, &bytes) in refs.iter().zip(&sizes) {
                    chunks.insert(r.id, Chunk::Good(bytes, true));
                }
                let entry = SsdEntry {
                    ns: header.namespace.as_str().into(),
                    tokens: header.tokens.clone().into(),
                    path: path.to_path_buf(),
                    bytes: meta.len(),
                    mtime: meta.modified().unwrap_or(UNIX_EPOCH),
                    trim_floor: header.trim_floor(),
                    checkpoint: header.checkpoint,
                    chunks: refs.iter().map(|r| r.id).collect(),
                };
                let mut ix = self.index();
                // A store during the scan may have indexed this very file already.
                if ix.prefix.exact(&entry.ns, &entry.tokens).is_empty() {
                    ix.insert(entry, &sizes);
                }
            }
            // Removed by another process sharing the directory since the listing.
            Err(CacheError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            }
            Err(CacheError::Io { op, source, .. }) => {
                tracing::warn!(path = %path.display(), op, error = %source, "cannot read an SSD cache file; skipped");
            }
            Err(CacheError::NotAFile { .. }) => {
                tracing::debug!(path = %path.display(), "not a regular file; skipped");
                report.skipped_not_files += 1;
            }
            Err(e) => {
                tracing::warn!(error = %e, "removing an unusable SSD cache file");
                if guard::remove_ours(path, format::MAGIC) {
                    match e {
                        CacheError::UnsupportedVersion { .. } => report.removed_unsupported += 1,
                        CacheError::Mismatch { .. } => report.removed_mismatched += 1,
                        _ => report.removed_corrupt += 1,
                    }
                }
            }
        }
    }
}
