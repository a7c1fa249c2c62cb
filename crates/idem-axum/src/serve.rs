//! Serving an axum app with the limits a service exposed to the internet
//! needs (feature `serve`), glued from what hyper, hyper-util and tower-http
//! give. shop and `idem proxy` serve with it:
//!
//! - a client that sends its headers slower than `header_timeout` is
//!   disconnected (hyper's header read timeout);
//! - a request body that stalls longer than `body_timeout` between two
//!   chunks fails the request (tower-http's body timeout), so one stalled
//!   upload cannot hold a handler;
//! - at most `max_connections` connections are served; beyond that, a new
//!   connection is closed at once, so stalled sockets cannot starve the
//!   rest for long (each is cut after its own timeouts);
//! - on shutdown the listener closes, in-flight requests finish within
//!   `grace`, and then the process exits whatever is still open.
//!
//! ```no_run
//! # async fn run(app: axum::Router) -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let stop = async { let _ = tokio::signal::ctrl_c().await; };
//! idem_axum::serve::serve(listener, app, idem_axum::serve::Limits::default(), stop).await;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

/// The limits (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A client must send a request's whole head within this (default 10 s).
    pub header_timeout: Duration,
    /// A request body may stall this long between two chunks (default 30 s).
    pub body_timeout: Duration,
    /// Connections served at once (default 1024); more are closed at once.
    pub max_connections: usize,
    /// How long in-flight requests may finish after shutdown (default 30 s).
    pub grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            grace: Duration::from_secs(30),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let app = app.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.body_timeout,
    ));
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off a moment.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(%peer, "connection limit reached; closing a new connection");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            // Above the app's own limit (100 fields, answered 431
            // problem+json), so that hyper's bare 431 is left for the
            // grossly oversized.
            .max_headers(1000)
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    info!(grace = ?limits.grace, "no longer accepting; letting in-flight requests finish");
    tokio::select! {
        () = graceful.shutdown() => info!("every connection closed"),
        () = tokio::time::sleep(limits.grace) => warn!("grace period over; exiting with connections still open"),
    }
}
