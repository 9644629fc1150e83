//! The downloads of this process, recent and running, as `GET /downloads` shows them.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Finished downloads kept (the running ones are always kept).
const KEEP: usize = 5;

/// Where a download is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DownloadState {
    /// Running.
    Active,
    /// Finished.
    Done,
    /// Failed.
    Error,
}

/// One download's progress.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DownloadStatus {
    /// `ORG/NAME`.
    pub repo_id: String,
    /// Running, done or failed.
    pub state: DownloadState,
    /// The file that last received bytes.
    pub current_file: Option<String>,
    /// Bytes in the cache for the selected files (those already there included).
    pub received_bytes: u64,
    /// Bytes of the selected files.
    pub total_bytes: u64,
    /// Files verified and in place.
    pub files_done: usize,
    /// Files selected.
    pub files_total: usize,
    /// Receive rate over about the last 5 seconds.
    pub bytes_per_sec: f64,
    /// Unix seconds.
    pub started_at: f64,
    /// Unix seconds, once finished.
    pub finished_at: Option<f64>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

struct Entry {
    status: DownloadStatus,
    samples: VecDeque<(Instant, u64)>,
}

static REGISTRY: Mutex<Vec<Arc<Mutex<Entry>>>> = Mutex::new(Vec::new());

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The recent downloads, newest first: every running one and the last few finished.
pub fn recent_downloads() -> Vec<DownloadStatus> {
    let list = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    list.iter()
        .rev()
        .map(|e| {
            let e = e.lock().unwrap_or_else(PoisonError::into_inner);
            let mut s = e.status.clone();
            s.bytes_per_sec = rate(&e.samples);
            s
        })
        .collect()
}

fn rate(samples: &VecDeque<(Instant, u64)>) -> f64 {
    match (samples.front(), samples.back()) {
        (Some((t0, b0)), Some((t1, b1))) if t1 > t0 => {
            // Nothing received for a while: the rate is 0, not the old average.
            if t1.elapsed().as_secs_f64() > 5.0 {
                return 0.0;
            }
            (b1 - b0) as f64 / (*t1 - *t0).as_secs_f64()
        }
        _ => 0.0,
    }
}

/// Handle a download updates.
pub(crate) struct Tracker(Arc<Mutex<Entry>>);

pub(crate) fn start(repo: &str) -> Tracker {
    let entry = Arc::new(Mutex::new(Entry {
        status: DownloadStatus {
            repo_id: repo.to_string(),
            state: DownloadState::Active,
            current_file: None,
            received_bytes: 0,
            total_bytes: 0,
            files_done: 0,
            files_total: 0,
            bytes_per_sec: 0.0,
            started_at: now(),
            finished_at: None,
            error: None,
        },
        samples: VecDeque::new(),
    }));
    let mut list = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    list.push(entry.clone());
    // Drop the oldest finished ones beyond KEEP.
    let finished = list
        .iter()
        .filter(|e| {
            e.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .status
                .state
                != DownloadState::Active
        })
        .count();
    let mut excess = finished.saturating_sub(KEEP);
    list.retain(|e| {
        let done = e
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .status
            .state
            != DownloadState::Active;
        if done && excess > 0 {
            excess -= 1;
            false
        } else {
            true
        }
    });
    Tracker(entry)
}

impl Tracker {
    fn with(&self, f: impl FnOnce(&mut Entry)) {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub(crate) fn plan(&self, files: usize, total: u64, present: u64) {
        self.with(|e| {
            e.status.files_total = files;
            e.status.total_bytes = total;
            e.status.received_bytes = present;
        });
    }

    pub(crate) fn add_bytes(&self, file: &str, n: u64) {
        self.with(|e| {
            e.status.received_bytes += n;
            if e.status.current_file.as_deref() != Some(file) {
                e.status.current_file = Some(file.to_string());
            }
            let t = Instant::now();
            e.samples.push_back((t, e.status.received_bytes));
            while e.samples.len() > 2
                && e.samples
                    .front()
                    .is_some_and(|(t0, _)| t.duration_since(*t0).as_secs_f64() > 5.0)
            {
                e.samples.pop_front();
            }
        });
    }

    pub(crate) fn file_done(&self) {
        self.with(|e| e.status.files_done += 1);
    }

    pub(crate) fn finish(&self, error: Option<String>) {
        self.with(|e| {
            e.status.finished_at = Some(now());
            e.status.state = if error.is_some() {
                DownloadState::Error
            } else {
                DownloadState::Done
            };
            e.status.error = error;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_download_is_listed_while_running_and_after() {
        let t = start("org/registry-test");
        t.plan(2, 100, 10);
        t.add_bytes("a.bin", 40);
        let row = recent_downloads()
            .into_iter()
            .find(|d| d.repo_id == "org/registry-test")
            .unwrap();
        assert_eq!(row.state, DownloadState::Active);
        assert_eq!(row.received_bytes, 50);
        assert_eq!(row.current_file.as_deref(), Some("a.bin"));
        t.file_done();
        t.finish(Some("boom".into()));
        let row = recent_downloads()
            .into_iter()
            .find(|d| d.repo_id == "org/registry-test")
            .unwrap();
        assert_eq!(row.state, DownloadState::Error);
        assert_eq!(row.files_done, 1);
        assert!(row.finished_at.is_some());
        let json = serde_json::to_value(&row).unwrap();
        assert_eq!(json["state"], "error");
        assert_eq!(json["error"], "boom");
    }
}
