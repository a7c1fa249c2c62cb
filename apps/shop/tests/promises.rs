//! The promises every mode keeps, each tried on all five (SQLite,
//! PostgreSQL, PostgreSQL with the claim held by the transaction, Redis in
//! front of PostgreSQL with a replay cache, Redis alone): a key stays bound
//! to its first request across crashes and failures, a key past its
//! retention is new, a sequential client is never told its own key is busy,
//! and a `409` suggests a short wait.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{account, pay, read, start_in, Db, Mode, RedisPrefix, BODY};

const OTHER: &str = r#"{"account_id":"acc_1","amount":500,"currency":"EUR"}"#;

/// Retries `key` with `BODY` until it is no longer `409` (a lease running
/// out), within `within`.
async fn until_not_busy(
    client: &reqwest::Client,
    shop: &common::Shop,
    key: &str,
    within: Duration,
) -> common::Answer {
    let deadline = Instant::now() + within;
    loop {
        let a = read(pay(client, shop, Some(key), BODY)).await;
        if a.status != 409 || Instant::now() > deadline {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn a_crash_after_the_bank_call_binds_the_key_to_its_request(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("crash-bound");
    let flags = ["--lease-ms", "2000"];
    let client = reqwest::Client::new();
    let mut first = start_in(mode, &db, &prefix.0, &flags).await;
    let lost = pay(&client, &first, Some("k"), BODY)
        .header("x-simulate", "crash-after-bank")
        .send()
        .await;
    assert!(lost.is_err(), "died before answering: {lost:?}");
    assert!(!first.wait_exit(Duration::from_secs(10)).success());
    drop(first);
    let shop = start_in(mode, &db, &prefix.0, &flags).await;

    // Another amount under the same key: refused, not charged.
    let other = read(pay(&client, &shop, Some("k"), OTHER)).await;
    assert_eq!(other.status, 422, "{mode:?}: {other:?}");
    assert!(other.problem_type().ends_with("idempotency-key-reused"));
    // The same request completes, under the operation id the bank saw.
    let retry = until_not_busy(&client, &shop, "k", Duration::from_secs(20)).await;
    assert_eq!(retry.status, 201, "{mode:?}: {retry:?}");
    assert_eq!(retry.json()["amount"], 1000);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{mode:?}: charged once: {acc}"
    );
    let other = read(pay(&client, &shop, Some("k"), OTHER)).await;
    assert_eq!(other.status, 422, "{mode:?}: {other:?}");
    let replay = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
}

async fn a_server_error_releases_the_key_but_keeps_it_bound(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("5xx-bound");
    let client = reqwest::Client::new();
    let shop = start_in(mode, &db, &prefix.0, &[]).await;
    let failed =
        read(pay(&client, &shop, Some("k"), BODY).header("x-simulate", "bank-error")).await;
    assert_eq!(failed.status, 502, "{mode:?}: {failed:?}");
    let other = read(pay(&client, &shop, Some("k"), OTHER)).await;
    assert_eq!(other.status, 422, "{mode:?}: {other:?}");
    let retry = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(retry.status, 201, "{mode:?}: released at once: {retry:?}");
    assert!(!retry.replayed);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{mode:?}: {acc}"
    );
}

async fn a_key_reused_past_its_retention_is_a_new_request(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("retention");
    let client = reqwest::Client::new();
    let shop = start_in(
        mode,
        &db,
        &prefix.0,
        &["--ttl-secs", "1", "--lease-ms", "500"],
    )
    .await;
    let first = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(first.status, 201, "{mode:?}: {first:?}");
    // Past the retention (with a margin for the replay cache's own expiry).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let again = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(
        again.status, 201,
        "{mode:?}: the key is new again: {again:?}"
    );
    assert!(!again.replayed, "{mode:?}");
    assert_ne!(again.json()["id"], first.json()["id"], "{mode:?}");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(2), Some(2)),
        "{mode:?}: two requests, two charges: {acc}"
    );
    let replay = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert!(replay.replayed, "{mode:?}");
    assert_eq!(replay.body, again.body);
}

