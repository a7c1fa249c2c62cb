//! `If-Match` and `Idempotency-Key` on the same PATCH.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::conditional::{precondition_failed, ETag, IfMatch};
use idem_axum::{IdempotencyLayer, SingleScope};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

/// A document with a version; PATCH replaces its text if the version matches.
type Doc = Arc<Mutex<(i64, String)>>;

async fn read(State(doc): State<Doc>) -> Response {
    let (v, text) = doc.lock().unwrap().clone();
    (ETag::from_version(v), text).into_response()
}

async fn patch(State(doc): State<Doc>, if_match: IfMatch, body: String) -> Response {
    let mut d = doc.lock().unwrap();
    let current = ETag::from_version(d.0);
    // the equivalent of UPDATE … WHERE version = $seen
    if !if_match.matches(Some(&current)) {
        return precondition_failed(Some(&current));
    }
    d.0 += 1;
    d.1 = body;
    (ETag::from_version(d.0), d.1.clone()).into_response()
}

fn app() -> (Router, Doc) {
    let doc: Doc = Arc::new(Mutex::new((1, "first".into())));
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        SingleScope("s".into()),
    );
    let app = Router::new()
        .route("/doc", get(read).patch(patch))
        .layer(layer)
        .with_state(doc.clone());
    (app, doc)
}

fn patch_req(key: Option<&str>, if_match: Option<&str>, body: &str) -> Request<Body> {
    let mut r = Request::patch("/doc");
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    if let Some(m) = if_match {
        r = r.header("if-match", m);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

#[tokio::test]
async fn a_retried_patch_replays_instead_of_failing_its_own_precondition() {
    let (app, doc) = app();
    let first = app
        .clone()
        .oneshot(patch_req(Some("k1"), Some("\"1\""), "second"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["etag"], "\"2\"");
    // the answer was lost; the client retries the same PATCH with the same key
    let retry = app
        .clone()
        .oneshot(patch_req(Some("k1"), Some("\"1\""), "second"))
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::OK, "replayed, not 412");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.headers()["etag"],
        "\"2\"",
        "ETag is on the replay allow-list"
    );
    assert_eq!(doc.lock().unwrap().0, 2, "applied once");
    // another writer that saw version 1 is refused
    let stale = app
        .clone()
        .oneshot(patch_req(Some("k2"), Some("\"1\""), "other"))
        .await
        .unwrap();
    assert_eq!(stale.status(), StatusCode::PRECONDITION_FAILED);
    assert_eq!(stale.headers()["etag"], "\"2\"");
    let body = stale.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("precondition-failed"));
}

#[tokio::test]
async fn a_missing_precondition_is_428_and_a_malformed_one_400() {
    let (app, _) = app();
    let missing = app
        .clone()
        .oneshot(patch_req(Some("k3"), None, "x"))
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    let bad = app
        .clone()
        .oneshot(patch_req(Some("k4"), Some("1"), "x"))
        .await
        .unwrap();
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let read = app
        .oneshot(Request::get("/doc").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(read.headers()["etag"], "\"1\"");
}
