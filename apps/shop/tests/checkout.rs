//! `POST /orders/{id}/checkout` against the real binary, in every mode:
//! two named steps (the bank's charge, then the order marked paid with its
//! receipt), a crash between the bank and the charge's record or between
//! the two steps resumed by the retry with one charge and one email, races
//! of one key and of two keys, and validation that stores nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{read, start_in, Answer, Db, Mode, RedisPrefix, Shop};
use serde_json::Value;

const LEASE_MS: u64 = 2500;

fn flags() -> Vec<&'static str> {
    vec!["--fault-injection", "all", "--lease-ms", "2500"]
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// Places an order for `client-1` and returns its id.
async fn place_order(shop: &Shop, reference: &str) -> String {
    let placed = read(
        client()
            .post(shop.url("/orders"))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .body(format!(
                r#"{{"customer_id":"cust-1","client_reference":"{reference}","items":[{{"sku":"sku-1","qty":1}}]}}"#
            )),
    )
    .await;
    assert_eq!(placed.status, 201, "{placed:?}");
    assert_eq!(placed.json()["status"], "placed");
    assert_eq!(placed.json()["bank_charges"], 0);
    placed.json()["id"].as_str().unwrap().to_owned()
}

fn checkout(
    shop: &Shop,
    order: &str,
    key: Option<&str>,
    account: &str,
    amount: &str,
) -> reqwest::RequestBuilder {
    checkout_by("client-1", shop, order, key, account, amount)
}

fn checkout_by(
    who: &str,
    shop: &Shop,
    order: &str,
    key: Option<&str>,
    account: &str,
    amount: &str,
) -> reqwest::RequestBuilder {
    let mut r = client()
        .post(shop.url(&format!("/orders/{order}/checkout")))
        .header("authorization", format!("Bearer {who}"))
        .header("content-type", "application/json")
        .body(format!(
            r#"{{"account_id":"{account}","amount":{amount},"currency":"EUR"}}"#
        ));
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r
}

async fn get(shop: &Shop, path: &str) -> Value {
    read(
        client()
            .get(shop.url(path))
            .header("authorization", "Bearer client-1"),
    )
    .await
    .json()
}

