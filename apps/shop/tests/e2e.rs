//! The real `shop` binary over TCP: races, crashes, and the contract.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{account, pay, read, Db, Shop, BODY};

on_both_backends!(
    forty_racing_identical_requests_make_one_payment_and_one_charge,
    with_waiting_every_racing_duplicate_gets_the_same_answer,
    a_crash_after_the_bank_call_is_taken_over_after_the_lease_and_charges_once,
    a_crash_before_the_bank_call_leaves_nothing_charged,
    every_row_of_the_contract_over_tcp,
    sigterm_shuts_down_gracefully,
    sigterm_waits_for_a_handler_whose_client_went_away,
);

async fn forty_racing_identical_requests_make_one_payment_and_one_charge(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..40 {
        // the bank call is slow, so most duplicates arrive while it runs
        let r =
            pay(&client, &shop, Some("race-key-1"), BODY).header("x-simulate", "bank-delay=300");
        tasks.push(tokio::spawn(read(r)));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let fresh: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed)
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request ran: {answers:?}");
    for a in &answers {
        assert!(
            a.status == 201 || a.status == 409,
            "unexpected answer {a:?}"
        );
        if a.status == 201 {
            assert_eq!(a.body, fresh[0].body, "every replay is byte-identical");
        } else {
            assert!(a.problem_type().ends_with("idempotency-key-in-use"));
            assert!(a.headers.contains_key("retry-after"));
        }
    }
    // after the storm, the key replays
    let again = read(pay(&client, &shop, Some("race-key-1"), BODY)).await;
    assert!(again.replayed);
    assert_eq!(again.body, fresh[0].body);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "{acc}");
    assert_eq!(acc["charged_total"], 1000, "{acc}");
}

async fn with_waiting_every_racing_duplicate_gets_the_same_answer(db: Db) {
    let shop = Shop::start(&db, &["--wait-ms", "10000"]).await;
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let r =
            pay(&client, &shop, Some("race-key-2"), BODY).header("x-simulate", "bank-delay=300");
        tasks.push(tokio::spawn(read(r)));
    }
    let mut bodies = HashSet::new();
    let mut fresh = 0;
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 201, "{a:?}");
        fresh += usize::from(!a.replayed);
        bodies.insert(a.body);
    }
    assert_eq!(fresh, 1);
    assert_eq!(bodies.len(), 1);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
}

async fn a_crash_after_the_bank_call_is_taken_over_after_the_lease_and_charges_once(db: Db) {
    // The lease is the margin: the restart must come back within it.
    let lease = ["--lease-ms", "8000"];
    let client = reqwest::Client::new();

    let mut first = Shop::start(&db, &lease).await;
    let lost = pay(&client, &first, Some("crash-key"), BODY)
        .header("x-simulate", "crash-after-bank")
        .send()
        .await;
    assert!(lost.is_err(), "the process died before answering: {lost:?}");
    let status = first.wait_exit(Duration::from_secs(10));
    assert!(!status.success(), "shop aborted: {status:?}");
    let claimed_at = std::time::Instant::now();
    drop(first);

    // The bank charged, the payment was not written, the claim is held.
    let second = Shop::start(&db, &lease).await;
    let busy = read(pay(&client, &second, Some("crash-key"), BODY)).await;
    assert!(
        claimed_at.elapsed() < Duration::from_millis(7000),
        "the restart took longer than the lease"
    );
    assert_eq!(busy.status, 409, "the lease still lives: {busy:?}");
    assert!(busy.problem_type().ends_with("idempotency-key-in-use"));
    let acc = account(&client, &second, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(0), Some(1)),
        "{acc}"
    );

    // After the lease, the retry takes over under the same operation id: the
    // bank recognises it and does not charge again.
    tokio::time::sleep(Duration::from_millis(8200).saturating_sub(claimed_at.elapsed())).await;
    let retry = read(pay(&client, &second, Some("crash-key"), BODY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    let acc = account(&client, &second, "acc_1").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "charged exactly once: {acc}");
    let replay = read(pay(&client, &second, Some("crash-key"), BODY)).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
}

