//! A Redis that refuses writes for now (out of memory under `noeviction`,
//! a replica that was a primary before a failover) makes the store
//! unavailable (`503` with `Retry-After`; idem-once retries a completion),
//! never a final failure: on a server of the test's own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_core::{Store, StoreError};
use idem_redis::{RedisConfig, RedisStore};

/// A `redis-server` of the test's own, killed when dropped.
struct OwnRedis {
    child: Child,
    port: u16,
}

impl OwnRedis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--enable-debug-command", "yes"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (`bash scripts/test` installs it)");
        let own = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while own.cli(&["PING"]) != "PONG" {
            assert!(Instant::now() < deadline, "redis-server never answered");
            std::thread::sleep(Duration::from_millis(50));
        }
        own
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn request(key: &str) -> idem_core::ClaimRequest {
    idem_store_suite::request(
        "s",
        key,
        "{}",
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

#[tokio::test]
async fn a_redis_refusing_writes_for_now_is_unavailable() {
    let redis = OwnRedis::start();
    let store = RedisStore::connect(RedisConfig::new(redis.url()).prefix("refusals"))
        .await
        .unwrap();
    assert!(store.claim(&request("before")).await.is_ok());

    // Out of memory, nothing to evict: `-OOM`.
    assert_eq!(
        redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        "OK"
    );
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    let full = store.claim(&request("full")).await;
    assert!(matches!(full, Err(StoreError::Unavailable(_))), "{full:?}");
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");

    // A replica now (the address still names the old primary after a
    // failover): `-READONLY`.
    let primary = OwnRedis::start();
    assert_eq!(
        redis.cli(&["REPLICAOF", "127.0.0.1", &primary.port.to_string()]),
        "OK"
    );
    let replica = store.claim(&request("replica")).await;
    assert!(
        matches!(replica, Err(StoreError::Unavailable(_))),
        "{replica:?}"
    );
}

/// A claim whose answer came too late (the server stalled for a moment)
/// was still written; the caller was told the store was unavailable, so
/// the claim is let go (fenced by its token), and the retry runs rather
/// than meet `409` for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_too_late_is_let_go() {
    use idem_core::ClaimOutcome;
    let redis = OwnRedis::start();
    let store = RedisStore::connect(RedisConfig::new(redis.url()).prefix("late"))
        .await
        .unwrap();
    // Loaded first, so that the stall is all the claim meets.
    assert!(store.claim(&request("warm")).await.is_ok());
    let port = redis.port.to_string();
    let stall = std::thread::spawn(move || {
        Command::new("redis-cli")
            .args(["-p", &port, "DEBUG", "SLEEP", "1.5"])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(200));
    let late = store.claim(&request("k")).await;
    assert!(matches!(late, Err(StoreError::Unavailable(_))), "{late:?}");
    stall.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.claim(&request("k")).await {
            Ok(ClaimOutcome::Acquired(_)) => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "the late claim still holds the key: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
