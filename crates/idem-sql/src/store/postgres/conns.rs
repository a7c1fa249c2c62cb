//! The connections claims run on: a few of the pool's, kept checked out.
//!
//! Why not hand each back: sqlx 0.8 sends a round trip (a `Sync`) on every
//! connection it takes back, a check that cannot be turned off. A claim is
//! one statement, so that check is a third of the round trips a replay
//! costs, and a wake-up of a server process each time. The store keeps up
//! to [`CLAIM_CONNECTIONS`] of the pool's connections checked out for claims
//! instead, bounded by a semaphore, and checks one only when it sat idle for
//! [`IDLE_CHECK_AFTER`] or more. They stay the pool's (counted in its
//! `max_connections`; never detached, so the server sees no more
//! connections than the pool allows). A connection whose statement failed
//! goes back to the pool, which checks it and closes it if it is broken.
//! At least one of the pool's connections is never kept: a pool of four or
//! fewer keeps one less than it has (a pool of one keeps none), so the
//! application's own transactions always have a connection to take, where
//! claims kept checked out would otherwise hold the whole pool idle. (The
//! bound is each store's: two stores on one small pool keep up to that many
//! each.)

use std::sync::Mutex;
use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::Connection;
use sqlx::Postgres;
use tokio::sync::{Semaphore, SemaphorePermit};

use super::IDLE_CHECK_AFTER;

/// At most this many claims run at once on one store, each one statement;
/// more wait for a connection (within the pool's acquire time-out). They
/// are the pool's, so the rest of it stays for the business transactions;
/// a pool of this many or fewer keeps one less than it has for claims.
pub const CLAIM_CONNECTIONS: usize = 4;

#[derive(Debug)]
pub(crate) struct ClaimConnections {
    permits: Semaphore,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
}

/// A claim connection in use. [`Checkout::keep`] keeps it for the next
/// claim once its statements succeeded; dropped without that, it goes back
/// to the pool.
pub(crate) struct Checkout<'a> {
    conn: PoolConnection<Postgres>,
    home: &'a ClaimConnections,
    /// How many connections may be kept for claims: [`CLAIM_CONNECTIONS`],
    /// fewer in a pool too small to spare them.
    keep_at_most: usize,
    _permit: SemaphorePermit<'a>,
}

impl Checkout<'_> {
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Keeps the connection for the next claim, or, if as many as the pool
    /// can spare are kept already, gives it back to the pool.
    pub(crate) fn keep(self) {
        if let Ok(mut idle) = self.home.idle.lock() {
            if idle.len() < self.keep_at_most {
                idle.push((self.conn, Instant::now()));
            }
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
        let spare = pool.options().get_max_connections().saturating_sub(1);
        let keep_at_most = CLAIM_CONNECTIONS.min(usize::try_from(spare).unwrap_or(usize::MAX));
        let permit = tokio::time::timeout(timeout, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            // The most recently used first: the likeliest to be alive.
            let kept = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            let Some((mut conn, since)) = kept else {
                let conn = pool.acquire().await?;
                return Ok(Checkout {
                    conn,
                    home: self,
                    keep_at_most,
                    _permit: permit,
                });
            };
            if since.elapsed() < IDLE_CHECK_AFTER || conn.ping().await.is_ok() {
                return Ok(Checkout {
                    conn,
                    home: self,
                    keep_at_most,
                    _permit: permit,
                });
            }
            // Dead while idle: back to the pool (which closes it), and the
            // next.
        }
    }
}
