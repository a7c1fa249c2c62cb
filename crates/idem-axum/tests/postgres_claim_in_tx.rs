//! Handlers that claim the key inside their own PostgreSQL transaction
//! (`IdempotencyLayer::claim_in_transaction`), against the real server, each
//! test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::{DeferredClaim, Idempotency, IdempotencyLayer, SingleScope};
use idem_core::{Policy, RecordState, Store};
use idem_postgres::PostgresStore;
use idem_test_support::postgres::TestSchema;
use tower::ServiceExt;

mod broken_body;
use broken_body::BrokenBody;

fn header(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Claims in its transaction, writes its effect, stalls for `x-delay-ms`
/// (a slow downstream call), then completes the record in the same
/// transaction. `x-fail: 500` answers 500 without committing; `x-fail:
/// panic` panics while holding the claim.
async fn create(
    State(store): State<PostgresStore>,
    pending: DeferredClaim,
    headers: http::HeaderMap,
) -> Response {
    let delay: u64 = header(&headers, "x-delay-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if header(&headers, "x-peek").is_some() {
        // What the key's record answers alone; 204 when it leaves it to
        // the claim.
        return match pending.answered_by_record(&store).await {
            Some(answered) => {
                let mut response = answered.into_response();
                response
                    .headers_mut()
                    .insert("x-peeked", "answered".parse().unwrap());
                response
            }
            None => StatusCode::NO_CONTENT.into_response(),
        };
    }
    let (mut tx, idem) = match pending.begin(&store).await {
        Ok(held) => held,
        Err(answered) => {
            let status = answered.status();
            let mut response = answered.into_response();
            response
                .headers_mut()
                .insert("x-answered", status.as_str().parse().unwrap());
            return response;
        }
    };
    sqlx::query("INSERT INTO effects (operation_id, token) VALUES ($1, $2)")
        .bind(idem.operation_id().to_string())
        .bind(idem.token().0)
        .execute(&mut *tx)
        .await
        .unwrap();
    if let Some(how) = header(&headers, "x-keep") {
        // A call whose outcome is lost: the claim is kept, the transaction
        // ended as the docs ask, and the answer is a 504.
        idem.keep_claim();
        tx.rollback().await.unwrap();
        if how == "panic" {
            panic!("the handler panics after keeping its claim");
        }
        return StatusCode::GATEWAY_TIMEOUT.into_response();
    }
    tokio::time::sleep(Duration::from_millis(delay)).await;
    match header(&headers, "x-fail").as_deref() {
        Some("500") => {
            tx.rollback().await.unwrap();
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        Some("panic") => panic!("the handler panics holding its claim"),
        _ => {}
    }
    assert_eq!((pending.scope(), pending.key()), (idem.scope(), idem.key()));
    if let Some(how) = header(&headers, "x-layer-completes") {
        // Commit the effect and leave the record to the layer.
        tx.commit().await.unwrap();
        if how == "broken" || how == "panicking" {
            // ... with an answer whose body breaks on the way out.
            let body = BrokenBody {
                panics: how == "panicking",
            };
            return (StatusCode::CREATED, Body::new(body)).into_response();
        }
        return (
            StatusCode::CREATED,
            format!("op {} by layer", idem.operation_id()),
        )
            .into_response();
    }
    let response = (StatusCode::CREATED, format!("op {}", idem.operation_id())).into_response();
    match idem.complete_in(&store, &mut *tx, response).await {
        Ok(response) => match tx.commit().await {
            Ok(()) => response,
            Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        },
        Err(e) => {
            tx.rollback().await.unwrap();
            e.into_response()
        }
    }
}

async fn wrong_extractor(_idem: Idempotency) -> StatusCode {
    StatusCode::OK
}

async fn setup(policy: Policy) -> (Router, PostgresStore, TestSchema) {
    let schema = TestSchema::create("idem_axum_in_tx").await;
    let store = PostgresStore::connect(&schema.url())
        .await
        .expect("connect");
    sqlx::query("CREATE TABLE effects (operation_id text NOT NULL, token bigint NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(Arc::new(store.clone()), policy, SingleScope("t".into()))
        .claim_in_transaction();
    let app = Router::new()
        .route("/effects", post(create))
        .route("/wrong", post(wrong_extractor))
        .layer(layer)
        .with_state(store.clone());
    (app, store, schema)
}

fn req(key: &str) -> http::request::Builder {
    Request::post("/effects")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
}

async fn send(app: &Router, r: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response = app.clone().oneshot(r).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

/// Sends `retry` and asserts the key is held (`409`): a retry inside the
/// lease that began at `started` does not run.
async fn assert_held(
    app: &Router,
    retry: Request<Body>,
    started: std::time::Instant,
    lease: Duration,
    what: &str,
) {
    let (status, headers, body) = send(app, retry).await;
    assert!(
        started.elapsed() < lease,
        "the machine stalled past the case's margin"
    );
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "{what}: a retry inside the lease ran: {headers:?} {body}"
    );
}

async fn effects(store: &PostgresStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT operation_id, token FROM effects")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_commits_once_and_replays() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let (status, _, body) = send(&app, req("a").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, again) = send(&app, req("a").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["x-answered"], "201", "the answer knows its status");
    assert_eq!(again, body);
    assert_eq!(effects(&store).await.len(), 1);
    assert!(matches!(
        store.get("t", "a").await.unwrap().unwrap().state,
        RecordState::Completed { .. }
    ));
    // the same key with another body, once committed, is 422
    let (status, _, _) = send(&app, req("a").body(Body::from(r#"{"x":1}"#)).unwrap()).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_commit_one_effect_and_the_rest_get_409() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let mut tasks = Vec::new();
    for _ in 0..30 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &app,
                req("race")
                    .header("x-delay-ms", "200")
                    .body(Body::from("{}"))
                    .unwrap(),
            )
            .await
        }));
    }
    let mut created = 0;
    for t in tasks {
        let (status, headers, _) = t.await.unwrap();
        match status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => assert_eq!(headers["retry-after"], "1"),
            other => panic!("unexpected {other}"),
        }
    }
    assert!(created >= 1);
    assert_eq!(effects(&store).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_get_the_replay_once_the_holder_commits() {
    let policy = Policy::builder()
        .wait_for_in_flight(Duration::from_secs(5))
        .build()
        .unwrap();
    let (app, store, _schema) = setup(policy).await;
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &app,
                req("wait")
                    .header("x-delay-ms", "150")
                    .body(Body::from("{}"))
                    .unwrap(),
            )
            .await
        }));
    }
    let mut bodies = Vec::new();
    for t in tasks {
        let (status, _, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        bodies.push(body);
    }
    bodies.dedup();
    assert_eq!(bodies.len(), 1, "every duplicate got the one answer");
    assert_eq!(effects(&store).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_rolls_back_and_the_key_stays_bound_to_its_request_and_operation_id() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let (status, _, _) = send(
        &app,
        req("f")
            .header("x-fail", "500")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(effects(&store).await.is_empty());
    // The claim committed before the handler ran: it outlives the rollback.
    let claimed = store.get("t", "f").await.unwrap().expect("the claim");
    assert!(matches!(claimed.state, RecordState::InProgress { .. }));

    // Another request under the key is refused, at once.
    let (status, _, _) = send(&app, req("f").body(Body::from(r#"{"x":1}"#)).unwrap()).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // The same request runs, under the same operation id.
    let (status, _, body) = send(&app, req("f").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    let rows = effects(&store).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, claimed.operation_id.to_string());
    assert_eq!(body, format!("op {}", claimed.operation_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_client_is_never_told_its_key_is_busy() {
    let (app, _store, _schema) = setup(Policy::default()).await;
    let (status, _, first) = send(&app, req("seq").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    for _ in 0..30 {
        let (status, headers, body) = send(&app, req("seq").body(Body::from("{}")).unwrap()).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers["idempotent-replayed"], "true");
        assert_eq!(body, first);
        let (status, _, _) = send(&app, req("seq").body(Body::from(r#"{"x":2}"#)).unwrap()).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_500_and_leaves_the_key_free() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let (status, _, _) = send(
        &app,
        req("p")
            .header("x-fail", "panic")
            .body(Body::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(effects(&store).await.is_empty());
    let (status, _, _) = send(&app, req("p").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(effects(&store).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stalled_past_its_lease_cannot_commit_and_the_retry_runs() {
    let policy = Policy::builder()
        .lease(Duration::from_millis(1000))
        .build()
        .unwrap();
    let (app, store, _schema) = setup(policy).await;
    // Two at once, each would stall 3 s, past the 1 s lease: one runs, the
    // other finds it in flight.
    let stalled = |app: Router| {
        tokio::spawn(async move {
            send(
                &app,
                req("s")
                    .header("x-delay-ms", "3000")
                    .body(Body::from("{}"))
                    .unwrap(),
            )
            .await
            .0
        })
    };
    let (a, b) = (stalled(app.clone()), stalled(app.clone()));
    let mut statuses = [a.await.unwrap(), b.await.unwrap()];
    statuses.sort();
    // The one that ran sat idle in its transaction past the lease: the
    // server ended its session, so it could not commit.
    assert_eq!(statuses[0], StatusCode::CONFLICT, "{statuses:?}");
    assert!(statuses[1].is_server_error(), "{statuses:?}");
    assert!(effects(&store).await.is_empty());
    let (status, _, _) = send(&app, req("s").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(effects(&store).await.len(), 1);
}

/// A handler that keeps its claim (its outcome unknown) and ends its
/// transaction, as the docs ask: the transaction was the claim's lease, so
/// the layer holds the key for a lease afterwards. A retry before it ends
/// gets `409` and runs nothing; one after it runs under the same operation
/// id. Also when the handler panics after keeping it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_claim_holds_the_key_for_a_lease_after_its_transaction_ends() {
    let lease = Duration::from_millis(1500);
    let (app, store, _schema) = setup(Policy::builder().lease(lease).build().unwrap()).await;
    for (key, how) in [("kept", "answer"), ("kept-panic", "panic")] {
        let started = std::time::Instant::now();
        let (status, _, _) = send(
            &app,
            req(key)
                .header("x-keep", how)
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        let want = if how == "panic" {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::GATEWAY_TIMEOUT
        };
        assert_eq!(status, want, "{key}");
        let retry = req(key).body(Body::from("{}")).unwrap();
        assert_held(&app, retry, started, lease, key).await;
        let record = store.get("t", key).await.unwrap().unwrap();
        assert!(matches!(record.state, RecordState::InProgress { .. }));
        tokio::time::sleep(lease.saturating_sub(started.elapsed()) + Duration::from_millis(200))
            .await;
        let (status, _, body) = send(&app, req(key).body(Body::from("{}")).unwrap()).await;
        assert_eq!(status, StatusCode::CREATED, "{key}: {body}");
        assert_eq!(body, format!("op {}", record.operation_id), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotency_extractor_is_missing_on_such_routes() {
    let (app, _store, _schema) = setup(Policy::default()).await;
    let r = Request::post("/wrong")
        .header("idempotency-key", "w")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = send(&app, r).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains("idempotency-layer-missing"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_without_completing_is_completed_by_the_layer() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let first = || {
        req("by-layer")
            .header("x-layer-completes", "1")
            .body(Body::from("{}"))
            .unwrap()
    };
    let (status, _, body) = send(&app, first()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(matches!(
        store.get("t", "by-layer").await.unwrap().unwrap().state,
        RecordState::Completed { .. }
    ));
    let (status, headers, again) = send(&app, first()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, body);
    assert_eq!(effects(&store).await.len(), 1, "the handler ran once");
}

/// An effect committed with an answer the layer cannot read (its body
/// fails, or panics) leaves the record unfinished: the claim, whose lease
/// ended with the transaction, is held for a lease again, so that a retry
/// does not run at once beside the effect that happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_left_unstored_holds_the_key_for_a_lease() {
    let lease = Duration::from_millis(1500);
    let (app, store, _schema) = setup(Policy::builder().lease(lease).build().unwrap()).await;
    for how in ["broken", "panicking"] {
        let started = std::time::Instant::now();
        let first = || {
            req(how)
                .header("x-layer-completes", how)
                .body(Body::from("{}"))
                .unwrap()
        };
        let (status, _, body) = send(&app, first()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{how}: {body}");
        assert_held(&app, first(), started, lease, how).await;
    }
    assert_eq!(effects(&store).await.len(), 2, "each ran once");
}

/// `answered_by_record` answers what the key's record decides alone (a
/// replay, `422`) with one read, writing nothing, and leaves the rest to
/// the claim: a new key, and one in flight (whose committed lease has run
/// out in this mode: the transaction's lock holds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_alone_answers_repeats_of_finished_requests() {
    let (app, store, _schema) = setup(Policy::default()).await;
    let peek = |key: &str, body: &'static str| {
        req(key)
            .header("x-peek", "1")
            .body(Body::from(body))
            .unwrap()
    };
    let (status, _, _) = send(&app, peek("p", "{}")).await;
    assert_eq!(
        status,
        StatusCode::NO_CONTENT,
        "a new key: the claim decides"
    );
    assert!(
        store.get("t", "p").await.unwrap().is_none(),
        "nothing written"
    );

    let (status, _, body) = send(&app, req("p").body(Body::from("{}")).unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, again) = send(&app, peek("p", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["x-peeked"], "answered");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, body);
    let (status, headers, _) = send(&app, peek("p", r#"{"x":1}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["x-peeked"], "answered");

    // In flight: the record's lease ran out at its commit; only the claim
    // (which reads the row's lock) can tell it is held, so the record
    // alone answers nothing, and the holder is left alone.
    let holder = {
        let app = app.clone();
        tokio::spawn(async move {
            send(
                &app,
                req("q")
                    .header("x-delay-ms", "5000")
                    .body(Body::from("{}"))
                    .unwrap(),
            )
            .await
        })
    };
    while store.get("t", "q").await.unwrap().is_none() {
        assert!(
            !holder.is_finished(),
            "the holder ended before its claim showed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _, _) = send(&app, peek("q", "{}")).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // (Its 5 s are the margin: the peek came while it held the key.)
    assert!(!holder.is_finished(), "the holder ended before the peek");
    let (status, _, _) = holder.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(effects(&store).await.len(), 2, "one effect per key");
}
