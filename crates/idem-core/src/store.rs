//! The `Store` trait: where records live.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::record::{Claim, Record, StoredResponse};

/// A boxed, `Send` future, as returned by [`Store`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller's claim is no longer current: its token was replaced by a
    /// takeover, or the record was completed or removed. The caller must not
    /// commit its effect.
    #[error("the claim was lost: another holder took the key over or the record is gone")]
    ClaimLost,
    /// The store could not be reached or failed to answer.
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store answered with an error that is not about reaching it (a
    /// constraint, a missing table, a bad statement).
    #[error("the idempotency store failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A stored record could not be decoded.
    #[error("a stored idempotency record is corrupt: {0}")]
    Corrupt(String),
}

/// What [`Store::claim`] is asked to do.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The tenant or client the key belongs to.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the claim is held before a retry may take it over.
    pub lease: Duration,
    /// How long a new record counts.
    pub retention: Duration,
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller holds the key: it is new (or its old record had expired),
    /// or the caller took over an expired or released lease
    /// ([`Claim::takeover`] tells which).
    Acquired(Claim),
    /// Someone else's record is there: completed, in flight under a live
    /// lease, or made by a request with another fingerprint. Pass it to
    /// [`on_arrival`](crate::on_arrival) to learn what to answer.
    Existing(Record),
}

/// Where idempotency records live.
///
/// Every operation is atomic on its own: two racing claims on one key never
/// both acquire it, and completion and release apply only while the record
/// still carries the caller's fencing token.
///
/// # Why boxed futures
///
/// The methods return [`BoxFuture`] rather than being `async fn`s so that the
/// trait is object-safe: applications choose a store at run time (SQLite or
/// PostgreSQL from a URL, with or without a cache in front) and hold it as
/// `Arc<dyn Store>`, and tiered stores wrap other stores the same way. One
/// allocation per call is noise next to a database round trip.
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// Claims `(scope, key)` atomically.
    ///
    /// - no record, or one past its retention: a fresh claim (new token, new
    ///   operation id);
    /// - a record in progress whose lease has run out (or was released), with
    ///   the same fingerprint: a takeover (new token, same operation id);
    /// - anything else: the existing record, untouched.
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>>;

    /// Completes the claimed record with its response, if the record still
    /// carries `claim.token` and is in progress; otherwise
    /// [`StoreError::ClaimLost`]. A record this claim already completed with
    /// the same response is `Ok` too: the same completion sent again, after
    /// its answer was lost on the way back (a time-out, a connection
    /// dropped after the commit), stands rather than reads as a takeover.
    /// Where telling the two apart takes a second look that fails, that
    /// failure is the answer, not [`StoreError::ClaimLost`]: a caller that
    /// retries an unavailable store finds out which it was.
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Releases the claim so that the next retry may take it over at once
    /// (keeping the operation id), if the record still carries `claim.token`
    /// and is in progress; otherwise [`StoreError::ClaimLost`].
    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Reads the record under `(scope, key)`; records past their retention
    /// read as absent.
    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;

    /// Deletes at most `batch` records past their retention, returning how
    /// many went. Call it until it returns less than `batch` to sweep all.
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// A short, fixed name for metrics labels (`sqlite`, `postgres`, …).
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// Told by the edge that `claim` was settled outside this store's own
    /// methods (completed inside the handler's transaction, or found lost),
    /// so that caches in front of the source of truth drop what they hold
    /// about it. The default does nothing.
    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        let _ = claim;
        Box::pin(async {})
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        (**self).claim(request)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).complete(claim, response)
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).release(claim)
    }
    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        (**self).get(scope, key)
    }
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        (**self).sweep(batch)
    }
    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        (**self).settled(claim)
    }
    fn kind(&self) -> &'static str {
        (**self).kind()
    }
}

impl From<crate::record::CorruptRecord> for StoreError {
    fn from(e: crate::record::CorruptRecord) -> Self {
        StoreError::Corrupt(e.0)
    }
}

/// Sweeps every expired record, `batch` at a time, returning how many went.
pub async fn sweep_all<S: Store + ?Sized>(store: &S, batch: usize) -> Result<u64, StoreError> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = store.sweep(batch).await?;
        total += n;
        if n < batch as u64 {
            return Ok(total);
        }
    }
}

/// A store whose records live in the same database as the application's
/// data, so that a handler can complete its record **inside its own
/// transaction** on connection type `C`: the business write and the record
/// commit together, or neither does.
///
/// Completion is fenced like [`Store::complete`]: if the record no longer
/// carries `claim.token`, nothing is written and [`StoreError::ClaimLost`]
/// is returned; the caller must then roll its transaction back.
pub trait TransactionalStore<C: ?Sized>: Store {
    /// Completes `claim` with `response` on `conn` (an open transaction).
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut C,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

impl<S, C> TransactionalStore<C> for Arc<S>
where
    S: TransactionalStore<C> + ?Sized,
    C: ?Sized,
{
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut C,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).complete_in_tx(conn, claim, response)
    }
}

