//! Natural keys, guarded transitions, conditional writes, webhooks and the
//! retrying client, against the real `shop` on SQLite and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{account, pay, read, Db, Shop, BODY};
use idem_client::{IdempotentRetry, RetryOutcomeExt};

on_both_backends!(
    fifty_racing_order_creates_make_one_order,
    captures_apply_once_and_explain_refusals,
    if_match_races_let_one_writer_win,
    a_webhook_delivered_three_times_acts_once,
    the_client_retries_a_timed_out_payment_into_a_replay,
);

const ORDER: &str = r#"{"customer_id":"cust-1","client_reference":"cart-77","items":[{"sku":"tea","qty":2},{"sku":"cup","qty":1}]}"#;

fn order(client: &reqwest::Client, shop: &Shop, body: &str) -> reqwest::RequestBuilder {
    client
        .post(shop.url("/orders"))
        .header("authorization", "Bearer client-1")
        .header("content-type", "application/json")
        .body(body.to_owned())
}

async fn fifty_racing_order_creates_make_one_order(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = common::signed_in();
    let mut tasks = Vec::new();
    for _ in 0..50 {
        tasks.push(tokio::spawn(read(order(&client, &shop, ORDER))));
    }
    let mut created = 0;
    let mut ids = HashSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert!(a.status == 201 || a.status == 200, "{a:?}");
        created += usize::from(a.status == 201);
        let id = a.json()["id"].as_str().unwrap().to_owned();
        assert_eq!(a.headers["location"], format!("/orders/{id}").as_str());
        ids.insert(id);
    }
    assert_eq!(created, 1, "one order created");
    assert_eq!(ids.len(), 1, "every answer carries the same order: {ids:?}");
    let id = ids.into_iter().next().unwrap();
    let fetched = read(client.get(shop.url(&format!("/orders/{id}")))).await;
    assert_eq!(fetched.json()["items"][0]["sku"], "tea");
    assert_eq!(fetched.json()["status"], "placed");

    // the same reference for other items is refused
    let other = ORDER.replace("\"qty\":2", "\"qty\":3");
    let a = read(order(&client, &shop, &other)).await;
    assert_eq!(a.status, 422, "{a:?}");
    assert!(a.problem_type().ends_with("client-reference-reused"));
    // an Idempotency-Key is honoured when sent: a new key, same order (200), then replays
    let with_key = read(order(&client, &shop, ORDER).header("idempotency-key", "ord-k1")).await;
    assert_eq!(with_key.status, 200);
    let replay = read(order(&client, &shop, ORDER).header("idempotency-key", "ord-k1")).await;
    assert!(replay.replayed);
    // and credentials are still required
    let anonymous = read(reqwest::Client::new().post(shop.url("/orders")).body(ORDER)).await;
    assert_eq!(anonymous.status, 401);
    let invalid = read(order(
        &client,
        &shop,
        r#"{"customer_id":"c","client_reference":"r","items":[]}"#,
    ))
    .await;
    assert_eq!(invalid.status, 400);
    assert!(invalid.problem_type().ends_with("validation"));
}

async fn captures_apply_once_and_explain_refusals(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = common::signed_in();
    let paid = read(pay(&client, &shop, Some("cap-1"), BODY)).await;
    let id = paid.json()["id"].as_str().unwrap().to_owned();
    let capture = |id: &str| read(client.post(shop.url(&format!("/payments/{id}/capture"))));
    let mut tasks = Vec::new();
    for _ in 0..30 {
        tasks.push(tokio::spawn(read(
            client.post(shop.url(&format!("/payments/{id}/capture"))),
        )));
    }
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        assert_eq!(a.json()["status"], "captured");
        assert_eq!(a.json()["id"], id.as_str());
    }
    let again = capture(&id).await;
    assert_eq!(
        (again.status, again.json()["status"].as_str()),
        (200, Some("captured"))
    );
    let missing = capture("pay_nope").await;
    assert_eq!(missing.status, 404);
    // a settled payment cannot be captured
    let other = read(pay(&client, &shop, Some("cap-2"), BODY)).await;
    let other_id = other.json()["id"].as_str().unwrap().to_owned();
    let settle = serde_json::json!({"event_id": "evt-cap-2", "type": "charge.settled", "payment_id": other_id});
    let a = read(client.post(shop.url("/webhooks/bank")).json(&settle)).await;
    assert_eq!(a.status, 200);
    let refused = capture(&other_id).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert!(refused.problem_type().ends_with("payment-state-conflict"));
}

