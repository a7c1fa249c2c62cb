//! The OpenAPI document (`GET /openapi.json`) says what shop serves, and
//! `--fault-injection` bounds what `X-Simulate` may do to it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;

use common::{account, pay, read, Db, Shop, BODY};
use serde_json::Value;

/// Every route shop serves, by method and path.
const ROUTES: &[(&str, &str)] = &[
    ("get", "/"),
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/problems"),
    ("post", "/payments"),
    ("post", "/bare/payments"),
    ("get", "/payments/{id}"),
    ("post", "/payments/{id}/capture"),
    ("get", "/payments/{id}/events"),
    ("get", "/accounts/{account_id}"),
    ("get", "/emails"),
    ("post", "/orders"),
    ("get", "/orders/{id}"),
    ("post", "/orders/{id}/checkout"),
    ("get", "/products/{sku}"),
    ("put", "/products/{sku}"),
    ("get", "/stock/{sku}"),
    ("post", "/webhooks/bank"),
];

fn header_params(op: &Value) -> BTreeSet<String> {
    op["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["in"] == "header")
        .map(|p| p["name"].as_str().unwrap().to_ascii_lowercase())
        .collect()
}

async fn the_document_covers_every_route(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let doc: Value = client
        .get(shop.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{doc}");

    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.clone(), path.clone()))
        })
        .collect();
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(documented, served);

    // The headers that steer the contract, and the bearer scheme.
    let op = |m: &str, p: &str| doc["paths"][p][m].clone();
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let payments = op("post", "/payments");
    assert!(header_params(&payments).contains("idempotency-key"));
    assert!(header_params(&payments).contains("x-simulate"));
    assert!(header_params(&op("post", "/orders")).contains("idempotency-key"));
    let checkout = op("post", "/orders/{id}/checkout");
    assert!(header_params(&checkout).contains("idempotency-key"));
    assert!(header_params(&checkout).contains("x-simulate"));
    for status in ["200", "404", "409", "422", "502"] {
        assert!(
            checkout["responses"][status].is_object(),
            "POST /orders/{{id}}/checkout documents {status}"
        );
    }
    assert!(header_params(&op("put", "/products/{sku}")).contains("if-match"));
    for (status, _) in [("201", ()), ("409", ()), ("422", ()), ("502", ())] {
        assert!(
            payments["responses"][status].is_object(),
            "POST /payments documents {status}"
        );
    }

    for (method, path) in ROUTES {
        let op = op(method, path);
        // A route that needs a client says so.
        let secured = op["security"].as_array().is_some_and(|s| !s.is_empty());
        // Every error is documented as problem+json.
        for (status, response) in op["responses"].as_object().unwrap() {
            if status.starts_with('4') || status.starts_with('5') {
                assert!(
                    response["content"]["application/problem+json"].is_object(),
                    "{method} {path} {status}: {response}"
                );
            }
        }
        if secured {
            assert!(op["responses"]["401"].is_object(), "{method} {path}");
        }
        // The router serves what the document lists: neither the fallback's
        // 404 nor a 405.
        let url = shop.url(
            &path
                .replace("{id}", "x")
                .replace("{sku}", "x")
                .replace("{account_id}", "x"),
        );
        let request = client
            .request(method.to_uppercase().parse().unwrap(), url)
            .header("authorization", "Bearer openapi-probe");
        let answer = read(request).await;
        assert_ne!(answer.status, 405, "{method} {path}: {answer:?}");
        let body = String::from_utf8_lossy(&answer.body);
        assert!(!body.contains("no route here"), "{method} {path}: {body}");
    }
    // And the fallback is what an unlisted route gets.
    let stray = read(client.get(shop.url("/nowhere"))).await;
    assert_eq!(stray.status, 404);
    assert!(String::from_utf8_lossy(&stray.body).contains("no route here"));
}

/// `off` refuses `X-Simulate`, and does not serve `/bare/payments` (no
/// idempotency: a retry charges again); `safe` refuses only the crashes;
/// neither charges the bank for a refused request.
async fn fault_injection_is_bounded_by_its_flag(db: Db) {
    let client = reqwest::Client::new();
    let off = Shop::start(&db, &["--fault-injection", "off"]).await;
    let refused =
        read(pay(&client, &off, Some("k-off"), BODY).header("x-simulate", "bank-error")).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.body).contains("--fault-injection off"));
    let bare = read(
        client
            .post(off.url("/bare/payments"))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .body(BODY),
    )
    .await;
    assert_eq!(bare.status, 404, "{bare:?}");
    assert_eq!(account(&client, &off, "acc_1").await["bank_charges"], 0);
    drop(off);

    let mut safe = Shop::start(&db, &["--fault-injection", "safe"]).await;
    for crash in [
        "crash-before-bank",
        "crash-after-bank",
        "bank-error, crash-after-bank",
    ] {
        let refused =
            read(pay(&client, &safe, Some(crash), BODY).header("x-simulate", crash)).await;
        assert_eq!(refused.status, 400, "{crash}: {refused:?}");
    }
    assert!(!safe.exited(), "a refused crash leaves the process running");
    assert_eq!(account(&client, &safe, "acc_1").await["bank_charges"], 0);
    let failed =
        read(pay(&client, &safe, Some("k-fail"), BODY).header("x-simulate", "bank-error")).await;
    assert_eq!(failed.status, 502, "{failed:?}");
    let slow =
        read(pay(&client, &safe, Some("k-slow"), BODY).header("x-simulate", "bank-delay=10")).await;
    assert_eq!(slow.status, 201, "{slow:?}");
    let too_slow =
        read(pay(&client, &safe, Some("k-slower"), BODY).header("x-simulate", "bank-delay=60001"))
            .await;
    assert_eq!(too_slow.status, 400, "{too_slow:?}");
    assert_eq!(account(&client, &safe, "acc_1").await["bank_charges"], 1);
}

on_both_backends!(
    the_document_covers_every_route,
    fault_injection_is_bounded_by_its_flag,
);
