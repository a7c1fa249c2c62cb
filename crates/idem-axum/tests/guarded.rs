//! `Guarded::transaction`: the business transaction, the record's
//! completion in it and the commit in one call, on real SQLite and
//! PostgreSQL; every way out ends the transaction.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::{Guarded, HandlerError, IdempotencyLayer, SingleScope, IDEMPOTENT_REPLAYED};
use idem_core::{Policy, Store};
use idem_postgres::PostgresStore;
use idem_sqlite::SqliteStore;
use idem_test_support::postgres::TestSchema;
use tokio::sync::Notify;
use tower::ServiceExt;

/// What the handler does, by the body it gets.
async fn sqlite_handler(guard: Guarded<SqliteStore>, body: String) -> Response {
    let operation_id = guard.operation_id().to_string();
    guard
        .transaction(async |tx| {
            sqlx::query("INSERT INTO effects (operation_id, body) VALUES (?1, ?2)")
                .bind(operation_id)
                .bind(&body)
                .execute(&mut *tx)
                .await?;
            match body.as_str() {
                // A bug: a statement a retry cannot mend.
                "broken" => {
                    sqlx::query("INSERT INTO no_such_table VALUES (1)")
                        .execute(&mut *tx)
                        .await?;
                }
                "busy" => return Err(HandlerError::unavailable("the ledger is busy")),
                "refused" => {
                    return Err(HandlerError::answer((
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "insufficient funds",
                    )))
                }
                "crashing" => return Ok((StatusCode::BAD_GATEWAY, "downstream failed".to_owned())),
                _ => {}
            }
            Ok((StatusCode::CREATED, body))
        })
        .await
}

async fn send(app: &Router, key: &str, body: &str) -> (StatusCode, bool, String) {
    let response = app
        .clone()
        .oneshot(
            Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::from(body.to_owned()))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

#[tokio::test]
async fn on_sqlite_every_way_out_ends_the_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("g.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (operation_id TEXT NOT NULL, body TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let layer =
        IdempotencyLayer::from_store(store.clone(), Policy::default(), SingleScope("t".into()));
    let app = Router::new()
        .route("/orders", post(sqlite_handler).route_layer(layer))
        .with_state(store.clone());
    let count = |body: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE body = ?1")
                .bind(body)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // Committed with its record: a repeat is a replay, one effect.
    assert_eq!(
        send(&app, "k1", "tea").await,
        (StatusCode::CREATED, false, "tea".into())
    );
    assert_eq!(
        send(&app, "k1", "tea").await,
        (StatusCode::CREATED, true, "tea".into())
    );
    assert_eq!(count("tea").await, 1);
    let record = store.get("t", "k1").await.unwrap().unwrap();
    assert!(
        matches!(record.state, idem_core::RecordState::Completed { .. }),
        "completed in the transaction"
    );

    // A bug in the work (a statement no retry mends): rolled back, 500,
    // never a 503 that invites retries; the claim released.
    let (status, _, _) = send(&app, "k2", "broken").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count("broken").await, 0, "rolled back");
    let (status, replayed, _) = send(&app, "k2", "broken").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::INTERNAL_SERVER_ERROR, false),
        "released: the retry ran afresh"
    );
    // Unavailable, by the work's own word: 503, released.
    let (status, _, _) = send(&app, "k5", "busy").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(count("busy").await, 0, "rolled back");
    assert!(!send(&app, "k5", "busy").await.1, "released");

    // The business refuses: rolled back, and the 4xx is stored and replayed.
    assert_eq!(
        send(&app, "k3", "refused").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        send(&app, "k3", "refused").await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            true,
            "insufficient funds".into()
        )
    );
    assert_eq!(count("refused").await, 0);

    // A 5xx answer is never committed with the work: rolled back, released.
    assert_eq!(
        send(&app, "k4", "crashing").await.0,
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(count("crashing").await, 0);
    let (status, replayed, _) = send(&app, "k4", "crashing").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::BAD_GATEWAY, false),
        "released"
    );

    // No transaction was left open: a write goes through at once.
    tokio::time::timeout(
        Duration::from_secs(5),
        sqlx::query("INSERT INTO effects VALUES ('x', 'after')").execute(store.pool()),
    )
    .await
    .expect("no transaction holds the write lock")
    .unwrap();
}

