//! The handlers the layer runs on tasks of their own, counted, so that a
//! graceful shutdown ([`crate::serve`]) waits for them too: a client that
//! disconnected closed its connection, but its handler runs on, and its
//! answer is still to be stored.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

static RUNNING: AtomicUsize = AtomicUsize::new(0);
static IDLE: Notify = Notify::const_new();

/// One detached handler, counted while it lives.
pub(crate) struct Running(());

impl Running {
    /// Counts a handler about to run detached.
    pub(crate) fn enter() -> Self {
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

/// How many detached handlers run now.
#[cfg(feature = "serve")]
pub(crate) fn running() -> usize {
    RUNNING.load(Ordering::SeqCst)
}

/// Waits until no detached handler runs.
#[cfg(feature = "serve")]
pub(crate) async fn idle() {
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
