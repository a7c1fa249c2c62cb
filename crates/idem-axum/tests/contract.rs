//! One test (or more) per row of the HTTP contract, driven through the layer
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! with `oneshot`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::{Idempotency, IdempotencyLayer, ScopeExtractor};
use idem_core::{Policy, RecordState, Store};
use idem_memory::MemoryStore;
use idem_test_support::stores::SlowClaimAnswers;
use tower::ServiceExt;

mod broken_body;
use broken_body::BrokenBody;

#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A handler steered by `x-behave`: `sleep=MS`, `status=N`, `panic`.
async fn handler(
    State(runs): State<Runs>,
    idem: Option<Idempotency>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    let behave = headers
        .get("x-behave")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut status = StatusCode::CREATED;
    for part in behave.split(',') {
        if let Some(ms) = part.strip_prefix("sleep=") {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        } else if let Some(code) = part.strip_prefix("status=") {
            status = StatusCode::from_u16(code.parse().unwrap()).unwrap();
        } else if part == "panic" {
            panic!("handler panicked on purpose");
        } else if part == "keep" {
            if let Some(idem) = &idem {
                idem.keep_claim();
            }
        } else if part == "store" {
            if let Some(idem) = &idem {
                idem.store_answer();
            }
        } else if part == "broken-body" {
            // The effect happened; the answer's body fails on the way out.
            return (status, Body::new(BrokenBody { panics: false })).into_response();
        } else if part == "panicking-body" {
            // The effect happened; the answer's body panics on the way out.
            return (status, Body::new(BrokenBody { panics: true })).into_response();
        }
    }
    let mut response = (
        status,
        [
            ("location", "/things/1".to_owned()),
            ("content-type", "application/json".to_owned()),
            ("set-cookie", "session=secret".to_owned()),
            ("x-run", n.to_string()),
        ],
        format!(
            r#"{{"run":{n},"operation_id":"{}","takeover":{},"scope":"{}","key":"{}","echo":{}}}"#,
            idem.as_ref()
                .map(|i| i.operation_id().to_string())
                .unwrap_or_default(),
            idem.as_ref().is_some_and(|i| i.is_takeover()),
            idem.as_ref()
                .map(|i| i.scope().to_owned())
                .unwrap_or_default(),
            idem.as_ref()
                .map(|i| i.key().to_owned())
                .unwrap_or_default(),
            String::from_utf8_lossy(&body).len()
        ),
    )
        .into_response();
    if behave.split(',').any(|part| part == "encoded") {
        // A layer inside idem's compressed the body.
        response
            .headers_mut()
            .insert("content-encoding", http::HeaderValue::from_static("gzip"));
    }
    if behave.split(',').any(|part| part == "in-use-header") {
        // The layer's "in flight" marker on an answer of another status
        // (as an upstream behind `idem proxy` may write it).
        response.headers_mut().insert(
            "idempotency-rejection",
            http::HeaderValue::from_static("idempotency-key-in-use"),
        );
    }
    response
}

fn by_client_header() -> impl ScopeExtractor {
    |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-client")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| StatusCode::UNAUTHORIZED.into_response())
    }
}

struct Harness {
    app: Router,
    runs: Runs,
    store: Arc<MemoryStore>,
}

fn harness(policy: Policy) -> Harness {
    let store = Arc::new(MemoryStore::new());
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(store.clone(), policy, by_client_header());
    let app = Router::new()
        .route(
            "/things",
            post(handler).patch(handler).get(|| async { "listing" }),
        )
        .layer(layer)
        .with_state(runs.clone());
    Harness { app, runs, store }
}

fn short_lease() -> Policy {
    Policy::builder()
        .lease(Duration::from_millis(300))
        .build()
        .unwrap()
}

fn post_req(key: Option<&str>, body: &str) -> http::request::Builder {
    let mut b = Request::post("/things")
        .header("x-client", "client-a")
        .header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    let _ = body;
    b
}

