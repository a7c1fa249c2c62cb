//! Keys and scopes come from clients: what the layer logs of them must not be
//! able to forge other log fields or lines.
//!
//! This test installs a *global* subscriber and is alone in its binary: a
//! thread-local `set_default` beside other tests in the same process races
//! with tracing's callsite-interest cache (a callsite first hit on another
//! thread can stay disabled), which made the assertion flaky.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use idem_axum::IdempotencyLayer;
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

/// A subscriber that keeps every span and event field as `Debug` shows it
/// (a `%` field shows its `Display` there, a `?` field its `Debug`).
#[derive(Debug, Default)]
struct Capture {
    fields: Mutex<Vec<(String, String)>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl tracing::field::Visit for &Capture {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.fields
            .lock()
            .unwrap()
            .push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl tracing::Subscriber for &'static Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        span.record(&mut &**self);
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::span::Id::from_u64(id + 1)
    }
    fn record(&self, _: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        values.record(&mut &**self);
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        event.record(&mut &**self);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

impl Capture {
    /// Every value logged under `name`.
    fn values(&self, name: &str) -> Vec<String> {
        self.fields
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn clear(&self) {
        self.fields.lock().unwrap().clear();
    }
}

#[tokio::test]
async fn client_controlled_scopes_and_keys_are_logged_escaped() {
    let capture: &'static Capture = Box::leak(Box::default());
    tracing::subscriber::set_global_default(capture).unwrap();

    // A completed request: its span carries the scope and the key.
    let scope = "tenant\n level=error msg=\"forged\"";
    let key = "k\"level=error";
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        move |_: &http::request::Parts| Ok(scope.to_owned()),
    );
    let app = Router::new()
        .route("/", post(|| async { "ok" }))
        .layer(layer);
    let request = Request::post("/")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(capture.values("scope"), vec![format!("{scope:?}")]);
    assert_eq!(capture.values("key"), vec![format!("{key:?}")]);

    // An abandoned claim (the handler panics): the guard's warning and the release log the key too, escaped. A key holds
    // only visible ASCII, so a quote and a backslash are what could forge.
    capture.clear();
    let key = "k\\\"level=error";
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        |_: &http::request::Parts| Ok("s".to_owned()),
    );
    let app = Router::new()
        .route(
            "/",
            post(|| async {
                if key.len() > 1 {
                    panic!("the handler fails half-way");
                }
                "ok"
            }),
        )
        .layer(layer);
    let request = Request::post("/")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // The guard releases on a task of its own: wait for it, not for a fixed
    // time (a loaded machine may take long).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while capture.values("key").len() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let logged = capture.values("key");
    assert_eq!(
        logged.len(),
        3,
        "the span, the guard's warning, the release: {logged:?}"
    );
    for value in &logged {
        assert_eq!(value, &format!("{key:?}"));
        assert!(value.contains("\\\\\\\""), "{value}");
    }
}
