//! A persistent thread pool tuned for many short parallel sections (a decode step runs a
//! few hundred of a few microseconds each).
//!
//! Workers spin for a short while after each job, then yield, then park, so back-to-back
//! jobs start within a microsecond while an idle pool costs nothing. A job is *open*
//! while its caller works on it: a worker that wakes late finds it closed and skips it,
//! so the caller never waits for a descheduled or sleeping worker — only for those that
//! actually joined. Work inside a job is split by the job itself (usually an atomic
//! counter), which keeps a job correct whatever number of threads end up joining.
use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::hint::spin_loop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// Bits of the job word: `epoch << 17 | open << 16 | joined workers`.
const JOINED: u64 = 0xFFFF;
const OPEN: u64 = 1 << 16;
const EPOCH_ONE: u64 = 1 << 17;

/// How long an idle worker spins before yielding, unless `WICK_SPIN_US` says otherwise.
const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Yields between spinning and parking.
const YIELDS: u32 = 64;

thread_local! {
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

type JobFn = dyn Fn(usize) + Sync;

struct Shared {
    word: AtomicU64,
    job: UnsafeCell<Option<*const JobFn>>,
    parked: Vec<AtomicBool>,
    handles: OnceLock<Vec<Thread>>,
    stop: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    spin: Duration,
    /// Set by [`ThreadPool::rest`]: idle workers park at once instead of spinning.
    rest: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `caller` while no worker is joined
// (the job is closed), and read only by joined workers.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fixed set of worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: usize,
    caller: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool running jobs on `threads` threads in total (the caller and `threads − 1`
    /// workers).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let spin = std::env::var("WICK_SPIN_US")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(DEFAULT_SPIN, Duration::from_micros);
        let shared = Arc::new(Shared {
            word: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            parked: (1..threads).map(|_| AtomicBool::new(false)).collect(),
            handles: OnceLock::new(),
            stop: AtomicBool::new(false),
            rest: AtomicBool::new(false),
            panic: Mutex::new(None),
            spin,
        });
        let workers: Vec<JoinHandle<()>> = (1..threads)
            .filter_map(|id| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("wick-kernel-{id}"))
                    .spawn(move || worker(&shared, id))
                    .ok()
            })
            .collect();
        let _ = shared
            .handles
            .set(workers.iter().map(|w| w.thread().clone()).collect());
        ThreadPool {
            threads: workers.len() + 1,
            shared,
            caller: Mutex::new(()),
            workers,
        }
    }

    /// The process-wide pool: `WICK_THREADS` threads, else one per available CPU.
    pub fn global() -> &'static ThreadPool {
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::env::var("WICK_THREADS")
                .ok()
                .and_then(|s| s.parse().ok())
                .filter(|&n| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            ThreadPool::new(n)
        })
    }

    /// Threads a job may run on (including the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Tells idle workers to sleep now rather than spin for the next job: call before
    /// the caller hands the CPUs to other work for a while (e.g. another thread pool),
    /// so spinning workers do not take cores from it. The next [`ThreadPool::run`]
    /// wakes them.
    pub fn rest(&self) {
        self.shared.rest.store(true, Ordering::Relaxed);
    }

    /// Runs `f(thread_index)` on the caller (index 0) and on every worker that joins in
    /// time. `f` must split its work so that any subset of threads completes it (e.g. an
    /// atomic counter over chunks). Nested calls, and calls while another thread uses the
    /// pool, run `f(0)` alone.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 || IN_JOB.with(|c| c.get()) {
            return f(0);
        }
        let Ok(_guard) = self.caller.try_lock() else {
            return f(0);
        };
        let sh = &*self.shared;
        // SAFETY: the job is closed (no worker joined), and we are the only caller. The
        // lifetime is erased; we wait below until no worker can still see `f`.
        unsafe {
            let p: *const JobFn = std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static JobFn>(f);
            *sh.job.get() = Some(p);
        }
        sh.rest.store(false, Ordering::Relaxed);
        let epoch = (sh.word.load(Ordering::Relaxed) & !(JOINED | OPEN)) + EPOCH_ONE;
        sh.word.store(epoch | OPEN, Ordering::SeqCst);
        if let Some(handles) = sh.handles.get() {
            for (parked, h) in sh.parked.iter().zip(handles) {
                if parked.load(Ordering::SeqCst) {
                    h.unpark();
                }
            }
        }
        IN_JOB.with(|c| c.set(true));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        IN_JOB.with(|c| c.set(false));
        // Close the job, then wait for the workers that joined.
        sh.word.fetch_and(!OPEN, Ordering::SeqCst);
        let mut spins = 0u32;
        while sh.word.load(Ordering::Acquire) & JOINED != 0 {
            spins += 1;
            if spins < 4096 {
                spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: closed and no worker joined: nobody reads the job any more.
        unsafe { *sh.job.get() = None };
        let worker_panic = sh.panic.lock().map(|mut p| p.take()).unwrap_or(None);
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
        if let Some(p) = worker_panic {
            std::panic::resume_unwind(p);
        }
    }
}

fn worker(sh: &Shared, id: usize) {
    IN_JOB.with(|c| c.set(true));
    let mut seen = sh.word.load(Ordering::Acquire) & !(JOINED | OPEN);
    loop {
        // Wait for a new epoch.
        let start = Instant::now();
        let mut spins = 0u32;
        let mut yields = 0u32;
        let word = loop {
            let w = sh.word.load(Ordering::Acquire);
            if w & !(JOINED | OPEN) != seen {
                break w;
            }
            if sh.stop.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            let resting = sh.rest.load(Ordering::Relaxed);
            if !resting && (!spins.is_multiple_of(256) || start.elapsed() < sh.spin) {
                spin_loop();
            } else if !resting && yields < YIELDS {
                yields += 1;
                std::thread::yield_now();
            } else {
                sh.parked[id - 1].store(true, Ordering::SeqCst);
                let w = sh.word.load(Ordering::SeqCst);
                if w & !(JOINED | OPEN) == seen && !sh.stop.load(Ordering::SeqCst) {
                    std::thread::park();
                }
                sh.parked[id - 1].store(false, Ordering::SeqCst);
            }
        };
        seen = word & !(JOINED | OPEN);
        // Join if the job is still open.
        let mut w = word;
        let joined = loop {
            if w & !(JOINED | OPEN) != seen || w & OPEN == 0 {
                break false;
            }
            match sh
                .word
                .compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break true,
                Err(now) => w = now,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: joined an open job: the caller keeps `f` alive until we leave.
        let job = unsafe { *sh.job.get() };
        if let Some(f) = job {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*f)(id) }));
            if let Err(p) = r {
                if let Ok(mut slot) = sh.panic.lock() {
                    slot.get_or_insert(p);
                }
            }
        }
        sh.word.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_chunk_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for round in 0..2000 {
            let n = 1 + round % 97;
            let next = AtomicUsize::new(0);
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|_| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn jobs_after_a_long_idle_still_run() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(30));
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        pool.rest();
        std::thread::sleep(Duration::from_millis(1));
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert!(count.load(Ordering::Relaxed) >= 3);
    }

    #[test]
    fn nested_runs_execute_inline() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            pool.run(&|i| {
                assert_eq!(i, 0);
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert!(count.load(Ordering::Relaxed) >= 1);
    }

    #[test]
    fn a_panicking_job_propagates_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|_| panic!("boom"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert!(count.load(Ordering::Relaxed) >= 1);
    }
}
