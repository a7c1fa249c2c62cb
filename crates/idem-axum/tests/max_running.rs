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

/// The count is the process's: this binary's tests take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cut_off_count_until_their_handlers_end() {
    let _turn = ONE_AT_A_TIME.lock().await;
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
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while gate.started.load(Ordering::SeqCst) == n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "handler {n} never started"
            );
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

/// Requests arriving together, their bodies still on the way, cannot all
/// pass one count: a request counts from the check on, so of ten only the
/// limit's two are let in, whatever order they come in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_arriving_together_are_let_in_up_to_the_limit() {
    let _turn = ONE_AT_A_TIME.lock().await;
    while idem_once::detached::running() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
                SingleScope("together".into()),
            )
            .max_running(2),
        )
        .with_state(gate.clone());
    let mut senders = Vec::new();
    let mut answers = Vec::new();
    for n in 0..10 {
        let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
        senders.push(tx);
        let body = Body::new(Fed(rx));
        let request = Request::post("/p")
            .header("idempotency-key", format!("t{n}"))
            .header("content-type", "application/json")
            .body(body)
            .unwrap();
        answers.push(tokio::spawn(app.clone().oneshot(request)));
    }
    // Every request is in the layer (each past its check, or refused),
    // none has its body yet.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while answers.iter().filter(|a| a.is_finished()).count() < 8 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of 10 answered, running {}",
            answers.iter().filter(|a| a.is_finished()).count(),
            idem_once::detached::running()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(idem_once::detached::running(), 2);
    for tx in &senders {
        let _ = tx.send(bytes::Bytes::from_static(b"{}")).await;
    }
    drop(senders);
    gate.open.add_permits(10);
    let mut statuses = Vec::new();
    for answer in answers {
        statuses.push(answer.await.unwrap().unwrap().status());
    }
    let ran = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert_eq!((ran, refused), (2, 8), "{statuses:?}");
    assert_eq!(gate.started.load(Ordering::SeqCst), 2);
}

/// A body fed chunk by chunk by the test.
struct Fed(tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl http_body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
    }
}
