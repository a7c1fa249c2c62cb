//! `shop --claim-in-transaction` on PostgreSQL: the real binary over TCP,
//! racing instances, and real processes killed mid-request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{account, pay, read, Db, Shop, BODY};

const IN_TX: &str = "--claim-in-transaction";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_200_racing_duplicates_of_20_keys_charge_20_times() {
    common::three_instances_race(&[IN_TX]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_bank_call_frees_the_key_at_once_and_the_retry_charges_once() {
    let db = Db::postgres().await;
    // A long lease: the retry must not need it to run out.
    let flags = [IN_TX, "--lease-ms", "60000"];
    let mut a = Shop::start(&db, &flags).await;
    let b = Shop::start(&db, &flags).await;
    let client = reqwest::Client::new();

    let lost = pay(&client, &a, Some("tx-crash"), BODY)
        .header("x-simulate", "crash-after-bank")
        .send()
        .await;
    assert!(lost.is_err(), "instance A died before answering: {lost:?}");
    assert!(!a.wait_exit(Duration::from_secs(10)).success());
    let crashed_at = Instant::now();
    let acc = account(&client, &b, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(0), Some(1)),
        "the bank charged; nothing of ours committed: {acc}"
    );

    // The claim is bound to its request: another amount is refused.
    let other = r#"{"account_id":"acc_1","amount":500,"currency":"EUR"}"#;
    let refused = read(pay(&client, &b, Some("tx-crash"), other)).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    // A's transaction died with its connection: B runs the retry now, under
    // the same operation id, and the bank does not charge again.
    let retry = read(pay(&client, &b, Some("tx-crash"), BODY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    assert!(
        crashed_at.elapsed() < Duration::from_secs(30),
        "no lease had to run out"
    );
    let acc = account(&client, &b, "acc_1").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "charged exactly once: {acc}");
    assert_eq!(
        retry.json()["bank_charge_id"]
            .as_str()
            .map(|s| s.starts_with("ch_")),
        Some(true)
    );
    let replay = read(pay(&client, &b, Some("tx-crash"), BODY)).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bank_slower_than_the_lease_rolls_back_and_the_retry_charges_once() {
    let db = Db::postgres().await;
    let shop = Shop::start(&db, &[IN_TX, "--lease-ms", "500"]).await;
    let client = reqwest::Client::new();
    // The transaction sits idle past the lease while the bank answers: the
    // server ends it, the payment is not written, the key is free.
    let slow =
        read(pay(&client, &shop, Some("tx-slow"), BODY).header("x-simulate", "bank-delay=1500"))
            .await;
    assert_eq!(slow.status, 503, "{slow:?}");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(0), Some(1)),
        "{acc}"
    );
    let retry = read(pay(&client, &shop, Some("tx-slow"), BODY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_errors_are_not_stored_and_server_errors_release() {
    let db = Db::postgres().await;
    let shop = Shop::start(&db, &[IN_TX]).await;
    let client = reqwest::Client::new();
    let bad = r#"{"account_id":"acc_1","amount":-5,"currency":"EUR"}"#;
    let first = read(pay(&client, &shop, Some("tx-400"), bad)).await;
    assert_eq!(first.status, 400, "{first:?}");
    let again = read(pay(&client, &shop, Some("tx-400"), bad)).await;
    assert_eq!(again.status, 400);
    assert!(!again.replayed, "refused before the claim: nothing stored");
    // The corrected request runs under the same key.
    let fixed = read(pay(&client, &shop, Some("tx-400"), BODY)).await;
    assert_eq!(fixed.status, 201, "{fixed:?}");

    let failed =
        read(pay(&client, &shop, Some("tx-503"), BODY).header("x-simulate", "bank-error")).await;
    assert!(failed.status >= 500, "{failed:?}");
    let other = r#"{"account_id":"acc_1","amount":2000,"currency":"EUR"}"#;
    let rebound = read(pay(&client, &shop, Some("tx-503"), other)).await;
    assert_eq!(rebound.status, 422, "the key stays bound: {rebound:?}");
    let retry = read(pay(&client, &shop, Some("tx-503"), BODY)).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed);
}

#[tokio::test]
async fn the_mode_refuses_stores_it_cannot_claim_in() {
    for extra in [
        vec!["--database-url", "sqlite::memory:"],
        vec![
            "--database-url",
            "postgres://127.0.0.1/test",
            "--replay-cache",
            "100",
        ],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
            .args(["--listen", "127.0.0.1:0", IN_TX])
            .args(&extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--claim-in-transaction"), "{extra:?}: {err}");
    }
}

/// A slow bank holds each claim-in-transaction payment (and its database
/// connection) for seconds: past `--claim-tx-limit` more wait their turn
/// (`--claim-tx-wait-ms`, holding no connection) and are then answered 503
/// with nothing claimed, while reads and `/healthz` keep answering (issue
/// 26's red-team finding: 14 slow payments used to drain the pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_bank_cannot_drain_the_pool_that_reads_and_healthz_need() {
    let db = Db::postgres().await;
    let shop = Shop::start(
        &db,
        &[
            IN_TX,
            "--claim-tx-limit",
            "4",
            "--claim-tx-wait-ms",
            "500",
            "--lease-ms",
            "60000",
        ],
    )
    .await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let slow: Vec<_> = (0..14)
        .map(|i| {
            let r = pay(&client, &shop, Some(&format!("slow-{i}")), BODY)
                .header("x-simulate", "bank-delay=4000");
            tokio::spawn(read(r))
        })
        .collect();
    // While the slow ones hold their transactions, the instance serves.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..5 {
        let started = Instant::now();
        let health = client.get(shop.url("/healthz")).send().await.unwrap();
        assert_eq!(health.status(), 200, "healthz while the bank is slow");
        let acc = client
            .get(shop.url("/accounts/acc_1"))
            .header("authorization", "Bearer client-1")
            .send()
            .await
            .unwrap();
        assert_eq!(acc.status(), 200, "a read while the bank is slow");
        // Well under the pool's 3 s acquire time-out: nobody queued for it.
        assert!(
            started.elapsed() < Duration::from_millis(2500),
            "{:?}",
            started.elapsed()
        );
    }
    let mut charged = 0;
    let mut busy = 0;
    for t in slow {
        let a = t.await.unwrap();
        match a.status {
            201 => charged += 1,
            503 => {
                assert!(a.problem_type().ends_with("busy"), "{a:?}");
                assert!(a.headers.contains_key("retry-after"), "{a:?}");
                busy += 1;
            }
            other => panic!("unexpected {other}: {a:?}"),
        }
    }
    assert_eq!(charged, 4, "the limit's worth ran");
    assert_eq!(busy, 10, "the rest were told to come back");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(acc["bank_charges"], 4, "{acc}");
    // A busy answer claimed nothing: its retry runs now.
    let retry = read(pay(&client, &shop, Some("slow-13"), BODY)).await;
    assert!(retry.status == 201 || retry.replayed, "{retry:?}");
}

/// While a slow payment holds every turn of the bulkhead, a repeat of a
/// finished payment (its replay, `422` for another body) is answered from
/// the key's record at once: not after the slow payment, nor `503` `busy`
/// after the wait. (A duplicate of the one in flight still waits: in this
/// mode only the row's lock says it is held, and the claim reads that.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_are_answered_without_a_turn_of_the_bulkhead() {
    let db = Db::postgres().await;
    let shop = Shop::start(
        &db,
        &[
            IN_TX,
            "--claim-tx-limit",
            "1",
            "--claim-tx-wait-ms",
            "60000",
            "--lease-ms",
            "60000",
        ],
    )
    .await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let done = read(pay(&client, &shop, Some("done"), BODY)).await;
    assert_eq!(done.status, 201, "{done:?}");
    // The bank charges at once and answers 10 s later: once the charge
    // shows, the slow payment holds the one turn for the rest of them.
    let slow = tokio::spawn(read(
        pay(&client, &shop, Some("slow"), BODY).header("x-simulate", "bank-delay=10000"),
    ));
    while account(&client, &shop, "acc_1").await["bank_charges"] != 2 {
        assert!(!slow.is_finished(), "the slow payment ended early");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = read(pay(&client, &shop, Some("done"), BODY)).await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, done.body);
    let other = BODY.replace("1000", "1001");
    let reused = read(pay(&client, &shop, Some("done"), &other)).await;
    assert_eq!(reused.status, 422, "{reused:?}");
    assert!(
        !slow.is_finished(),
        "the repeats waited for the slow payment's turn"
    );
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, 201, "{slow:?}");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(acc["bank_charges"], 2, "{acc}");
}
