//! `/healthz` in Redis-alone mode reflects Redis: on a Redis server of the
//! test's own (the shared one is never stopped), stopped and started again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{Db, OwnRedis, Shop};

async fn health(client: &reqwest::Client, shop: &Shop) -> reqwest::Response {
    client.get(shop.url("/healthz")).send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_while_the_redis_of_redis_alone_mode_is_down() {
    let mut redis = OwnRedis::start();
    let db = Db::sqlite();
    let url = redis.url();
    let shop = Shop::start(&db, &["--redis-url", &url, "--idem-store", "redis"]).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    assert_eq!(health(&client, &shop).await.status(), 200);

    redis.stop();
    let down = health(&client, &shop).await;
    assert_eq!(down.status(), 503);
    assert_eq!(down.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = down.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("store-unavailable"),
        "{problem}"
    );
    assert!(
        problem["title"].as_str().unwrap().contains("Redis"),
        "{problem}"
    );

    // Redis back on the same port: healthy again, without a restart.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    while health(&client, &shop).await.status() != 200 {
        assert!(Instant::now() < deadline, "still unhealthy with Redis back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
