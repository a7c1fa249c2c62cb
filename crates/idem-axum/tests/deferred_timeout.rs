//! A handler that claims in its own transaction (`DeferredClaim::begin`)
//! on a store that stops answering (a network partition) gets `503` within
//! the policy's store timeout, as the layer's own store calls do, instead
//! of waiting for the partition to heal.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use idem_axum::{DeferredClaim, IdempotencyLayer, SingleScope};
use idem_core::{
    BoxFuture, Claim, ClaimInTransaction, ClaimOutcome, ClaimRequest, Policy, Record, Store,
    StoreError, StoredResponse, TxClaimOutcome,
};
use idem_memory::MemoryStore;
use tower::ServiceExt;

/// A store that never answers.
#[derive(Debug, Clone, Copy)]
struct Silent;

fn never<'a, T: 'a>() -> BoxFuture<'a, T> {
    Box::pin(std::future::pending())
}

impl Store for Silent {
    fn claim<'a>(&'a self, _: &'a ClaimRequest) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        never()
    }
    fn complete<'a>(
        &'a self,
        _: &'a Claim,
        _: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        never()
    }
    fn release<'a>(&'a self, _: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        never()
    }
    fn get<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        never()
    }
    fn sweep(&self, _: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        never()
    }
}

impl ClaimInTransaction for Silent {
    type Transaction = ();
    fn claim_and_begin<'a>(
        &'a self,
        _: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<TxClaimOutcome<()>, StoreError>> {
        never()
    }
}

async fn handler(pending: DeferredClaim, headers: http::HeaderMap) -> Response {
    if headers.contains_key("x-peek") {
        return match pending.answered_by_record(&Silent).await {
            Some(answered) => answered.into_response(),
            None => StatusCode::NO_CONTENT.into_response(),
        };
    }
    match pending.begin(&Silent).await {
        Ok(_) => StatusCode::CREATED.into_response(),
        Err(answered) => answered.into_response(),
    }
}

#[tokio::test]
async fn a_silent_store_answers_503_within_the_store_timeout() {
    let policy = Policy::builder()
        .store_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let layer = IdempotencyLayer::new(
        std::sync::Arc::new(MemoryStore::new()),
        policy,
        SingleScope("s".to_owned()),
    )
    .claim_in_transaction();
    let app = Router::new().route("/p", post(handler).route_layer(layer));
    let send = |peek: bool| {
        let mut r = Request::post("/p")
            .header("idempotency-key", "k")
            .header("content-type", "application/json");
        if peek {
            r = r.header("x-peek", "1");
        }
        app.clone().oneshot(r.body(Body::from("{}")).unwrap())
    };
    let started = Instant::now();
    let answered = tokio::time::timeout(Duration::from_secs(20), send(false))
        .await
        .expect("an answer within 20 s")
        .unwrap();
    assert_eq!(answered.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(answered.headers().contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(10));
    // The read before a turn: none, so the claim decides (bounded too).
    let peeked = tokio::time::timeout(Duration::from_secs(20), send(true))
        .await
        .expect("an answer within 20 s")
        .unwrap();
    assert_eq!(peeked.status(), StatusCode::NO_CONTENT);
}
