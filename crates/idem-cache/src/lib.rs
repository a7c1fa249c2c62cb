//! [`ReplayCache`]: completed records kept in process, a zero-round-trip
//! tier for replays in front of any store (SQLite, PostgreSQL, Redis, or
//! Redis in front of SQL).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use idem_core::{
    BeginTransaction, BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, RecordState, Store,
    StoreError, StoredResponse, TransactionalStore, UnixMillis,
};

type Id = (String, String);

#[derive(Debug, Default)]
struct Entries {
    records: HashMap<Id, Arc<Record>>,
    order: VecDeque<Id>,
    bytes: usize,
}

/// Completed records cached in this process, in front of store `S`.
///
/// A replay of a cached record is answered without any round trip. It is
/// safe with many instances because a completed record never changes before
/// it expires; in-flight records are never cached, so every claim that could
/// run a handler still goes to `S`. Bounded by entries and by bytes (oldest
/// out first); entries expire with their record (never served after it),
/// and [`Store::sweep`] through the cache drops them from the process.
///
/// ```
/// use idem_cache::ReplayCache;
/// use idem_memory::MemoryStore;
/// let store = ReplayCache::new(MemoryStore::new(), 10_000, 64 * 1024 * 1024);
/// ```
#[derive(Debug)]
pub struct ReplayCache<S> {
    inner: S,
    entries: Mutex<Entries>,
    max_entries: usize,
    max_bytes: usize,
}

fn size(record: &Record) -> usize {
    let body = match &record.state {
        RecordState::Completed { response, .. } => {
            response.body.len()
                + response
                    .headers
                    .iter()
                    .map(|(n, v)| n.len() + v.len())
                    .sum::<usize>()
        }
        RecordState::InProgress { .. } => 0,
    };
    body + record.scope.len() + record.key.len() + 128
}

impl<S> ReplayCache<S> {
    /// Caches at most `max_entries` records and `max_bytes` of responses.
    pub fn new(inner: S, max_entries: usize, max_bytes: usize) -> Self {
        Self {
            inner,
            entries: Mutex::default(),
            max_entries,
            max_bytes,
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many records are cached.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lookup(&self, scope: &str, key: &str, now: UnixMillis) -> Option<Record> {
        let e = self.lock();
        let id = (scope.to_owned(), key.to_owned());
        let record = e.records.get(&id)?.clone();
        drop(e);
        // An expired record stays where it is (its place in the eviction
        // order with it) until it is evicted or replaced by `insert`: the
        // records and the order never disagree.
        (!record.is_expired(now)).then(|| (*record).clone())
    }

    fn insert(&self, record: &Record) {
        let n = size(record);
        // Already expired by this process's clock (the store's runs ahead,
        // or the record expired on its way here): never served, so never
        // kept, nor let to push out a live one.
        if n > self.max_bytes || self.max_entries == 0 || record.is_expired(UnixMillis::now()) {
            return;
        }
        let mut e = self.lock();
        let id = (record.scope.clone(), record.key.clone());
        if let Some(cached) = e.records.get(&id).cloned() {
            if !cached.is_expired(UnixMillis::now()) {
                return;
            }
            // The key was used again after its record expired: the old
            // record goes (from the order too), and the new one comes in
            // as any other, newest, within the bounds.
            e.records.remove(&id);
            e.order.retain(|old| old != &id);
            e.bytes = e.bytes.saturating_sub(size(&cached));
        }
        while e.records.len() >= self.max_entries || e.bytes + n > self.max_bytes {
            let Some(old) = e.order.pop_front() else {
                break;
            };
            if let Some(r) = e.records.remove(&old) {
                e.bytes = e.bytes.saturating_sub(size(&r));
            }
        }
        e.records.insert(id.clone(), Arc::new(record.clone()));
        e.order.push_back(id);
        e.bytes += n;
    }

    /// Drops the records expired at `now`: an answer past its retention is
    /// gone from the process too, not only never served.
    fn purge_expired(&self, now: UnixMillis) -> usize {
        let mut e = self.lock();
        let Entries {
            records,
            order,
            bytes,
        } = &mut *e;
        let before = records.len();
        records.retain(|_, record| {
            let expired = record.is_expired(now);
            if expired {
                *bytes = bytes.saturating_sub(size(record));
            }
            !expired
        });
        if records.len() != before {
            order.retain(|id| records.contains_key(id));
        }
        before - records.len()
    }
}

impl<S: Store> Store for ReplayCache<S> {
    fn kind(&self) -> &'static str {
        "replay-cache"
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            if let Some(record) = self.lookup(&request.scope, &request.key, UnixMillis::now()) {
                return Ok(ClaimOutcome::Existing(record));
            }
            let outcome = self.inner.claim(request).await?;
            if let ClaimOutcome::Existing(record) = &outcome {
                if matches!(record.state, RecordState::Completed { .. }) {
                    self.insert(record);
                }
            }
            Ok(outcome)
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.complete(claim, response)
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.release(claim)
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.get(scope, key)
    }

    /// Sweeps the store behind, and drops from the process the cached
    /// records expired by now (they count in neither figure: the store's
    /// copy is what the sweep deletes).
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.purge_expired(UnixMillis::now());
        self.inner.sweep(batch)
    }

    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        self.inner.settled(claim)
    }
}

