//! The connection loop: HTTP/1.1 over hyper with a header-read timeout (which is also the
//! keep-alive idle timeout), a cap on open connections and a graceful close.
//!
//! Past the cap the longest-idle connection (one with no request in progress: a
//! half-open socket, a client keeping an idle connection) is closed to make room, so a
//! flood of idle sockets can delay a real client by one accept, not lock it out. When every
//! connection is busy, new ones wait in the kernel's backlog until one finishes.
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};

use crate::config::ServerConfig;

/// File descriptors kept free for everything but client sockets (model files, the SSD
/// cache, logs).
const RESERVED_FDS: u64 = 64;

/// How long an accept waits for an evicted connection to close before evicting another.
const EVICT_WAIT: Duration = Duration::from_millis(100);

/// How long a closing connection keeps reading (and dropping) what its client still sends,
/// so the client gets the answer rather than a reset ([`linger`]).
const LINGER_TIME: Duration = Duration::from_secs(5);

/// … and how long it waits for more (a client that keeps an idle connection open sends
/// nothing, and is not waited for longer).
const LINGER_IDLE: Duration = Duration::from_secs(1);

/// Pause after an accept error that is not about one connection (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The connection settings taken from [`ServerConfig`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most (already lowered to what the descriptor limit allows).
    pub max_connections: usize,
    /// Time a connection has to send a request's headers, from its opening or its previous
    /// answer.
    pub header_timeout: Duration,
}

impl Limits {
    /// The limits of `config`, the cap lowered to what the process's descriptor limit
    /// leaves (with a warning).
    pub fn from_config(config: &ServerConfig) -> Limits {
        let mut max_connections = config.max_connections.clamp(1, Semaphore::MAX_PERMITS);
        if let Some(soft) = fd_soft_limit() {
            let room = soft.saturating_sub(RESERVED_FDS).max(1);
            if (max_connections as u64) > room {
                tracing::warn!(
                    max_connections,
                    fd_limit = soft,
                    "--max-connections lowered to what the open-file limit leaves"
                );
                max_connections = room as usize;
            }
        }
        Limits {
            max_connections,
            header_timeout: config.header_timeout,
        }
    }
}

/// The soft `RLIMIT_NOFILE`, where there is one.
fn fd_soft_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit struct through a valid pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0
            && limit.rlim_cur != libc::RLIM_INFINITY
        {
            // `rlim_t` is not `u64` on every target.
            #[allow(clippy::unnecessary_cast)]
            return Some(limit.rlim_cur as u64);
        }
    }
    None
}

/// Raises the soft open-file limit to the hard one, so the connection cap, not the
/// descriptor table, bounds the connections (Go and Node do the same).
pub fn raise_fd_limit() {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit read and write one rlimit struct via valid pointers.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0
                || limit.rlim_cur >= limit.rlim_max
            {
                return;
            }
            let wanted = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                tracing::debug!("could not raise the open-file limit");
            }
        }
    }
}

/// Asks the kernel for a longer accept queue than the standard library's, so a burst of
/// connections waits there instead of being refused.
pub fn widen_backlog(listener: &std::net::TcpListener) {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: listen() on a socket we own and that is already listening only
        // changes its backlog (capped by the kernel's somaxconn).
        unsafe {
            libc::listen(listener.as_raw_fd(), 4096);
        }
    }
}

/// One open connection's state.
struct Slot {
    /// Requests in progress (from the headers to the end of the answer's body).
    busy: usize,
    /// When it last became idle (or opened).
    idle_since: Instant,
    /// Already asked to close.
    evicting: bool,
    /// Wakes the connection's task to close it.
    close: Arc<Notify>,
}

/// The open connections.
#[derive(Default)]
struct Registry {
    slots: Mutex<HashMap<u64, Slot>>,
    next_id: AtomicU64,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Slot>> {
        // A poisoned map is still a valid map: every update is one field write.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open(&self) -> (u64, Arc<Notify>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(Notify::new());
        self.lock().insert(
            id,
            Slot {
                busy: 0,
                idle_since: Instant::now(),
                evicting: false,
                close: close.clone(),
            },
        );
        (id, close)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn is_idle(&self, id: u64) -> bool {
        self.lock().get(&id).is_some_and(|s| s.busy == 0)
    }

    /// Asks the longest-idle connection not yet asked to close; `false` when none is idle.
    fn evict_oldest_idle(&self) -> bool {
        let mut slots = self.lock();
        let oldest = slots
            .values_mut()
            .filter(|s| s.busy == 0 && !s.evicting)
            .min_by_key(|s| s.idle_since);
        match oldest {
            Some(slot) => {
                slot.evicting = true;
                slot.close.notify_one();
                true
            }
            None => false,
        }
    }

    fn begin(self: &Arc<Self>, id: u64) -> Busy {
        if let Some(slot) = self.lock().get_mut(&id) {
            slot.busy += 1;
        }
        Busy {
            registry: self.clone(),
            id,
        }
    }
}

/// A request in progress on a connection; dropped when its answer's body is done.
struct Busy {
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(slot) = self.registry.lock().get_mut(&self.id) {
            slot.busy = slot.busy.saturating_sub(1);
            if slot.busy == 0 {
                slot.idle_since = Instant::now();
            }
        }
    }
}

