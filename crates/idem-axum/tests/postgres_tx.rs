//! Handlers that commit the record in their own PostgreSQL transaction,
//! against the real server, each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use idem_axum::{Idempotency, IdempotencyLayer, SingleScope};
use idem_core::{Policy, RecordState, Store};
use idem_postgres::PostgresStore;
use idem_test_support::postgres::TestSchema;
use tower::ServiceExt;

/// Writes its effect first, then stalls for `x-delay-ms` with the
/// transaction open (a slow downstream call), then completes the record in
/// the same transaction.
async fn create(
    State(store): State<PostgresStore>,
    idem: Idempotency,
    headers: http::HeaderMap,
) -> Response {
    let delay: u64 = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO effects (operation_id, token) VALUES ($1, $2)")
        .bind(idem.operation_id().to_string())
        .bind(idem.token().0)
        .execute(&mut *tx)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let response = (StatusCode::CREATED, format!("token {}", idem.token())).into_response();
    match idem.complete_in(&store, &mut *tx, response).await {
        Ok(response) => {
            tx.commit().await.unwrap();
            response
        }
        Err(e) => e.into_response(), // `tx` is dropped: the effect rolls back
    }
}

async fn setup(lease: Duration) -> (Router, PostgresStore, TestSchema) {
    let schema = TestSchema::create("idem_axum").await;
    let store = PostgresStore::connect(&schema.url())
        .await
        .expect("connect");
    sqlx::query("CREATE TABLE effects (operation_id text NOT NULL, token bigint NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let policy = Policy::builder().lease(lease).build().unwrap();
    let layer = IdempotencyLayer::new(Arc::new(store.clone()), policy, SingleScope("t".into()));
    let app = Router::new()
        .route("/effects", post(create))
        .layer(layer)
        .with_state(store.clone());
    (app, store, schema)
}

fn req(key: &str, delay_ms: u64) -> Request<Body> {
    Request::post("/effects")
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms.to_string())
        .body(Body::from("{}"))
        .unwrap()
}

async fn effects(store: &PostgresStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT operation_id, token FROM effects")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_that_wrote_before_stalling_rolls_back() {
    let (app, store, _schema) = setup(Duration::from_millis(400)).await;
    // the first attempt writes, then stalls for three times its lease
    let zombie = tokio::spawn(app.clone().oneshot(req("z", 1200)));
    tokio::time::sleep(Duration::from_millis(600)).await;
    // the retry takes the expired claim over and completes
    let retry = app.clone().oneshot(req("z", 0)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let zombie = zombie.await.unwrap().unwrap();
    assert_eq!(
        zombie.status(),
        StatusCode::CONFLICT,
        "the zombie learns it lost its claim"
    );
    let rows = effects(&store).await;
    assert_eq!(
        rows.len(),
        1,
        "only the retry's write is in the database: {rows:?}"
    );
    match store.get("t", "z").await.unwrap().unwrap().state {
        RecordState::Completed { response, .. } => {
            assert_eq!(response.body, format!("token {}", rows[0].1))
        }
        other => panic!("not completed: {other:?}"),
    }
    let again = app.oneshot(req("z", 0)).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_write_once() {
    let (app, store, _schema) = setup(Duration::from_secs(30)).await;
    let mut tasks = Vec::new();
    for _ in 0..30 {
        tasks.push(tokio::spawn(app.clone().oneshot(req("race", 200))));
    }
    let mut created = 0;
    for t in tasks {
        let status = t.await.unwrap().unwrap().status();
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
        created += usize::from(status == StatusCode::CREATED);
    }
    assert!(created >= 1);
    assert_eq!(effects(&store).await.len(), 1);
}
