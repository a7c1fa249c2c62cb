//! The generic store suite on Redis alone and on Redis in front of a store,
//! against the real server, each test under its own key prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Store, StoreError, StoredResponse};
use idem_memory::MemoryStore;
use idem_redis::{RedisConfig, RedisStore, TieredStore};
use idem_test_support::stores::{ClaimDelay, SlowClaimAnswers};

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

/// The Redis Cluster the tests use: three primaries (`bash scripts/test`
/// starts them on ports 7000 to 7002).
fn cluster_nodes() -> Vec<String> {
    std::env::var("IDEM_TEST_REDIS_CLUSTER")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".to_owned()
        })
        .split(',')
        .map(str::to_owned)
        .collect()
}

async fn cluster() -> (RedisStore, Prefix) {
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let nodes = cluster_nodes();
    let store = RedisStore::connect(RedisConfig::cluster(nodes.clone()).prefix(prefix))
        .await
        .unwrap_or_else(|e| {
            panic!("cannot connect to the Redis Cluster at {nodes:?} (`bash scripts/test` starts it): {e}")
        });
    (store.clone(), Prefix(store))
}

/// Redis alone on a three-primary Redis Cluster: a record's keys share a
/// slot, so every script runs on one node.
mod cluster_alone {
    idem_store_suite::store_suite!(|| super::cluster(), native_expiry);
}

async fn tiered_cluster() -> (TieredStore<Counting>, Prefix) {
    let (r, guard) = cluster().await;
    (TieredStore::new(counting(), r), guard)
}

mod tiered_over_cluster {
    idem_store_suite::store_suite!(|| super::tiered_cluster());
}

