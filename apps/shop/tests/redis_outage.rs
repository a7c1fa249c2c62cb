//! Redis stopped under load, then started again: a Redis server of the
//! test's own (the shared one is never stopped or flushed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{account, pay, read, Db, OwnRedis, Shop, BODY};

fn cached_keys(redis: &OwnRedis, prefix: &str) -> usize {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &redis.port.to_string()])
        .args(["--scan", "--pattern", &format!("{prefix}:*")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_answered_while_redis_is_down_and_the_fast_path_comes_back() {
    let mut redis = OwnRedis::start();
    let redis_url = redis.url();
    let db = Db::postgres().await;
    let prefix = format!("shop-outage-{}", uuid::Uuid::new_v4().simple());
    let args = [
        "--redis-url",
        redis_url.as_str(),
        "--redis-prefix",
        prefix.as_str(),
    ];
    let shops = Arc::new([Shop::start(&db, &args).await, Shop::start(&db, &args).await]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    // Clients pay under fresh keys, and replay each one, for 6 s.
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..8 {
        let (client, shops) = (client.clone(), shops.clone());
        clients.push(tokio::spawn(async move {
            let mut paid = 0usize;
            while started.elapsed() < Duration::from_secs(6) {
                let key = format!("outage-{c}-{paid}");
                let first = read(pay(&client, &shops[paid % 2], Some(&key), BODY)).await;
                assert_eq!(first.status, 201, "{key}: {first:?}");
                let replay = read(pay(&client, &shops[(paid + 1) % 2], Some(&key), BODY)).await;
                assert_eq!(replay.status, 201, "{key}: {replay:?}");
                assert!(replay.replayed);
                assert_eq!(replay.body, first.body);
                paid += 1;
            }
            paid
        }));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        cached_keys(&redis, &prefix) > 0,
        "the fast path is in use before the outage"
    );
    redis.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.restart();

    let mut keys = 0;
    for c in clients {
        keys += c.await.unwrap();
    }
    let acc = account(&client, &shops[0], "acc_1").await;
    assert_eq!(acc["payments"], keys, "{acc}");
    assert_eq!(acc["bank_charges"], keys, "{acc}");

    // Redis came back empty; replays read through SQL and fill it again,
    // without a restart of either instance.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let key = "outage-0-0";
        let a = read(pay(&client, &shops[0], Some(key), BODY)).await;
        assert!(a.replayed);
        if cached_keys(&redis, &prefix) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the fast path did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