/// An answer's body that keeps its connection marked busy until it is sent.
struct BusyBody {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for BusyBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The router as one connection's hyper service.
#[derive(Clone)]
struct ConnService {
    router: Router,
    registry: Arc<Registry>,
    id: u64,
}

impl hyper::service::Service<hyper::Request<Incoming>> for ConnService {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        let busy = self.registry.begin(self.id);
        let mut router = self.router.clone();
        Box::pin(async move {
            let req: Request = req.map(Body::new);
            let response = tower_service::Service::call(&mut router, req).await?;
            Ok(response.map(|inner| Body::new(BusyBody { inner, _busy: busy })))
        })
    }
}

/// Closes a connection whose last answer is written: the write side first (the client
/// reads the answer, then the end), then what the client still sends is read and dropped
/// until it closes too or pauses for [`LINGER_IDLE`], for [`LINGER_TIME`] at most (what
/// Apache's lingering close does). Closing a socket with unread bytes
/// resets the connection, and a client still sending a body (one refused with 413 before it
/// was read) would get that reset instead of the answer.
async fn linger(stream: TcpStream) {
    let Ok(stream) = stream.into_std() else {
        return;
    };
    if stream.shutdown(std::net::Shutdown::Write).is_err() {
        return;
    }
    // `into_std` leaves the socket non-blocking, as `from_std` wants it.
    let Ok(stream) = TcpStream::from_std(stream) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + LINGER_TIME;
    let mut sink = vec![0u8; 16 << 10];
    loop {
        let wait = deadline.min(tokio::time::Instant::now() + LINGER_IDLE);
        match tokio::time::timeout_at(wait, stream.readable()).await {
            Ok(Ok(())) => {}
            _ => break,
        }
        match stream.try_read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
}

/// Whether an accept error concerns only the connection being accepted.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves `router` on `listener` until `stop` turns true, then stops accepting, lets every
/// connection finish its request in progress and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let registry = Arc::new(Registry::default());
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    let mut closing = stop.clone();
    let stopping = async {
        let _ = stop.wait_for(|s| *s).await;
    };
    tokio::pin!(stopping);
    loop {
        let accepted = tokio::select! {
            _ = &mut stopping => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, _peer) = match accepted {
            Ok(pair) => pair,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let permit = loop {
            if let Ok(permit) = permits.clone().try_acquire_owned() {
                break Some(permit);
            }
            let evicted = registry.evict_oldest_idle();
            if evicted {
                tracing::debug!("connection cap reached: closing the longest-idle connection");
            }
            tokio::select! {
                _ = &mut stopping => break None,
                permit = permits.clone().acquire_owned() => break permit.ok(),
                _ = tokio::time::sleep(EVICT_WAIT) => {}
            }
        };
        let Some(permit) = permit else { break };
        let _ = stream.set_nodelay(true);
        let (id, close) = registry.open();
        let service = ConnService {
            router: router.clone(),
            registry: registry.clone(),
            id,
        };
        let builder = builder.clone();
        let registry = registry.clone();
        let mut shutdown = closing.clone();
        tokio::spawn(async move {
            let mut conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut graceful = false;
            let mut ended = false;
            loop {
                tokio::select! {
                    result = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => {
                        match result {
                            Ok(()) => ended = true,
                            Err(e) => tracing::debug!("connection closed: {e}"),
                        }
                        break;
                    }
                    _ = close.notified() => {
                        if registry.is_idle(id) {
                            break;
                        }
                        // Busy after all: close it after the answer in progress.
                        Pin::new(&mut conn).graceful_shutdown();
                    }
                    _ = shutdown.wait_for(|s| *s), if !graceful => {
                        // No request in progress (at most some header bytes): close now
                        // rather than wait out the header timeout.
                        if registry.is_idle(id) {
                            break;
                        }
                        graceful = true;
                        Pin::new(&mut conn).graceful_shutdown();
                    }
                }
            }
            if ended {
                linger(conn.into_parts().io.into_inner()).await;
            }
            registry.remove(id);
            drop(permit);
        });
    }
    drop(listener);
    let _ = closing.wait_for(|s| *s).await;
    // Every connection holds a permit until it is closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
    Ok(())
}
