//! The two `422`s a client can meet under one key: the handler's own (here
//! axum's JSON rejection, stored and replayed like any 4xx answer) and
//! idem's for a key reused with another body, told apart by a header.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem_axum::{IdempotencyLayer, SingleScope, IDEMPOTENCY_REJECTION, IDEMPOTENT_REPLAYED};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

#[derive(serde::Deserialize)]
struct Payment {
    amount: i64,
}

async fn pay(Json(p): Json<Payment>) -> (StatusCode, String) {
    (StatusCode::CREATED, p.amount.to_string())
}

async fn send(app: &Router, body: &str) -> axum::response::Response {
    let req = Request::post("/payments")
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(Body::from(body.to_owned()))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

#[tokio::test]
async fn the_handlers_422_is_stored_and_replayed_and_idems_own_says_so() {
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        SingleScope("t".into()),
    );
    let app = Router::new().route("/payments", post(pay).route_layer(layer));

    // The body lacks `amount`: axum's JSON extractor answers 422.
    let first = send(&app, r#"{"amt":1}"#).await;
    assert_eq!(first.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(first.headers().get(IDEMPOTENCY_REJECTION).is_none());

    // The same request again: the stored 422, replayed.
    let again = send(&app, r#"{"amt":1}"#).await;
    assert_eq!(again.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
    assert!(again.headers().get(IDEMPOTENCY_REJECTION).is_none());

    // Another body under the same key: idem's 422, named.
    let reused = send(&app, r#"{"amount":1}"#).await;
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        reused.headers()[IDEMPOTENCY_REJECTION],
        "idempotency-key-reused"
    );
    assert!(reused.headers().get(IDEMPOTENT_REPLAYED).is_none());
}
