//! Serving an axum app with the limits a service exposed to the internet
//! needs (feature `serve`), glued from what hyper, hyper-util and tower-http
//! give. shop and `idem proxy` serve with it:
//!
//! - a client that sends its headers slower than `header_timeout` is
//!   disconnected (hyper's header read timeout);
//! - a request body that stalls longer than `body_timeout` between two
//!   chunks fails the request (tower-http's body timeout), so one stalled
//!   upload cannot hold a handler;
//! - a request body must keep up an average of `body_min_rate` bytes a
//!   second once its first `body_timeout` is over ([`MinRateLayer`]), so a
//!   client that trickles a byte every few seconds (never stalling long
//!   enough for the idle timeout) cannot hold a connection for hours;
//! - at most `max_connections` connections are served; beyond that, a new
//!   connection is closed at once, so stalled sockets cannot starve the
//!   rest for long (each is cut after its own timeouts). Nor is one
//!   accepted while `max_connections` guarded handlers run on whose
//!   clients went away (`idem_once::detached::abandoned`): such a handler
//!   runs on to store its answer, and without this a client that sends a
//!   guarded request and hangs up, again and again, would start handlers
//!   without end, each holding its database connection or upstream call.
//!   So the handlers running at once stay under about twice
//!   `max_connections`;
//! - on shutdown the listener closes, in-flight requests finish within
//!   `grace` (the handlers the idempotency layers run on tasks of their
//!   own included, when their clients went away: their answers are still
//!   stored; the count is the process's, `idem_once::detached`, so a
//!   tonic server's guarded handlers in the same process are waited for
//!   too), and then the process exits whatever is still open.
//!
//! ```no_run
//! # async fn run(app: axum::Router) -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let stop = async { let _ = tokio::signal::ctrl_c().await; };
//! idem_axum::serve::serve(listener, app, idem_axum::serve::Limits::default(), stop).await;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
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
    /// The average a request body must keep up, in bytes a second, once
    /// its first `body_timeout` is over (default 500, as Apache's
    /// `mod_reqtimeout`; 0: no minimum). See [`MinRateLayer`].
    pub body_min_rate: u64,
    /// Connections served at once (default 1024); more are closed at once,
    /// as is any new one while as many guarded handlers run on whose
    /// clients went away.
    pub max_connections: usize,
    /// How long in-flight requests may finish after shutdown (default 30 s).
    pub grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            body_min_rate: 500,
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
    let app = app
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            limits.body_timeout,
        ))
        .layer(MinRateLayer::new(limits.body_timeout, limits.body_min_rate));
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
        if idem_once::detached::abandoned() >= limits.max_connections {
            // Handlers whose clients went away still run: a client that
            // hangs up on every request must not start them without end.
            debug!(
                %peer,
                abandoned = idem_once::detached::abandoned(),
                "as many guarded handlers run on for clients gone as connections are allowed; closing a new connection"
            );
            drop(stream);
            continue;
        }
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
    // The connections, then the handlers the layers run on tasks of their
    // own, in this process (one whose client went away runs on, its answer
    // to be stored), gRPC ones included.
    let drained = async {
        graceful.shutdown().await;
        info!("every connection closed");
        if idem_once::detached::running() > 0 {
            info!(
                handlers = idem_once::detached::running(),
                "waiting for handlers whose clients went away"
            );
            idem_once::detached::idle().await;
        }
    };
    tokio::select! {
        () = drained => info!("every request finished"),
        () = tokio::time::sleep(limits.grace) => warn!(
            handlers = idem_once::detached::running(),
            "grace period over; exiting with requests still running"
        ),
    }
}

/// A tower layer that holds each request body to a minimum average rate:
/// the body must have arrived whole by
/// `first read + grace + received / min_rate`, a deadline that moves on with
/// every chunk received ([`MinRateBody`]). A body that falls behind fails
/// with [`BodyTooSlow`] (the request is then answered as one whose body
/// could not be read, before anything is claimed).
///
/// The idle timeout between two chunks (tower-http's) does not catch a
/// client that sends one byte every few seconds; this does, while a slow
/// but honest upload (a phone on a poor link) keeps going as long as it
/// averages `min_rate`.
#[derive(Debug, Clone, Copy)]
pub struct MinRateLayer {
    grace: Duration,
    min_rate: u64,
}

impl MinRateLayer {
    /// Bodies get `grace` for free, then must average `min_rate` bytes a
    /// second; a `min_rate` of 0 sets no minimum.
    #[must_use]
    pub fn new(grace: Duration, min_rate: u64) -> Self {
        Self { grace, min_rate }
    }
}

impl<S> tower::Layer<S> for MinRateLayer {
    type Service = MinRate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MinRate {
            inner,
            grace: self.grace,
            min_rate: self.min_rate,
        }
    }
}

/// The service of [`MinRateLayer`].
#[derive(Debug, Clone)]
pub struct MinRate<S> {
    inner: S,
    grace: Duration,
    min_rate: u64,
}

impl<S, B> tower::Service<http::Request<B>> for MinRate<S>
where
    S: tower::Service<http::Request<MinRateBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let (grace, min_rate) = (self.grace, self.min_rate);
        self.inner
            .call(request.map(|body| MinRateBody::new(body, grace, min_rate)))
    }
}

/// A request body held to a minimum average rate (see [`MinRateLayer`]).
#[derive(Debug)]
pub struct MinRateBody<B> {
    inner: B,
    /// When the body was first read (the handler asked for it; with
    /// `Expect: 100-continue`, when the client was told to send it).
    start: Option<tokio::time::Instant>,
    grace: Duration,
    min_rate: u64,
    received: u64,
    /// Made on the first wait only: most bodies arrive with their head.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    failed: bool,
}

