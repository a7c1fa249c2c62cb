//! Redis behind a link that stalls: a command that times out is followed on
//! a fresh connection, against the real server through a fault proxy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use idem_core::{ClaimOutcome, Store, StoreError};
use idem_redis::{RedisConfig, RedisStore};
use idem_test_support::faults::FaultProxy;

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// `host:port` of a `redis://[user@]host:port[/db]` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    rest.split(['/', '?']).next().unwrap_or(rest).to_owned()
}

fn req(key: &str) -> idem_core::ClaimRequest {
    idem_store_suite::request(
        "s",
        key,
        "{}",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

/// A TCP stream can go silent for good while the network works again: the
/// kernel's retransmission back-off after a partition keeps it quiet for
/// seconds past the heal. A command on it times out; the next must not
/// queue behind it on the same stream (each would time out in turn), but go
/// on a fresh connection, which works at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_command_times_out_the_next_goes_on_a_fresh_connection() {
    let proxy = FaultProxy::start(&host_port(&redis_url())).await;
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(
        RedisConfig::new(format!("redis://{}", proxy.addr()))
            .prefix(prefix)
            .timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach Redis (`bash scripts/test` starts it): {e}"));
    let ClaimOutcome::Acquired(first) = store.claim(&req("before")).await.unwrap() else {
        panic!("a new key is acquired");
    };

    proxy.stall();
    match store.claim(&req("stalled")).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("a command on a stalled connection times out: {other:?}"),
    }
    // Several commands in a row: each on a working connection.
    for i in 0..3 {
        let outcome = store.claim(&req(&format!("after-{i}"))).await;
        assert!(
            matches!(outcome, Ok(ClaimOutcome::Acquired(_))),
            "after a time-out, a fresh connection answers: {outcome:?}"
        );
    }
    let (record, _) = store.peek("s", "before").await.unwrap();
    assert_eq!(
        record.map(|r| r.operation_id),
        Some(first.operation_id),
        "what was written before the stall is read back on the new connection"
    );
    store.clear().await.unwrap();
}

/// Tiered: a request that completes while Redis is bypassed (another
/// request's Redis call failed a moment before) cannot delete its in-flight
/// marker, which lasts until its lease ends. Once Redis is used again, that
/// marker must not answer "in flight": the retry gets the completed record
/// from the SQL store, not 409s for the rest of the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_left_while_redis_was_bypassed_does_not_answer_in_flight() {
    use idem_core::{RecordState, StoredResponse};
    use idem_redis::TieredStore;
    use idem_test_support::faults::Fault;

    let proxy = FaultProxy::start(&host_port(&redis_url())).await;
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let redis = RedisStore::connect(
        RedisConfig::new(format!("redis://{}", proxy.addr()))
            .prefix(prefix)
            .timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach Redis (`bash scripts/test` starts it): {e}"));
    let sql = std::sync::Arc::new(idem_memory::MemoryStore::new());
    let store = TieredStore::new(sql.clone(), redis);
    // Another instance on the same SQL store and Redis, whose link is fine.
    let other_redis = RedisStore::connect(
        RedisConfig::new(redis_url())
            .prefix(store.redis().prefix())
            .timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let other_instance = TieredStore::new(sql.clone(), other_redis);
    // The claim's marker goes to Redis (its lease: 60 s).
    let ClaimOutcome::Acquired(claim) = store.claim(&req("k")).await.unwrap() else {
        panic!("a new key is acquired");
    };
    // Another request's Redis read times out: Redis is bypassed for 1 s.
    proxy.set(Fault::Partition);
    let other = store.claim(&req("other")).await.unwrap();
    assert!(matches!(other, ClaimOutcome::Acquired(_)), "{other:?}");
    // Meanwhile the first completes: SQL has it, the marker stays.
    let done = StoredResponse {
        status: 201,
        headers: vec![],
        body: "{}".into(),
    };
    store.complete(&claim, &done).await.unwrap();
    proxy.set(Fault::None);
    // Past the bypass, Redis is used again: the next request (for any key)
    // deletes the marker left behind, so another instance, which trusts
    // Redis, sees no request in flight either.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let next = store.claim(&req("next")).await.unwrap();
    assert!(matches!(next, ClaimOutcome::Acquired(_)), "{next:?}");
    match other_instance.claim(&req("k")).await.unwrap() {
        ClaimOutcome::Existing(r) => assert!(
            matches!(r.state, RecordState::Completed { .. }),
            "the other instance got the marker left in Redis: {r:?}"
        ),
        other => panic!("the completed record: {other:?}"),
    }
    match store.claim(&req("k")).await.unwrap() {
        ClaimOutcome::Existing(r) => assert!(
            matches!(r.state, RecordState::Completed { .. }),
            "the completed record, not the marker left in Redis: {r:?}"
        ),
        other => panic!("the completed record: {other:?}"),
    }
    store.redis().clear().await.unwrap();
}
