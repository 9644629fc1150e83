//! [`SsdTier::refresh`]: catching up with a directory that other processes write into.
//!
//! The index lives in memory, built by the start-up scan. When several replicas share one
//! directory, each also re-reads it now and then: files it has not indexed are read
//! (header only, as the scan does) and indexed, and indexed files that are gone leave the
//! index. Nothing is removed from disk here except by eviction to the byte cap; a file
//! that cannot be read is skipped and remembered, never deleted (it may belong to a
//! process of another version).
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::PathBuf;
use std::sync::Weak;
use std::time::{Duration, UNIX_EPOCH};

use super::{format::EXTENSION, scan_file, SsdEntry, SsdTier};

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
                "SSD cache refreshed from the shared directory"
            );
        }
    }
}

impl SsdTier {
    /// Re-reads the fingerprint directory: indexes entries written by other processes and
    /// drops entries whose files other processes removed, then evicts to the byte cap.
    pub fn refresh(&self) -> RefreshReport {
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
            match scan_file(path, sub_name, &self.cfg) {
                Ok((header, meta)) => {
                    let entry = SsdEntry {
                        ns: header.namespace.as_str().into(),
                        tokens: header.tokens.clone().into(),
                        path: path.clone(),
                        bytes: meta.len(),
                        mtime: meta.modified().unwrap_or(UNIX_EPOCH),
                        trim_floor: header.trim_floor(),
                        checkpoint: header.checkpoint,
                    };
                    let mut ix = self.index();
                    // A store of ours may have indexed this very file meanwhile.
                    if ix.prefix.exact(&entry.ns, &entry.tokens).is_empty() {
                        ix.insert(entry);
                        report.added += 1;
                    }
                }
                // Removed again since the listing.
                Err(crate::CacheError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
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
        report.evicted = self.evict_to_cap(&mut ix, None);
        report
    }

    /// Every `.wkv` regular file under the fingerprint directory's namespace directories.
    fn list_entry_files(&self) -> HashSet<PathBuf> {
        let mut out = HashSet::new();
        let Ok(subdirs) = fs::read_dir(&self.dir) else {
            return out;
        };
        let suffix = format!(".{EXTENSION}");
        for sub in subdirs.flatten() {
            if !sub.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(files) = fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let is_entry = f.file_name().to_str().is_some_and(|n| n.ends_with(&suffix));
                if is_entry && f.file_type().is_ok_and(|t| t.is_file()) {
                    out.insert(f.path());
                }
            }
        }
        out
    }
}
