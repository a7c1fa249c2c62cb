//! `IdempotencyLayer::max_running`: requests cut off mid-way leave their
//! handlers running (to store their answers), and those count. (A binary
//! of its own: the count of running handlers is the process's.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::{IdempotencyLayer, SingleScope};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct Gate {
    open: Arc<Semaphore>,
    started: Arc<AtomicUsize>,
}

async fn handler(State(gate): State<Gate>) -> &'static str {
    gate.started.fetch_add(1, Ordering::SeqCst);
    gate.open.acquire().await.unwrap().forget();
    "done"
}

fn request(key: &str) -> Request<Body> {
    Request::post("/p")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cut_off_count_until_their_handlers_end() {
    let gate = Gate {
        open: Arc::new(Semaphore::new(0)),
        started: Arc::new(AtomicUsize::new(0)),
    };
    let app = Router::new()
        .route("/p", post(handler))
        .layer(
            IdempotencyLayer::new(
                Arc::new(MemoryStore::new()),
                Policy::default(),
                SingleScope("app".into()),
            )
            .max_running(2),
        )
        .with_state(gate.clone());

    // Two requests, each cut off once its handler has started (a client
    // gone, a stream reset): the handlers run on.
    for n in 0..2 {
        let cut = tokio::spawn(app.clone().oneshot(request(&format!("k{n}"))));
        while gate.started.load(Ordering::SeqCst) == n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cut.abort();
        let _ = cut.await;
    }
    assert_eq!(idem_once::detached::running(), 2);

    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        app.clone().oneshot(request("k-next")),
    )
    .await
    .expect("refused at once, not run")
    .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["idempotency-rejection"], "overloaded");
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(gate.started.load(Ordering::SeqCst), 2, "no handler more");

    // Once they end, the same key runs (nothing was claimed for it).
    gate.open.add_permits(3);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while idem_once::detached::running() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handlers never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ran = app.oneshot(request("k-next")).await.unwrap();
    assert_eq!(ran.status(), StatusCode::OK);
    assert!(ran.headers().get("idempotent-replayed").is_none());
    assert_eq!(ran.into_body().collect().await.unwrap().to_bytes(), "done");
}
