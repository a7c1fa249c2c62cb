//! The generic store suite on Redis alone and on Redis in front of a store,
//! against the real server, each test under its own key prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, Store, StoreError, StoredResponse,
};
use idem_memory::MemoryStore;
use idem_redis::{RedisConfig, RedisStore, TieredStore};

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Deletes the test's keys when dropped.
struct Prefix(RedisStore);

impl Drop for Prefix {
    fn drop(&mut self) {
        let store = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(store.clear()).ok()
        })
        .join();
    }
}

async fn redis() -> (RedisStore, Prefix) {
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let url = redis_url();
    let store = RedisStore::connect(RedisConfig::new(&url).prefix(prefix))
        .await
        .unwrap_or_else(|e| {
            panic!("cannot connect to Redis at {url} (`bash scripts/test` starts it): {e}")
        });
    (store.clone(), Prefix(store))
}

mod alone {
    idem_store_suite::store_suite!(|| super::redis(), native_expiry);
}

async fn tiered() -> (TieredStore<Counting<MemoryStore>>, Prefix) {
    let (r, guard) = redis().await;
    (
        TieredStore::new(Counting::new(MemoryStore::new()), r),
        guard,
    )
}

mod tiered_over_memory {
    idem_store_suite::store_suite!(|| super::tiered());
}

/// Counts the claims that reach the store behind the tier.
#[derive(Debug)]
struct Counting<S> {
    inner: S,
    claims: Arc<AtomicUsize>,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            claims: Arc::default(),
        }
    }
}

impl<S: Store> Store for Counting<S> {
    fn claim<'a>(&'a self, r: &'a ClaimRequest) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(r)
    }
    fn complete<'a>(
        &'a self,
        c: &'a Claim,
        r: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.complete(c, r)
    }
    fn release<'a>(&'a self, c: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.release(c)
    }
    fn get<'a>(
        &'a self,
        s: &'a str,
        k: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.get(s, k)
    }
    fn sweep(&self, b: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.sweep(b)
    }
}

fn req(key: &str) -> ClaimRequest {
    idem_store_suite::request(
        "s",
        key,
        "{}",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

fn ok() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("location".into(), b"/x".to_vec())],
        body: "{}".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_and_in_flight_collisions_do_not_touch_the_sql_store_while_cached() {
    let (store, _guard) = tiered().await;
    let counter = store.inner().claims.clone();
    let ClaimOutcome::Acquired(claim) = store.claim(&req("k")).await.unwrap() else {
        panic!()
    };
    assert_eq!(counter.load(Ordering::SeqCst), 1);
    // in flight: answered from Redis
    for _ in 0..5 {
        assert!(matches!(
            store.claim(&req("k")).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        1,
        "in-flight collisions stay in Redis"
    );
    store.complete(&claim, &ok()).await.unwrap();
    // the first replay reads through, the rest come from Redis
    for _ in 0..20 {
        assert!(matches!(
            store.claim(&req("k")).await.unwrap(),
            ClaimOutcome::Existing(_)
        ));
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        2,
        "one read-through, then Redis alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_redis_falls_through_to_sql() {
    let (store, guard) = tiered().await;
    let ClaimOutcome::Acquired(claim) = store.claim(&req("f")).await.unwrap() else {
        panic!()
    };
    store.complete(&claim, &ok()).await.unwrap();
    assert!(matches!(
        store.claim(&req("f")).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    guard.0.clear().await.unwrap(); // what FLUSHALL does to this prefix
    let again = store.claim(&req("f")).await.unwrap();
    assert!(matches!(again, ClaimOutcome::Existing(ref r) if r.operation_id == claim.operation_id));
}

#[tokio::test]
async fn an_unreachable_redis_is_an_error_at_connect_not_a_panic() {
    let err = RedisStore::connect(
        RedisConfig::new("redis://127.0.0.1:1").timeout(Duration::from_millis(100)),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(RedisStore::connect(RedisConfig::new("not a url"))
        .await
        .is_err());
}
