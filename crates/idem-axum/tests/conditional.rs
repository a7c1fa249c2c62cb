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

/// A PATCH with one `If-Match` field line per entry of `if_match`.
fn patch_lines(key: &str, if_match: &[&str], body: &str) -> Request<Body> {
    let mut r = Request::patch("/doc").header("idempotency-key", key);
    for line in if_match {
        r = r.header("if-match", *line);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

#[tokio::test]
async fn if_match_takes_a_list_on_one_line_or_several_and_star() {
    let (app, doc) = app();
    let send = |key: &'static str, lines: &'static [&'static str]| {
        let app = app.clone();
        async move { app.oneshot(patch_lines(key, lines, key)).await.unwrap() }
    };
    // version 1: one of the listed tags
    let r = send("l1", &["\"7\", \"1\""]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["etag"], "\"2\"");
    // version 2: the list spread over two field lines
    let r = send("l2", &["\"9\"", "\"2\""]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["etag"], "\"3\"");
    // none of the tags is current
    let r = send("l3", &["\"1\", \"2\"", "\"4\""]).await;
    assert_eq!(r.status(), StatusCode::PRECONDITION_FAILED);
    assert_eq!(r.headers()["etag"], "\"3\"");
    // `*`: any current representation
    let r = send("l4", &["*"]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["etag"], "\"4\"");
    // a weak tag never matches, even the current one
    let r = send("l5", &["W/\"4\""]).await;
    assert_eq!(r.status(), StatusCode::PRECONDITION_FAILED);
    // ... but a strong one beside it does
    let r = send("l6", &["W/\"4\", \"4\""]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["etag"], "\"5\"");
    assert_eq!(doc.lock().unwrap().clone(), (5, "l6".to_owned()));
}

#[tokio::test]
async fn a_malformed_if_match_is_a_400_problem_that_says_why() {
    let (app, doc) = app();
    let cases: [&[&str]; 9] = [
        &["1"],
        &["\"1\" \"2\""],
        &["\"1\", x"],
        &["*, \"1\""],
        &["*", "\"1\""],
        &["W/1"],
        &["\"1"],
        &[""],
        &["\"1\"", "w/\"2\""],
    ];
    for (i, lines) in cases.into_iter().enumerate() {
        let key = format!("bad-{i}");
        let r = app
            .clone()
            .oneshot(patch_lines(&key, lines, "x"))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{lines:?}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{lines:?}"
        );
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            problem["type"],
            format!(
                "{}precondition-invalid",
                idem_axum::problem::problem_type_base()
            ),
            "{lines:?}"
        );
        assert_eq!(problem["status"], 400);
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.starts_with("if-match"), "{lines:?}: {detail}");
    }
    assert_eq!(doc.lock().unwrap().0, 1, "nothing was written");
}

#[tokio::test]
async fn an_entity_tag_may_hold_a_comma() {
    async fn put(if_match: IfMatch) -> Response {
        let current = ETag::new("v1,2").unwrap();
        if if_match.matches(Some(&current)) {
            StatusCode::NO_CONTENT.into_response()
        } else {
            precondition_failed(Some(&current))
        }
    }
    let app: Router = Router::new().route("/tagged", axum::routing::put(put));
    let send = |if_match: &'static str| {
        let app = app.clone();
        async move {
            app.oneshot(
                Request::put("/tagged")
                    .header("if-match", if_match)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap()
            .status()
        }
    };
    assert_eq!(send("\"v1\", \"v1,2\"").await, StatusCode::NO_CONTENT);
    assert_eq!(send("\"v1\", \"2\"").await, StatusCode::PRECONDITION_FAILED);
}
