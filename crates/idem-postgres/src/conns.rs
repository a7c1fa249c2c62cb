//! The connections claims run on: a few kept by the store, outside the pool.
//!
//! Why not the pool: sqlx 0.8 sends a round trip (a `Sync`) on every
//! connection it takes back, a check that cannot be turned off. A claim is
//! one statement, so that check is a third of the round trips a replay
//! costs, and a wake-up of a server process each time. The store keeps up to
//! [`CLAIM_CONNECTIONS`] connections of its own for claims instead (taken
//! from the pool once, then detached from it), bounded by a semaphore, and
//! checks one only when it sat idle for [`IDLE_CHECK_AFTER`] or more, as the
//! pool does. A connection whose statement failed is dropped, never kept.

use std::sync::Mutex;
use std::time::Instant;

use sqlx::postgres::{PgConnection, PgPool};
use sqlx::Connection;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::IDLE_CHECK_AFTER;

/// At most this many claims run at once on one store; more wait for a
/// connection (within the pool's acquire time-out).
pub const CLAIM_CONNECTIONS: usize = 8;

#[derive(Debug)]
pub(crate) struct ClaimConnections {
    permits: Semaphore,
    idle: Mutex<Vec<(PgConnection, Instant)>>,
}

/// A claim connection in use. [`Checkout::keep`] gives it back once its
/// statements succeeded; dropped without that, it is closed.
pub(crate) struct Checkout<'a> {
    conn: PgConnection,
    home: &'a ClaimConnections,
    _permit: SemaphorePermit<'a>,
}

impl Checkout<'_> {
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Gives the connection back for the next claim.
    pub(crate) fn keep(self) {
        if let Ok(mut idle) = self.home.idle.lock() {
            idle.push((self.conn, Instant::now()));
        }
    }
}

impl ClaimConnections {
    pub(crate) fn new() -> Self {
        Self {
            permits: Semaphore::new(CLAIM_CONNECTIONS),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A connection for one claim: a kept one (checked if it sat idle), or
    /// a new one from the pool.
    pub(crate) async fn checkout(&self, pool: &PgPool) -> Result<Checkout<'_>, sqlx::Error> {
        let timeout = pool.options().get_acquire_timeout();
        let permit = tokio::time::timeout(timeout, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            // The most recently used first: the likeliest to be alive.
            let kept = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            let Some((mut conn, since)) = kept else {
                let conn = pool.acquire().await?.detach();
                return Ok(Checkout {
                    conn,
                    home: self,
                    _permit: permit,
                });
            };
            if since.elapsed() < IDLE_CHECK_AFTER || conn.ping().await.is_ok() {
                return Ok(Checkout {
                    conn,
                    home: self,
                    _permit: permit,
                });
            }
            // Dead while idle: drop it and try the next.
        }
    }
}