fn req(key: &str, body: &str) -> Request<Body> {
    post_req(Some(key), body)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn req_with(key: &str, body: &str, behave: &str) -> Request<Body> {
    post_req(Some(key), body)
        .header("x-behave", behave)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(app: &Router, r: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = app.clone().oneshot(r).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// Sends `key` with `behave`, which makes the request fail with `500`
/// after its effect, and asserts its claim is then held (`409`), not
/// released: the retry sent at once does not run. Returns the failure's
/// headers and body, and when it was sent (the lease counts from then).
async fn fails_then_is_held(
    app: &Router,
    key: &str,
    behave: &str,
    lease: Duration,
) -> (HeaderMap, Bytes, std::time::Instant) {
    let started = std::time::Instant::now();
    let (status, headers, body) = send(app, req_with(key, "{}", behave)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{behave}");
    let (held, _, _) = send(app, req(key, "{}")).await;
    assert!(
        started.elapsed() < lease,
        "the machine stalled past the case's margin"
    );
    assert_eq!(
        held,
        StatusCode::CONFLICT,
        "{behave}: released, the retry ran at once"
    );
    (headers, body, started)
}

fn problem_type(headers: &HeaderMap, body: &[u8]) -> String {
    assert_eq!(headers["content-type"], "application/problem+json");
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["type"].as_str().unwrap().to_owned()
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

#[tokio::test]
async fn new_key_runs_the_handler_and_stores_the_answer() {
    let h = harness(Policy::default());
    let (status, headers, body) = send(&h.app, req("k-new", r#"{"a":1}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(h.runs.get(), 1);
    assert!(headers.get("idempotent-replayed").is_none());
    // the handler ran under the request's own scope and key, as the first
    let ran = json(&body);
    assert_eq!(
        (&ran["scope"], &ran["key"], &ran["takeover"]),
        (
            &serde_json::json!("client-a"),
            &serde_json::json!("k-new"),
            &serde_json::json!(false)
        )
    );
    // the first answer is sent whole, session headers included
    assert_eq!(headers["set-cookie"], "session=secret");
    let record = h.store.get("client-a", "k-new").await.unwrap().unwrap();
    match record.state {
        RecordState::Completed { response, .. } => {
            assert_eq!(response.status, 201);
            assert_eq!(response.body, body);
        }
        other => panic!("not completed: {other:?}"),
    }
}

#[tokio::test]
async fn completed_key_replays_byte_for_byte_without_running() {
    let h = harness(Policy::default());
    let (s1, h1, b1) = send(&h.app, req("k-replay", r#"{"a":1,"b":[1,2]}"#)).await;
    // the same JSON, spelled differently by another client library
    let (s2, h2, b2) = send(&h.app, req("k-replay", "{ \"b\": [1, 2.0], \"a\": 1 }")).await;
    assert_eq!(h.runs.get(), 1, "the handler must not run for a replay");
    assert_eq!(s2, s1);
    assert_eq!(b2, b1);
    assert_eq!(h2["idempotent-replayed"], "true");
    assert_eq!(h2["location"], h1["location"]);
    assert_eq!(h2["content-type"], "application/json");
    assert!(
        h2.get("set-cookie").is_none(),
        "Set-Cookie is never replayed"
    );
    assert!(
        h2.get("x-run").is_none(),
        "headers off the allow-list are not replayed"
    );
}

#[tokio::test]
async fn allow_listed_headers_are_replayed() {
    let h = harness(Policy::builder().replay_header("x-run").build().unwrap());
    let (_, h1, _) = send(&h.app, req("k-hdr", "{}")).await;
    let (_, h2, _) = send(&h.app, req("k-hdr", "{}")).await;
    assert_eq!(h2["x-run"], h1["x-run"]);
}

/// A body a layer inside idem's encoded (compressed) is replayed with its
/// `Content-Encoding`, on every allow-list: without it the replayed bytes
/// cannot be read.
#[tokio::test]
async fn an_encoded_body_is_replayed_with_its_encoding() {
    for policy in [
        Policy::default(),
        Policy::builder()
            .never_replay_header("content-encoding")
            .build()
            .unwrap(),
    ] {
        let h = harness(policy);
        let (_, h1, b1) = send(&h.app, req_with("k-enc", "{}", "encoded")).await;
        assert_eq!(h1["content-encoding"], "gzip");
        let (_, h2, b2) = send(&h.app, req_with("k-enc", "{}", "encoded")).await;
        assert_eq!(h2["idempotent-replayed"], "true");
        assert_eq!(b2, b1);
        assert_eq!(h2["content-encoding"], "gzip", "{h2:?}");
    }
}

#[tokio::test]
async fn bare_and_structured_key_spellings_are_the_same_key() {
    let h = harness(Policy::default());
    send(&h.app, req("abc-1", "{}")).await;
    let (_, headers, _) = send(&h.app, req("\"abc-1\"", "{}")).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn in_flight_duplicate_gets_409_with_retry_after() {
    let h = harness(Policy::default());
    let app = h.app.clone();
    let first =
        tokio::spawn(async move { send(&app, req_with("k-busy", "{}", "sleep=500")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, body) = send(&h.app, req("k-busy", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(problem_type(&headers, &body).ends_with("idempotency-key-in-use"));
    // A short hint (the policy's, 1 s), not the rest of the 30 s lease.
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn in_flight_duplicate_waits_and_replays_when_configured() {
    let policy = Policy::builder()
        .wait_for_in_flight(Duration::from_secs(3))
        .build()
        .unwrap();
    let h = harness(policy);
    let app = h.app.clone();
    let first =
        tokio::spawn(async move { send(&app, req_with("k-wait", "{}", "sleep=400")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, body) = send(&h.app, req("k-wait", "{}")).await;
    let (s1, _, b1) = first.await.unwrap();
    assert_eq!(status, s1);
    assert_eq!(body, b1);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn waiting_is_bounded() {
    let policy = Policy::builder()
        .wait_for_in_flight(Duration::from_millis(200))
        .build()
        .unwrap();
    let h = harness(policy);
    let app = h.app.clone();
    let first =
        tokio::spawn(async move { send(&app, req_with("k-wait2", "{}", "sleep=1500")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let (status, headers, _) = send(&h.app, req("k-wait2", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.contains_key("retry-after"));
    assert!(
        started.elapsed() < Duration::from_millis(1200),
        "waited {:?}",
        started.elapsed()
    );
    first.await.unwrap();
}

#[tokio::test]
async fn expired_lease_is_taken_over_with_the_same_operation_id() {
    let h = harness(short_lease());
    let app = h.app.clone();
    // the first attempt stalls well past its 300 ms lease
    let zombie =
        tokio::spawn(async move { send(&app, req_with("k-take", "{}", "sleep=1200")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, _, body) = send(&h.app, req("k-take", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    let retry = json(&body);
    assert_eq!(retry["takeover"], true);
    assert_eq!(h.runs.get(), 2);
    let (_, _, zbody) = zombie.await.unwrap();
    let zombie = json(&zbody);
    assert_eq!(
        zombie["takeover"], false,
        "the first attempt took nothing over"
    );
    assert_eq!(
        zombie["operation_id"], retry["operation_id"],
        "the operation id survives the takeover"
    );
    // the zombie's late answer did not overwrite the stored one
    let (_, headers, replayed) = send(&h.app, req("k-take", "{}")).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, body);
}

#[tokio::test]
async fn different_request_under_the_same_key_gets_422() {
    let h = harness(Policy::default());
    send(&h.app, req("k-reuse", r#"{"amount":1}"#)).await;
    let (status, headers, body) = send(&h.app, req("k-reuse", r#"{"amount":2}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(problem_type(&headers, &body).ends_with("idempotency-key-reused"));
    assert_eq!(headers["idempotency-rejection"], "idempotency-key-reused");
    // another method or path is another request too
    let patch = Request::patch("/things")
        .header("x-client", "client-a")
        .header("content-type", "application/json")
        .header("idempotency-key", "k-reuse")
        .body(Body::from(r#"{"amount":1}"#))
        .unwrap();
    assert_eq!(
        send(&h.app, patch).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn amounts_a_double_cannot_tell_apart_are_different_requests() {
    let h = harness(Policy::default());
    let wei = r#"{"amount":10000000000000000000001}"#;
    assert_eq!(send(&h.app, req("k-wei", wei)).await.0, StatusCode::CREATED);
    for other in [
        r#"{"amount":10000000000000000000002}"#,
        r#"{"amount":1e22}"#,
    ] {
        let (status, headers, body) = send(&h.app, req("k-wei", other)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{other}");
        assert!(problem_type(&headers, &body).ends_with("idempotency-key-reused"));
    }
    // The same amount spelled another way is the same request.
    let (status, headers, _) = send(
        &h.app,
        req("k-wei", r#"{ "amount" : 1.0000000000000000000001e22 }"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn a_body_with_a_key_twice_is_only_the_same_request_as_itself() {
    // Read as 1000 by a parser that keeps the first key, as 1 by one that
    // keeps the last: another body under the key is another request.
    let h = harness(Policy::default());
    let twice = r#"{"amount":1000,"amount":1}"#;
    assert_eq!(
        send(&h.app, req("k-twice", twice)).await.0,
        StatusCode::CREATED
    );
    for other in [
        r#"{"amount":5,"amount":1}"#,
        r#"{"amount":1}"#,
        r#"{"amount":1000}"#,
    ] {
        let (status, headers, body) = send(&h.app, req("k-twice", other)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{other}");
        assert!(problem_type(&headers, &body).ends_with("idempotency-key-reused"));
    }
    // The same bytes again: the replay.
    let (status, headers, _) = send(&h.app, req("k-twice", twice)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn the_in_flight_marker_on_another_status_is_that_answer() {
    // Only the layer's own `409` in flight, returned by a handler, frees
    // the key; the marker on a `201` is part of an answer, stored.
    let h = harness(Policy::default());
    let first = send(&h.app, req_with("k-marker", "{}", "in-use-header")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let (status, headers, _) = send(&h.app, req_with("k-marker", "{}", "in-use-header")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn missing_key_is_400_where_required() {
    let h = harness(Policy::default());
    let r = post_req(None, "{}").body(Body::from("{}")).unwrap();
    let (status, headers, body) = send(&h.app, r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(problem_type(&headers, &body).ends_with("idempotency-key-missing"));
    assert_eq!(h.runs.get(), 0);
    assert!(h.store.is_empty());
}

#[tokio::test]
async fn missing_key_passes_through_where_optional() {
    let h = harness(Policy::builder().require_key(false).build().unwrap());
    let r = post_req(None, "{}").body(Body::from("{}")).unwrap();
    let (status, _, body) = send(&h.app, r).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(json(&body)["operation_id"], "", "no claim without a key");
    assert_eq!(h.runs.get(), 1);
    assert!(h.store.is_empty());
}

#[tokio::test]
async fn a_request_without_a_key_needs_no_scope_where_the_key_is_optional() {
    let h = harness(Policy::builder().require_key(false).build().unwrap());
    let anonymous = Request::post("/things").body(Body::from("{}")).unwrap();
    let (status, _, _) = send(&h.app, anonymous).await;
    assert_eq!(status, StatusCode::CREATED, "not guarded, so not scoped");
    // With a key, the scope is still required.
    let keyed = Request::post("/things")
        .header("idempotency-key", "k")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(send(&h.app, keyed).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(h.runs.get(), 1);
    assert!(h.store.is_empty());
}

#[tokio::test]
async fn a_kept_claim_is_neither_stored_nor_released_until_its_lease_ends() {
    let lease = Duration::from_millis(1500);
    let h = harness(Policy::builder().lease(lease).build().unwrap());
    let (status, _, first) = send(&h.app, req_with("k-keep", "{}", "keep,status=504")).await;
    assert_eq!(
        status,
        StatusCode::GATEWAY_TIMEOUT,
        "the handler's answer is passed on"
    );
    let record = h.store.get("client-a", "k-keep").await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "not stored, not released"
    );
    let (held, headers, _) = send(&h.app, req("k-keep", "{}")).await;
    assert_eq!(held, StatusCode::CONFLICT, "held while its lease runs");
    assert!(headers.contains_key("retry-after"));
    assert_eq!(h.runs.get(), 1);
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let (status, _, again) = send(&h.app, req("k-keep", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(json(&again)["takeover"], true);
    assert_eq!(json(&again)["operation_id"], json(&first)["operation_id"]);
    assert_eq!(h.runs.get(), 2);
}

/// A handler that says its answer is the outcome whatever its status
/// (`store_answer`, as `idem proxy` does for an upstream answer too large
/// to keep) has a `5xx` stored and replayed; one that then fails to answer
/// (a panic) keeps its claim until the lease ends, never frees it at once.
#[tokio::test]
async fn an_answer_said_to_be_the_outcome_is_stored_whatever_its_status() {
    let lease = Duration::from_millis(1500);
    let h = harness(Policy::builder().lease(lease).build().unwrap());
    let (status, _, first) = send(&h.app, req_with("k-store", "{}", "store,status=502")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let record = h.store.get("client-a", "k-store").await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "stored"
    );
    let (status, headers, again) = send(&h.app, req("k-store", "{}")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first);
    assert_eq!(h.runs.get(), 1);

    fails_then_is_held(&h.app, "k-store-panic", "store,panic", lease).await;
    assert_eq!(h.runs.get(), 2);

    // One of the layer's own refusals is not stored for it: it says
    // nothing ran (here the 409 of a step another attempt holds).
    let (status, _, _) = send(
        &h.app,
        req_with("k-store-refused", "{}", "store,status=409,in-use-header"),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, _, _) = send(&h.app, req("k-store-refused", "{}")).await;
    assert_eq!(status, StatusCode::CREATED, "the refusal was stored");
    assert_eq!(h.runs.get(), 4);
}

/// The handler answered a status that is its outcome, and then its body
/// failed: the effect may have happened, so the claim is neither released
/// (a retry would run again at once) nor stored (there is nothing to
/// replay): it is kept until its lease ends, then taken over under the
/// same operation id. A status that releases (5xx) still releases.
#[tokio::test]
async fn a_body_that_fails_after_the_answer_keeps_the_claim_for_its_lease() {
    let lease = Duration::from_millis(1500);
    let h = harness(Policy::builder().lease(lease).build().unwrap());
    let (headers, body, started) =
        fails_then_is_held(&h.app, "k-broken", "broken-body", lease).await;
    assert!(problem_type(&headers, &body).ends_with("response-unreadable"));
    assert_eq!(h.runs.get(), 1);
    tokio::time::sleep(lease.saturating_sub(started.elapsed()) + Duration::from_millis(50)).await;
    let (status, _, again) = send(&h.app, req("k-broken", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(json(&again)["takeover"], true);
    assert_eq!(h.runs.get(), 2);

    // A body that panics instead of failing (a bug in a stream, or in a
    // store's driver as it writes the answer) keeps the claim the same way.
    fails_then_is_held(&h.app, "k-panicking", "panicking-body", lease).await;
    assert_eq!(h.runs.get(), 3);

    // A 5xx whose body fails releases, as any 5xx (passed on as it is).
    let failed = h
        .app
        .clone()
        .oneshot(req_with("k-broken-5xx", "{}", "status=503,broken-body"))
        .await
        .unwrap();
    assert_eq!(failed.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(failed);
    let (status, _, _) = send(&h.app, req("k-broken-5xx", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
}

/// A client that gives up while its claim's answer is on the way back: the
/// claim was made, and the request goes on without the client (the handler
/// runs, its answer is stored), so the retry gets the replay. Dropped with
/// the client, the claim held the key for a lease (30 s) with no handler.
#[tokio::test]
async fn a_client_gone_while_its_claim_is_answered_still_gets_its_answer_stored() {
    let runs = Runs::default();
    let store = Arc::new(SlowClaimAnswers {
        inner: MemoryStore::new(),
        delay: Duration::from_millis(300),
    });
    let layer = IdempotencyLayer::new(store, Policy::default(), by_client_header());
    let app = Router::new()
        .route("/things", post(handler))
        .layer(layer)
        .with_state(runs.clone());
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        app.clone().oneshot(req("k-gone", "{}")),
    )
    .await;
    assert!(gone.is_err(), "the client gave up first");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while runs.get() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler never ran: the claim was dropped with the client"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = loop {
        let (status, headers, body) = send(&app, req("k-gone", "{}")).await;
        if status != StatusCode::CONFLICT {
            break (status, headers, body);
        }
        assert!(std::time::Instant::now() < deadline, "still in flight");
    };
    assert_eq!(replay.0, StatusCode::CREATED);
    assert_eq!(replay.1["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn malformed_keys_are_400() {
    let h = harness(Policy::default());
    let long = "x".repeat(256);
    for bad in [
        "",
        "   ",
        "\"\"",
        "has space",
        "\"unterminated",
        long.as_str(),
        "caf\u{e9}",
    ] {
        let r = Request::post("/things")
            .header("x-client", "client-a")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
            )
            .body(Body::from("{}"))
            .unwrap();
        let (status, headers, body) = send(&h.app, r).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert!(
            problem_type(&headers, &body).ends_with("idempotency-key-invalid"),
            "{bad:?}"
        );
    }
    // the header sent twice
    let r = Request::post("/things")
        .header("x-client", "client-a")
        .header("idempotency-key", "a")
        .header("idempotency-key", "a")
        .body(Body::from("{}"))
        .unwrap();
    let (status, headers, body) = send(&h.app, r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(problem_type(&headers, &body).ends_with("idempotency-key-invalid"));
    assert_eq!(h.runs.get(), 0);
    assert!(h.store.is_empty());
}

#[tokio::test]
async fn body_over_the_limit_is_413_and_nothing_is_stored() {
    let h = harness(Policy::builder().max_body(1024).build().unwrap());
    let big = "x".repeat(2000);
    let (status, headers, body) = send(&h.app, req("k-big", &big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(problem_type(&headers, &body).ends_with("payload-too-large"));
    // a streamed body without Content-Length is cut off too
    let chunks = futures_chunks(vec![vec![b'x'; 700], vec![b'x'; 700]]);
    let r = post_req(Some("k-big2"), "").body(chunks).unwrap();
    assert_eq!(send(&h.app, r).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h.runs.get(), 0);
    assert!(h.store.is_empty(), "nothing is stored for a rejected body");
    // exactly at the limit is fine
    assert_eq!(
        send(&h.app, req("k-fits", &"y".repeat(1024))).await.0,
        StatusCode::CREATED
    );
}

/// A body that arrives in chunks, with no length known up front.
struct Chunked(std::collections::VecDeque<Bytes>);

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }
}

fn futures_chunks(chunks: Vec<Vec<u8>>) -> Body {
    Body::new(Chunked(chunks.into_iter().map(Bytes::from).collect()))
}

#[tokio::test]
async fn client_errors_are_stored_and_replayed() {
    let h = harness(Policy::default());
    let (s1, _, b1) = send(&h.app, req_with("k-4xx", "{}", "status=404")).await;
    let (s2, h2, b2) = send(&h.app, req_with("k-4xx", "{}", "status=404")).await;
    assert_eq!((s1, s2), (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    assert_eq!(b1, b2);
    assert_eq!(h2["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

/// A rate limiter inside the layer: refuses the first `refusals` requests
/// with `429` (the handler never runs), then lets requests through.
async fn limiter(
    State(left): State<Arc<AtomicUsize>>,
    request: Request<Body>,
    next: axum::middleware::Next,
) -> Response {
    let refused = left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if refused {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            "slow down",
        )
            .into_response();
    }
    next.run(request).await
}

fn rate_limited(policy: Policy, refusals: usize) -> Harness {
    let store = Arc::new(MemoryStore::new());
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(store.clone(), policy, by_client_header());
    let app = Router::new()
        .route("/things", post(handler))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(AtomicUsize::new(refusals)),
            limiter,
        ))
        .layer(layer)
        .with_state(runs.clone());
    Harness { app, runs, store }
}

#[tokio::test]
async fn a_rate_limit_inside_the_layer_releases_the_claim_and_the_retry_runs() {
    let h = rate_limited(Policy::default(), 2);
    for _ in 0..2 {
        let (status, headers, _) = send(&h.app, req("k-429", "{}")).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(headers.get("idempotent-replayed").is_none());
    }
    assert_eq!(h.runs.get(), 0);
    let (status, headers, first) = send(&h.app, req("k-429", "{}")).await;
    assert_eq!(status, StatusCode::CREATED, "the retry past the limit runs");
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(h.runs.get(), 1);
    // The key kept its operation id across the released attempts, and the
    // answer that ran is the one replayed from now on.
    let (status, headers, again) = send(&h.app, req("k-429", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(first, again);
    assert_eq!(h.runs.get(), 1);
    assert_eq!(json(&first)["takeover"], true, "claimed before, released");
}

#[tokio::test]
async fn try_again_later_answers_release_and_the_policy_can_store_them() {
    let h = harness(Policy::default());
    for status in ["408", "425", "429"] {
        let key = format!("k-later-{status}");
        let (s1, _, _) = send(&h.app, req_with(&key, "{}", &format!("status={status}"))).await;
        assert_eq!(s1.as_str(), status);
        let (s2, h2, _) = send(&h.app, req(&key, "{}")).await;
        assert_eq!(s2, StatusCode::CREATED, "{status} was released");
        assert!(h2.get("idempotent-replayed").is_none());
    }
    assert_eq!(h.runs.get(), 6);

    // A service whose 429 is its final answer stores it; one that says
    // "later" with 423 releases that.
    let h = harness(
        Policy::builder()
            .store_client_error(429)
            .release_client_error(423)
            .build()
            .unwrap(),
    );
    let (s1, _, _) = send(&h.app, req_with("k-quota", "{}", "status=429")).await;
    let (s2, h2, _) = send(&h.app, req("k-quota", "{}")).await;
    assert_eq!(
        (s1, s2),
        (StatusCode::TOO_MANY_REQUESTS, StatusCode::TOO_MANY_REQUESTS)
    );
    assert_eq!(h2["idempotent-replayed"], "true");
    let (s1, _, _) = send(&h.app, req_with("k-locked", "{}", "status=423")).await;
    let (s2, _, _) = send(&h.app, req("k-locked", "{}")).await;
    assert_eq!((s1, s2), (StatusCode::LOCKED, StatusCode::CREATED));
    assert_eq!(h.runs.get(), 3);
}

#[tokio::test]
async fn server_errors_release_the_claim_and_keep_the_operation_id() {
    let h = harness(Policy::default());
    let (s1, _, b1) = send(&h.app, req_with("k-5xx", "{}", "status=503")).await;
    assert_eq!(s1, StatusCode::SERVICE_UNAVAILABLE);
    let (s2, h2, b2) = send(&h.app, req("k-5xx", "{}")).await;
    assert_eq!(s2, StatusCode::CREATED);
    assert!(h2.get("idempotent-replayed").is_none());
    assert_eq!(h.runs.get(), 2, "the retry runs afresh");
    assert_eq!(json(&b1)["operation_id"], json(&b2)["operation_id"]);
    assert_eq!(json(&b2)["takeover"], true);
}

#[tokio::test]
async fn a_panicking_handler_answers_500_and_releases_the_claim() {
    let h = harness(Policy::default());
    let (status, headers, body) = send(&h.app, req_with("k-panic", "{}", "panic")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(problem_type(&headers, &body).ends_with("handler-failed"));
    // the release runs on a spawned task
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, _, body) = send(&h.app, req("k-panic", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(json(&body)["takeover"], true, "same operation, taken over");
    assert_eq!(h.runs.get(), 2);
}

#[tokio::test]
async fn a_client_that_goes_away_does_not_cancel_the_handler() {
    let h = harness(Policy::default());
    let app = h.app.clone();
    let task = tokio::spawn(async move { send(&app, req_with("k-gone", "{}", "sleep=300")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort(); // the client timed out and hung up
    let _ = task.await;
    assert_eq!(
        send(&h.app, req("k-gone", "{}")).await.0,
        StatusCode::CONFLICT,
        "still running"
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    // the handler finished and its answer was stored: the retry gets the replay
    let (status, headers, _) = send(&h.app, req("k-gone", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(h.runs.get(), 1);
}

#[tokio::test]
async fn records_past_retention_are_gone() {
    let policy = Policy::builder()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300))
        .build()
        .unwrap();
    let h = harness(policy);
    send(&h.app, req("k-ttl", r#"{"a":1}"#)).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // a new request under the old key runs, even with another body
    let (status, headers, _) = send(&h.app, req("k-ttl", r#"{"a":2}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(h.runs.get(), 2);
}

#[tokio::test]
async fn safe_methods_pass_through_untouched() {
    let h = harness(Policy::default());
    let r = Request::get("/things").body(Body::empty()).unwrap();
    let (status, _, body) = send(&h.app, r).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "listing");
    assert!(h.store.is_empty());
}

#[tokio::test]
async fn keys_are_scoped_per_client() {
    let h = harness(Policy::default());
    send(&h.app, req("shared-key", "{}")).await;
    let other = Request::post("/things")
        .header("x-client", "client-b")
        .header("content-type", "application/json")
        .header("idempotency-key", "shared-key")
        .body(Body::from("{}"))
        .unwrap();
    let (status, headers, _) = send(&h.app, other).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(h.runs.get(), 2);
}

#[tokio::test]
async fn requests_without_a_scope_are_refused_by_the_scope_extractor() {
    let h = harness(Policy::default());
    let r = Request::post("/things")
        .header("idempotency-key", "k")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(send(&h.app, r).await.0, StatusCode::UNAUTHORIZED);
    assert!(h.store.is_empty());
}

/// A scope longer than every store keeps is refused as no scope, before any
/// claim (a store would fail on it every time, a 503 for ever); one of the
/// longest length is guarded as any other.
#[tokio::test]
async fn a_scope_longer_than_the_stores_keep_is_refused() {
    let h = harness(Policy::default());
    let scoped = |scope: &str| {
        Request::post("/things")
            .header("x-client", scope)
            .header("content-type", "application/json")
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .unwrap()
    };
    let (status, headers, body) =
        send(&h.app, scoped(&"c".repeat(idem_core::MAX_SCOPE_LEN + 1))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        problem["type"].as_str().unwrap().ends_with("scope-missing"),
        "{problem}"
    );
    assert!(
        problem["detail"].as_str().unwrap().contains("1025 bytes"),
        "{problem}"
    );
    assert!(h.store.is_empty());
    assert_eq!(h.runs.get(), 0);
    let (status, _, _) = send(&h.app, scoped(&"c".repeat(idem_core::MAX_SCOPE_LEN))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(h.runs.get(), 1);
}

/// A body whose sender waits for `100 Continue`: polling it would hang.
struct AwaitingContinue;

impl http_body::Body for AwaitingContinue {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

#[tokio::test]
async fn expect_continue_with_a_body_declared_too_large_is_413_without_reading_it() {
    let h = harness(Policy::builder().max_body(1024).build().unwrap());
    let r = post_req(Some("k-expect"), "")
        .header("expect", "100-continue")
        .header("content-length", "5000")
        .body(Body::new(AwaitingContinue))
        .unwrap();
    // Polling the body would hang until the 5 s drain deadline.
    let (status, headers, body) = tokio::time::timeout(Duration::from_secs(3), send(&h.app, r))
        .await
        .expect("answered without polling the body");
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(problem_type(&headers, &body).ends_with("payload-too-large"));
    assert!(h.store.is_empty());
    // A body within the limit is read as usual, Expect or not.
    let small = post_req(Some("k-expect-small"), "")
        .header("expect", "100-continue")
        .header("content-length", "2")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(send(&h.app, small).await.0, StatusCode::CREATED);
}

#[tokio::test]
async fn an_in_flight_duplicate_is_told_the_policys_retry_after() {
    let policy = Policy::builder()
        .retry_after(Duration::from_secs(3))
        .build()
        .unwrap();
    let h = harness(policy);
    let app = h.app.clone();
    let first =
        tokio::spawn(async move { send(&app, req_with("k-hint", "{}", "sleep=500")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, _) = send(&h.app, req("k-hint", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(headers["retry-after"], "3");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
}

#[tokio::test]
async fn a_declared_length_at_the_limit_passes_and_one_byte_more_is_413() {
    let h = harness(Policy::builder().max_body(16).build().unwrap());
    let at = post_req(Some("k-at"), "")
        .header("content-length", "16")
        .body(Body::from("x".repeat(16)))
        .unwrap();
    assert_eq!(send(&h.app, at).await.0, StatusCode::CREATED);
    let over = post_req(Some("k-over"), "")
        .header("content-length", "17")
        .body(Body::from("x".repeat(17)))
        .unwrap();
    assert_eq!(send(&h.app, over).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h.runs.get(), 1);
}

/// A request the route's validator refuses is answered before any claim,
/// and nothing is stored: the corrected request runs under the same key,
/// even with another body.
#[tokio::test]
async fn a_request_refused_by_validation_is_not_stored_and_the_corrected_retry_runs() {
    let store = Arc::new(MemoryStore::new());
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(store.clone(), Policy::default(), by_client_header())
        .validate(|parts, body| {
            let value: serde_json::Value = serde_json::from_slice(body)
                .map_err(|_| (StatusCode::BAD_REQUEST, "not JSON").into_response())?;
            if parts.headers.contains_key("x-bad") || !value["amount"].is_i64() {
                return Err((StatusCode::BAD_REQUEST, "amount must be an integer").into_response());
            }
            Ok(())
        });
    let app = Router::new()
        .route("/things", post(handler))
        .layer(layer)
        .with_state(runs.clone());
    let refused = app
        .clone()
        .oneshot(req("k1", r#"{"amount": 10.5}"#))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(runs.get(), 0, "the handler did not run");
    assert!(
        store.get("client-a", "k1").await.unwrap().is_none(),
        "nothing stored"
    );
    // A bad header, then the same body with the header fixed.
    let mut bad = req("k2", r#"{"amount": 10}"#);
    bad.headers_mut().insert("x-bad", "1".parse().unwrap());
    assert_eq!(
        app.clone().oneshot(bad).await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert!(store.get("client-a", "k2").await.unwrap().is_none());
    // The corrected requests run, under the same keys.
    let fixed = app
        .clone()
        .oneshot(req("k1", r#"{"amount": 10}"#))
        .await
        .unwrap();
    assert_eq!(fixed.status(), StatusCode::CREATED);
    assert!(fixed.headers().get("idempotent-replayed").is_none());
    let fixed = app
        .clone()
        .oneshot(req("k2", r#"{"amount": 10}"#))
        .await
        .unwrap();
    assert_eq!(fixed.status(), StatusCode::CREATED);
    assert_eq!(runs.get(), 2);
    // A valid request's answer is stored as before.
    let replay = app
        .clone()
        .oneshot(req("k1", r#"{"amount": 10}"#))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 2);
}

/// Where keys are optional, a request without one is still validated: a
/// handler that counts on the check (a positive amount) never sees one that
/// fails it, key or no key; one that passes runs unguarded with its body
/// whole, and one over the body limit is `413`.
#[tokio::test]
async fn a_request_without_a_key_is_validated_where_keys_are_optional() {
    let store = Arc::new(MemoryStore::new());
    let runs = Runs::default();
    let policy = Policy::builder()
        .require_key(false)
        .max_body(64)
        .build()
        .unwrap();
    let layer = IdempotencyLayer::new(store.clone(), policy, by_client_header()).validate(
        |_parts, body| {
            let value: serde_json::Value = serde_json::from_slice(body)
                .map_err(|_| (StatusCode::BAD_REQUEST, "not JSON").into_response())?;
            if value["amount"].as_i64().is_some_and(|a| a > 0) {
                Ok(())
            } else {
                Err((StatusCode::BAD_REQUEST, "amount must be positive").into_response())
            }
        },
    );
    let app = Router::new()
        .route("/things", post(handler))
        .layer(layer)
        .with_state(runs.clone());
    let keyless = |body: &str| {
        post_req(None, body)
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let (status, _, _) = send(&app, keyless(r#"{"amount": -5}"#)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(runs.get(), 0, "the handler never saw it");
    let (status, _, _) = send(
        &app,
        keyless(&format!(r#"{{"amount": 5, "pad": "{}"}}"#, "x".repeat(80))),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.get(), 0);
    let (status, headers, body) = send(&app, keyless(r#"{"amount": 5}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(
        json(&body)["echo"],
        r#"{"amount": 5}"#.len(),
        "the body reached it whole"
    );
    assert_eq!(json(&body)["key"], "", "unguarded");
    assert_eq!(runs.get(), 1);
    // Keyed requests as before.
    let (status, _, _) = send(&app, req("k1", r#"{"amount": 0}"#)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(runs.get(), 1);
}