async fn a_crash_before_the_bank_call_leaves_nothing_charged(db: Db) {
    let client = reqwest::Client::new();
    let mut first = Shop::start(&db, &["--lease-ms", "500"]).await;
    let lost = pay(&client, &first, Some("k-before"), BODY)
        .header("x-simulate", "crash-before-bank")
        .send()
        .await;
    assert!(lost.is_err());
    first.wait_exit(Duration::from_secs(10));
    drop(first);
    let second = Shop::start(&db, &["--lease-ms", "500"]).await;
    let acc = account(&client, &second, "acc_1").await;
    assert_eq!(acc["bank_charges"], 0, "{acc}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let retry = read(pay(&client, &second, Some("k-before"), BODY)).await;
    assert_eq!(retry.status, 201);
    let acc = account(&client, &second, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
}

async fn every_row_of_the_contract_over_tcp(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();

    // no credentials: 401, before anything else
    let a = read(
        client
            .post(shop.url("/payments"))
            .header("idempotency-key", "x")
            .body(BODY),
    )
    .await;
    assert_eq!(a.status, 401);
    // key missing: 400
    let a = read(pay(&client, &shop, None, BODY)).await;
    assert_eq!(a.status, 400);
    assert!(a.problem_type().ends_with("idempotency-key-missing"));
    // key malformed: 400 (empty, too long, repeated)
    for bad in ["", &"k".repeat(256)] {
        let a = read(pay(&client, &shop, Some(bad), BODY)).await;
        assert_eq!(a.status, 400, "{bad:?}");
        assert!(a.problem_type().ends_with("idempotency-key-invalid"));
    }
    let a = read(pay(&client, &shop, Some("a"), BODY).header("idempotency-key", "b")).await;
    assert!(a.problem_type().ends_with("idempotency-key-invalid"));

    // new key: 201 with Location; the payment is readable there
    let created = read(pay(&client, &shop, Some("k-1"), BODY)).await;
    assert_eq!(created.status, 201);
    let payment = created.json();
    assert_eq!(payment["status"], "authorized");
    assert_eq!(payment["amount"], 1000);
    assert_eq!(payment["currency"], "EUR");
    assert_eq!(payment["account_id"], "acc_1");
    assert!(payment["bank_charge_id"]
        .as_str()
        .is_some_and(|s| !s.is_empty()));
    let location = created.headers["location"].to_str().unwrap().to_owned();
    assert_eq!(
        location,
        format!("/payments/{}", payment["id"].as_str().unwrap())
    );
    let fetched: serde_json::Value = client
        .get(shop.url(&location))
        .header("authorization", "Bearer client-1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(fetched, payment);

    // same key, same JSON spelled differently: replayed byte for byte
    let again = read(pay(
        &client,
        &shop,
        Some("\"k-1\""),
        r#"{ "currency": "EUR", "amount": 1000, "account_id": "acc_1" }"#,
    ))
    .await;
    assert!(again.replayed);
    assert_eq!(again.body, created.body);
    assert_eq!(again.headers["location"], location.as_str());

    // same key, other body: 422
    let a = read(pay(
        &client,
        &shop,
        Some("k-1"),
        r#"{"account_id":"acc_1","amount":5,"currency":"EUR"}"#,
    ))
    .await;
    assert_eq!(a.status, 422);
    assert!(a.problem_type().ends_with("idempotency-key-reused"));

    // another client may use the same key: scopes are separate
    let other = read(
        client
            .post(shop.url("/payments"))
            .header("authorization", "Bearer client-2")
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(BODY),
    )
    .await;
    assert_eq!(other.status, 201);
    assert!(!other.replayed);

    // invalid body: 400 validation, refused before the claim and not
    // stored (as Stripe saves nothing when parameters fail validation)
    let bad_bodies = [
        r#"{"account_id":"acc_1","amount":-5,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":1,"currency":"EURO"}"#,
        r#"{"account_id":"acc_1","amount":1.5,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":"1","currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":1,"currency":"EUR","x":1}"#,
        r#"{"amount":1,"currency":"EUR"}"#,
        r#"[]"#,
        "nope",
    ];
    for (i, bad) in bad_bodies.into_iter().enumerate() {
        let key = format!("bad-{i}");
        let a = read(pay(&client, &shop, Some(&key), bad)).await;
        assert_eq!(a.status, 400, "{bad}");
        assert!(a.problem_type().ends_with("validation"), "{bad}");
        let b = read(pay(&client, &shop, Some(&key), bad)).await;
        assert_eq!(b.status, 400, "{bad}");
        assert!(!b.replayed, "{bad}");
    }
    // ... so the corrected request runs under the same key, even the one
    // the fingerprint calls equal (1.0 and 1 are one number to it).
    let fraction = r#"{"account_id":"acc_1","amount":1000.0,"currency":"EUR"}"#;
    let a = read(pay(&client, &shop, Some("bad-fraction"), fraction)).await;
    assert_eq!(a.status, 400, "{a:?}");
    let fixed = read(pay(&client, &shop, Some("bad-fraction"), BODY)).await;
    assert_eq!(fixed.status, 201, "{fixed:?}");
    assert!(!fixed.replayed);
    let fixed = read(pay(&client, &shop, Some("bad-2"), BODY)).await;
    assert_eq!(
        fixed.status, 201,
        "another body under a refused key: {fixed:?}"
    );
    let sim =
        read(pay(&client, &shop, Some("bad-sim"), BODY).header("x-simulate", "nonsense")).await;
    assert_eq!(sim.status, 400, "{sim:?}");
    let fixed = read(pay(&client, &shop, Some("bad-sim"), BODY)).await;
    assert_eq!(fixed.status, 201, "{fixed:?}");

    // body over the limit: 413, nothing stored (the same key then works)
    let huge = format!(
        r#"{{"account_id":"acc_1","amount":1,"currency":"EUR","pad":"{}"}}"#,
        "x".repeat(1 << 20)
    );
    let a = read(pay(&client, &shop, Some("k-huge"), &huge)).await;
    assert_eq!(a.status, 413);
    assert!(a.problem_type().ends_with("payload-too-large"));
    let a = read(pay(&client, &shop, Some("k-huge"), BODY)).await;
    assert_eq!(a.status, 201);
    assert!(!a.replayed);

    // the bank fails: 502, the claim is released, the retry runs afresh
    let a =
        read(pay(&client, &shop, Some("k-bank"), BODY).header("x-simulate", "bank-error")).await;
    assert_eq!(a.status, 502);
    let b = read(pay(&client, &shop, Some("k-bank"), BODY)).await;
    assert_eq!(b.status, 201);
    assert!(!b.replayed);

    // in flight: 409 with Retry-After
    let slow = tokio::spawn(read(
        pay(&client, &shop, Some("k-slow"), BODY).header("x-simulate", "bank-delay=800"),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = read(pay(&client, &shop, Some("k-slow"), BODY)).await;
    assert_eq!(a.status, 409);
    assert!(a.headers.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().status, 201);

    // GET passes through untouched; unknown accounts are zeros
    let acc = account(&client, &shop, "nobody").await;
    assert_eq!(
        acc,
        serde_json::json!({"account_id":"nobody","payments":0,"charged_total":0,"bank_charges":0})
    );
    let a = read(
        client
            .get(shop.url("/payments/pay_missing"))
            .header("authorization", "Bearer client-1"),
    )
    .await;
    assert_eq!(a.status, 404);

    // totals: k-1, bad-fraction, bad-2, bad-sim (corrected after a 400),
    // k-huge, k-bank, k-slow; client-2's k-1 is client-2's
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(acc["payments"], 7, "{acc}");
    assert_eq!(acc["bank_charges"], 7, "{acc}");
    assert_eq!(acc["charged_total"], 7000, "{acc}");
    let theirs: serde_json::Value = client
        .get(shop.url("/accounts/acc_1"))
        .header("authorization", "Bearer client-2")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(theirs["payments"], 1, "{theirs}");
    assert_eq!(theirs["bank_charges"], 1, "{theirs}");
}

async fn sigterm_shuts_down_gracefully(db: Db) {
    let mut shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    // a request in flight when SIGTERM arrives still gets its answer
    let slow = tokio::spawn(read(
        pay(&client, &shop, Some("k-term"), BODY).header("x-simulate", "bank-delay=500"),
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    shop.terminate();
    assert_eq!(slow.await.unwrap().status, 201);
    let status = shop.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
}

/// SIGTERM while a handler whose client gave up still runs (its connection
/// closed): the shop waits for it too, so its answer is stored, and the
/// retry, after a restart, is its replay. Before, the last connection's
/// close ended the wait, and the process exited with the handler cut.
async fn sigterm_waits_for_a_handler_whose_client_went_away(db: Db) {
    let mut shop = Shop::start(&db, &[]).await;
    // It gives up a second in (the claim made by then), the bank three.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let gave_up = pay(&impatient, &shop, Some("k-gone"), BODY)
        .header("x-simulate", "bank-delay=3000")
        .send()
        .await;
    assert!(gave_up.is_err(), "the client gave up: {gave_up:?}");
    shop.terminate();
    let status = shop.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
    drop(shop);
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let again = read(pay(&client, &shop, Some("k-gone"), BODY)).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed, "stored before the exit: {again:?}");
}

#[tokio::test]
async fn bad_flags_fail_with_a_clear_message() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args([
            "--lease-ms",
            "60000",
            "--ttl-secs",
            "30",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            "sqlite::memory:",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("retention"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--database-url", "oracle://x", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));
    // A mode a database cannot keep is refused at start, not half-kept.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args([
            "--database-url",
            "mysql://root@127.0.0.1:3306/test",
            "--claim-in-transaction",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--claim-in-transaction needs a PostgreSQL"),
        "{err}"
    );
    // A consumer's concurrency is 1 to 64.
    for bad in ["0", "65", "many"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
            .args([
                "--database-url",
                "sqlite::memory:",
                "--consumer-concurrency",
                bad,
                "--listen",
                "127.0.0.1:0",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--consumer-concurrency"), "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_are_answered_413_not_cut_off() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let huge = format!(
        r#"{{"account_id":"acc_1","amount":1,"currency":"EUR","pad":"{}"}}"#,
        "x".repeat(3 << 20)
    );
    for i in 0..10 {
        let a = read(pay(&client, &shop, Some(&format!("huge-{i}")), &huge)).await;
        assert_eq!(a.status, 413, "attempt {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_alone_settles_racing_duplicates_too() {
    let db = Db::sqlite();
    // Its keys deleted when the test ends, after the shop's.
    let prefix = common::RedisPrefix::new("alone");
    let shop = Shop::start(
        &db,
        &[
            "--idem-store",
            "redis",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--redis-prefix",
            &prefix.0,
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..30 {
        let r = pay(&client, &shop, Some("alone-1"), BODY).header("x-simulate", "bank-delay=200");
        tasks.push(tokio::spawn(read(r)));
    }
    let mut fresh = 0;
    for t in tasks {
        let a = t.await.unwrap();
        assert!(a.status == 201 || a.status == 409, "{a:?}");
        fresh += usize::from(a.status == 201 && !a.replayed);
    }
    assert_eq!(fresh, 1);
    let again = read(pay(&client, &shop, Some("alone-1"), BODY)).await;
    assert!(again.replayed);
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args([
            "--idem-store",
            "redis",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            "sqlite::memory:",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("needs --redis-url"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bare_baseline_route_charges_every_time() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let a = read(
            client
                .post(shop.url("/bare/payments"))
                .header("authorization", "Bearer client-1")
                .header("content-type", "application/json")
                .body(BODY),
        )
        .await;
        assert_eq!(a.status, 201);
    }
    let acc = account(&client, &shop, "acc_1").await;
    assert_eq!(
        acc["payments"], 3,
        "no idempotency: every retry is a new charge"
    );
    assert_eq!(acc["bank_charges"], 3);
}

/// The value of one sample in a Prometheus text page.
fn sample(page: &str, name_and_labels: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            l.strip_prefix(name_and_labels)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_each_outcome_of_a_scripted_mix() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    // 3 fresh payments, 2 replays, 1 reused key, 1 missing key, 1 invalid key
    for k in ["m-a", "m-b", "m-c"] {
        assert_eq!(read(pay(&client, &shop, Some(k), BODY)).await.status, 201);
    }
    for _ in 0..2 {
        assert!(read(pay(&client, &shop, Some("m-a"), BODY)).await.replayed);
    }
    let other = r#"{"account_id":"acc_1","amount":7,"currency":"EUR"}"#;
    assert_eq!(
        read(pay(&client, &shop, Some("m-b"), other)).await.status,
        422
    );
    assert_eq!(read(pay(&client, &shop, None, BODY)).await.status, 400);
    assert_eq!(read(pay(&client, &shop, Some(""), BODY)).await.status, 400);
    // one in-flight collision (the fourth fresh one), then a bank failure (released)
    let slow = tokio::spawn(read(
        pay(&client, &shop, Some("m-d"), BODY).header("x-simulate", "bank-delay=500"),
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        read(pay(&client, &shop, Some("m-d"), BODY)).await.status,
        409
    );
    assert_eq!(slow.await.unwrap().status, 201);
    let failed =
        read(pay(&client, &shop, Some("m-e"), BODY).header("x-simulate", "bank-error")).await;
    assert_eq!(failed.status, 502);

    let page = client
        .get(shop.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let outcome = |o: &str| sample(&page, &format!("idem_requests_total{{outcome=\"{o}\"}}"));
    assert_eq!(outcome("fresh"), 5.0, "{page}"); // a, b, c, d, e
    assert_eq!(outcome("replay"), 2.0, "{page}");
    assert_eq!(outcome("mismatch"), 1.0, "{page}");
    assert_eq!(outcome("missing_key"), 1.0, "{page}");
    assert_eq!(outcome("invalid_key"), 1.0, "{page}");
    assert_eq!(outcome("conflict"), 1.0, "{page}");
    assert_eq!(outcome("released"), 1.0, "{page}");
    assert_eq!(outcome("takeover"), 0.0, "{page}");
    // claims: a, b, c, 2 replays, the reused key, d twice, e
    assert_eq!(
        sample(
            &page,
            "idem_store_seconds_count{store=\"sqlite\",op=\"claim\"}"
        ),
        9.0,
        "{page}"
    );
    assert!(
        page.contains("idem_store_seconds_bucket{store=\"sqlite\",op=\"claim\",le=\"0.001\"}"),
        "a histogram: {page}"
    );
    assert!(
        !page.contains("m-a") && !page.contains("client-1"),
        "labels never carry keys or scopes"
    );
    // the payments' events went through the outbox and the send-email consumer
    // (generous: the other tests of this binary load the machine meanwhile)
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let page = client
            .get(shop.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let processed = sample(
            &page,
            "idem_messages_total{consumer=\"send-email\",outcome=\"processed\"}",
        );
        // The relay counts a message published only once the consumer
        // acked it, so the email can show up a moment before the count.
        let published = sample(&page, "idem_outbox_published_total");
        if processed >= 4.0 && published >= 4.0 {
            assert_eq!(processed, 4.0, "each payment's email exactly once: {page}");
            assert_eq!(published, 4.0, "each event published once: {page}");
            assert!(page.contains("idem_outbox_lag_seconds"), "{page}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{processed} emails and {published} events of 4 after 30 s: {page}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_demo_page_is_served_from_the_binary() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let page = reqwest::get(shop.url("/")).await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let html = page.text().await.unwrap();
    for needle in [
        "Double-click",
        "Reply lost, retry",
        "Retry storm",
        "/bare/payments",
        "idempotency-key",
        "aria-live",
    ] {
        assert!(html.contains(needle), "{needle}");
    }
}
