//! [`Durability`]: turns RAM cache puts into durable SSD entries — the background
//! writer thread, its bounded queue, write-behind with debounce, and `flush`.
//!
//! - Evicted RAM entries are queued as spills (unless the SSD already covers them).
//! - Each put marks its key dirty ([`dirty`]); when the debounce ends and the engine is
//!   idle, the writer takes a host copy of the RAM entry and stores it. While the engine
//!   is busy, dirty keys wait (up to [`Timing::max_defer`]).
//! - Generation checkpoints and their removal go through the same queue, in order, so
//!   a removal always follows the checkpoints written before it.
//! - [`Durability::flush`] waits for the queue, then forces every dirty key one at a
//!   time, and reports whether everything is durable.
//!
//! Nothing here ever fails a request: write errors are counted and warned about.
pub mod dirty;
pub mod queue;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::checkpoint::{CheckpointKey, CheckpointMeta};
use crate::ram::{Evicted, RamTier};
use crate::ssd::{SsdTier, StoreOutcome};
use crate::stats::FlushReport;
use crate::value::{CacheValue, KvSnapshot};
use crate::{CacheError, Result};
use dirty::{DirtyKey, DirtyRecords, Next, Timing};
use queue::{Job, JobKind, WriteQueue};

/// Counters of the writer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DurabilityCounters {
    /// Dirty RAM entries not yet durable.
    pub pending_snapshots: usize,
    /// Jobs queued or being written.
    pub pending_spills: usize,
    /// Bytes of queued jobs.
    pub pending_spill_bytes: u64,
    /// Jobs dropped because the queue was full, all time.
    pub dropped_spills: u64,
    /// Jobs whose write failed, all time.
    pub failed_spills: u64,
    /// Generation checkpoints written, all time.
    pub checkpoints_saved: u64,
}

struct WriterState<V> {
    queue: WriteQueue<V>,
    in_flight: Option<u64>,
    dirty: DirtyRecords,
    shutdown: bool,
    dropped: u64,
    failed: u64,
    checkpoints_saved: u64,
}

struct Shared<V> {
    ram: Arc<Mutex<RamTier<V>>>,
    ssd: Arc<SsdTier>,
    state: Mutex<WriterState<V>>,
    /// Wakes the writer (new job, new dirty key, engine idle, shutdown).
    wake: Condvar,
    /// Wakes flushers (a job finished).
    done: Condvar,
    busy: AtomicBool,
    timing: Timing,
    write_behind: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V> Shared<V> {
    fn state(&self) -> MutexGuard<'_, WriterState<V>> {
        lock(&self.state)
    }
}

/// The writer and its state.
pub struct Durability<V: CacheValue> {
    shared: Arc<Shared<V>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    flush_lock: Mutex<()>,
}

