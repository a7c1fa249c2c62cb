//! The problem type base is the application's to choose: set once, every
//! problem idem answers with carries it, followed by the slug.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use idem_axum::problem::{self, ProblemBaseError, DEFAULT_PROBLEM_TYPE_BASE};
use idem_axum::{IdempotencyLayer, SingleScope, IDEMPOTENCY_REJECTION};
use idem_core::Policy;
use idem_memory::MemoryStore;
use tower::ServiceExt;

#[tokio::test]
async fn a_base_set_at_start_up_is_every_problems_prefix() {
    // The default points at idem's own definitions of each slug.
    assert_eq!(problem::problem_type_base(), DEFAULT_PROBLEM_TYPE_BASE);
    assert!(matches!(
        problem::set_problem_type_base("not a uri"),
        Err(ProblemBaseError::NotAUri(_))
    ));
    assert!(matches!(
        problem::set_problem_type_base("https://bad.example/\"x"),
        Err(ProblemBaseError::NotAUri(_))
    ));
    // A rejection answered before the base is set carries the default (and
    // the body idem keeps for it must not outlive the change).
    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        SingleScope("t".into()),
    );
    let app = Router::new().route("/orders", post(|| async { "created" }).layer(layer));
    let missing_key = |app: Router| async move {
        let response = app
            .oneshot(Request::post("/orders").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        problem["type"].as_str().unwrap().to_owned()
    };
    assert_eq!(
        missing_key(app.clone()).await,
        format!("{DEFAULT_PROBLEM_TYPE_BASE}idempotency-key-missing")
    );
    problem::set_problem_type_base("https://api.example.com/problems/").unwrap();
    assert_eq!(
        missing_key(app).await,
        "https://api.example.com/problems/idempotency-key-missing"
    );
    problem::set_problem_type_base("https://api.example.com/problems/").unwrap();
    assert_eq!(
        problem::set_problem_type_base("https://other.example/"),
        Err(ProblemBaseError::AlreadySet(
            "https://api.example.com/problems/".into()
        ))
    );

    let layer = IdempotencyLayer::new(
        Arc::new(MemoryStore::new()),
        Policy::default(),
        SingleScope("t".into()),
    );
    let app = Router::new().route("/orders", post(|| async { "created" }).layer(layer));
    let response = app
        .oneshot(Request::post("/orders").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        response.headers()[IDEMPOTENCY_REJECTION],
        "idempotency-key-missing"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"],
        "https://api.example.com/problems/idempotency-key-missing"
    );
    assert_eq!(
        idem_axum::Problem::new(StatusCode::NOT_FOUND, "not-found", "No such thing").kind(),
        "https://api.example.com/problems/not-found"
    );
}