impl<B> MinRateBody<B> {
    /// `inner`, given `grace` from when it is first read and then held to
    /// `min_rate` bytes a second (0: not held).
    pub fn new(inner: B, grace: Duration, min_rate: u64) -> Self {
        Self {
            inner,
            start: None,
            grace,
            min_rate,
            received: 0,
            timer: None,
            failed: false,
        }
    }

    /// The moment the body is too slow if nothing more arrives, read from
    /// `start`; `None` if that lies beyond what the clock can say (a grace
    /// of `Duration::MAX`: no deadline).
    fn deadline(&self, start: tokio::time::Instant) -> Option<tokio::time::Instant> {
        let earned = Duration::from_millis(self.received.saturating_mul(1000) / self.min_rate);
        start.checked_add(self.grace.saturating_add(earned))
    }
}

/// A request body fell behind [`MinRateLayer`]'s minimum rate.
#[derive(Debug, thiserror::Error)]
#[error("the request body arrived slower than {min_rate} bytes a second ({received} bytes)")]
pub struct BodyTooSlow {
    /// The minimum, in bytes a second.
    pub min_rate: u64,
    /// What had arrived.
    pub received: u64,
}

impl<B> http_body::Body for MinRateBody<B>
where
    B: http_body::Body + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = B::Data;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use bytes::Buf;
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        let start = *this.start.get_or_insert_with(tokio::time::Instant::now);
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let n = u64::try_from(data.remaining()).unwrap_or(u64::MAX);
                    this.received = this.received.saturating_add(n);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending if this.min_rate == 0 => Poll::Pending,
            Poll::Pending => {
                let Some(deadline) = this.deadline(start) else {
                    return Poll::Pending;
                };
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                match timer.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        this.failed = true;
                        Poll::Ready(Some(Err(Box::new(BodyTooSlow {
                            min_rate: this.min_rate,
                            received: this.received,
                        }))))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.failed {
            http_body::SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use bytes::Bytes;
    use http_body::{Body, Frame};
    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    /// A body fed chunk by chunk by the test.
    struct Fed(mpsc::UnboundedReceiver<Bytes>);

    impl Body for Fed {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|c| c.map(|c| Ok(Frame::data(c))))
        }
    }

    fn fed(grace: Duration, min_rate: u64) -> (mpsc::UnboundedSender<Bytes>, MinRateBody<Fed>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, MinRateBody::new(Fed(rx), grace, min_rate))
    }

    /// Sends `n` one-byte chunks, `every` apart, then ends the body.
    fn trickle(tx: mpsc::UnboundedSender<Bytes>, n: usize, every: Duration) {
        tokio::spawn(async move {
            for _ in 0..n {
                tokio::time::sleep(every).await;
                if tx.send(Bytes::from_static(b"x")).is_err() {
                    return;
                }
            }
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_below_the_rate_fails_once_its_grace_and_earned_time_are_over() {
        // 1 byte a second against 10 a second: after the 5 s grace, each
        // byte earns 100 ms, so it fails a little after 5.5 s.
        let (tx, body) = fed(Duration::from_secs(5), 10);
        trickle(tx, 1000, Duration::from_secs(1));
        let began = tokio::time::Instant::now();
        let err = body.collect().await.expect_err("too slow");
        let took = began.elapsed();
        let slow = err.downcast_ref::<BodyTooSlow>().expect("BodyTooSlow");
        assert_eq!(slow.min_rate, 10);
        assert_eq!(slow.received, 5);
        assert!(
            (Duration::from_millis(5500)..Duration::from_secs(6)).contains(&took),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_rate_arrives_whole_however_long_it_takes() {
        // 1 byte every 80 ms against 10 a second (100 ms each): 300 bytes,
        // 24 s, far past the grace.
        let (tx, body) = fed(Duration::from_secs(1), 10);
        trickle(tx, 300, Duration::from_millis(80));
        let whole = body.collect().await.expect("whole").to_bytes();
        assert_eq!(whole.len(), 300);
    }

    #[tokio::test(start_paused = true)]
    async fn no_minimum_waits_as_long_as_the_body_takes() {
        let (tx, body) = fed(Duration::from_secs(1), 0);
        trickle(tx, 20, Duration::from_secs(10));
        let whole = body.collect().await.expect("whole").to_bytes();
        assert_eq!(whole.len(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn the_grace_counts_from_the_first_read_and_may_be_endless() {
        // Read 10 s after it was made: its 1 s grace starts then.
        let (tx, body) = fed(Duration::from_secs(1), 1000);
        tokio::time::sleep(Duration::from_secs(10)).await;
        trickle(tx, 1, Duration::from_millis(500));
        assert_eq!(body.collect().await.expect("whole").to_bytes().len(), 1);
        // A grace of Duration::MAX (no timeout) is no deadline, not a panic.
        let (tx, body) = fed(Duration::MAX, 1000);
        trickle(tx, 3, Duration::from_secs(3600));
        assert_eq!(body.collect().await.expect("whole").to_bytes().len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn after_failing_the_body_ends() {
        let (tx, mut body) = fed(Duration::from_millis(100), 1000);
        let err = body.frame().await.expect("a frame").expect_err("too slow");
        assert!(err.is::<BodyTooSlow>(), "{err}");
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
        drop(tx);
    }
}
