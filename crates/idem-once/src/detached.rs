//! Handlers that the edges (the axum and tonic layers) run on tasks of
//! their own, counted process-wide, so that a graceful shutdown waits for
//! them too: a client that disconnected closed its connection, but its
//! handler runs on, and its answer is still to be stored.
//!
//! `idem_axum::serve` waits for them by itself. A server of your own (a
//! tonic server, say) awaits [`idle`] after it stopped taking calls,
//! within its grace:
//!
//! ```
//! # async fn f() {
//! use std::time::Duration;
//! // … the server's graceful shutdown has returned …
//! if tokio::time::timeout(Duration::from_secs(10), idem_once::detached::idle()).await.is_err() {
//!     eprintln!("{} handlers still running; exiting", idem_once::detached::running());
//! }
//! # }
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

static RUNNING: AtomicUsize = AtomicUsize::new(0);
static IDLE: Notify = Notify::const_new();

/// One detached handler, counted while this lives: create it before the
/// handler's task is spawned and move it into the task.
#[derive(Debug)]
#[must_use = "the handler is counted only while this lives"]
pub struct Running(());

impl Running {
    /// Counts a handler about to run detached.
    pub fn enter() -> Self {
        RUNNING.fetch_add(1, Ordering::SeqCst);
        Running(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if RUNNING.fetch_sub(1, Ordering::SeqCst) == 1 {
            IDLE.notify_waiters();
        }
    }
}

/// How many detached handlers run now, in this process.
pub fn running() -> usize {
    RUNNING.load(Ordering::SeqCst)
}

/// Waits until no detached handler runs in this process.
pub async fn idle() {
    loop {
        let notified = IDLE.notified();
        let mut notified = std::pin::pin!(notified);
        // Registered before the count is read: a last handler ending in
        // between still wakes this.
        notified.as_mut().enable();
        if running() == 0 {
            return;
        }
        notified.await;
    }
}
