//! [`BoundedStore`]: every store call that waits gets an answer within a
//! time limit.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, Store, StoreError, StoredResponse,
};

/// A store whose every call ends within `timeout` of its first poll (the
/// poll that starts it, sending the request; a call answered by that poll
/// sets no timer): one that gets no answer in time fails with
/// [`StoreError::Unavailable`] (its cause a [`StoreTimedOut`]) instead of
/// waiting for a network partition to heal.
///
/// What a call that timed out did is unknown, and every caller already
/// treats an unavailable store that way: a claim may have been written (it
/// is then held until its lease runs out, and a retry takes it over under
/// the same operation id), a completion may not have been (the claim stays
/// until its lease ends, so nothing runs again before then), a release is
/// left to the lease. The edges (the axum and tonic layers, the proxy) wrap
/// their store in one, with [`Policy::store_timeout`](idem_core::Policy::store_timeout).
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idem_core::Store;
/// let store: Arc<dyn Store> = Arc::new(idem_memory::MemoryStore::new());
/// let bounded = idem_once::BoundedStore::new(store, Duration::from_secs(5));
/// assert_eq!(bounded.kind(), "memory");
/// ```
#[derive(Debug, Clone)]
pub struct BoundedStore {
    inner: Arc<dyn Store>,
    timeout: Duration,
}

/// The cause of [`StoreError::Unavailable`] when a store call got no answer
/// within a [`BoundedStore`]'s limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the idempotency store gave no answer within {0:?}")]
pub struct StoreTimedOut(pub Duration);

impl BoundedStore {
    /// `inner`, each call bounded by `timeout`.
    pub fn new(inner: Arc<dyn Store>, timeout: Duration) -> Self {
        Self { inner, timeout }
    }

    /// The store it bounds.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    /// The limit on each call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match within(self.timeout, call).await {
            Some(result) => result,
            None => Err(StoreError::Unavailable(Box::new(StoreTimedOut(
                self.timeout,
            )))),
        }
    }
}

/// `call`'s output, or `None` if it had none `limit` after its first poll.
///
/// A call that answers on its first poll (the memory store, an answer
/// already at hand) sets no timer: the timer would cost more than the call.
/// Any other is timed from the end of that poll, which only starts the
/// work (sends the request); a poll that blocked could not be cut short by
/// a timer anyway.
async fn within<T>(limit: Duration, call: impl Future<Output = T>) -> Option<T> {
    let mut call = std::pin::pin!(call);
    if let Poll::Ready(answer) =
        std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await
    {
        return Some(answer);
    }
    tokio::time::timeout(limit, call).await.ok()
}

impl Store for BoundedStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(self.bounded(self.inner.claim(request)))
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.bounded(self.inner.complete(claim, response)))
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.bounded(self.inner.release(claim)))
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(self.bounded(self.inner.get(scope, key)))
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(self.bounded(self.inner.sweep(batch)))
    }

    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _ = within(self.timeout, self.inner.settled(claim)).await;
        })
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Fingerprint;

    /// A store that never answers, as one behind a network partition.
    #[derive(Debug)]
    struct Partitioned;

    impl Store for Partitioned {
        fn claim<'a>(
            &'a self,
            _: &'a ClaimRequest,
        ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn complete<'a>(
            &'a self,
            _: &'a Claim,
            _: &'a StoredResponse,
        ) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(std::future::pending())
        }
        fn release<'a>(&'a self, _: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(std::future::pending())
        }
        fn get<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
        ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn sweep(&self, _: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn settled<'a>(&'a self, _: &'a Claim) -> BoxFuture<'a, ()> {
            Box::pin(std::future::pending())
        }
    }

    fn request() -> ClaimRequest {
        ClaimRequest {
            scope: "s".into(),
            key: "k".into(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
        }
    }

    /// A call answered on its first poll sets no timer: it runs on a
    /// runtime without timers, where setting one panics.
    #[test]
    fn an_answer_on_the_first_poll_sets_no_timer() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = BoundedStore::new(
            Arc::new(idem_memory::MemoryStore::new()),
            Duration::from_secs(5),
        );
        let outcome = runtime.block_on(store.claim(&request())).unwrap();
        let ClaimOutcome::Acquired(claim) = outcome else {
            panic!("{outcome:?}")
        };
        let response = StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: Vec::new().into(),
        };
        runtime.block_on(store.complete(&claim, &response)).unwrap();
        let record = runtime.block_on(store.get("s", "k")).unwrap();
        assert!(record.is_some_and(|r| matches!(r.state, idem_core::RecordState::Completed { .. })));
    }

    /// A call that waits is answered if it answers within the limit, and
    /// cut short if it does not.
    #[tokio::test]
    async fn a_call_that_waits_is_timed() {
        let answer = within(Duration::from_secs(30), async {
            tokio::task::yield_now().await;
            7
        })
        .await;
        assert_eq!(answer, Some(7));
        let late = within(Duration::from_millis(20), async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            7
        })
        .await;
        assert_eq!(late, None);
    }

    #[tokio::test]
    async fn every_call_ends_within_the_limit() {
        let limit = Duration::from_millis(50);
        let store = BoundedStore::new(Arc::new(Partitioned), limit);
        let started = tokio::time::Instant::now();
        let err = store.claim(&request()).await.unwrap_err();
        assert!(started.elapsed() >= limit);
        let StoreError::Unavailable(cause) = err else {
            panic!("{err:?}")
        };
        assert_eq!(
            cause.downcast_ref::<StoreTimedOut>(),
            Some(&StoreTimedOut(limit))
        );
        assert!(matches!(
            store.get("s", "k").await,
            Err(StoreError::Unavailable(_))
        ));
        assert!(matches!(
            store.sweep(10).await,
            Err(StoreError::Unavailable(_))
        ));
        let claim = Claim {
            scope: "s".into(),
            key: "k".into(),
            token: idem_core::FencingToken::generate(),
            operation_id: idem_core::OperationId::generate(),
            locked_until: idem_core::UnixMillis(0),
            takeover: false,
        };
        assert!(matches!(
            store.release(&claim).await,
            Err(StoreError::Unavailable(_))
        ));
        let response = StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: Vec::new().into(),
        };
        assert!(matches!(
            store.complete(&claim, &response).await,
            Err(StoreError::Unavailable(_))
        ));
        let before = tokio::time::Instant::now();
        store.settled(&claim).await;
        assert!(before.elapsed() >= limit);
    }
}