/// A store that begins the business transaction its records complete in
/// (on the database the records live in), so that an edge can run a
/// handler's work, complete the record and commit in one call: the
/// `Guarded::transaction` of idem-axum.
pub trait BeginTransaction: TransactionalStore<Self::Connection> {
    /// The open transaction (e.g. `sqlx::Transaction<'static, Postgres>`).
    type Transaction: Send;
    /// The connection the transaction runs on, which the record is
    /// completed on.
    type Connection: ?Sized + Send;

    /// Begins a transaction (SQLite: an immediate one, the write lock first).
    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>>;

    /// The connection `tx` runs on.
    fn connection(tx: &mut Self::Transaction) -> &mut Self::Connection;

    /// Commits `tx`.
    fn commit(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>>;

    /// Rolls `tx` back.
    fn rollback(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>>;
}

impl<S: BeginTransaction + ?Sized> BeginTransaction for Arc<S> {
    type Transaction = S::Transaction;
    type Connection = S::Connection;

    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        (**self).begin_transaction()
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

/// What [`ClaimInTransaction::claim_and_begin`] found.
#[derive(Debug)]
pub enum TxClaimOutcome<T> {
    /// The key is claimed and `transaction` is open, holding the claim.
    Acquired {
        /// The claim: complete it in `transaction` before committing.
        claim: Claim,
        /// The open transaction that holds the claim.
        transaction: T,
    },
    /// Someone else's record is there: pass it to [`on_arrival`](crate::on_arrival).
    Existing(Record),
    /// An open transaction holds the key: the request is in flight.
    Busy,
}

/// A store whose claims are held by the **business transaction itself**
/// rather than by a lease alone.
///
/// [`claim_and_begin`](ClaimInTransaction::claim_and_begin) commits the
/// claim first (binding the key to this request's fingerprint and operation
/// id, durably, before any effect can leave the process), then begins the
/// transaction and holds the claim in it. While that transaction is open,
/// duplicates are busy (`409`). When it ends (commit, rollback, or the
/// process's death closing its connection) the claim is free at once: no
/// lease to wait out after a crash; a retry of the same request takes it
/// over under the same operation id, and another request gets `422`.
///
/// Complete the claim in the transaction with
/// [`TransactionalStore::complete_in_tx`], then commit. On any other
/// outcome, roll the transaction back **explicitly** before answering: a
/// transaction left to a drop ends later, and holds the key until it does.
pub trait ClaimInTransaction: Store {
    /// The transaction a claim is held in.
    type Transaction: Send;

    /// Claims `request` durably, then begins the transaction that holds it.
    fn claim_and_begin<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<TxClaimOutcome<Self::Transaction>, StoreError>>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::task::{Context, Poll, Waker};

    /// Runs a future that never waits (the test store's futures are ready).
    fn ready<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("the test store never waits"),
        }
    }

    /// Sweeps the given numbers of records, one batch per call.
    #[derive(Debug)]
    struct Batches(Mutex<Vec<u64>>);

    impl Store for Batches {
        fn claim<'a>(
            &'a self,
            _: &'a ClaimRequest,
        ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
            Box::pin(async { Err(StoreError::Backend("unused".into())) })
        }
        fn complete<'a>(
            &'a self,
            _: &'a Claim,
            _: &'a StoredResponse,
        ) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn release<'a>(&'a self, _: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn get<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
        ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
            Box::pin(async { Ok(None) })
        }
        fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
            let mut left = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let n = if left.is_empty() { 0 } else { left.remove(0) };
            assert!(n <= batch as u64);
            Box::pin(async move { Ok(n) })
        }
    }

    #[test]
    fn sweep_all_sweeps_until_a_batch_comes_back_short() {
        let store = Batches(Mutex::new(vec![3, 3, 2, 3]));
        assert_eq!(ready(sweep_all(&store, 3)).unwrap(), 8);
        // the last full-looking batch was never asked for
        assert_eq!(*store.0.lock().unwrap(), vec![3]);
        let exact = Batches(Mutex::new(vec![3, 3]));
        assert_eq!(ready(sweep_all(&exact, 3)).unwrap(), 6);
        // a batch of zero is one at a time, not an endless loop
        let ones = Batches(Mutex::new(vec![1, 1, 0]));
        assert_eq!(ready(sweep_all(&ones, 0)).unwrap(), 2);
    }

    #[test]
    fn a_shared_store_keeps_its_kind() {
        let store = || Batches(Mutex::new(vec![]));
        assert_eq!(store().kind(), "custom", "the trait's default");
        assert_eq!(Arc::new(store()).kind(), "custom");
        let shared: Arc<dyn Store> = Arc::new(store());
        assert_eq!(shared.kind(), "custom");
    }
}
