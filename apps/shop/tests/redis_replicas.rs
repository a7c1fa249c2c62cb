//! `--redis-wait-replicas`: with the records in Redis alone, a claim counts
//! only once a replica has it. Without a replica to acknowledge, the
//! payment is answered 503 and does not run (nothing charged), and its key
//! is free again at once; without the flag the same payment runs on a
//! claim that a failover could lose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{account, pay, read, Db, OwnRedis, Shop, BODY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_its_replica() {
    let primary = OwnRedis::start();
    let mut replica = OwnRedis::replica_of(&format!("127.0.0.1:{}", primary.port));
    primary.wait_replicas_online(1);
    let db = Db::postgres().await;
    let url = primary.url();
    let redis_alone = ["--redis-url", &url, "--idem-store", "redis"];
    let mut waiting = redis_alone.to_vec();
    waiting.extend([
        "--redis-wait-replicas",
        "1",
        "--redis-wait-timeout-ms",
        "200",
    ]);
    let safe = Shop::start(&db, &waiting).await;
    let plain = Shop::start(&db, &redis_alone).await;
    let client = common::signed_in();

    // A refused claim is released at once, so a busy machine that misses
    // the 200 ms `WAIT` on the first try gets the key's next try.
    let first = until_acknowledged(&client, &safe, "wait-1").await;
    assert_eq!(first.status, 201, "acknowledged by the replica: {first:?}");

    replica.stop();
    let before = account(&client, &safe, "acc_1").await;
    let refused = read(pay(&client, &safe, Some("wait-2"), BODY)).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(refused.headers.contains_key("retry-after"));
    assert!(
        refused.problem_type().ends_with("store-unavailable"),
        "{refused:?}"
    );
    let after = account(&client, &safe, "acc_1").await;
    assert_eq!(
        before["bank_charges"], after["bank_charges"],
        "nothing charged"
    );
    // Without the flag, the payment runs on a claim no replica has.
    let unsafe_run = read(pay(&client, &plain, Some("wait-3"), BODY)).await;
    assert_eq!(unsafe_run.status, 201);

    // The replica is back: the refused key runs now, not after a lease.
    replica.restart();
    primary.wait_replicas_online(1);
    // Not held for its 30 s lease: it runs as soon as the replica
    // acknowledges again (a busy machine may need a few tries).
    let retried = until_acknowledged(&client, &safe, "wait-2").await;
    assert_eq!(retried.status, 201, "released when refused: {retried:?}");
    let replay = read(pay(&client, &safe, Some("wait-2"), BODY)).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retried.body);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let end = account(&client, &safe, "acc_1").await;
    assert_eq!(
        end["bank_charges"].as_i64().unwrap() - before["bank_charges"].as_i64().unwrap(),
        2,
        "wait-3 and wait-2, once each: {end}"
    );
}

/// Pays with `key` until the answer is not `503` (a claim no replica
/// acknowledged in time, released at once), for at most 15 s.
async fn until_acknowledged(client: &reqwest::Client, shop: &Shop, key: &str) -> common::Answer {
    let start = std::time::Instant::now();
    loop {
        let a = read(pay(client, shop, Some(key), BODY)).await;
        if a.status != 503 || start.elapsed() > Duration::from_secs(15) {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flag_needs_redis_alone() {
    let db = Db::sqlite();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--listen", "127.0.0.1:0", "--database-url", &db.url()])
        .args(["--redis-wait-replicas", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--redis-wait-replicas applies to --idem-store redis"),
        "{err}"
    );
}

/// On a Redis Cluster too: the shared test cluster has no replicas, so no
/// claim is acknowledged: every payment is `503` and runs nothing (a
/// cluster failover with replicas is the history checker's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_without_replicas_nothing_runs() {
    let db = Db::postgres().await;
    let nodes = common::redis_cluster_urls();
    let prefix = common::RedisPrefix::new("wait-cluster");
    let shop = Shop::start(
        &db,
        &[
            "--redis-url",
            &nodes,
            "--redis-cluster",
            "--redis-prefix",
            &prefix.0,
            "--idem-store",
            "redis",
            "--redis-wait-replicas",
            "1",
            "--redis-wait-timeout-ms",
            "100",
        ],
    )
    .await;
    let client = common::signed_in();
    let before = account(&client, &shop, "acc_1").await;
    for i in 0..5 {
        let refused = read(pay(&client, &shop, Some(&format!("c-{i}")), BODY)).await;
        assert_eq!(refused.status, 503, "{refused:?}");
        assert!(
            refused.problem_type().ends_with("store-unavailable"),
            "{refused:?}"
        );
    }
    let after = account(&client, &shop, "acc_1").await;
    assert_eq!(
        before["bank_charges"], after["bank_charges"],
        "nothing charged"
    );
}
