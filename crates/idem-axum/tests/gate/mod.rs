//! A handler held at a gate, for the tests that count running handlers
//! (each a binary of its own: the count is the process's).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use tokio::sync::Semaphore;

/// Handlers wait here for a permit before they answer.
#[derive(Clone)]
pub(crate) struct Gate {
    pub(crate) open: Arc<Semaphore>,
    pub(crate) started: Arc<AtomicUsize>,
}

impl Gate {
    pub(crate) fn closed() -> Self {
        Self {
            open: Arc::new(Semaphore::new(0)),
            started: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// How many handlers have started.
    pub(crate) fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// Waits (up to 30 s) until more than `before` handlers have started.
    pub(crate) async fn until_started_past(&self, before: usize) {
        until(|| self.started() > before, "a handler never started").await;
    }
}

/// The handler: counts itself started, waits at the gate, answers `done`.
pub(crate) async fn handler(State(gate): State<Gate>) -> &'static str {
    gate.started.fetch_add(1, Ordering::SeqCst);
    if let Ok(permit) = gate.open.acquire().await {
        permit.forget();
    }
    "done"
}

/// Waits (up to 30 s) until `done` holds, or fails saying `what`.
pub(crate) async fn until(done: impl Fn() -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 30 s) until no guarded handler runs or is abandoned.
pub(crate) async fn until_idle() {
    until(
        || idem_once::detached::running() == 0 && idem_once::detached::abandoned() == 0,
        "the handlers never ended",
    )
    .await;
}
