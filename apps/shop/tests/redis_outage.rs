//! Redis stopped under load, then started again. Its own test binary: it
//! takes the shared Redis down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{account, pay, read, Db, Shop, BODY};

fn redis_up() -> bool {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "6379", "ping"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
}

fn stop_redis() {
    let _ = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "6379", "shutdown", "nosave"])
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis_up() {
        assert!(Instant::now() < deadline, "Redis did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts Redis the way this machine does.
fn start_redis() {
    let status = Command::new("redis-server")
        .args([
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "-::1",
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "/var/lib/redis",
            "--logfile",
            "/var/log/redis/ci.log",
        ])
        .status()
        .expect("run redis-server");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !redis_up() {
        assert!(Instant::now() < deadline, "Redis did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct StartOnDrop(Arc<AtomicBool>);

impl Drop for StartOnDrop {
    fn drop(&mut self) {
        if self.0.load(Ordering::SeqCst) {
            start_redis();
        }
    }
}

fn cached_keys(prefix: &str) -> usize {
    let out = Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            "6379",
            "--scan",
            "--pattern",
            &format!("{prefix}:*"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_answered_while_redis_is_down_and_the_fast_path_comes_back() {
    assert!(
        redis_up(),
        "Redis must be running on 127.0.0.1:6379 (`bash scripts/test` starts it)"
    );
    let db = Db::postgres().await;
    let prefix = format!("shop-outage-{}", uuid::Uuid::new_v4().simple());
    let args = [
        "--redis-url",
        "redis://127.0.0.1:6379",
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

    let down = Arc::new(AtomicBool::new(false));
    let guard = StartOnDrop(down.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        cached_keys(&prefix) > 0,
        "the fast path is in use before the outage"
    );
    down.store(true, Ordering::SeqCst);
    stop_redis();
    tokio::time::sleep(Duration::from_secs(2)).await;
    start_redis();
    down.store(false, Ordering::SeqCst);
    drop(guard);

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
        if cached_keys(&prefix) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the fast path did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "6379", "FLUSHALL"])
        .status();
}