impl<S: BeginTransaction> BeginTransaction for ReplayCache<S> {
    type Transaction = S::Transaction;
    type Connection = S::Connection;

    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        self.inner.begin_transaction()
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

impl<S, C> TransactionalStore<C> for ReplayCache<S>
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
        self.inner.complete_in_tx(conn, claim, response)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use idem_memory::MemoryStore;

    mod suite {
        idem_store_suite::store_suite!(|| async {
            (
                super::ReplayCache::new(idem_memory::MemoryStore::new(), 100, 1 << 20),
                (),
            )
        });
    }

    fn req(key: &str) -> ClaimRequest {
        idem_store_suite::request(
            "s",
            key,
            "{}",
            Duration::from_secs(60),
            Duration::from_millis(400),
        )
    }

    #[tokio::test]
    async fn replays_come_from_the_cache_and_expire_with_the_record() {
        let cache = ReplayCache::new(MemoryStore::new(), 2, 1 << 20);
        let ClaimOutcome::Acquired(c) = cache.claim(&req("a")).await.unwrap() else {
            panic!()
        };
        assert!(cache.is_empty(), "in-flight records are never cached");
        let ok = StoredResponse {
            status: 201,
            headers: vec![],
            body: "x".into(),
        };
        cache.complete(&c, &ok).await.unwrap();
        assert!(matches!(
            cache.claim(&req("a")).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        assert_eq!(cache.len(), 1);
        // served from the cache even if the store forgot it
        cache.inner().sweep(10).await.unwrap();
        assert!(matches!(
            cache.claim(&req("a")).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
        tokio::time::sleep(Duration::from_millis(450)).await;
        // expired: the key is new again
        assert!(matches!(
            cache.claim(&req("a")).await.unwrap(),
            ClaimOutcome::Acquired(_)
        ));
    }

    /// A key used again after its record expired: the new record takes the
    /// old one's place, and the eviction order holds each key once (it
    /// grew by one orphan per reuse, which later evicted fresh records).
    #[tokio::test]
    async fn a_key_reused_after_expiry_is_cached_once() {
        let cache = ReplayCache::new(MemoryStore::new(), 10, 1 << 20);
        let ok = StoredResponse {
            status: 201,
            headers: vec![],
            body: "x".into(),
        };
        for _ in 0..4 {
            let ClaimOutcome::Acquired(c) = cache.claim(&req("k")).await.unwrap() else {
                panic!("expired: the key is new again")
            };
            cache.complete(&c, &ok).await.unwrap();
            let again = cache.claim(&req("k")).await.unwrap();
            assert!(matches!(again, ClaimOutcome::Existing(_)), "{again:?}");
            assert_eq!(cache.len(), 1);
            assert_eq!(cache.lock().order.len(), 1, "the key once in the order");
            let bytes = cache.lock().bytes;
            assert_eq!(bytes, size(cache.lock().records.values().next().unwrap()));
            tokio::time::sleep(Duration::from_millis(450)).await;
        }
    }

    /// A sweep drops the records expired in the process too (they were
    /// never served, but stayed in memory until evicted: on a quiet
    /// service, for as long as it ran), and a record already expired when
    /// it arrives is not cached.
    #[tokio::test]
    async fn expired_records_leave_the_process_at_the_sweep() {
        let cache = ReplayCache::new(MemoryStore::new(), 10, 1 << 20);
        let ok = StoredResponse {
            status: 201,
            headers: vec![],
            body: "x".into(),
        };
        for k in ["a", "b"] {
            let ClaimOutcome::Acquired(c) = cache.claim(&req(k)).await.unwrap() else {
                panic!()
            };
            cache.complete(&c, &ok).await.unwrap();
            cache.claim(&req(k)).await.unwrap();
        }
        assert_eq!(cache.len(), 2);
        let old = cache.inner().get("s", "a").await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(450)).await;
        let ClaimOutcome::Acquired(c) = cache.claim(&req("c")).await.unwrap() else {
            panic!()
        };
        cache.complete(&c, &ok).await.unwrap();
        cache.claim(&req("c")).await.unwrap();
        assert_eq!(cache.len(), 3, "expired, still held until the sweep");
        cache.sweep(10).await.unwrap();
        assert_eq!(cache.len(), 1);
        let e = cache.lock();
        assert_eq!(e.order.len(), 1);
        assert!(e.records.contains_key(&("s".to_owned(), "c".to_owned())));
        assert_eq!(e.bytes, size(e.records.values().next().unwrap()));
        drop(e);
        cache.insert(&old);
        assert_eq!(cache.len(), 1, "an expired record is not cached");
    }

    #[tokio::test]
    async fn bounded_by_entries() {
        let cache = ReplayCache::new(MemoryStore::new(), 2, 1 << 20);
        let ok = StoredResponse {
            status: 200,
            headers: vec![],
            body: "x".into(),
        };
        for k in ["a", "b", "c"] {
            let ClaimOutcome::Acquired(c) = cache.claim(&req(k)).await.unwrap() else {
                panic!()
            };
            cache.complete(&c, &ok).await.unwrap();
            cache.claim(&req(k)).await.unwrap();
        }
        assert_eq!(cache.len(), 2);
        let tiny = ReplayCache::new(MemoryStore::new(), 10, 10);
        let ClaimOutcome::Acquired(c) = tiny.claim(&req("big")).await.unwrap() else {
            panic!()
        };
        tiny.complete(&c, &ok).await.unwrap();
        tiny.claim(&req("big")).await.unwrap();
        assert!(
            tiny.is_empty(),
            "a record over the byte bound is not cached"
        );
    }
}
