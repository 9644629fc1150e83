//! What the callers' handles and the engine thread share: the waiting requests, the
//! count of accepted requests the queue limit is checked against, the counters, the
//! prompt cache and the KV pool.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;

use super::admission::KvAdmission;
use super::cache::EngineCache;
use super::stats::EngineCounters;
use super::{EngineConfig, EngineEvent};
use crate::generation::GenerationRequest;

/// A request accepted by `submit`: waiting for a place in the batch, then carried by the
/// running (or preempted) sequence that serves it.
pub(crate) struct Pending {
    pub id: u64,
    pub request: GenerationRequest,
    pub events: UnboundedSender<EngineEvent>,
    pub cancel: Arc<AtomicBool>,
    pub submitted: Instant,
    /// The request's place in the accepted count; given back when the request is dropped,
    /// or earlier with [`Pending::release`].
    slot: Option<Slot>,
}

impl Pending {
    pub fn new(
        id: u64,
        request: GenerationRequest,
        events: UnboundedSender<EngineEvent>,
        cancel: Arc<AtomicBool>,
        slot: Slot,
    ) -> Self {
        Pending {
            id,
            request,
            events,
            cancel,
            submitted: Instant::now(),
            slot: Some(slot),
        }
    }

    /// Whether the client cancelled or hung up.
    pub fn is_gone(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }

    /// Gives the request's place back before its last event is sent, so a client that
    /// submits again right after it is not refused for a place it just left.
    pub fn release(&mut self) {
        self.slot = None;
    }
}

/// One accepted request's share of [`Shared::accepted`].
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Requests not yet taken by the engine thread.
pub(crate) struct Queue {
    pub waiting: VecDeque<Pending>,
    pub shutting_down: bool,
    pub next_id: u64,
}

/// State shared by the handles and the engine thread.
pub(crate) struct Shared {
    pub queue: Mutex<Queue>,
    pub wake: Condvar,
    /// Requests accepted and not finished: waiting, running or preempted. The queue is
    /// full when this reaches `max_batch + max_queue`, so requests the engine has not
    /// picked up yet never count against free batch places.
    accepted: Arc<AtomicUsize>,
    pub counters: EngineCounters,
    pub config: EngineConfig,
    /// Set when a shutdown's grace period ran out: running requests are cancelled.
    pub abort: AtomicBool,
    /// The prompt cache, when on.
    pub cache: Option<EngineCache>,
    /// The KV block pool and admission figures.
    pub admission: KvAdmission,
    /// Why the engine thread stopped after a panic (`None` while it runs); watched by the
    /// server, which stops answering healthy and exits.
    halted: watch::Sender<Option<String>>,
}

impl Shared {
    pub fn new(config: EngineConfig, cache: Option<EngineCache>, admission: KvAdmission) -> Self {
        Shared {
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                shutting_down: false,
                next_id: 1,
            }),
            wake: Condvar::new(),
            accepted: Arc::new(AtomicUsize::new(0)),
            counters: EngineCounters::default(),
            config,
            abort: AtomicBool::new(false),
            cache,
            admission,
            halted: watch::Sender::new(None),
        }
    }

    /// Records that the engine thread stopped after a panic, and why.
    pub fn halt(&self, reason: String) {
        self.halted.send_replace(Some(reason));
    }

    /// Why the engine thread stopped, if it did.
    pub fn halted(&self) -> Option<String> {
        self.halted.borrow().clone()
    }

    /// A receiver that sees the engine halt.
    pub fn watch_halt(&self) -> watch::Receiver<Option<String>> {
        self.halted.subscribe()
    }

    /// The queue, even after a panic on another thread (the HTTP side must not go down
    /// with the engine thread).
    pub fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more request, if fewer than `max_batch + max_queue` are accepted.
    /// Call with the queue locked, so that concurrent submits cannot both take the last
    /// place.
    pub fn try_slot(&self, _queue: &Queue) -> Option<Slot> {
        let limit = self
            .config
            .max_batch
            .max(1)
            .saturating_add(self.config.max_queue);
        if self.accepted.load(Ordering::Acquire) >= limit {
            return None;
        }
        self.accepted.fetch_add(1, Ordering::AcqRel);
        Some(Slot(self.accepted.clone()))
    }
}
