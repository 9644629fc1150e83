//! Running the server: binding (a busy port is a clear error), serving until SIGINT or
//! SIGTERM, then a bounded shutdown — stop accepting, let in-flight generations finish
//! within the grace period, cancel the rest.
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

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
    let listener = std::net::TcpListener::bind(&addr).map_err(|source| {
        let hint = match source.kind() {
            std::io::ErrorKind::AddrInUse => {
                " (another process is listening there: stop it or pick another --port)"
            }
            std::io::ErrorKind::PermissionDenied => " (ports below 1024 need privileges)",
            _ => "",
        };
        StartupError::Bind {
            addr: addr.clone(),
            source,
            hint,
        }
    })?;
    listener
        .set_nonblocking(true)
        .map_err(StartupError::Serve)?;
    Ok(listener)
}

/// Resolves when the process gets SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
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
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app(state)).with_graceful_shutdown(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    });
    let mut server = tokio::spawn(async move { server.await });
    tokio::select! {
        result = &mut server => {
            return match result {
                Ok(r) => r.map_err(StartupError::Serve),
                Err(e) => Err(StartupError::Serve(std::io::Error::other(e))),
            };
        }
        _ = shutdown => {}
    }
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "shutting down: no new connections"
    );
    let _ = stop_tx.send(true);
    let engine_done = tokio::task::spawn_blocking(move || engine.shutdown(grace));
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
    Ok(())
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
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(StartupError::Serve)?;
        let addr = listener.local_addr().map_err(StartupError::Serve)?;
        on_ready(addr);
        serve(listener, state, shutdown_signal()).await
    })?;
    // Blocking workers (prompt rendering) may still hold the model: do not wait for them.
    runtime.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}