/// The receipt emails of `account`, once the relay and the consumer had
/// time to deliver `want` of them (and a moment more, to catch a second).
/// The bound is past the relay's lease (30 s): a message a crashed
/// process's relay held is published again after it.
async fn receipts(shop: &Shop, account: &str, want: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let emails = get(shop, &format!("/emails?account_id={account}")).await["emails"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if emails.len() >= want || Instant::now() > deadline {
            tokio::time::sleep(Duration::from_millis(700)).await;
            return get(shop, &format!("/emails?account_id={account}")).await["emails"]
                .as_array()
                .cloned()
                .unwrap_or_default();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A crash at `simulate`, a restart, and the retry after the lease: paid,
/// one bank charge, one payment, one receipt.
async fn crash_then_retry(mode: Mode, db: &Db, prefix: &str, simulate: &str) {
    let mut shop = start_in(mode, db, prefix, &flags()).await;
    let order = place_order(&shop, simulate).await;
    let account = format!("acc-{simulate}");
    let key = format!("checkout-{simulate}");
    let lost = checkout(&shop, &order, Some(&key), &account, "1500")
        .header("x-simulate", simulate)
        .send()
        .await;
    assert!(lost.is_err(), "the process died before answering: {lost:?}");
    let claimed = Instant::now();
    assert!(!shop.wait_exit(Duration::from_secs(10)).success());
    drop(shop);

    let shop = start_in(mode, db, prefix, &flags()).await;
    // The order is not paid yet; the bank charged once (after the bank) or
    // once with its step stored (after the charge).
    let before = get(&shop, &format!("/orders/{order}")).await;
    assert_eq!(before["status"], "placed", "{before}");
    assert_eq!(before["bank_charges"], 1, "{before}");
    // After the lease, the retry takes the key over under the same
    // operation id and resumes.
    let lease = Duration::from_millis(LEASE_MS + 200);
    tokio::time::sleep(lease.saturating_sub(claimed.elapsed())).await;
    let retry = read(checkout(&shop, &order, Some(&key), &account, "1500")).await;
    assert_eq!(retry.status, 200, "{simulate}: {retry:?}");
    assert!(!retry.replayed);
    assert_eq!(retry.json()["status"], "paid", "{retry:?}");
    assert_eq!(retry.json()["bank_charges"], 1, "charged once: {retry:?}");
    let shown = get(&shop, &format!("/orders/{order}")).await;
    assert_eq!(
        (shown["status"].as_str(), shown["bank_charges"].as_i64()),
        (Some("paid"), Some(1)),
        "{shown}"
    );
    let acc = get(&shop, &format!("/accounts/{account}")).await;
    assert_eq!(acc["bank_charges"], 1, "{acc}");
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["charged_total"], 1500, "{acc}");
    let emails = receipts(&shop, &account, 1).await;
    assert_eq!(emails.len(), 1, "one receipt: {emails:?}");
    assert!(
        emails[0]["subject"].as_str().unwrap().contains(&order),
        "{emails:?}"
    );
    let replay = read(checkout(&shop, &order, Some(&key), &account, "1500")).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
}

async fn a_crash_after_the_bank_or_after_the_charge_step_resumes_with_one_charge(
    mode: Mode,
    db: Db,
) {
    let prefix = RedisPrefix::new("checkout-crash");
    crash_then_retry(mode, &db, &prefix.0, "crash-after-bank").await;
    crash_then_retry(mode, &db, &prefix.0, "crash-after-charge").await;
}

async fn the_checkout_contract(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("checkout");
    let shop = start_in(mode, &db, &prefix.0, &flags()).await;
    let order = place_order(&shop, "contract").await;

    // Refused before the claim, nothing stored: the corrected request runs
    // under the same key (the fingerprint calls 1000.0 equal to 1000).
    let fraction = read(checkout(&shop, &order, Some("k1"), "acc-c", "1000.0")).await;
    assert_eq!(fraction.status, 400, "{fraction:?}");
    assert!(fraction.problem_type().ends_with("validation"));
    let bad_sim =
        read(checkout(&shop, &order, Some("k1"), "acc-c", "1000").header("x-simulate", "explode"))
            .await;
    assert_eq!(bad_sim.status, 400, "{bad_sim:?}");
    let missing = read(checkout(&shop, &order, None, "acc-c", "1000")).await;
    assert_eq!(missing.status, 400);
    assert!(missing.problem_type().ends_with("idempotency-key-missing"));

    // Five racing duplicates of one key, the bank slow: one charge.
    let mut racing = Vec::new();
    for _ in 0..5 {
        racing.push(tokio::spawn(read(
            checkout(&shop, &order, Some("k1"), "acc-c", "1000")
                .header("x-simulate", "bank-delay=300"),
        )));
    }
    let mut answers: Vec<Answer> = Vec::new();
    for r in racing {
        answers.push(r.await.unwrap());
    }
    let paid: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    assert!(!paid.is_empty(), "{answers:?}");
    assert!(
        answers.iter().all(|a| a.status == 200 || a.status == 409),
        "{answers:?}"
    );
    assert_eq!(
        paid.iter().filter(|a| !a.replayed).count(),
        1,
        "{answers:?}"
    );
    let first = paid.iter().find(|a| !a.replayed).unwrap();
    assert_eq!(first.json()["status"], "paid");
    assert_eq!(first.json()["bank_charges"], 1);
    let replay = read(checkout(&shop, &order, Some("k1"), "acc-c", "1000")).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    // The same key with another body: 422.
    let reused = read(checkout(&shop, &order, Some("k1"), "acc-c", "999")).await;
    assert_eq!(reused.status, 422);
    // Another key for the paid order: 409, nothing charged.
    let again = read(checkout(&shop, &order, Some("k2"), "acc-c", "1000")).await;
    assert_eq!(again.status, 409, "{again:?}");
    assert!(
        again.problem_type().ends_with("order-already-paid"),
        "{again:?}"
    );
    // Another client's order: 404.
    let foreign = read(checkout_by(
        "client-2",
        &shop,
        &order,
        Some("k3"),
        "acc-c",
        "1000",
    ))
    .await;
    assert_eq!(foreign.status, 404, "{foreign:?}");
    let shown = get(&shop, &format!("/orders/{order}")).await;
    assert_eq!(shown["bank_charges"], 1, "{shown}");
    assert_eq!(get(&shop, "/accounts/acc-c").await["bank_charges"], 1);
    assert_eq!(receipts(&shop, "acc-c", 1).await.len(), 1);

    // An attempt that outlives its lease (the bank answers after it) stores
    // nothing: it answers 409 and its retry resumes (found by the checkout
    // history: the 409 used to be stored, and replayed for a day).
    let order = place_order(&shop, "slow-bank").await;
    let slow = read(
        checkout(&shop, &order, Some("k-slow"), "acc-e", "300")
            .header("x-simulate", &format!("bank-delay={}", LEASE_MS + 500)),
    )
    .await;
    assert_eq!(slow.status, 409, "{slow:?}");
    assert!(!slow.replayed);
    let resumed = read(checkout(&shop, &order, Some("k-slow"), "acc-e", "300")).await;
    assert_eq!(resumed.status, 200, "{resumed:?}");
    assert_eq!(resumed.json()["bank_charges"], 1, "{resumed:?}");
    assert_eq!(get(&shop, "/accounts/acc-e").await["bank_charges"], 1);

    // Two keys racing for one order: one pays, the other is 409.
    let order = place_order(&shop, "two-keys").await;
    let a = tokio::spawn(read(
        checkout(&shop, &order, Some("ka"), "acc-d", "700").header("x-simulate", "bank-delay=200"),
    ));
    let b = tokio::spawn(read(
        checkout(&shop, &order, Some("kb"), "acc-d", "700").header("x-simulate", "bank-delay=200"),
    ));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let mut statuses = [a.status, b.status];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 409], "{a:?} {b:?}");
    assert_eq!(
        get(&shop, &format!("/orders/{order}")).await["bank_charges"],
        1
    );
    assert_eq!(get(&shop, "/accounts/acc-d").await["bank_charges"], 1);
}