#[tokio::test]
async fn a_cluster_spreads_records_over_its_primaries_and_clears_them_all() {
    let (store, _guard) = cluster().await;
    for i in 0..60 {
        let outcome = store.claim(&req(&format!("spread-{i}"))).await.unwrap();
        assert!(matches!(outcome, ClaimOutcome::Acquired(_)));
    }
    assert_eq!(store.count_keys().await.unwrap(), 60);
    // The keys landed on more than one primary.
    let mut per_node = Vec::new();
    for node in cluster_nodes() {
        let client = redis::Client::open(node.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let n: u64 = redis::cmd("EVAL")
            .arg("return #redis.call('KEYS', ARGV[1])")
            .arg(0)
            .arg(format!("{}:*", store.prefix()))
            .query_async(&mut conn)
            .await
            .unwrap();
        per_node.push(n);
    }
    assert_eq!(per_node.iter().sum::<u64>(), 60, "{per_node:?}");
    assert!(
        per_node.iter().filter(|n| **n > 0).count() >= 2,
        "{per_node:?}"
    );
    assert_eq!(store.clear().await.unwrap(), 60);
    assert_eq!(store.count_keys().await.unwrap(), 0);
}

async fn tiered() -> (TieredStore<Counting>, Prefix) {
    let (r, guard) = redis().await;
    (TieredStore::new(counting(), r), guard)
}

mod tiered_over_memory {
    idem_store_suite::store_suite!(|| super::tiered());
}

/// The store behind the tier, counting the claims that reach it.
type Counting = SlowClaimAnswers<MemoryStore, Claims>;

fn counting() -> Counting {
    SlowClaimAnswers {
        inner: MemoryStore::new(),
        delay: Claims::default(),
    }
}

/// Counts the claims made, each answered at once.
#[derive(Debug, Default)]
struct Claims(Arc<AtomicUsize>);

impl ClaimDelay for Claims {
    fn delay(&self, _: &ClaimRequest) -> Duration {
        self.0.fetch_add(1, Ordering::SeqCst);
        Duration::ZERO
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
    let counter = store.inner().delay.0.clone();
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

#[tokio::test]
async fn clearing_a_prefix_with_pattern_characters_clears_only_it() {
    let base = format!("idem-glob-{}", uuid::Uuid::new_v4().simple());
    let url = redis_url();
    let starred = RedisStore::connect(RedisConfig::new(&url).prefix(format!("{base}*")))
        .await
        .unwrap();
    let other = RedisStore::connect(RedisConfig::new(&url).prefix(format!("{base}x")))
        .await
        .unwrap();
    let _guard = Prefix(other.clone());
    starred.claim(&req("a")).await.unwrap();
    other.claim(&req("b")).await.unwrap();
    assert_eq!(starred.count_keys().await.unwrap(), 1);
    assert_eq!(starred.clear().await.unwrap(), 1);
    assert_eq!(
        other.count_keys().await.unwrap(),
        1,
        "another prefix's key stays"
    );
    // Cleared here, on this runtime: the guard's clear (from a runtime of
    // its own, in `Drop`) was seen to leave this key behind.
    assert_eq!(other.clear().await.unwrap(), 1);
}

/// `wait_replicas` on a cluster: the script and its `WAIT` go to the
/// primary of the key's slot. The test cluster has no replicas, so the
/// claim is refused as unavailable, and released: a claim that does not
/// wait takes it over at once (its lease is not held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_claim_no_replica_acknowledged_is_refused_and_released() {
    let (plain, _guard) = cluster().await;
    let waiting = RedisStore::connect(
        RedisConfig::cluster(cluster_nodes())
            .prefix(plain.prefix())
            .wait_replicas(1, Duration::from_millis(50)),
    )
    .await
    .unwrap();
    for key in ["a", "b", "c"] {
        match waiting.claim(&req(key)).await {
            Err(StoreError::Unavailable(e)) => {
                let refused = e.downcast_ref::<idem_redis::NotReplicated>();
                assert_eq!(
                    refused.map(|r| (r.wanted, r.acknowledged)),
                    Some((1, 0)),
                    "{e}"
                );
            }
            other => panic!("no replica acknowledged, yet {other:?}"),
        }
        match plain.claim(&req(key)).await.unwrap() {
            ClaimOutcome::Acquired(claim) => assert!(claim.takeover, "released, not new"),
            ClaimOutcome::Existing(r) => panic!("the refused claim still holds {key}: {r:?}"),
        }
    }
}

/// A completion fewer replicas acknowledged than asked is reported
/// unavailable, though the primary has it: sent again by its holder (as
/// idem-once does), it stands, and is reported unavailable again while the
/// replicas lag, never as a claim lost. The same completion from a store
/// that does not wait is then simply done, and the record replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_sent_again_after_wait_fell_short_stands() {
    let (plain, _guard) = redis().await;
    // More replicas than any server here has.
    let waiting = RedisStore::connect(
        RedisConfig::new(redis_url())
            .prefix(plain.prefix())
            .wait_replicas(64, Duration::from_millis(20)),
    )
    .await
    .unwrap();
    let claim = match plain.claim(&req("w")).await.unwrap() {
        ClaimOutcome::Acquired(claim) => claim,
        ClaimOutcome::Existing(r) => panic!("a new key, yet {r:?}"),
    };
    for attempt in 1..=2 {
        match waiting.complete(&claim, &ok()).await {
            Err(StoreError::Unavailable(e)) => assert!(
                e.downcast_ref::<idem_redis::NotReplicated>().is_some(),
                "attempt {attempt}: {e}"
            ),
            other => panic!("attempt {attempt}: not replicated, yet {other:?}"),
        }
    }
    plain.complete(&claim, &ok()).await.unwrap();
    match plain.get("s", "w").await.unwrap().map(|r| r.state) {
        Some(idem_core::RecordState::Completed { response, .. }) => assert_eq!(response, ok()),
        other => panic!("completed, not {other:?}"),
    }
}

/// Clearing (or counting) a prefix leaves the records of a prefix that
/// begins with it and a colon (`shop` and `shop:eu`): made new again, its
/// keys would run their effects again.
#[tokio::test]
async fn clearing_a_prefix_leaves_a_longer_prefix_that_starts_with_it() {
    let base = format!("idem-nested-{}", uuid::Uuid::new_v4().simple());
    let url = redis_url();
    let outer = RedisStore::connect(RedisConfig::new(&url).prefix(base.clone()))
        .await
        .unwrap();
    let inner = RedisStore::connect(RedisConfig::new(&url).prefix(format!("{base}:eu")))
        .await
        .unwrap();
    let _guards = (Prefix(outer.clone()), Prefix(inner.clone()));
    outer.claim(&req("a")).await.unwrap();
    inner.claim(&req("b")).await.unwrap();
    assert_eq!(outer.count_keys().await.unwrap(), 1);
    assert_eq!(outer.clear().await.unwrap(), 1);
    assert_eq!(
        inner.count_keys().await.unwrap(),
        1,
        "the longer prefix's key stays"
    );
    assert!(inner.get("s", "b").await.unwrap().is_some());
    assert_eq!(inner.clear().await.unwrap(), 1);
}

/// On a cluster a prefix with a brace is refused with the reason: Redis
/// would hash the prefix's `{…}`, not the record's, and every record would
/// land in one slot, on one primary.
#[tokio::test]
async fn a_cluster_prefix_with_a_brace_is_refused() {
    for prefix in ["app{eu}", "app}", "{"] {
        let refused =
            RedisStore::connect(RedisConfig::cluster(cluster_nodes()).prefix(prefix)).await;
        let Err(StoreError::Backend(reason)) = &refused else {
            panic!("{prefix}: {:?}", refused.map(|_| ()));
        };
        assert!(reason.to_string().contains("one slot"), "{reason}");
    }
    // One server has no slots: the prefix is its own business.
    let one = RedisStore::connect(RedisConfig::new(redis_url()).prefix("app{eu}")).await;
    assert!(one.is_ok(), "{:?}", one.map(|_| ()));
}

/// `withdraw` deletes a claim that did nothing, by its token only: the key
/// is then free for a request with another body (a release would have
/// kept the record and refused it with `422`). Another token, or a
/// completed record, is left as it is.
#[tokio::test]
async fn a_withdrawn_claim_frees_the_key_for_any_request() {
    let (store, _prefix) = redis().await;
    let first = idem_store_suite::request(
        "s",
        "k",
        r#"{"a":1}"#,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let other = idem_store_suite::request(
        "s",
        "k",
        r#"{"a":2}"#,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let ClaimOutcome::Acquired(claim) = store.claim(&first).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let mut stranger = claim.clone();
    stranger.token = idem_core::FencingToken(claim.token.0.wrapping_add(1));
    assert!(!store.withdraw(&stranger).await.unwrap(), "another token");
    assert!(store.withdraw(&claim).await.unwrap());
    assert!(store.get("s", "k").await.unwrap().is_none());
    let ClaimOutcome::Acquired(taken) = store.claim(&other).await.unwrap() else {
        panic!("the key is free for another body")
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: "{}".into(),
    };
    store.complete(&taken, &response).await.unwrap();
    assert!(!store.withdraw(&taken).await.unwrap(), "completed: kept");
    assert!(store.get("s", "k").await.unwrap().is_some());
}
