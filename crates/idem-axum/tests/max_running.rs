//! `IdempotencyLayer::max_running`: requests cut off mid-way leave their
//! handlers running (to store their answers), and those count. (A binary
//! of its own: the count of running handlers is the process's.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gate;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_axum::{IdempotencyLayer, SingleScope};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

use gate::{handler, until, until_idle, Gate};

fn request(key: &str, body: Body) -> Request<Body> {
    Request::post("/p")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}

/// The gated handler behind the layer, at most two guarded requests at once.
fn app(gate: &Gate) -> Router {
    Router::new()
        .route("/p", post(handler))
        .layer(
            IdempotencyLayer::new(
                Arc::new(MemoryStore::new()),
                Policy::default(),
                SingleScope("app".into()),
            )
            .max_running(2),
        )
        .with_state(gate.clone())
}

/// The count is the process's: this binary's tests take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cut_off_count_until_their_handlers_end() {
    let _turn = ONE_AT_A_TIME.lock().await;
    until_idle().await;
    let gate = Gate::closed();
    let app = app(&gate);

    // Two requests, each cut off once its handler has started (a client
    // gone, a stream reset): the handlers run on.
    for n in 0..2 {
        let cut = tokio::spawn(
            app.clone()
                .oneshot(request(&format!("k{n}"), Body::from("{}"))),
        );
        gate.until_started_past(n).await;
        cut.abort();
        let _ = cut.await;
    }
    assert_eq!(idem_once::detached::running(), 2);
    until(
        || idem_once::detached::abandoned() == 2,
        "the handlers cut off never counted as abandoned",
    )
    .await;

    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        app.clone().oneshot(request("k-next", Body::from("{}"))),
    )
    .await
    .expect("refused at once, not run")
    .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["idempotency-rejection"], "overloaded");
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(gate.started(), 2, "no handler more");

    // Once they end, the same key runs (nothing was claimed for it).
    gate.open.add_permits(3);
    until_idle().await;
    let ran = app
        .oneshot(request("k-next", Body::from("{}")))
        .await
        .unwrap();
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
    until_idle().await;
    let gate = Gate::closed();
    let app = app(&gate);
    let mut senders = Vec::new();
    let mut answers = Vec::new();
    for n in 0..10 {
        let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
        senders.push(tx);
        let body = Body::new(Fed(rx));
        answers.push(tokio::spawn(
            app.clone().oneshot(request(&format!("t{n}"), body)),
        ));
    }
    // Every request is in the layer (each past its check, or refused),
    // none has its body yet.
    until(
        || answers.iter().filter(|a| a.is_finished()).count() >= 8,
        "the requests over the limit were not refused at once",
    )
    .await;
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
    assert_eq!(gate.started(), 2);
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
