//! [`SsdTier::refresh`]: catching up with a directory that other processes write into.
//!
//! The index lives in memory, built by the start-up scan. When several replicas share one
//! directory, each also re-reads it now and then: entry files it has not indexed are read
//! (header only, as the scan does; their chunks are read once, when first referred to) and
//! indexed, and indexed entries that are gone leave the index, so the chunks only they
//! referred to become unreferenced. Nothing is removed from disk here except by eviction to
//! the byte cap and the removal of unreferenced chunks; an entry file that cannot be read is
//! skipped and remembered, never deleted (it may belong to a process of another version).
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::PathBuf;
use std::sync::Weak;
use std::time::{Duration, UNIX_EPOCH};

use super::{chunks, guard, scan_file, SsdEntry, SsdTier};
use crate::namespace;

/// How often a tier opened in the background re-reads its directory.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// What one refresh changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RefreshReport {
    /// Entries other processes wrote, now indexed.
    pub added: usize,
    /// Indexed entries whose files are gone, dropped from the index.
    pub dropped: usize,
    /// Entries evicted to meet the byte cap.
    pub evicted: usize,
    /// Chunk files no entry refers to any more, removed.
    pub removed_chunks: usize,
}

/// Refreshes the tier behind `tier` every [`REFRESH_INTERVAL`] until it is dropped. A
/// timed poll, because a shared (possibly network) filesystem sends no change events.
pub(super) fn keep_fresh(tier: Weak<SsdTier>) {
    loop {
        std::thread::sleep(REFRESH_INTERVAL);
        let Some(t) = tier.upgrade() else { return };
        let report = t.refresh();
        if report != RefreshReport::default() {
            tracing::debug!(
                added = report.added,
                dropped = report.dropped,
                evicted = report.evicted,
                removed_chunks = report.removed_chunks,
                "SSD cache refreshed from the shared directory"
            );
        }
    }
}

impl SsdTier {
    /// Re-reads the fingerprint directory: indexes entries written by other processes and
    /// drops entries whose files other processes removed, then evicts to the byte cap and
    /// removes the chunks no entry refers to any more.
    pub fn refresh(&self) -> RefreshReport {
        let mut report = self.sync_with_disk();
        report.evicted = {
            let mut ix = self.index();
            self.evict_to_cap(&mut ix, None)
        };
        report.removed_chunks = self.collect_garbage();
        report
    }

    /// Indexes entry files not indexed yet and drops indexed ones whose files are gone.
    pub(super) fn sync_with_disk(&self) -> RefreshReport {
        let mut report = RefreshReport::default();
        let listed = self.list_entry_files();
        let known: HashMap<PathBuf, crate::ram::EntryId> = self
            .index()
            .entries
            .iter()
            .map(|(id, e)| (e.path.clone(), *id))
            .collect();
        let mut unreadable = self.unreadable.lock().unwrap_or_else(|p| p.into_inner());
        unreadable.retain(|p| listed.contains(p));
        for path in listed.iter().filter(|p| !known.contains_key(*p)) {
            if unreadable.contains(path) {
                continue;
            }
            let Some(sub_name) = path
                .parent()
                .and_then(|d| d.file_name())
                .and_then(|n| n.to_str())
            else {
                continue;
            };
            let scanned = scan_file(path, sub_name, &self.cfg).and_then(|(header, meta)| {
                // Its chunks: known here, or read once now.
                let refs = chunks::refs(&header);
                let mut sizes = Vec::with_capacity(refs.len());
                for r in &refs {
                    let known = self.index().chunks.get(&r.id).map(|c| c.bytes);
                    let bytes = match known {
                        Some(b) if b > 0 => b,
                        _ => self.check_chunk(r.id, &self.chunk_path(r.id), false)?,
                    };
                    sizes.push(bytes);
                }
                Ok((header, meta, refs, sizes))
            });
            match scanned {
                Ok((header, meta, refs, sizes)) => {
                    let entry = SsdEntry {
                        ns: header.namespace.as_str().into(),
                        tokens: header.tokens.clone().into(),
                        path: path.clone(),
                        bytes: meta.len(),
                        mtime: meta.modified().unwrap_or(UNIX_EPOCH),
                        trim_floor: header.trim_floor(),
                        checkpoint: header.checkpoint,
                        chunks: refs.iter().map(|r| r.id).collect(),
                    };
                    let mut ix = self.index();
                    // A store of ours may have indexed this very file meanwhile.
                    if ix.prefix.exact(&entry.ns, &entry.tokens).is_empty() {
                        ix.insert(entry, &sizes);
                        report.added += 1;
                    }
                }
                // Removed again since the listing.
                Err(crate::CacheError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound && !path.exists() => {}
                Err(e) => {
                    tracing::debug!(error = %e, "SSD cache file not indexed");
                    unreadable.insert(path.clone());
                }
            }
        }
        drop(unreadable);
        let mut ix = self.index();
        for (path, id) in known.iter().filter(|(p, _)| !listed.contains(*p)) {
            // A store of ours may have renamed it into place after the listing.
            if ix.entries.get(id).is_some_and(|e| &e.path == path) && !path.exists() {
                ix.remove(*id);
                report.dropped += 1;
            }
        }
        report
    }

    /// Every entry file (a regular file with an entry's name) under the fingerprint
    /// directory's namespace directories.
    fn list_entry_files(&self) -> HashSet<PathBuf> {
        let mut out = HashSet::new();
        let Ok(subdirs) = fs::read_dir(&self.dir) else {
            return out;
        };
        for sub in subdirs.flatten() {
            let is_ns = sub.file_name().to_str().is_some_and(namespace::is_dir_name);
            if !is_ns || guard::check_own_dir(&sub.path()).is_err() {
                continue;
            }
            let Ok(files) = fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let is_entry = f.file_name().to_str().is_some_and(guard::is_entry_name);
                if is_entry && f.file_type().is_ok_and(|t| t.is_file()) {
                    out.insert(f.path());
                }
            }
        }
        out
    }
}
