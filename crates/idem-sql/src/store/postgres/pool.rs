//! The pool idem opens: bounded waits, idle connections checked.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

#[allow(unused_imports)] // for the docs' links
use idem_core::StoreError;

/// How long a request waits for a pooled connection before the store
/// answers [`StoreError::Unavailable`]: an outage becomes a prompt `503`,
/// never a hang.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// A pooled connection idle at least this long is checked (one round trip)
/// before it is handed out; see [`open_pool`].
pub const IDLE_CHECK_AFTER: Duration = Duration::from_secs(1);

/// Opens a pool with idem's defaults: a bounded acquire time-out, and a
/// connection that sat idle for [`IDLE_CHECK_AFTER`] or more checked before
/// use, so a restarted server is picked up.
///
/// Why not sqlx's `test_before_acquire` (a round trip on every checkout):
/// sqlx 0.8 already checks every connection as it goes back to the pool, so
/// one handed out again at once was alive a moment ago, and the check would
/// cost a round trip and a server wake-up on every request (a third of a
/// replay's database work). A connection that dies in that moment fails its
/// statement, which is reported as [`StoreError::Unavailable`] (a `503`
/// with `Retry-After`), and sqlx then discards it.
pub async fn open_pool(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_CHECK_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect(url)
        .await
}
