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
//!
//! A pool's `close` waits for every connection checked out, so the kept
//! ones are handed back as soon as it is called: a task started with the
//! first kept connection waits for the pool's close event, and once the
//! pool is closed nothing is kept and no claim takes a kept one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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

type Idle = Mutex<Vec<(PoolConnection<Postgres>, Instant)>>;

#[derive(Debug)]
pub(crate) struct ClaimConnections {
    permits: Semaphore,
    idle: Arc<Idle>,
    /// Whether the task that hands the kept connections back when the pool
    /// closes runs (it says when it ends: with its runtime, say, so that
    /// the next kept connection starts another).
    watching: Arc<AtomicBool>,
    /// Ends that task when the store goes (dropped with it).
    _store_gone: tokio::sync::watch::Sender<()>,
    store_gone: tokio::sync::watch::Receiver<()>,
}

/// A claim connection in use. [`Checkout::keep`] keeps it for the next
/// claim once its statements succeeded; dropped without that, it goes back
/// to the pool.
pub(crate) struct Checkout<'a> {
    conn: PoolConnection<Postgres>,
    home: &'a ClaimConnections,
    pool: &'a PgPool,
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
    /// Nothing is kept once the pool is closed: the connection goes back,
    /// so the pool's close is not left waiting for it.
    pub(crate) fn keep(self) {
        let Ok(mut idle) = self.home.idle.lock() else {
            return;
        };
        // Checked under the lock the close's hand-back takes: either this
        // sees the pool closed, or the hand-back, which locks after the
        // pool is marked closed, finds the connection pushed here.
        if self.pool.is_closed() || idle.len() >= self.keep_at_most {
            return;
        }
        if !self.home.watching.load(Ordering::Acquire)
            && !self.home.watching.swap(true, Ordering::AcqRel)
        {
            self.home.watch(self.pool);
            // sqlx's close event looks whether the pool is closed, then
            // listens: a close between the two is not heard. Looked at
            // again now that it listens.
            if self.pool.is_closed() {
                return;
            }
        }
        idle.push((self.conn, Instant::now()));
    }
}

impl ClaimConnections {
    pub(crate) fn new() -> Self {
        let (store_gone_tx, store_gone) = tokio::sync::watch::channel(());
        Self {
            permits: Semaphore::new(CLAIM_CONNECTIONS),
            idle: Arc::new(Mutex::new(Vec::new())),
            watching: Arc::new(AtomicBool::new(false)),
            _store_gone: store_gone_tx,
            store_gone,
        }
    }

    /// Starts the task that hands the kept connections back to `pool` when
    /// it closes. The close event is taken here, before any connection is
    /// kept, so a close from now on is not missed; the task holds neither
    /// the pool nor the store, and ends when the store goes.
    fn watch(&self, pool: &PgPool) {
        let closed = pool.close_event();
        let idle = Arc::downgrade(&self.idle);
        let mut store_gone = self.store_gone.clone();
        let ended = Ended(self.watching.clone());
        tokio::spawn(async move {
            let _ended = ended;
            tokio::select! {
                () = closed => {
                    if let Some(idle) = idle.upgrade() {
                        drop(take_all(&idle));
                    }
                }
                _ = store_gone.changed() => {}
            }
        });
    }

    /// A connection for one claim: a kept one (checked if it sat idle), or
    /// a new one from the pool.
    pub(crate) async fn checkout<'a>(
        &'a self,
        pool: &'a PgPool,
    ) -> Result<Checkout<'a>, sqlx::Error> {
        let timeout = pool.options().get_acquire_timeout();
        let spare = pool.options().get_max_connections().saturating_sub(1);
        let keep_at_most = CLAIM_CONNECTIONS.min(usize::try_from(spare).unwrap_or(usize::MAX));
        let permit = tokio::time::timeout(timeout, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            if pool.is_closed() {
                drop(take_all(&self.idle));
                return Err(sqlx::Error::PoolClosed);
            }
            // The most recently used first: the likeliest to be alive.
            let kept = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            let Some((mut conn, since)) = kept else {
                let conn = pool.acquire().await?;
                return Ok(Checkout {
                    conn,
                    home: self,
                    pool,
                    keep_at_most,
                    _permit: permit,
                });
            };
            if since.elapsed() < IDLE_CHECK_AFTER || conn.ping().await.is_ok() {
                return Ok(Checkout {
                    conn,
                    home: self,
                    pool,
                    keep_at_most,
                    _permit: permit,
                });
            }
            // Dead while idle: back to the pool (which closes it), and the
            // next.
        }
    }
}

/// Says the watching task ended, however it ends (dropped with its
/// runtime too).
struct Ended(Arc<AtomicBool>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Every kept connection, taken out under the lock; dropped by the caller
/// outside it, each goes back to its pool.
fn take_all(idle: &Idle) -> Vec<(PoolConnection<Postgres>, Instant)> {
    idle.lock()
        .map(|mut idle| std::mem::take(&mut *idle))
        .unwrap_or_default()
}
