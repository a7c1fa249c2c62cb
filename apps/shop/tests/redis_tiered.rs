//! Two `shop` instances with Redis in front of PostgreSQL, and a FLUSHALL
//! in the middle of a storm of duplicates, on a Redis server of the test's
//! own (the shared one is never flushed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{account, pay, read, Answer, Db, OwnRedis, Shop, BODY};

fn redis_cli(url: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-u", url])
        .args(args)
        .output()
        .expect("run redis-cli");
    assert!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_with_redis_and_a_flushall_mid_storm_charge_once_per_key() {
    let db = Db::postgres().await;
    let prefix = format!("shop-test-{}", uuid::Uuid::new_v4().simple());
    let redis = OwnRedis::start();
    let url = redis.url();
    let args = [
        "--redis-url",
        url.as_str(),
        "--redis-prefix",
        prefix.as_str(),
    ];
    let shops = [Shop::start(&db, &args).await, Shop::start(&db, &args).await];
    let client = reqwest::Client::new();

    let mut tasks = Vec::new();
    for i in 0..200 {
        let key = format!("tier-key-{}", i % 20);
        let r =
            pay(&client, &shops[i % 2], Some(&key), BODY).header("x-simulate", "bank-delay=150");
        tasks.push((key, tokio::spawn(read(r))));
        if i == 100 {
            // half-way: Redis forgets everything
            tokio::time::sleep(Duration::from_millis(100)).await;
            redis_cli(&url, &["FLUSHALL"]);
        }
    }
    let mut by_key: HashMap<String, Vec<Answer>> = HashMap::new();
    for (key, t) in tasks {
        by_key.entry(key).or_default().push(t.await.unwrap());
    }
    for (key, answers) in &by_key {
        let fresh: Vec<_> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed)
            .collect();
        assert_eq!(fresh.len(), 1, "{key}: {answers:?}");
        for a in answers {
            assert!(a.status == 201 || a.status == 409, "{key}: {a:?}");
            if a.status == 201 {
                assert_eq!(a.body, fresh[0].body);
            }
        }
        // replays from either instance, from Redis or through to SQL, agree
        for shop in &shops {
            let again = read(pay(&client, shop, Some(key), BODY)).await;
            assert!(again.replayed);
            assert_eq!(again.body, fresh[0].body);
        }
    }
    let acc = account(&client, &shops[0], "acc_1").await;
    assert_eq!(acc["payments"], 20, "{acc}");
    assert_eq!(acc["bank_charges"], 20, "{acc}");
    // the replays after the storm were cached in Redis again
    let cached = redis_cli(&url, &["--scan", "--pattern", &format!("{prefix}:*")]);
    assert!(cached.lines().count() >= 20, "{cached}");
}
