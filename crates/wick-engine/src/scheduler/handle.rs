//! The caller's side of the engine: starting it, submitting requests, reading a
//! request's events, stats and shutdown.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::admission::KvAdmission;
use super::cache::EngineCache;
use super::queue::{Pending, Shared};
use super::stats::EngineStats;
use super::{EngineConfig, EngineEvent, FlushReport, ScanReport};
use crate::generation::GenerationRequest;
use crate::model::Model;
use crate::EngineError;

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The request itself is invalid (too long for the context, bad parameters …).
    #[error(transparent)]
    Invalid(#[from] EngineError),
    /// Too many requests are waiting.
    #[error("the request queue is full ({limit} waiting); retry later")]
    QueueFull {
        /// The configured limit.
        limit: usize,
    },
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The engine thread stopped after an internal error (a panic); nothing runs until the
    /// process is restarted.
    #[error("{reason}")]
    Halted {
        /// What stopped it.
        reason: String,
    },
}

/// Starts engine loops.
pub struct Engine;

impl Engine {
    /// Starts the engine thread for `model`.
    ///
    /// With an SSD cache directory this opens and scans it first (a directory another
    /// process holds, or one that cannot be created, is an error).
    pub fn start(model: Arc<Model>, config: EngineConfig) -> Result<EngineHandle, EngineError> {
        if let Some(draft) = &config.draft_model {
            // The same checks as building it: a config assembled by hand is refused too.
            crate::speculative::DraftModel::new(&model, draft.0.clone())?;
            if config.speculative.is_none() {
                return Err(EngineError::DraftModel(format!(
                    "{} is set as the draft model but speculative decoding is off",
                    draft.0.info().name
                )));
            }
            tracing::info!(draft = %draft.0.info().name, "speculative decoding with a draft model");
        }
        let share = config
            .draft_model
            .as_ref()
            .map_or(1.0, |d| d.target_share(&model));
        let cache = EngineCache::new(&model, &config, share)?;
        let admission = KvAdmission::new(
            &model,
            config.kv_budget,
            config.step_token_budget,
            config.prompt_cache_bytes,
            share,
        )?;
        tracing::info!(
            weights_mib = model.info().weight_bytes / (1 << 20),
            "{}",
            admission.describe(&model)
        );
        let shared = Arc::new(Shared::new(config, cache, admission));
        let loop_shared = shared.clone();
        let loop_model = model.clone();
        let thread = std::thread::Builder::new()
            .name("wick-engine".into())
            .spawn(move || super::engine_loop::run(&loop_model, &loop_shared))
            .map_err(|e| EngineError::Backend {
                backend: "engine",
                message: format!("cannot start the engine thread: {e}"),
            })?;
        Ok(EngineHandle {
            shared,
            model,
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }
}

/// A cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
    model: Arc<Model>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic on the engine thread must not take the HTTP side down with it.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl EngineHandle {
    /// The model the engine runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Validates and queues a request. Never blocks on model work.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        self.model.check_request(&request)?;
        self.shared.admission.check(&request)?;
        let (tx, rx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = {
            let mut q = self.shared.lock_queue();
            if let Some(reason) = self.shared.halted() {
                return Err(SubmitError::Halted { reason });
            }
            if q.shutting_down {
                return Err(SubmitError::ShuttingDown);
            }
            // Requests the engine has not picked up yet take free batch places first:
            // only those beyond the batch count against `max_queue`.
            let Some(slot) = self.shared.try_slot(&q) else {
                return Err(SubmitError::QueueFull {
                    limit: self.shared.config.max_queue,
                });
            };
            let id = q.next_id;
            q.next_id += 1;
            q.waiting
                .push_back(Pending::new(id, request, tx, cancel.clone(), slot));
            self.shared
                .counters
                .queued
                .store(q.waiting.len(), Ordering::Relaxed);
            id
        };
        self.shared.wake.notify_one();
        Ok(RequestHandle {
            id,
            events: rx,
            cancel,
        })
    }

    /// Why the engine thread stopped after an internal error (a panic), if it did: every
    /// request then in flight or waiting has failed with this reason, and every later
    /// submit is refused with it. A server stops reporting healthy and exits.
    pub fn halted(&self) -> Option<String> {
        self.shared.halted()
    }

    /// Resolves with [`EngineHandle::halted`]'s reason once the engine thread stops after
    /// a panic; never while it runs.
    pub async fn wait_halted(&self) -> String {
        let mut watch = self.shared.watch_halt();
        let reason = watch
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|r| r.clone());
        match reason {
            Some(reason) => reason,
            // The sender lives as long as this handle's shared state: not reached.
            None => std::future::pending().await,
        }
    }

    /// Current counters, the prompt cache's included.
    pub fn stats(&self) -> EngineStats {
        let mut stats = self.shared.counters.snapshot();
        if let Some(cache) = &self.shared.cache {
            stats.prompt_cache = cache.tiers.stats();
        }
        stats.kv_pool = self.kv_pool_stats();
        stats
    }

    /// The KV block pool's figures.
    pub fn kv_pool_stats(&self) -> super::KvPoolStats {
        let a = &self.shared.admission;
        super::KvPoolStats::from_usage(
            a.pool.usage(),
            a.bounded,
            a.block_bytes,
            a.max_sequence_tokens,
        )
    }

    /// The longest sequence (prompt + generated tokens) a request may ask for: the
    /// model's context, or less when the KV memory budget cannot hold that much.
    pub fn max_sequence_tokens(&self) -> usize {
        self.shared.admission.max_sequence_tokens
    }

    /// Makes every prompt-cache entry durable on the SSD tier within `timeout`: waits
    /// for pending writes, then writes each RAM entry not yet on disk. `durable` in the
    /// report is true only when everything is on disk (answer `POST /admin/cache/flush`
    /// with 200 then, 503 otherwise). Without an SSD tier nothing needs flushing:
    /// `enabled` is false and `durable` true. Safe to call while requests run, and after
    /// [`EngineHandle::shutdown`] (the shutdown path: drain, then flush).
    pub fn flush_cache(&self, timeout: Duration) -> FlushReport {
        match &self.shared.cache {
            Some(cache) => cache.flush(timeout),
            None => FlushReport {
                enabled: false,
                durable: true,
                ..FlushReport::default()
            },
        }
    }

    /// What the SSD tier's start-up scan found (`None` without an SSD tier). The scan runs
    /// in the background from the engine's start on; this waits for it to finish.
    pub fn cache_scan_report(&self) -> Option<ScanReport> {
        let cache = self.shared.cache.as_ref()?;
        cache.wait_for_scan(Duration::from_secs(86_400))
    }

    /// Waits up to `timeout` for the SSD tier's start-up scan; its report, or `None` without
    /// an SSD tier or while it is still running.
    pub fn wait_for_cache_scan(&self, timeout: Duration) -> Option<ScanReport> {
        let cache = self.shared.cache.as_ref()?;
        cache.wait_for_scan(timeout)
    }

    /// Whether the SSD tier's start-up scan is still indexing entries (lookups meanwhile
    /// miss the entries it has not reached).
    pub fn cache_scanning(&self) -> bool {
        self.shared.cache.as_ref().is_some_and(|c| c.is_scanning())
    }

    /// The fingerprint directory of the SSD tier, if any.
    pub fn ssd_cache_path(&self) -> Option<std::path::PathBuf> {
        self.shared
            .cache
            .as_ref()
            .and_then(|c| c.tiers.ssd().map(|s| s.dir().to_path_buf()))
    }

    /// Stops accepting requests, fails the waiting ones, lets running ones finish for up
    /// to `grace`, then cancels what is left. Returns whether everything finished in time.
    pub fn shutdown(&self, grace: Duration) -> bool {
        {
            let mut q = self.shared.lock_queue();
            q.shutting_down = true;
            for p in q.waiting.drain(..) {
                let _ = p
                    .events
                    .send(EngineEvent::Failed("the server is shutting down".into()));
            }
            self.shared.counters.queued.store(0, Ordering::Relaxed);
        }
        self.shared.wake.notify_all();
        let Some(thread) = lock(&self.thread).take() else {
            return true;
        };
        let deadline = Instant::now() + grace;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let in_time = thread.is_finished();
        if !in_time {
            self.shared.abort.store(true, Ordering::Relaxed);
            self.shared.wake.notify_all();
        }
        let _ = thread.join();
        in_time
    }
}

/// One submitted request: its events, and cancellation when dropped.
pub struct RequestHandle {
    id: u64,
    events: UnboundedReceiver<EngineEvent>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// The engine's id for the request.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        self.events.recv().await
    }

    /// The next event, blocking the thread (not for use inside an async runtime).
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        self.events.blocking_recv()
    }

    /// Asks the engine to stop this request (also done on drop).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}
