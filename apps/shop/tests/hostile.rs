//! `shop` as an attacker finds it: a second client can neither see nor
//! touch the first one's resources, malformed input is a clear 4xx that
//! writes nothing, every error is problem+json, and webhooks can require a
//! signature. On SQLite and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{read, Answer, Db, Shop, BODY};
use hmac::Mac;

on_both_backends!(
    a_second_client_cannot_see_or_touch_the_first_clients_resources,
    natural_keys_are_per_client,
    malformed_input_is_a_400_and_writes_nothing,
    every_error_is_problem_json,
    credentials_are_checked_strictly,
);

fn as_client(
    client: &reqwest::Client,
    who: &str,
    method: reqwest::Method,
    url: String,
) -> reqwest::RequestBuilder {
    client
        .request(method, url)
        .header("authorization", format!("Bearer {who}"))
}

async fn get_as(client: &reqwest::Client, shop: &Shop, who: &str, path: &str) -> Answer {
    read(as_client(client, who, reqwest::Method::GET, shop.url(path))).await
}

fn assert_problem(a: &Answer, status: u16) {
    assert_eq!(a.status, status, "{a:?}");
    assert_eq!(
        a.headers["content-type"], "application/problem+json",
        "{a:?}"
    );
}

async fn a_second_client_cannot_see_or_touch_the_first_clients_resources(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let paid = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::POST,
            shop.url("/payments"),
        )
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(BODY),
    )
    .await;
    assert_eq!(paid.status, 201, "{paid:?}");
    let id = paid.json()["id"].as_str().unwrap().to_owned();

    // Alice sees her payment; Bob gets 404 everywhere, never its content.
    assert_eq!(
        get_as(&client, &shop, "alice", &format!("/payments/{id}"))
            .await
            .status,
        200
    );
    for path in [format!("/payments/{id}"), format!("/payments/{id}/events")] {
        let a = get_as(&client, &shop, "bob", &path).await;
        assert_problem(&a, 404);
        assert!(!String::from_utf8_lossy(&a.body).contains("ch_"), "{a:?}");
    }
    let capture = read(as_client(
        &client,
        "bob",
        reqwest::Method::POST,
        shop.url(&format!("/payments/{id}/capture")),
    ))
    .await;
    assert_problem(&capture, 404);
    // ...and Bob's capture did not move Alice's payment.
    let mine = get_as(&client, &shop, "alice", &format!("/payments/{id}")).await;
    assert_eq!(mine.json()["status"], "authorized");

    // The account view counts only the caller's payments.
    let alice = get_as(&client, &shop, "alice", "/accounts/acc_1")
        .await
        .json();
    assert_eq!(
        (alice["payments"].as_i64(), alice["bank_charges"].as_i64()),
        (Some(1), Some(1))
    );
    let bob = get_as(&client, &shop, "bob", "/accounts/acc_1")
        .await
        .json();
    assert_eq!(
        bob,
        serde_json::json!({"account_id":"acc_1","payments":0,"charged_total":0,"bank_charges":0})
    );
    // Bob's key k1 is his own: a new payment, not Alice's replay.
    let bobs = read(
        as_client(&client, "bob", reqwest::Method::POST, shop.url("/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k1")
            .body(BODY),
    )
    .await;
    assert_eq!(bobs.status, 201);
    assert!(!bobs.replayed);
    assert_ne!(bobs.json()["id"], paid.json()["id"]);

    // Emails, once the consumer sent them, are per client too.
    for (who, theirs) in [("alice", &paid), ("bob", &bobs)] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let emails = get_as(&client, &shop, who, "/emails?account_id=acc_1")
                .await
                .json();
            let list = emails["emails"].as_array().cloned().unwrap_or_default();
            assert!(
                list.iter().all(|e| e["payment_id"] == theirs.json()["id"]),
                "{who}: {emails}"
            );
            if !list.is_empty() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no email for {who}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    // Reading anything of a client's needs credentials.
    for path in [
        format!("/payments/{id}"),
        "/accounts/acc_1".to_owned(),
        "/emails?account_id=acc_1".to_owned(),
    ] {
        let a = read(client.get(shop.url(&path))).await;
        assert_problem(&a, 401);
    }
    // The catalog is shared: reads are public, writes need a client.
    let put = read(
        client
            .put(shop.url("/products/tea"))
            .header("content-type", "application/json")
            .body(r#"{"name":"Tea","price":300}"#),
    )
    .await;
    assert_problem(&put, 401);
    assert_eq!(
        read(client.get(shop.url("/products/tea"))).await.status,
        404
    );
}

async fn natural_keys_are_per_client(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let order = |who: &str, items: &str| {
        as_client(&client, who, reqwest::Method::POST, shop.url("/orders"))
            .header("content-type", "application/json")
            .body(format!(
                r#"{{"customer_id":"cust-1","client_reference":"cart-1","items":{items}}}"#
            ))
    };
    let a = read(order("alice", r#"[{"sku":"tea","qty":1}]"#)).await;
    assert_eq!(a.status, 201, "{a:?}");
    // Bob uses the same reference: his own order, not Alice's, not blocked.
    let b = read(order("bob", r#"[{"sku":"cup","qty":5}]"#)).await;
    assert_eq!(b.status, 201, "{b:?}");
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(b.json()["items"][0]["sku"], "cup");
    let again = read(order("bob", r#"[{"sku":"cup","qty":5}]"#)).await;
    assert_eq!(
        (again.status, again.json()["id"].clone()),
        (200, b.json()["id"].clone())
    );
    let id = a.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        get_as(&client, &shop, "alice", &format!("/orders/{id}"))
            .await
            .status,
        200
    );
    assert_problem(
        &get_as(&client, &shop, "bob", &format!("/orders/{id}")).await,
        404,
    );
}

async fn malformed_input_is_a_400_and_writes_nothing(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let pay = |key: &str, body: &str| {
        as_client(
            &client,
            "alice",
            reqwest::Method::POST,
            shop.url("/payments"),
        )
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(body.to_owned())
    };
    let bad = [
        r#"{"account_id":"acc_1","amount":0,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":-5,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":1000000001,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":9223372036854775807,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":10.5,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":"10","currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":10,"currency":"EURO"}"#,
        r#"{"account_id":"acc_1","amount":10,"currency":"E1R"}"#,
        r#"{"account_id":"","amount":10,"currency":"EUR"}"#,
        r#"{"account_id":"acc 1","amount":10,"currency":"EUR"}"#,
        "{\"account_id\":\"acc\\u0000\",\"amount\":10,\"currency\":\"EUR\"}",
        "{\"account_id\":\"acc\\n1\",\"amount\":10,\"currency\":\"EUR\"}",
        r#"{"account_id":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","amount":10,"currency":"EUR"}"#,
        r#"{"account_id":"acc_1","amount":10,"currency":"EUR","extra":1}"#,
        r#"[1,2]"#,
        "not json",
    ];
    for (i, body) in bad.iter().enumerate() {
        let a = read(pay(&format!("bad-{i}"), body)).await;
        assert_problem(&a, 400);
        assert!(a.problem_type().ends_with("validation"), "{body}: {a:?}");
    }
    let orders = [
        r#"{"customer_id":"c\u0000","client_reference":"r","items":[{"sku":"tea","qty":1}]}"#,
        r#"{"customer_id":"c","client_reference":"r/1","items":[{"sku":"tea","qty":1}]}"#,
        r#"{"customer_id":"c","client_reference":"r","items":[{"sku":"t a","qty":1}]}"#,
        r#"{"customer_id":"c","client_reference":"r","items":[{"sku":"tea","qty":0}]}"#,
    ];
    for body in orders {
        let a = read(
            as_client(&client, "alice", reqwest::Method::POST, shop.url("/orders"))
                .header("content-type", "application/json")
                .body(body),
        )
        .await;
        assert_problem(&a, 400);
    }
    // A control character in a path or a query is a 400, never a 5xx.
    for path in [
        "/payments/pay%00x",
        "/payments/pay%0Ax",
        "/accounts/acc%00",
        "/emails?account_id=acc%00",
        "/orders/o%01",
    ] {
        assert_problem(&get_as(&client, &shop, "alice", path).await, 400);
    }
    assert_problem(&read(client.get(shop.url("/stock/tea%00"))).await, 400);
    let nul_sku = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::PUT,
            shop.url("/products/t%00"),
        )
        .header("content-type", "application/json")
        .body(r#"{"name":"Tea","price":300}"#),
    )
    .await;
    assert_problem(&nul_sku, 400);
    let nul_name = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::PUT,
            shop.url("/products/tea"),
        )
        .header("content-type", "application/json")
        .body("{\"name\":\"T\\u0000ea\",\"price\":300}"),
    )
    .await;
    assert_problem(&nul_name, 400);

    // Not JSON at all: 415, before any record is made.
    let text = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::POST,
            shop.url("/payments"),
        )
        .header("content-type", "text/plain")
        .header("idempotency-key", "k-text")
        .body(BODY),
    )
    .await;
    assert_problem(&text, 415);
    let json = read(pay("k-text", BODY)).await;
    assert_eq!(json.status, 201, "the 415 stored nothing: {json:?}");
    let missing = read(
        as_client(&client, "alice", reqwest::Method::POST, shop.url("/orders"))
            .body(r#"{"customer_id":"c","client_reference":"r","items":[{"sku":"tea","qty":1}]}"#),
    )
    .await;
    assert_problem(&missing, 415);
    let plus_json = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::POST,
            shop.url("/payments"),
        )
        .header("content-type", "application/vnd.shop+json; charset=utf-8")
        .header("idempotency-key", "k-plus")
        .body(BODY),
    )
    .await;
    assert_eq!(plus_json.status, 201, "{plus_json:?}");

    // Nothing of the refused requests was written.
    let acc = get_as(&client, &shop, "alice", "/accounts/acc_1")
        .await
        .json();
    assert_eq!(
        (acc["payments"].as_i64(), acc["bank_charges"].as_i64()),
        (Some(2), Some(2)),
        "{acc}"
    );
}

