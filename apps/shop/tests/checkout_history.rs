//! The checkout history: orders paid through `POST /orders/{id}/checkout`
//! by clients that retry, against two `shop` processes per mode, while the
//! processes crash between the bank and the charge step's record
//! (`crash-after-bank`), between the two steps (`crash-after-charge`), get
//! `kill -9`, and the bank fails. Every answer is recorded; then, per
//! order:
//!
//! - one bank charge (`bank_charges` 1 on the order, 1 on its account), one
//!   payment, one receipt email;
//! - the order `paid`, and every `200` for its key byte-equal to the first;
//! - another key for the paid order `409` (`order-already-paid`).
//!
//! The figures (orders, requests, crashes, kills, restarts, charges per
//! order) are printed per mode (`--nocapture`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fleet::Fleet;
use common::{read, Mode, Rng};
use serde_json::Value;

const LEASE_MS: u64 = 1500;
const ORDERS: usize = 12;
const PROCESSES: usize = 2;
/// Attempts per order with faults injected, before it is settled.
const CHAOS_ATTEMPTS: u64 = 3;

/// What the run saw.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    crashes: u64,
    answers: Vec<(usize, u16, bool, Vec<u8>)>,
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

fn checkout(base: &str, order: &str, key: &str, account: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{base}/orders/{order}/checkout"))
        .header("authorization", "Bearer client-1")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(format!(
            r#"{{"account_id":"{account}","amount":2500,"currency":"EUR"}}"#
        ))
}

async fn get(base: &str, path: &str) -> Value {
    client()
        .get(format!("{base}{path}"))
        .header("authorization", "Bearer client-1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// One order's client: faults first, then retries without them until
/// paid.
async fn pay(fleet: Arc<Fleet>, tally: Arc<Mutex<Tally>>, i: usize, order: String, seed: u64) {
    let mut rng = Rng::new(seed);
    let key = format!("checkout-{i}");
    let account = format!("acc-h-{i}");
    for _ in 0..CHAOS_ATTEMPTS {
        let fault = match rng.below(100) {
            0..=24 => Some("crash-after-bank"),
            25..=49 => Some("crash-after-charge"),
            50..=64 => Some("bank-error"),
            65..=74 => Some("bank-delay=2000"),
            _ => None,
        };
        let Some(base) = fleet.base(rng.next()) else {
            fleet.tend(None).await;
            continue;
        };
        let mut request = checkout(&base, &order, &key, &account);
        if let Some(f) = fault {
            request = request.header("x-simulate", f);
        }
        tally.lock().unwrap().requests += 1;
        match request.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let replayed = r.headers().contains_key("idempotent-replayed");
                let body = r.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
                tally
                    .lock()
                    .unwrap()
                    .answers
                    .push((i, status, replayed, body));
            }
            Err(_) => {
                if fault.is_some_and(|f| f.starts_with("crash")) {
                    tally.lock().unwrap().crashes += 1;
                }
                fleet.tend(None).await;
            }
        }
        // Now and then, a host dies under everyone.
        if rng.below(100) < 8 {
            fleet.tend(Some(rng.below(PROCESSES as u64) as usize)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
    }
    // Settle: retried without faults until paid.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "order {i} never settled; last answer: {last}"
        );
        let Some(base) = fleet.base(rng.next()) else {
            fleet.tend(None).await;
            continue;
        };
        tally.lock().unwrap().requests += 1;
        // Another client's fault may take this process down mid-request.
        let answer = match checkout(&base, &order, &key, &account).send().await {
            Ok(answer) => answer,
            Err(e) => {
                last = e.to_string();
                fleet.tend(None).await;
                continue;
            }
        };
        let status = answer.status().as_u16();
        let replayed = answer.headers().contains_key("idempotent-replayed");
        let body = answer.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
        match status {
            200 => {
                tally.lock().unwrap().answers.push((i, 200, replayed, body));
                break;
            }
            409 | 502 | 503 => {
                last = format!("{status} {}", String::from_utf8_lossy(&body));
                tally
                    .lock()
                    .unwrap()
                    .answers
                    .push((i, status, replayed, body));
                tokio::time::sleep(Duration::from_millis(200 + rng.below(300))).await;
            }
            other => panic!(
                "order {i}: unexpected answer {other}: {}",
                String::from_utf8_lossy(&body)
            ),
        }
    }
}

