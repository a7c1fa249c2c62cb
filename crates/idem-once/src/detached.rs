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
static ABANDONED: AtomicUsize = AtomicUsize::new(0);
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

    /// Counts a handler about to run detached: always with no `max`, and
    /// with one as [`try_enter`](Self::try_enter) does (`None` when `max`
    /// already run).
    pub fn admit(max: Option<usize>) -> Option<Self> {
        match max {
            None => Some(Self::enter()),
            Some(max) => Self::try_enter(max),
        }
    }

    /// Counts a handler about to run detached if fewer than `max` run
    /// (at least one always may): the check and the count are one step,
    /// so requests arriving together cannot all pass a check of the same
    /// count. `None` when `max` already run.
    pub fn try_enter(max: usize) -> Option<Self> {
        let max = max.max(1);
        RUNNING
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Running(()))
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

/// How many of them run on although their caller went away (the request's
/// future was dropped before the handler's task ended: a client that hung
/// up, a deadline, a reset stream), in this process: work no connection
/// or stream limit counts any more. See [`join`].
pub fn abandoned() -> usize {
    ABANDONED.load(Ordering::SeqCst)
}

/// Awaits `task`, a handler's task; if this future is dropped first (its
/// caller went away), the task runs on and counts in [`abandoned`] until
/// it ends.
pub fn join<T: Send + 'static>(task: tokio::task::JoinHandle<T>) -> Join<T> {
    Join(Some(task))
}

/// The future [`join`] returns: a handler's task, awaited by its caller;
/// dropped unfinished, the task is counted as abandoned until it ends.
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct Join<T: Send + 'static>(Option<tokio::task::JoinHandle<T>>);

impl<T: Send + 'static> std::future::Future for Join<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(task) = self.0.as_mut() else {
            // Polled again after its result: nothing more comes.
            return std::task::Poll::Pending;
        };
        let result = std::task::ready!(std::pin::Pin::new(task).poll(cx));
        self.0 = None;
        std::task::Poll::Ready(result)
    }
}

impl<T: Send + 'static> Drop for Join<T> {
    fn drop(&mut self) {
        let Some(task) = self.0.take() else {
            return;
        };
        if task.is_finished() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        ABANDONED.fetch_add(1, Ordering::SeqCst);
        runtime.spawn(async move {
            let _ = task.await;
            ABANDONED.fetch_sub(1, Ordering::SeqCst);
        });
    }
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
