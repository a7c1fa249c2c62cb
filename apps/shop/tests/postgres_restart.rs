//! PostgreSQL stopped and started again under load. This test binary holds
//! only this test: cargo runs test binaries one after another, so no other
//! test is using the server while it goes down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{account, pay, read, Db, Shop, BODY};

/// The local cluster, driven with Debian's `pg_ctlcluster`.
struct Cluster {
    version: String,
}

impl Cluster {
    fn find() -> Cluster {
        let version = std::fs::read_dir("/etc/postgresql")
            .expect("PostgreSQL's /etc/postgresql (this test drives the local Debian cluster)")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .max()
            .expect("a cluster version under /etc/postgresql");
        Cluster { version }
    }

    fn ctl(&self, action: &str) {
        let mut cmd = Command::new("pg_ctlcluster");
        cmd.args(["--skip-systemctl-redirect", &self.version, "main", action]);
        if action == "stop" {
            cmd.args(["-m", "fast"]);
        }
        let status = cmd.status().expect("run pg_ctlcluster");
        assert!(
            status.success(),
            "pg_ctlcluster {action} failed: {status:?}"
        );
    }
}

/// Starts the server again if the test ends while it is down.
struct RestartOnDrop<'a>(&'a Cluster, Arc<AtomicBool>);

impl Drop for RestartOnDrop<'_> {
    fn drop(&mut self) {
        if self.1.load(Ordering::SeqCst) {
            self.0.ctl("start");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_restart_under_load_gives_503s_then_recovers_without_double_charges() {
    let cluster = Cluster::find();
    let db = Db::postgres().await;
    let lease = ["--lease-ms", "2000"];
    let shops = Arc::new([
        Shop::start(&db, &lease).await,
        Shop::start(&db, &lease).await,
    ]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();

    // 12 clients, each paying under a fresh key after another for 8 s,
    // retrying each key until it gets 201, spread over both instances.
    const CLIENTS: usize = 12;
    let load_for = Duration::from_secs(8);
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (client, shops) = (client.clone(), shops.clone());
        clients.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut paid = 0usize;
            let mut attempt = 0usize;
            while started.elapsed() < load_for {
                let key = format!("restart-{c}-{paid}");
                loop {
                    attempt += 1;
                    let shop = &shops[(c + attempt) % 2];
                    let sent = Instant::now();
                    let r =
                        pay(&client, shop, Some(&key), BODY).header("x-simulate", "bank-delay=50");
                    let resp = match r.send().await {
                        Ok(resp) => resp,
                        Err(e) => panic!("{key}: no answer within the client's 15 s bound: {e}"),
                    };
                    let status = resp.status().as_u16();
                    let ctype = resp
                        .headers()
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    assert!(
                        sent.elapsed() < Duration::from_secs(10),
                        "{key}: an answer took {:?}",
                        sent.elapsed()
                    );
                    seen.push(status);
                    match status {
                        201 => break,
                        409 => {}
                        503 => {
                            assert_eq!(ctype.as_deref(), Some("application/problem+json"), "{key}")
                        }
                        other => panic!("{key}: unexpected status {other}"),
                    }
                    assert!(
                        started.elapsed() < Duration::from_secs(60),
                        "{key} never succeeded: {seen:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                paid += 1;
            }
            (paid, seen)
        }));
    }

    // Take the server down in the middle of the load, for three seconds.
    let down = Arc::new(AtomicBool::new(false));
    let guard = RestartOnDrop(&cluster, down.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    down.store(true, Ordering::SeqCst);
    cluster.ctl("stop");
    let probe = read(client.get(shops[0].url("/healthz"))).await;
    assert_eq!(probe.status, 503, "healthz reports the outage: {probe:?}");
    let during = read(pay(&client, &shops[1], Some("during-outage"), BODY)).await;
    assert_eq!(during.status, 503, "{during:?}");
    assert!(
        during.problem_type().ends_with("store-unavailable"),
        "{during:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.ctl("start");
    down.store(false, Ordering::SeqCst);
    drop(guard);

    let mut statuses = Vec::new();
    let mut keys = 0;
    for c in clients {
        let (paid, seen) = c.await.unwrap();
        keys += paid;
        statuses.extend(seen);
    }
    assert!(
        statuses.contains(&503),
        "some requests met the outage: {statuses:?}"
    );
    let after_outage = statuses.iter().rposition(|s| *s == 503).unwrap();
    assert!(
        statuses[after_outage..].contains(&201),
        "service resumed after the outage"
    );

    // Service resumed by itself: the totals show every key paid exactly once.
    let acc = account(&client, &shops[0], "acc_1").await;
    assert_eq!(acc["payments"], keys, "{acc}");
    assert_eq!(acc["bank_charges"], keys, "no double charge: {acc}");
    eprintln!(
        "{keys} keys paid across the outage; {} answers, {} of them 503",
        statuses.len(),
        statuses.iter().filter(|s| **s == 503).count()
    );
    // and no key is left held: a fresh request on each instance just works
    for (i, shop) in shops.iter().enumerate() {
        let a = read(pay(&client, shop, Some(&format!("after-{i}")), BODY)).await;
        assert_eq!(a.status, 201, "{a:?}");
    }
}