async fn if_match_races_let_one_writer_win(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = common::signed_in();
    let url = shop.url("/products/tea");
    let created = read(
        client
            .put(&url)
            .json(&serde_json::json!({"name": "Tea", "price": 300})),
    )
    .await;
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(created.headers["etag"], "\"1\"");
    let got = read(client.get(&url)).await;
    let etag = got.headers["etag"].to_str().unwrap().to_owned();
    assert_eq!(got.json()["price"], 300);

    // two writers saw the same version: one wins, one gets 412
    let a = tokio::spawn(read(
        client
            .put(&url)
            .header("if-match", &etag)
            .json(&serde_json::json!({"name": "Tea", "price": 310})),
    ));
    let b = tokio::spawn(read(
        client
            .put(&url)
            .header("if-match", &etag)
            .json(&serde_json::json!({"name": "Tea", "price": 320})),
    ));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let mut statuses = [a.status, b.status];
    statuses.sort();
    assert_eq!(statuses, [200, 412], "{a:?} {b:?}");
    let loser = if a.status == 412 { &a } else { &b };
    assert!(loser.problem_type().ends_with("precondition-failed"));
    assert_eq!(
        loser.headers["etag"], "\"2\"",
        "the 412 names the current version"
    );
    let now = read(client.get(&url)).await;
    assert_eq!(now.headers["etag"], "\"2\"");

    // an update without If-Match is refused with 428; If-None-Match: * never overwrites
    let blind = read(
        client
            .put(&url)
            .json(&serde_json::json!({"name": "Tea", "price": 1})),
    )
    .await;
    assert_eq!(blind.status, 428);
    assert!(blind.problem_type().ends_with("precondition-required"));
    let create_only = read(
        client
            .put(&url)
            .header("if-none-match", "*")
            .json(&serde_json::json!({"name": "Tea", "price": 1})),
    )
    .await;
    assert_eq!(create_only.status, 412);
    let fresh = read(
        client
            .put(shop.url("/products/cup"))
            .header("if-none-match", "*")
            .json(&serde_json::json!({"name": "Cup", "price": 900})),
    )
    .await;
    assert_eq!(fresh.status, 201);
    // If-Match on a product that does not exist fails
    let ghost = read(
        client
            .put(shop.url("/products/ghost"))
            .header("if-match", "\"1\"")
            .json(&serde_json::json!({"name": "G", "price": 1})),
    )
    .await;
    assert_eq!(ghost.status, 412);
    assert_eq!(
        read(client.get(shop.url("/products/ghost"))).await.status,
        404
    );
}

