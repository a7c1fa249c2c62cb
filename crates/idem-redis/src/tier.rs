//! [`TieredStore`]: Redis in front of a SQL store.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{
    BeginTransaction, BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, RecordState, Store,
    StoreError, StoredResponse, TransactionalStore,
};
use tracing::{debug, warn};

use crate::RedisStore;

/// How long Redis is bypassed after it failed, before it is tried again.
const BACKOFF: Duration = Duration::from_secs(1);

/// Redis in front of a SQL store `S`; see the crate-level docs.
///
/// - Replays of completed records and collisions with in-flight ones are
///   answered from Redis, without touching `S`, while Redis holds them.
/// - Every claim that could run a handler is decided by `S` alone. Redis
///   only ever answers "already done" or "in flight", from records `S`
///   decided; a miss falls through to `S`.
/// - A Redis failure is logged and bypassed for a second, then tried again:
///   requests never fail because of Redis, and the fast path returns by
///   itself when Redis does.
#[derive(Debug)]
pub struct TieredStore<S> {
    sql: S,
    redis: RedisStore,
    bypass_until: Mutex<Option<Instant>>,
    /// Until when (the claims' clock, Unix ms) an in-flight marker in Redis
    /// may be one left behind: its claim ended (completed, released) while
    /// Redis was bypassed or failed, so it was not deleted, and it lasts
    /// until its lease ends. Until then Redis's in-flight answers are not
    /// trusted: the SQL store decides.
    stale_markers_until: AtomicI64,
    /// The keys whose markers could not be deleted, deleted once Redis
    /// answers again (so other instances, which trust Redis, stop
    /// answering 409 from them); at most [`UNFORGOTTEN_MAX`].
    unforgotten: Mutex<Vec<(String, String)>>,
}

/// The most keys kept to delete later; past that, their markers expire
/// with their leases.
const UNFORGOTTEN_MAX: usize = 10_000;

/// How many of them one request deletes.
const FORGOTTEN_PER_REQUEST: usize = 64;

impl<S> TieredStore<S> {
    /// `redis` in front of `sql`.
    pub fn new(sql: S, redis: RedisStore) -> Self {
        Self {
            sql,
            redis,
            bypass_until: Mutex::new(None),
            stale_markers_until: AtomicI64::new(0),
            unforgotten: Mutex::new(Vec::new()),
        }
    }

    /// The source of truth.
    pub fn inner(&self) -> &S {
        &self.sql
    }

    /// The fast tier.
    pub fn redis(&self) -> &RedisStore {
        &self.redis
    }

    fn redis_usable(&self) -> bool {
        let mut until = self.bypass_until.lock().unwrap_or_else(|e| e.into_inner());
        match *until {
            Some(t) if Instant::now() < t => false,
            Some(_) => {
                *until = None;
                true
            }
            None => true,
        }
    }

    fn redis_failed(&self, what: &str, e: &StoreError) {
        warn!(error = %e, what, "Redis failed; using the SQL store alone for a second");
        *self.bypass_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + BACKOFF);
    }

    /// Deletes the claim's in-flight marker; if that cannot be done, Redis's
    /// in-flight answers are not trusted until the marker's lease ends.
    async fn forget(&self, claim: &Claim) {
        let forgotten = self.redis_usable()
            && match self.redis.forget(&claim.scope, &claim.key).await {
                Ok(()) => true,
                Err(e) => {
                    self.redis_failed("forget", &e);
                    false
                }
            };
        if !forgotten {
            self.stale_markers_until
                .fetch_max(claim.locked_until.0, Ordering::SeqCst);
            let mut later = self.unforgotten.lock().unwrap_or_else(|e| e.into_inner());
            if later.len() < UNFORGOTTEN_MAX {
                later.push((claim.scope.clone(), claim.key.clone()));
            }
        }
    }

    /// Deletes the markers that could not be deleted when their claims
    /// ended; those it still cannot are kept for the next time.
    async fn forget_later(&self) {
        // A few a request, so that no one request pays for a long outage.
        let keys: Vec<(String, String)> = {
            let mut later = self.unforgotten.lock().unwrap_or_else(|e| e.into_inner());
            let from = later.len().saturating_sub(FORGOTTEN_PER_REQUEST);
            later.split_off(from)
        };
        for (i, (scope, key)) in keys.iter().enumerate() {
            if let Err(e) = self.redis.forget(scope, key).await {
                self.redis_failed("forget", &e);
                let mut later = self.unforgotten.lock().unwrap_or_else(|e| e.into_inner());
                later.extend(keys[i..].iter().cloned());
                later.truncate(UNFORGOTTEN_MAX);
                return;
            }
        }
    }

    /// Whether Redis's copy of a record can answer on its own: a completed
    /// record SQL committed, or an in-flight marker while none may be stale.
    fn answers(&self, record: &Record, now: idem_core::UnixMillis) -> bool {
        match &record.state {
            RecordState::Completed { .. } => !record.is_expired(now),
            RecordState::InProgress { locked_until, .. } => {
                *locked_until > now && now.0 >= self.stale_markers_until.load(Ordering::SeqCst)
            }
        }
    }
}

impl<S: Store> TieredStore<S> {
    async fn claim_inner(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let left_behind = !self
            .unforgotten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if left_behind && self.redis_usable() {
            self.forget_later().await;
        }
        if self.redis_usable() {
            match self.redis.fetch(&req.scope, &req.key).await {
                Ok((Some(record), now)) if self.answers(&record, now) => {
                    debug!("answered from Redis");
                    return Ok(ClaimOutcome::Existing(record));
                }
                Ok(_) => {}
                Err(e) => self.redis_failed("read", &e),
            }
        }
        let outcome = self.sql.claim(req).await?;
        if self.redis_usable() {
            let cached = match &outcome {
                ClaimOutcome::Acquired(claim) => {
                    self.redis.mark_in_flight(claim, &req.fingerprint).await
                }
                ClaimOutcome::Existing(record)
                    if matches!(record.state, RecordState::Completed { .. }) =>
                {
                    self.redis.cache_completed(record).await
                }
                ClaimOutcome::Existing(_) => Ok(()),
            };
            if let Err(e) = cached {
                self.redis_failed("write", &e);
            }
        }
        Ok(outcome)
    }
}

impl<S: Store> Store for TieredStore<S> {
    fn kind(&self) -> &'static str {
        "tiered"
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(self.claim_inner(request))
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let result = self.sql.complete(claim, response).await;
            // The next duplicate reads the completed record through SQL once
            // and caches it.
            self.forget(claim).await;
            result
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let result = self.sql.release(claim).await;
            self.forget(claim).await;
            result
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.sql.get(scope, key)
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.sql.sweep(batch)
    }

    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.sql.settled(claim).await;
            self.forget(claim).await;
        })
    }
}

impl<S: BeginTransaction> BeginTransaction for TieredStore<S> {
    type Transaction = S::Transaction;
    type Connection = S::Connection;

    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        self.sql.begin_transaction()
    }
    fn connection(tx: &mut Self::Transaction) -> &mut Self::Connection {
        S::connection(tx)
    }
    fn commit(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        S::commit(tx)
    }
    fn rollback(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        S::rollback(tx)
    }
}

impl<S, C> TransactionalStore<C> for TieredStore<S>
where
    S: TransactionalStore<C>,
    C: ?Sized,
{
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut C,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.sql.complete_in_tx(conn, claim, response)
    }
}