async fn a_sequential_client_is_never_told_its_key_is_busy(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("sequential");
    let client = reqwest::Client::new();
    let shop = start_in(mode, &db, &prefix.0, &[]).await;
    for i in 0..10 {
        let key = format!("seq-{i}");
        let first = read(pay(&client, &shop, Some(&key), BODY)).await;
        assert_eq!(first.status, 201, "{mode:?}: {first:?}");
        for _ in 0..3 {
            let replay = read(pay(&client, &shop, Some(&key), BODY)).await;
            assert_eq!(replay.status, 201, "{mode:?}: {replay:?}");
            assert!(replay.replayed);
            assert_eq!(replay.body, first.body);
            let other = read(pay(&client, &shop, Some(&key), OTHER)).await;
            assert_eq!(other.status, 422, "{mode:?}: {other:?}");
        }
        // A request refused by validation is not stored: its corrected
        // retry runs under the same key.
        let bad_key = format!("seq-bad-{i}");
        let bad = r#"{"account_id":"acc_1","amount":-1,"currency":"EUR"}"#;
        let first = read(pay(&client, &shop, Some(&bad_key), bad)).await;
        assert_eq!(first.status, 400, "{mode:?}: {first:?}");
        let again = read(pay(&client, &shop, Some(&bad_key), bad)).await;
        assert_eq!(
            (again.status, again.replayed),
            (400, false),
            "{mode:?}: {again:?}"
        );
        let fixed = read(pay(&client, &shop, Some(&bad_key), BODY)).await;
        assert_eq!(fixed.status, 201, "{mode:?}: {fixed:?}");
        let other = read(pay(&client, &shop, Some(&bad_key), OTHER)).await;
        assert_eq!(other.status, 422, "{mode:?}: {other:?}");
    }
}

async fn a_request_in_flight_gets_409_with_a_short_retry_after(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("retry-after");
    let client = reqwest::Client::new();
    // The default lease (30 s): Retry-After must not be the rest of it.
    let shop = start_in(mode, &db, &prefix.0, &[]).await;
    // Duplicates at once, the bank slow: one runs, the others find it in flight.
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            tokio::spawn(read(
                pay(&client, &shop, Some("k"), BODY).header("x-simulate", "bank-delay=2000"),
            ))
        })
        .collect();
    let mut busy = 0;
    for t in tasks {
        let a = t.await.unwrap();
        match a.status {
            201 => {}
            409 => {
                busy += 1;
                assert_eq!(a.headers["retry-after"], "1", "{mode:?}: {a:?}");
            }
            _ => panic!("{mode:?}: {a:?}"),
        }
    }
    assert!(busy > 0, "{mode:?}: no duplicate arrived in flight");
}

in_every_mode!(
    a_crash_after_the_bank_call_binds_the_key_to_its_request,
    a_server_error_releases_the_key_but_keeps_it_bound,
    a_key_reused_past_its_retention_is_a_new_request,
    a_sequential_client_is_never_told_its_key_is_busy,
    a_request_in_flight_gets_409_with_a_short_retry_after,
);