async fn a_webhook_delivered_three_times_acts_once(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = common::signed_in();
    let paid = read(pay(&client, &shop, Some("wh-1"), BODY)).await;
    let id = paid.json()["id"].as_str().unwrap().to_owned();
    let event =
        serde_json::json!({"event_id": "evt-1", "type": "charge.settled", "payment_id": id});
    let mut answers = Vec::new();
    for _ in 0..3 {
        // no bearer token, no Idempotency-Key: providers send neither
        answers.push(read(client.post(shop.url("/webhooks/bank")).json(&event)).await);
    }
    assert!(answers.iter().all(|a| a.status == 200), "{answers:?}");
    assert_eq!(answers[0].json()["status"], "processed");
    assert_eq!(answers[1].json()["status"], "duplicate");
    assert_eq!(answers[2].json()["status"], "duplicate");
    let events = read(client.get(shop.url(&format!("/payments/{id}/events"))))
        .await
        .json();
    assert_eq!(
        events["events"].as_array().unwrap().len(),
        1,
        "one effect: {events}"
    );
    let payment = read(client.get(shop.url(&format!("/payments/{id}"))))
        .await
        .json();
    assert_eq!(payment["status"], "settled");
    // racing deliveries of another event act once too
    let event2 = serde_json::json!({"event_id": "evt-2", "type": "charge.note", "payment_id": id});
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(tokio::spawn(read(
            client.post(shop.url("/webhooks/bank")).json(&event2),
        )));
    }
    let mut processed = 0;
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200);
        processed += usize::from(a.json()["status"] == "processed");
    }
    assert_eq!(processed, 1);
    let events = read(client.get(shop.url(&format!("/payments/{id}/events"))))
        .await
        .json();
    assert_eq!(events["events"].as_array().unwrap().len(), 2, "{events}");
    let unknown = serde_json::json!({"event_id": "evt-3", "type": "charge.settled", "payment_id": "pay_nope"});
    assert_eq!(
        read(client.post(shop.url("/webhooks/bank")).json(&unknown))
            .await
            .status,
        404
    );
    // An event id already processed, sent with another type or for another
    // payment, is not a repeat: 422, and nothing is recorded or moved.
    let other = read(pay(&client, &shop, Some("wh-2"), BODY)).await;
    let other_id = other.json()["id"].as_str().unwrap().to_owned();
    for reused in [
        serde_json::json!({"event_id": "evt-2", "type": "charge.settled", "payment_id": id}),
        serde_json::json!({"event_id": "evt-2", "type": "charge.note", "payment_id": other_id}),
        serde_json::json!({"event_id": "evt-1", "type": "charge.settled", "payment_id": other_id}),
        serde_json::json!({"event_id": "evt-1", "type": "charge.settled", "payment_id": "pay_nope"}),
    ] {
        let answer = read(client.post(shop.url("/webhooks/bank")).json(&reused)).await;
        assert_eq!(answer.status, 422, "{reused}: {answer:?}");
        assert!(
            answer.problem_type().ends_with("event-id-reused"),
            "{answer:?}"
        );
    }
    let events = read(client.get(shop.url(&format!("/payments/{id}/events"))))
        .await
        .json();
    assert_eq!(events["events"].as_array().unwrap().len(), 2, "{events}");
    let untouched = read(client.get(shop.url(&format!("/payments/{other_id}/events"))))
        .await
        .json();
    assert_eq!(
        untouched["events"].as_array().unwrap().len(),
        0,
        "{untouched}"
    );
    let other = read(client.get(shop.url(&format!("/payments/{other_id}"))))
        .await
        .json();
    assert_ne!(other["status"], "settled", "{other}");
    // The first delivery's repeat is still a duplicate.
    let again = read(client.post(shop.url("/webhooks/bank")).json(&event)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["status"], "duplicate");
}

async fn the_client_retries_a_timed_out_payment_into_a_replay(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let retrying = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotentRetry::builder()
                .base_delay(Duration::from_millis(100))
                .max_retry_after(Duration::from_millis(300))
                .max_attempts(10)
                .build(),
        )
        .build();
    // The bank charges at once but answers after 1.2 s; the client gives up
    // on each attempt after 400 ms and retries with the same key.
    let response = retrying
        .post(shop.url("/payments"))
        .header("authorization", "Bearer client-1")
        .header("content-type", "application/json")
        .header("x-simulate", "bank-delay=1200")
        .body(BODY)
        .timeout(Duration::from_millis(400))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let outcome = response.retry_outcome().unwrap().clone();
    assert!(outcome.attempts >= 2, "{outcome:?}");
    assert!(
        outcome.replayed,
        "the answer is the first attempt's, replayed: {outcome:?}"
    );
    let plain = reqwest::Client::new();
    let acc = account(&plain, &shop, "acc_1").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "charged once: {acc}");

    // a 422 is never retried
    let key = outcome.idempotency_key.unwrap();
    let reused = retrying
        .post(shop.url("/payments"))
        .header("authorization", "Bearer client-1")
        .header("content-type", "application/json")
        .header("idempotency-key", &key)
        .body(r#"{"account_id":"acc_1","amount":5,"currency":"EUR"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reused.status(), 422);
    assert_eq!(reused.retry_outcome().unwrap().attempts, 1);
}
