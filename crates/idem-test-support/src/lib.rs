//! What idem's tests share, beside the store conformance suite
//! (`idem-store-suite`):
//!
//! - [`postgres`]: a PostgreSQL schema of its own for each test, dropped
//!   after it, so tests run in parallel and leave nothing behind;
//! - [`mysql`]: a MySQL / MariaDB database of its own for each test,
//!   dropped after it;
//! - [`redis`]: a Redis key prefix of its own for each test, its keys
//!   deleted after it;
//! - [`broker`]: the broker conformance suite, run on RabbitMQ and NATS;
//! - [`faults`]: a TCP proxy that makes a link slow, partitions it (then
//!   heals it) or cuts its connections;
//! - [`messaging`]: the outbox and inbox fixtures the broker tests use (an
//!   outbox in a fresh schema, messages, recorded effects);
//! - [`stores`]: stores that misbehave on purpose (claims answered late).
//!
//! A test that needs a server fails loudly when it cannot reach it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod broker;
pub mod faults;
pub mod messaging;
pub mod mysql;
pub mod postgres;
pub mod redis;
pub mod stores;

/// Runs the future `work` makes to its end, on a thread with a runtime of
/// its own: how a `Drop` (outside async code) cleans up a server's test
/// database or schema. `false` when it gave up (`None`) or the thread
/// failed.
pub(crate) fn cleanup<F, Fut>(work: F) -> bool
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<()>>,
{
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?
            .block_on(work())
    })
    .join();
    matches!(done, Ok(Some(())))
}