/// Redis alone cannot fence the payment's commit: an attempt that outlived
/// its lease still records its payment after a retry took over. The retry
/// then meets that payment at the unique operation id and answers with it
/// (the effect that exists), never with an error stored for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_converges_on_the_payment_a_superseded_attempt_recorded() {
    let mode = Mode::RedisAlone;
    let db = mode.db().await;
    let prefix = RedisPrefix::new("converge");
    let client = reqwest::Client::new();
    let shop = start_in(mode, &db, &prefix.0, &["--lease-ms", "500"]).await;

    // A charges, then stalls past its lease; it commits its payment while
    // B, which took over, is still waiting on the bank.
    let a = tokio::spawn(read(
        pay(&client, &shop, Some("k"), BODY).header("x-simulate", "bank-delay=2000"),
    ));
    // A holds the claim once the bank has charged.
    let deadline = Instant::now() + Duration::from_secs(10);
    while account(&client, &shop, "acc_1").await["bank_charges"] != 1 {
        assert!(Instant::now() < deadline, "A never reached the bank");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = loop {
        let started = Instant::now();
        let b = read(pay(&client, &shop, Some("k"), BODY).header("x-simulate", "bank-delay=4000"))
            .await;
        if b.status != 409 {
            assert!(
                started.elapsed() >= Duration::from_secs(3),
                "B took the claim over and waited on the bank: {b:?}"
            );
            break b;
        }
        assert!(Instant::now() < deadline, "never taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let a = a.await.unwrap();
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(
        b.status, 201,
        "B answers with the payment that exists: {b:?}"
    );
    assert_eq!(b.body, a.body, "one payment, one answer");
    let replay = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, a.body);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
}

/// Redis alone: a record Redis lost (a failover without `WAIT`, an emptied
/// shard; here its keys deleted) lets the key run again under a new
/// operation id. The key was bound to its first operation in the database
/// before the bank was called, so the retry resumes under that one: the
/// bank answers with the charge it made, and the answer is the payment
/// recorded then, byte for byte. Another payment under the key is `422`,
/// as its record would have answered. Before, the retry charged again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_a_lost_record_resumes_under_the_bound_operation() {
    let mode = Mode::RedisAlone;
    let db = mode.db().await;
    let prefix = RedisPrefix::new("lost-record");
    let client = reqwest::Client::new();
    let shop = start_in(mode, &db, &prefix.0, &[]).await;
    let first = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let lose = || idem_test_support::redis::clear_prefix(&common::redis_url(), &prefix.0);
    lose();
    let again = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(!again.replayed, "the record was lost: {again:?}");
    assert_eq!(again.body, first.body, "the payment made first");
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "charged once: {acc}"
    );
    lose();
    let other = read(pay(&client, &shop, Some("k"), OTHER)).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert!(other.problem_type().ends_with("idempotency-key-reused"));
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(acc["bank_charges"].as_i64(), Some(1), "{acc}");
    // That refused request's claim is withdrawn, not left on the key with
    // its body: the key's own request still gets its payment (before, it
    // was refused too, until the retention ended).
    let own = read(pay(&client, &shop, Some("k"), BODY)).await;
    assert_eq!(own.status, 201, "{own:?}");
    assert_eq!(own.body, first.body);
    // Another key is another payment.
    let fresh = read(pay(&client, &shop, Some("k2"), BODY)).await;
    assert_eq!(fresh.status, 201, "{fresh:?}");
    assert_ne!(fresh.json()["id"], first.json()["id"]);
}

/// Redis alone, on each database: a payment key's binding is kept for the
/// records' retention, then swept (it would only grow otherwise), and the
/// key is new again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_key_bindings_are_swept_after_the_retention() {
    for db in [Db::sqlite(), Db::postgres().await, Db::mysql().await] {
        let prefix = RedisPrefix::new("bindings-swept");
        let client = reqwest::Client::new();
        let flags = ["--ttl-secs", "1", "--lease-ms", "500"];
        let shop = start_in(Mode::RedisAlone, &db, &prefix.0, &flags).await;
        let first = read(pay(&client, &shop, Some("k"), BODY)).await;
        assert_eq!(first.status, 201, "{}: {first:?}", db.url());
        const BOUND: &str = "SELECT count(*) FROM shop_payment_keys";
        assert_eq!(db.scalar(BOUND).await, 1, "{}: bound", db.url());
        let deadline = Instant::now() + Duration::from_secs(20);
        while db.scalar(BOUND).await != 0 {
            assert!(Instant::now() < deadline, "{}: never swept", db.url());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let again = read(pay(&client, &shop, Some("k"), BODY)).await;
        assert_eq!(again.status, 201, "{}: {again:?}", db.url());
        assert_ne!(again.json()["id"], first.json()["id"], "{}", db.url());
    }
}
