//! Routers nested under a prefix: axum strips the prefix before the layer
//! sees the request, but the fingerprint is of the path the client sent,
//! so one key reused on two nested endpoints is `422`, never the other
//! endpoint's answer replayed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idem_axum::{IdempotencyLayer, SingleScope, IDEMPOTENCY_REJECTION};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

async fn send(app: &Router, path: &str) -> axum::response::Response {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

#[tokio::test]
async fn one_key_on_two_nested_endpoints_is_422_not_a_replay_of_the_other() {
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        SingleScope("t".into()),
    );
    let orders = Router::new()
        .route("/", post(|| async { (StatusCode::CREATED, "order") }))
        .layer(layer.clone());
    let refunds = Router::new()
        .route("/", post(|| async { (StatusCode::CREATED, "refund") }))
        .layer(layer);
    let app = Router::new()
        .nest("/orders", orders)
        .nest("/refunds", refunds);

    let order = send(&app, "/orders").await;
    assert_eq!(order.status(), StatusCode::CREATED);
    let refund = send(&app, "/refunds").await;
    assert_eq!(refund.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        refund.headers()[IDEMPOTENCY_REJECTION],
        "idempotency-key-reused"
    );
    // The same endpoint again: its own answer, replayed.
    let again = send(&app, "/orders").await;
    assert_eq!(again.status(), StatusCode::CREATED);
}