/// The same key back after its record expired (or Redis lost it) gets a
/// new operation id; the order's checkout resumes under the one bound
/// first, and the bank answers with the charge it made.
async fn a_key_back_after_its_record_expired_resumes_under_the_bound_operation(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("checkout-expired");
    let flags = [
        "--fault-injection",
        "all",
        "--lease-ms",
        "1000",
        "--ttl-secs",
        "3",
    ];
    let mut shop = start_in(mode, &db, &prefix.0, &flags).await;
    let order = place_order(&shop, "expired").await;
    let lost = checkout(&shop, &order, Some("k-exp"), "acc-x", "900")
        .header("x-simulate", "crash-after-bank")
        .send()
        .await;
    assert!(lost.is_err());
    assert!(!shop.wait_exit(Duration::from_secs(10)).success());
    drop(shop);
    let shop = start_in(mode, &db, &prefix.0, &flags).await;
    // Past the retention: the key's record is gone, the key is new again.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let retry = read(checkout(&shop, &order, Some("k-exp"), "acc-x", "900")).await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.json()["status"], "paid");
    assert_eq!(retry.json()["bank_charges"], 1, "charged once: {retry:?}");
    let acc = get(&shop, "/accounts/acc-x").await;
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(1), Some(1)),
        "{acc}"
    );
    // Past the retention again, the same key with another amount is
    // another checkout of a paid order, not the paid one's answer.
    let past_retention = || tokio::time::sleep(Duration::from_millis(3500));
    past_retention().await;
    let other = read(checkout(&shop, &order, Some("k-exp"), "acc-x", "901")).await;
    assert_eq!(other.status, 409, "{other:?}");
    assert!(
        other.problem_type().ends_with("order-already-paid"),
        "{other:?}"
    );
    // A checkout row an instance from before `intent` made: what it pays
    // with is read from its payment, the currency in any case.
    db.execute("UPDATE shop_checkouts SET intent = ''").await;
    past_retention().await;
    let same = read(
        client()
            .post(shop.url(&format!("/orders/{order}/checkout")))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .header("idempotency-key", "k-exp")
            .body(r#"{"account_id":"acc-x","amount":900,"currency":"eur"}"#),
    )
    .await;
    assert_eq!(same.status, 200, "the same checkout: {same:?}");
    past_retention().await;
    let other = read(checkout(&shop, &order, Some("k-exp"), "acc-y", "900")).await;
    assert_eq!(other.status, 409, "{other:?}");
    let acc = get(&shop, "/accounts/acc-x").await;
    assert_eq!(acc["bank_charges"].as_i64(), Some(1), "{acc}");
}

in_every_mode!(
    a_crash_after_the_bank_or_after_the_charge_step_resumes_with_one_charge,
    the_checkout_contract,
    a_key_back_after_its_record_expired_resumes_under_the_bound_operation,
);

/// The order can be marked paid only after the bank charged: a database
/// error there is a `5xx` that lets the key go, never a `4xx` (stored and
/// replayed, it would tell the client the checkout was refused while the
/// bank had charged). Here the database refuses the order's update with a
/// data exception (class 22, which shop's other routes answer `400`) until
/// the trigger is dropped; the retry then pays, charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_refusal_after_the_charge_is_never_stored_as_a_4xx() {
    let db = Mode::Postgres.db().await;
    let prefix = RedisPrefix::new("checkout-refused");
    let shop = start_in(Mode::Postgres, &db, &prefix.0, &flags()).await;
    let order = place_order(&shop, "refused").await;
    db.execute(
        "CREATE FUNCTION refuse_paid() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'refused for the test' USING ERRCODE = '22023'; END $$",
    )
    .await;
    db.execute(
        "CREATE TRIGGER refuse_paid BEFORE UPDATE ON shop_orders
         FOR EACH ROW WHEN (NEW.status = 'paid') EXECUTE FUNCTION refuse_paid()",
    )
    .await;
    let failed = read(checkout(
        &shop,
        &order,
        Some("k-refused"),
        "acc-refused",
        "700",
    ))
    .await;
    assert!(
        failed.status >= 500,
        "charged, then refused by the database: {failed:?}"
    );
    db.execute("DROP TRIGGER refuse_paid ON shop_orders").await;
    let retry = read(checkout(
        &shop,
        &order,
        Some("k-refused"),
        "acc-refused",
        "700",
    ))
    .await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert!(!retry.replayed, "{retry:?}");
    assert_eq!(retry.json()["status"], "paid", "{retry:?}");
    assert_eq!(retry.json()["bank_charges"], 1, "charged once: {retry:?}");
}
