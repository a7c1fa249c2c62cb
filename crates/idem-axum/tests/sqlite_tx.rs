//! Handlers that commit the record in their own SQLite transaction.
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
use idem_axum::{Idempotency, IdempotencyLayer, SingleScope};
use idem_core::{Policy, RecordState, Store};
use idem_sqlite::SqliteStore;
use tower::ServiceExt;

/// Stalls for `x-delay-ms` (a slow call to another system, say), then writes
/// its effect and completes the record in one transaction.
async fn create(
    State(store): State<SqliteStore>,
    idem: Idempotency,
    headers: http::HeaderMap,
) -> Response {
    let delay: u64 = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO effects (operation_id, token) VALUES (?1, ?2)")
        .bind(idem.operation_id().to_string())
        .bind(idem.token().0)
        .execute(&mut *tx)
        .await
        .unwrap();
    // `x-status`: the answer's status (201 unless told).
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .and_then(|v| StatusCode::from_u16(v).ok())
        .unwrap_or(StatusCode::CREATED);
    let response = (status, format!("token {}", idem.token())).into_response();
    match idem.complete_in(&store, &mut *tx, response).await {
        Ok(response) => {
            tx.commit().await.unwrap();
            response
        }
        // dropping `tx` rolls the effect back
        Err(e) => e.into_response(),
    }
}

async fn setup(lease: Duration) -> (Router, SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (operation_id TEXT NOT NULL, token INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let policy = Policy::builder().lease(lease).build().unwrap();
    let layer = IdempotencyLayer::new(Arc::new(store.clone()), policy, SingleScope("t".into()));
    let app = Router::new()
        .route("/effects", post(create))
        .layer(layer)
        .with_state(store.clone());
    (app, store, dir)
}

fn req(key: &str, delay_ms: u64) -> Request<Body> {
    Request::post("/effects")
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms.to_string())
        .body(Body::from("{}"))
        .unwrap()
}

async fn effects(store: &SqliteStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT operation_id, token FROM effects")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_record_commits_with_the_effect_and_replays() {
    let (app, store, _dir) = setup(Duration::from_secs(30)).await;
    let first = app.clone().oneshot(req("k1", 0)).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.into_body().collect().await.unwrap().to_bytes();
    let again = app.clone().oneshot(req("k1", 0)).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.into_body().collect().await.unwrap().to_bytes(),
        first_body
    );
    assert_eq!(effects(&store).await.len(), 1);
    assert!(matches!(
        store.get("t", "k1").await.unwrap().unwrap().state,
        RecordState::Completed { .. }
    ));
}

#[tokio::test]
async fn a_zombie_past_its_lease_rolls_back_and_its_effect_is_not_committed() {
    let (app, store, _dir) = setup(Duration::from_millis(300)).await;
    // the first attempt stalls for 900 ms, three times its lease
    let zombie = tokio::spawn(app.clone().oneshot(req("z", 900)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // the retry finds the lease run out, takes over and completes
    let retry = app.clone().oneshot(req("z", 0)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let zombie = zombie.await.unwrap().unwrap();
    assert_eq!(
        zombie.status(),
        StatusCode::CONFLICT,
        "the zombie learns it lost its claim"
    );
    let rows = effects(&store).await;
    assert_eq!(rows.len(), 1, "only the retry's effect committed: {rows:?}");
    match store.get("t", "z").await.unwrap().unwrap().state {
        RecordState::Completed { response, .. } => {
            assert_eq!(response.body, format!("token {}", rows[0].1));
        }
        other => panic!("not completed: {other:?}"),
    }
    // and the stored answer is the retry's
    let again = app.oneshot(req("z", 0)).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
}

#[tokio::test]
async fn an_unreachable_store_answers_503_and_runs_nothing() {
    let (app, store, _dir) = setup(Duration::from_secs(30)).await;
    store.pool().close().await;
    let resp = app.oneshot(req("k3", 0)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    assert!(resp.headers().contains_key("retry-after"));
}

/// The layer's view of the store, counting the completions it makes itself.
#[derive(Debug, Clone)]
struct CountingCompletions {
    inner: SqliteStore,
    completes: Arc<std::sync::atomic::AtomicUsize>,
}

impl Store for CountingCompletions {
    fn claim<'a>(
        &'a self,
        r: &'a idem_core::ClaimRequest,
    ) -> idem_core::BoxFuture<'a, Result<idem_core::ClaimOutcome, idem_core::StoreError>> {
        self.inner.claim(r)
    }
    fn complete<'a>(
        &'a self,
        c: &'a idem_core::Claim,
        r: &'a idem_core::StoredResponse,
    ) -> idem_core::BoxFuture<'a, Result<(), idem_core::StoreError>> {
        self.completes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.complete(c, r)
    }
    fn release<'a>(
        &'a self,
        c: &'a idem_core::Claim,
    ) -> idem_core::BoxFuture<'a, Result<(), idem_core::StoreError>> {
        self.inner.release(c)
    }
    fn get<'a>(
        &'a self,
        s: &'a str,
        k: &'a str,
    ) -> idem_core::BoxFuture<'a, Result<Option<idem_core::Record>, idem_core::StoreError>> {
        self.inner.get(s, k)
    }
    fn sweep(&self, b: usize) -> idem_core::BoxFuture<'_, Result<u64, idem_core::StoreError>> {
        self.inner.sweep(b)
    }
}

#[tokio::test]
async fn a_record_completed_in_the_transaction_is_not_completed_again_by_the_layer() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("c.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (operation_id TEXT NOT NULL, token INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let counting = CountingCompletions {
        inner: store.clone(),
        completes: Arc::default(),
    };
    let layer = IdempotencyLayer::new(
        Arc::new(counting.clone()),
        Policy::default(),
        SingleScope("t".into()),
    );
    let app = Router::new()
        .route("/effects", post(create))
        .layer(layer)
        .with_state(store.clone());
    let response = app.clone().oneshot(req("once", 0)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        counting.completes.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the handler's transaction completed the record; the layer must not try again"
    );
    let replay = app.oneshot(req("once", 0)).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// The documented pattern (`Ok` commits, `Err` rolls back) with an answer
/// the layer does not store (a 5xx): `complete_in` says so with an error,
/// the effect rolls back with the released claim, and the retry runs once.
#[tokio::test]
async fn an_answer_that_is_not_stored_rolls_its_effect_back() {
    let (app, store, _dir) = setup(Duration::from_secs(30)).await;
    let mut failing = req("k-502", 0);
    failing
        .headers_mut()
        .insert("x-status", http::HeaderValue::from_static("502"));
    let resp = app.clone().oneshot(failing).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert!(
        effects(&store).await.is_empty(),
        "the 502's effect rolled back"
    );
    // Released: the retry runs, once.
    let retry = app.clone().oneshot(req("k-502", 0)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(effects(&store).await.len(), 1);
}