async fn run(mode: Mode) {
    let lease = LEASE_MS.to_string();
    let fleet = Fleet::start(
        mode,
        "checkout-history",
        PROCESSES,
        &["--lease-ms", &lease, "--fault-injection", "all"],
    )
    .await;
    let seed: u64 = std::env::var("IDEM_HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) ^ 0x9e37_79b9);
    let base = fleet.base(0).unwrap();
    let mut orders = Vec::new();
    for i in 0..ORDERS {
        let placed = read(
            client()
                .post(format!("{base}/orders"))
                .header("authorization", "Bearer client-1")
                .header("content-type", "application/json")
                .body(format!(
                    r#"{{"customer_id":"cust-h","client_reference":"h-{i}","items":[{{"sku":"sku-h","qty":1}}]}}"#
                )),
        )
        .await;
        assert_eq!(placed.status, 201, "{placed:?}");
        orders.push(placed.json()["id"].as_str().unwrap().to_owned());
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let clients: Vec<_> = orders
        .iter()
        .enumerate()
        .map(|(i, order)| {
            tokio::spawn(pay(
                fleet.clone(),
                tally.clone(),
                i,
                order.clone(),
                seed.wrapping_add(i as u64 * 7919),
            ))
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    fleet.tend(None).await;
    let base = fleet.base(0).unwrap();

    // Per order: paid, charged once, one payment, one receipt; every 200
    // the same bytes; another key refused.
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    let mut charges = Vec::new();
    for (i, order) in orders.iter().enumerate() {
        let shown = get(&base, &format!("/orders/{order}")).await;
        assert_eq!(shown["status"], "paid", "{mode:?} order {i}: {shown}");
        charges.push(shown["bank_charges"].as_i64().unwrap());
        let account = get(&base, &format!("/accounts/acc-h-{i}")).await;
        assert_eq!(account["bank_charges"], 1, "{mode:?} order {i}: {account}");
        assert_eq!(account["payments"], 1, "{mode:?} order {i}: {account}");
        let oks: Vec<&Vec<u8>> = tally
            .answers
            .iter()
            .filter(|(o, status, _, _)| *o == i && *status == 200)
            .map(|(_, _, _, body)| body)
            .collect();
        assert!(
            oks.windows(2).all(|w| w[0] == w[1]),
            "{mode:?} order {i}: 200s differ"
        );
        for (_, status, _, body) in tally.answers.iter().filter(|(o, ..)| *o == i) {
            assert!(
                [200, 409, 502, 503].contains(status),
                "{mode:?} order {i}: {status} {}",
                String::from_utf8_lossy(body)
            );
        }
        let other = read(checkout(
            &base,
            order,
            &format!("other-{i}"),
            &format!("acc-h-{i}"),
        ))
        .await;
        assert_eq!(other.status, 409, "{mode:?} order {i}: {other:?}");
    }
    assert!(
        charges.iter().all(|&c| c == 1),
        "{mode:?}: charges per order {charges:?}"
    );
    // One receipt per order, once the relay caught up (a message a killed
    // process's relay held is published again after the relay's lease).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut receipts = vec![0usize; ORDERS];
    loop {
        for (i, n) in receipts.iter_mut().enumerate() {
            *n = get(&base, &format!("/emails?account_id=acc-h-{i}")).await["emails"]
                .as_array()
                .map_or(0, Vec::len);
        }
        if receipts.iter().all(|&n| n >= 1) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        receipts.iter().all(|&n| n == 1),
        "{mode:?}: receipts per order {receipts:?}"
    );
    eprintln!(
        "checkout history {mode:?} (seed {seed}): {ORDERS} orders, {} requests, {} simulated crashes, {} kill -9, {} restarts; bank charges per order {charges:?}; receipts per order {receipts:?}; 0 violations",
        tally.requests,
        tally.crashes,
        *fleet.kills.lock().unwrap(),
        *fleet.restarts.lock().unwrap(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    run(Mode::Sqlite).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    run(Mode::Postgres).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    run(Mode::Mysql).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_claim_in_transaction() {
    run(Mode::ClaimInTx).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_redis_and_replay_cache() {
    run(Mode::Tiered).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone() {
    run(Mode::RedisAlone).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_on_a_redis_cluster() {
    run(Mode::RedisCluster).await
}