#[tokio::test]
async fn a_route_the_layer_does_not_guard_is_a_500_that_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("g.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    let app = Router::new()
        .route("/orders", post(sqlite_handler))
        .with_state(store);
    let response = app
        .oneshot(
            Request::post("/orders")
                .header("idempotency-key", "k")
                .body(Body::from("tea"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        response.headers()[idem_axum::IDEMPOTENCY_REJECTION],
        "idempotency-layer-missing"
    );
}

/// A handler that holds its transaction until `go` is notified (after
/// writing nothing yet), then writes and completes.
#[derive(Clone)]
struct Gate(Arc<Notify>);

/// The router's state: the store and the gate, each extracted by type.
#[derive(Clone)]
struct PgState {
    store: PostgresStore,
    gate: Gate,
}

impl axum::extract::FromRef<PgState> for PostgresStore {
    fn from_ref(s: &PgState) -> Self {
        s.store.clone()
    }
}

impl axum::extract::FromRef<PgState> for Gate {
    fn from_ref(s: &PgState) -> Self {
        s.gate.clone()
    }
}

async fn postgres_handler(
    guard: Guarded<PostgresStore>,
    axum::extract::State(gate): axum::extract::State<Gate>,
    headers: http::HeaderMap,
) -> Response {
    let operation_id = guard.operation_id().to_string();
    let token = guard.idempotency().token().0;
    let wait = headers.contains_key("x-wait");
    guard
        .transaction(async |tx| {
            if wait {
                gate.0.notified().await;
            }
            sqlx::query("INSERT INTO effects (operation_id, token) VALUES ($1, $2)")
                .bind(operation_id)
                .bind(token)
                .execute(&mut *tx)
                .await?;
            Ok((StatusCode::CREATED, format!("token {token}")))
        })
        .await
}

/// On PostgreSQL, fenced: an attempt that stalled past its lease and was
/// taken over cannot commit its effect; the one that took over does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres_a_stalled_attempt_taken_over_commits_nothing() {
    let schema = TestSchema::create("idem_guarded").await;
    let store = PostgresStore::connect(&schema.url()).await.unwrap();
    sqlx::query("CREATE TABLE effects (operation_id text NOT NULL, token bigint NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let lease = Duration::from_millis(300);
    let policy = Policy::builder().lease(lease).build().unwrap();
    let gate = Gate(Arc::new(Notify::new()));
    let layer = IdempotencyLayer::from_store(store.clone(), policy, SingleScope("t".into()));
    let app = Router::new()
        .route("/pay", post(postgres_handler).route_layer(layer))
        .with_state(PgState {
            store: store.clone(),
            gate: gate.clone(),
        });
    let request = |wait: bool| {
        let mut r = Request::post("/pay").header("idempotency-key", "k");
        if wait {
            r = r.header("x-wait", "1");
        }
        r.body(Body::empty()).unwrap()
    };
    let stalled = tokio::spawn(app.clone().oneshot(request(true)));
    // Past the lease (the policy's margin, not the machine's), a retry
    // takes over and commits.
    let taken_over = loop {
        tokio::time::sleep(lease).await;
        let r = app.clone().oneshot(request(false)).await.unwrap();
        if r.status() != StatusCode::CONFLICT {
            break r;
        }
    };
    assert_eq!(taken_over.status(), StatusCode::CREATED);
    gate.0.notify_one();
    let stalled = stalled.await.unwrap().unwrap();
    assert_eq!(stalled.status(), StatusCode::CONFLICT, "fenced out");
    let (n, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT operation_id) FROM effects")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!((n, distinct), (1, 1), "one effect");
    // And a repeat is the taken-over attempt's answer.
    let again = app.clone().oneshot(request(false)).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().contains_key(IDEMPOTENT_REPLAYED));
    let idle: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database()",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(idle, 0, "no transaction left open");
}

/// Under `store_client_errors(false)` a `4xx` from the work releases the
/// claim like a `5xx`: rolled back, not stored, the retry runs afresh. And
/// a "failure" that answers a success is never stored for work that did
/// not commit.
#[tokio::test]
async fn answers_the_policy_does_not_store_are_rolled_back_and_released() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("g.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (operation_id TEXT NOT NULL, body TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let policy = Policy::builder()
        .store_client_errors(false)
        .build()
        .unwrap();
    let layer = IdempotencyLayer::from_store(store.clone(), policy, SingleScope("t".into()));
    let app = Router::new()
        .route("/orders", post(sqlite_handler).route_layer(layer))
        .with_state(store.clone());
    for _ in 0..2 {
        let (status, replayed, _) = send(&app, "k1", "refused").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::UNPROCESSABLE_ENTITY, false),
            "not stored: each retry runs afresh"
        );
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 0, "rolled back");
    // The key is free: the same request, now accepted, runs.
    let record = store.get("t", "k1").await.unwrap();
    assert!(
        !matches!(
            record.map(|r| r.state),
            Some(idem_core::RecordState::Completed { .. })
        ),
        "nothing stored for the 422"
    );

    let misuse = HandlerError::answer(StatusCode::OK);
    assert!(format!("{misuse:?}").contains("500"), "{misuse:?}");
}