async fn every_error_is_problem_json(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    assert_problem(&read(client.get(shop.url("/no/such/route"))).await, 404);
    let wrong_method = read(client.delete(shop.url("/payments"))).await;
    assert_problem(&wrong_method, 405);
    assert!(
        wrong_method.headers.contains_key("allow"),
        "{wrong_method:?}"
    );
    let bad_path = read(client.get(shop.url("/products/%FF"))).await;
    assert_problem(&bad_path, 400);
    // Every problem's type is a section of the service's own page, shop's
    // types and idem's alike: `<shop>/problems#<slug>`, an anchor it serves.
    let page = client
        .get(shop.url("/problems"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let missing_key = read(
        as_client(
            &client,
            "alice",
            reqwest::Method::POST,
            shop.url("/payments"),
        )
        .header("content-type", "application/json")
        .body(BODY),
    )
    .await;
    for answer in [&wrong_method, &bad_path, &missing_key] {
        let kind = answer.problem_type();
        let slug = kind
            .strip_prefix(&format!("{}/problems#", shop.base))
            .unwrap_or_else(|| panic!("{kind} is not a section of {}/problems", shop.base));
        assert!(page.contains(&format!("id=\"{slug}\"")), "no anchor {slug}");
    }
    // (Last: the server may close this connection rather than read the rest.)
    let too_large = read(
        as_client(&client, "alice", reqwest::Method::POST, shop.url("/orders"))
            .header("content-type", "application/json")
            .body(vec![b'x'; 3 * 1024 * 1024]),
    )
    .await;
    assert_problem(&too_large, 413);
}

async fn credentials_are_checked_strictly(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let pay = || {
        client
            .post(shop.url("/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-auth")
            .body(BODY)
    };
    let two = read(
        pay()
            .header("authorization", "Bearer alice")
            .header("authorization", "Bearer bob"),
    )
    .await;
    assert_problem(&two, 400);
    let basic = read(pay().header("authorization", "Basic YTpi")).await;
    assert_problem(&basic, 401);
    // The scheme is case-insensitive (RFC 9110).
    let lower = read(pay().header("authorization", "bearer alice")).await;
    assert_eq!(lower.status, 201, "{lower:?}");
    let upper = read(pay().header("authorization", "BEARER alice")).await;
    assert!(upper.replayed, "the same client: {upper:?}");
}

fn sign(secret: &str, body: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256={hex}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_webhooks_need_the_right_signature() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--webhook-secret", "whsec-test"]).await;
    let client = reqwest::Client::new();
    let paid = read(common::pay(&client, &shop, Some("k-wh"), BODY)).await;
    let id = paid.json()["id"].as_str().unwrap().to_owned();
    let event = format!(r#"{{"event_id":"evt-1","type":"charge.settled","payment_id":"{id}"}}"#);
    let send = |signature: Option<String>| {
        let mut r = client
            .post(shop.url("/webhooks/bank"))
            .header("content-type", "application/json")
            .body(event.clone());
        if let Some(s) = signature {
            r = r.header("x-bank-signature", s);
        }
        read(r)
    };
    assert_problem(&send(None).await, 401);
    assert_problem(&send(Some(sign("wrong", &event))).await, 401);
    assert_problem(&send(Some(sign("whsec-test", "{}"))).await, 401);
    // Nothing changed: the payment is still authorized.
    let payment = read(
        client
            .get(shop.url(&format!("/payments/{id}")))
            .header("authorization", "Bearer client-1"),
    )
    .await;
    assert_eq!(payment.json()["status"], "authorized");
    let ok = send(Some(sign("whsec-test", &event))).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.json()["status"], "processed");
    let payment = read(
        client
            .get(shop.url(&format!("/payments/{id}")))
            .header("authorization", "Bearer client-1"),
    )
    .await;
    assert_eq!(payment.json()["status"], "settled");
}

/// An empty webhook secret would let anyone sign (an HMAC with an empty key
/// is anyone's to make): refused at start, from the flag or the
/// environment, never taken for "unsigned".
#[test]
fn an_empty_webhook_secret_is_refused_at_start() {
    let from_flag = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        // (`--db-connections 4` on an in-memory database is refused too,
        // later: were the secret taken, shop would still stop.)
        .args(["--database-url", "sqlite::memory:", "--db-connections", "4"])
        .args(["--webhook-secret", ""])
        .output()
        .unwrap();
    assert!(!from_flag.status.success());
    let from_env = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--database-url", "sqlite::memory:", "--db-connections", "4"])
        .env("SHOP_WEBHOOK_SECRET", "")
        .output()
        .unwrap();
    assert!(!from_env.status.success());
    for refused in [&from_flag, &from_env] {
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("webhook-secret"), "{stderr}");
    }
}