impl<V: CacheValue> Durability<V> {
    /// Starts the writer thread.
    pub fn start(
        ram: Arc<Mutex<RamTier<V>>>,
        ssd: Arc<SsdTier>,
        timing: Timing,
        write_behind: bool,
        queue_bytes: usize,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            ram,
            ssd,
            state: Mutex::new(WriterState {
                queue: WriteQueue::new(queue_bytes),
                in_flight: None,
                dirty: DirtyRecords::default(),
                shutdown: false,
                dropped: 0,
                failed: 0,
                checkpoints_saved: 0,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            busy: AtomicBool::new(false),
            timing,
            write_behind,
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("wick-ssd-writer".into())
            .spawn(move || run(&worker))
            .map_err(|e| CacheError::Config(format!("cannot start the SSD writer thread: {e}")))?;
        Ok(Durability {
            shared,
            thread: Mutex::new(Some(thread)),
            flush_lock: Mutex::new(()),
        })
    }

    /// Tells the writer whether the engine is computing (write-behind waits for idle).
    pub fn set_busy(&self, busy: bool) {
        let was = self.shared.busy.swap(busy, Ordering::Relaxed);
        if was && !busy {
            self.shared.wake.notify_all();
        }
    }

    /// A RAM put of `tokens` under `ns`: it is dirty until on disk; with write-behind
    /// on, it is snapshotted after the debounce, else at the next flush.
    pub fn schedule(&self, ns: Arc<str>, tokens: Arc<[u32]>) {
        let mut st = self.shared.state();
        st.dirty
            .schedule(DirtyKey { ns, tokens }, Instant::now(), &self.shared.timing);
        drop(st);
        self.shared.wake.notify_all();
    }

    fn push(&self, kind: JobKind<V>, bytes: usize, droppable: bool) -> u64 {
        let mut st = self.shared.state();
        let (seq, dropped) = st.queue.push(kind, bytes, droppable);
        if !dropped.is_empty() {
            st.dropped += dropped.len() as u64;
            tracing::warn!(
                dropped = dropped.len(),
                "SSD write queue full: dropped the oldest pending writes"
            );
        }
        drop(st);
        self.shared.wake.notify_all();
        seq
    }

    /// Queues an evicted RAM entry for the SSD, unless the SSD already covers it.
    pub fn spill(&self, e: Evicted<V>) {
        if self.shared.ssd.covers(&e.ns, &e.tokens) {
            return;
        }
        let bytes = e.value.byte_size();
        self.push(
            JobKind::Spill {
                ns: e.ns,
                tokens: e.tokens,
                value: e.value,
            },
            bytes,
            true,
        );
    }

    /// Queues a generation checkpoint.
    pub fn checkpoint(
        &self,
        key: CheckpointKey,
        meta: CheckpointMeta,
        tokens: Arc<[u32]>,
        host: KvSnapshot,
    ) {
        let bytes = host.byte_size();
        self.push(
            JobKind::Checkpoint {
                key,
                meta,
                tokens,
                host,
            },
            bytes,
            true,
        );
    }

    /// Queues the removal of a generation's checkpoints (after any queued before it).
    pub fn remove_checkpoints(&self, key: CheckpointKey) {
        self.push(JobKind::RemoveCheckpoints { key }, 0, false);
    }

    /// Counters.
    pub fn counters(&self) -> DurabilityCounters {
        let st = self.shared.state();
        DurabilityCounters {
            pending_snapshots: st.dirty.len(),
            pending_spills: st.queue.len() + usize::from(st.in_flight.is_some()),
            pending_spill_bytes: st.queue.bytes() as u64,
            dropped_spills: st.dropped,
            failed_spills: st.failed,
            checkpoints_saved: st.checkpoints_saved,
        }
    }

    /// Waits until every job numbered up to `seq` is written or dropped.
    fn wait_resolved(&self, seq: u64, deadline: Instant) -> bool {
        let mut st = self.shared.state();
        loop {
            let queued = st.queue.first_seq().is_some_and(|f| f <= seq);
            let writing = st.in_flight.is_some_and(|s| s <= seq);
            if !queued && !writing {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self
                .shared
                .done
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Makes everything durable, or says what is not, within `timeout`:
    /// 1. waits for every queued write;
    /// 2. writes each dirty RAM entry, one at a time (bounded extra memory);
    /// 3. reconciles entries that left RAM but are now covered on disk.
    ///
    /// Dirty entries that left RAM uncovered (their spill was dropped or failed) can
    /// never become durable: they are reported as missing once and forgotten.
    pub fn flush(&self, timeout: Duration) -> FlushReport {
        let _single = lock(&self.flush_lock);
        let started = Instant::now();
        let deadline = started + timeout;
        let (dropped0, failed0) = {
            let st = self.shared.state();
            (st.dropped, st.failed)
        };
        let mark = self.shared.state().queue.next_seq() - 1;
        let mut timed_out = !self.wait_resolved(mark, deadline);
        let keys = self.shared.state().dirty.keys();
        let mut flushed = 0;
        let mut missing = Vec::new();
        for key in keys {
            if timed_out || Instant::now() >= deadline {
                timed_out = true;
                break;
            }
            if !self.shared.state().dirty.keys().contains(&key) {
                continue;
            }
            if self.shared.ssd.covers(&key.ns, &key.tokens) {
                self.shared.state().dirty.clear(&key);
                continue;
            }
            let host = lock(&self.shared.ram).host_exact(&key.ns, &key.tokens);
            match host {
                None => missing.push(key),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "cannot copy a cache entry for the SSD");
                    self.shared.state().failed += 1;
                }
                Some(Ok(host)) => {
                    let bytes = host.byte_size();
                    let seq = self.push(
                        JobKind::Snapshot {
                            ns: key.ns.clone(),
                            tokens: key.tokens.clone(),
                            host,
                        },
                        bytes,
                        false,
                    );
                    timed_out = !self.wait_resolved(seq, deadline);
                    flushed += 1;
                }
            }
        }
        let mut missing_n = 0;
        {
            let mut st = self.shared.state();
            for key in &missing {
                if self.shared.ssd.covers(&key.ns, &key.tokens) {
                    st.dirty.clear(key);
                } else if st.dirty.keys().contains(key) {
                    st.dirty.clear(key);
                    missing_n += 1;
                }
            }
        }
        let c = self.counters();
        let dropped = c.dropped_spills - dropped0;
        let failed = c.failed_spills - failed0;
        FlushReport {
            enabled: true,
            durable: !timed_out
                && c.pending_snapshots == 0
                && c.pending_spills == 0
                && dropped == 0
                && failed == 0
                && missing_n == 0,
            timed_out,
            flushed_snapshots: flushed,
            missing_snapshots: missing_n,
            elapsed_ms: started.elapsed().as_millis() as u64,
            pending_snapshots: c.pending_snapshots,
            pending_spills: c.pending_spills,
            pending_spill_bytes: c.pending_spill_bytes,
            dropped_spills: dropped,
            failed_spills: failed,
        }
    }
}

impl<V: CacheValue> Drop for Durability<V> {
    fn drop(&mut self) {
        self.shared.state().shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// What the writer picked up.
enum Work<V> {
    Job(Job<V>),
    WriteBehind(DirtyKey),
}

/// The writer thread: queued jobs first, then due write-behind keys; sleeps otherwise.
fn run<V: CacheValue>(shared: &Shared<V>) {
    loop {
        let work = {
            let mut st = shared.state();
            loop {
                if let Some(job) = st.queue.pop() {
                    st.in_flight = Some(job.seq);
                    break Work::Job(job);
                }
                if st.shutdown {
                    return;
                }
                let busy = shared.busy.load(Ordering::Relaxed);
                let next = if shared.write_behind {
                    st.dirty.next(Instant::now(), busy, &shared.timing)
                } else {
                    Next::Wait(None)
                };
                match next {
                    Next::Due(key) => break Work::WriteBehind(key),
                    Next::Wait(Some(d)) => {
                        st = shared
                            .wake
                            .wait_timeout(st, d)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    Next::Wait(None) => {
                        st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner());
                    }
                }
            }
        };
        match work {
            Work::Job(job) => {
                let seq = job.seq;
                run_job(shared, job);
                let mut st = shared.state();
                if st.in_flight == Some(seq) {
                    st.in_flight = None;
                }
                drop(st);
                shared.done.notify_all();
            }
            Work::WriteBehind(key) => write_behind(shared, key),
        }
    }
}

/// Stores a host copy; on success clears every dirty key the new entry covers.
fn store<V>(shared: &Shared<V>, ns: &str, tokens: &[u32], host: &KvSnapshot) -> bool {
    match shared.ssd.store(ns, tokens, host, None) {
        Ok(outcome) => {
            let floor = match outcome {
                StoreOutcome::Stored { .. } => host.trim_floor(),
                // Covered by a longer entry on disk: this key at least is done.
                StoreOutcome::AlreadyDurable => tokens.len(),
            };
            shared.state().dirty.clear_covered(ns, tokens, floor);
            true
        }
        Err(_) => {
            shared.state().failed += 1;
            false
        }
    }
}

fn run_job<V: CacheValue>(shared: &Shared<V>, job: Job<V>) {
    match job.kind {
        JobKind::Spill { ns, tokens, value } => match value.to_host() {
            Ok(host) => {
                drop(value);
                store(shared, &ns, &tokens, &host);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot copy an evicted cache entry for the SSD");
                shared.state().failed += 1;
            }
        },
        JobKind::Snapshot { ns, tokens, host } => {
            if !store(shared, &ns, &tokens, &host) {
                let key = DirtyKey { ns, tokens };
                shared
                    .state()
                    .dirty
                    .failed(&key, Instant::now(), &shared.timing);
            }
        }
        JobKind::Checkpoint {
            key,
            meta,
            tokens,
            host,
        } => match shared
            .ssd
            .store(&key.namespace(), &tokens, &host, Some(&meta))
        {
            Ok(_) => shared.state().checkpoints_saved += 1,
            Err(_) => shared.state().failed += 1,
        },
        JobKind::RemoveCheckpoints { key } => {
            shared.ssd.remove_checkpoints(key);
        }
    }
}

fn write_behind<V: CacheValue>(shared: &Shared<V>, key: DirtyKey) {
    if shared.ssd.covers(&key.ns, &key.tokens) {
        shared.state().dirty.clear(&key);
        return;
    }
    let host = lock(&shared.ram).host_exact(&key.ns, &key.tokens);
    match host {
        None => shared.state().dirty.missing(&key),
        Some(Err(e)) => {
            tracing::warn!(error = %e, "cannot copy a cache entry for the SSD");
            shared
                .state()
                .dirty
                .failed(&key, Instant::now(), &shared.timing);
        }
        Some(Ok(host)) => {
            if !store(shared, &key.ns, &key.tokens, &host) {
                shared
                    .state()
                    .dirty
                    .failed(&key, Instant::now(), &shared.timing);
            }
        }
    }
}
