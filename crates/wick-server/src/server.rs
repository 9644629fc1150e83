//! Running the server: binding (a busy port is a clear error), serving until SIGINT or
//! SIGTERM (or until the engine halts after an internal error, which ends in an error so
//! the process exits non-zero), then a bounded shutdown — stop accepting, let in-flight generations finish
//! within the grace period, cancel the rest, then flush the prompt cache to the SSD tier
//! within its own timeout.
//!
//! Connections are served by [`crate::connections`]: a header-read timeout, a cap on open
//! connections that closes the longest-idle one for a newcomer, and a graceful close.
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use crate::connections;
use crate::error::StartupError;
use crate::routes::app;
use crate::state::AppState;

/// Extra time after the grace period for connections to close before the server stops
/// waiting for them.
const CLOSE_MARGIN: Duration = Duration::from_secs(3);

/// Binds `host:port` (port 0 picks a free one).
pub fn bind(host: &str, port: u16) -> Result<std::net::TcpListener, StartupError> {
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let listener = std::net::TcpListener::bind(&addr).map_err(|reason| {
        let hint = match reason.kind() {
            std::io::ErrorKind::AddrInUse => {
                " (another process is listening there: stop it or pick another --port)"
            }
            std::io::ErrorKind::PermissionDenied => " (ports below 1024 need privileges)",
            _ => "",
        };
        StartupError::Bind {
            addr: addr.clone(),
            reason,
            hint,
        }
    })?;
    listener
        .set_nonblocking(true)
        .map_err(StartupError::Serve)?;
    connections::widen_backlog(&listener);
    Ok(listener)
}

/// A future that resolves when the process gets SIGINT (Ctrl-C) or SIGTERM. The handlers
/// are installed when this is called, not when the future is first polled: call it (inside
/// the runtime) before the server says it is ready, so that a signal sent right after that
/// reaches the graceful shutdown instead of the default action, which kills the process.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        async fn recv(s: std::io::Result<tokio::signal::unix::Signal>, name: &str) {
            match s {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::error!("cannot listen for {name}: {e}");
                    std::future::pending::<()>().await;
                }
            }
        }
        let (int, term) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        );
        async move {
            tokio::select! {
                _ = recv(int, "SIGINT") => tracing::info!("SIGINT received"),
                _ = recv(term, "SIGTERM") => tracing::info!("SIGTERM received"),
            }
        }
    }
    #[cfg(not(unix))]
    async {
        match tokio::signal::ctrl_c().await {
            Ok(()) => tracing::info!("Ctrl-C received"),
            Err(e) => {
                tracing::error!("cannot listen for Ctrl-C: {e}");
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Serves `state` on `listener` until `shutdown` resolves, then shuts down within the
/// configured grace period (plus a short margin for connections to close).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let engine = state.engine().clone();
    let grace = state.config().shutdown_grace;
    let flush_timeout = state.config().cache_flush_timeout;
    let limits = connections::Limits::from_config(state.config());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server = connections::serve(listener, app(state), limits, stop_rx);
    let mut server = tokio::spawn(server);
    let mut halted = None;
    tokio::select! {
        result = &mut server => {
            return match result {
                Ok(r) => r.map_err(StartupError::Serve),
                Err(e) => Err(StartupError::Serve(std::io::Error::other(e))),
            };
        }
        _ = shutdown => {}
        reason = engine.wait_halted() => {
            // The engine failed its requests already; a restarted process is the only way
            // back (docs/reliability.md).
            tracing::error!(%reason, "the engine stopped: shutting down to be restarted");
            halted = Some(reason);
        }
    }
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "shutting down: no new connections"
    );
    let _ = stop_tx.send(true);
    let engine_done = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.shutdown(grace))
    };
    match tokio::time::timeout(grace + CLOSE_MARGIN, &mut server).await {
        Ok(Ok(result)) => result.map_err(StartupError::Serve)?,
        Ok(Err(e)) => return Err(StartupError::Serve(std::io::Error::other(e))),
        Err(_) => {
            tracing::warn!("connections still open after the grace period: closing them");
            server.abort();
        }
    }
    match engine_done.await {
        Ok(true) => tracing::info!("all generations finished"),
        Ok(false) => {
            tracing::warn!("generations still running after the grace period were cancelled")
        }
        Err(e) => tracing::error!("engine shutdown failed: {e}"),
    }
    flush_at_shutdown(engine, flush_timeout).await;
    match halted {
        Some(reason) => Err(StartupError::EngineHalted(reason)),
        None => Ok(()),
    }
}

/// The last flush of the prompt cache, once the engine is idle: what it could not make
/// durable within `timeout` is logged (the files written so far stay valid).
async fn flush_at_shutdown(engine: wick_engine::scheduler::EngineHandle, timeout: Duration) {
    if engine.ssd_cache_path().is_none() {
        return;
    }
    tracing::info!(
        timeout_s = timeout.as_secs_f64(),
        "flushing the prompt cache to the SSD"
    );
    match tokio::task::spawn_blocking(move || engine.flush_cache(timeout)).await {
        Ok(r) if r.durable => tracing::info!(
            flushed = r.flushed_snapshots,
            elapsed_ms = r.elapsed_ms,
            "prompt cache durable"
        ),
        Ok(r) => tracing::warn!(
            pending_snapshots = r.pending_snapshots,
            pending_spills = r.pending_spills,
            dropped = r.dropped_spills,
            failed = r.failed_spills,
            missing = r.missing_snapshots,
            timed_out = r.timed_out,
            "prompt cache not fully durable at shutdown"
        ),
        Err(e) => tracing::error!("prompt cache flush failed: {e}"),
    }
}

/// Builds a runtime and serves until SIGINT/SIGTERM; `on_ready` gets the bound address once
/// the server accepts requests.
pub fn run(
    listener: std::net::TcpListener,
    state: AppState,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), StartupError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("wick-http")
        .build()
        .map_err(StartupError::Serve)?;
    connections::raise_fd_limit();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(StartupError::Serve)?;
        let addr = listener.local_addr().map_err(StartupError::Serve)?;
        let shutdown = shutdown_signal();
        on_ready(addr);
        serve(listener, state, shutdown).await
    })?;
    // Blocking workers (prompt rendering) may still hold the model: do not wait for them.
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}
