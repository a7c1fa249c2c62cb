//! The middleware against a scripted local server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idem_client::{IdempotentRetry, IntentKey, RetryOutcomeExt};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};

/// One scripted answer: a status and extra headers.
type Answer = (u16, Vec<(&'static str, &'static str)>);

/// Answers with the scripted statuses in turn (201 once they run out), each
/// with optional extra headers, and records the keys it saw.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    keys: Arc<Mutex<Vec<Option<String>>>>,
}

async fn serve(script: Script) -> String {
    let app = Router::new().route(
        "/p",
        post(move |headers: HeaderMap| {
            let script = script.clone();
            async move {
                script.keys.lock().unwrap().push(
                    headers
                        .get("idempotency-key")
                        .map(|v| v.to_str().unwrap().to_owned()),
                );
                let (status, extra) = script
                    .answers
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or((201, vec![]));
                let mut response = (StatusCode::from_u16(status).unwrap(), "body").into_response();
                for (k, v) in extra {
                    response.headers_mut().insert(k, v.parse().unwrap());
                }
                response
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/p")
}

fn client(retry: IdempotentRetry) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(retry)
        .build()
}

fn fast() -> IdempotentRetry {
    IdempotentRetry::builder()
        .base_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
        .build()
}

fn script(answers: Vec<Answer>) -> Script {
    Script {
        answers: Arc::new(Mutex::new(answers.into())),
        keys: Arc::default(),
    }
}

#[tokio::test]
async fn one_generated_key_across_every_retry() {
    let s = script(vec![(503, vec![]), (500, vec![]), (502, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 201);
    let outcome = r.retry_outcome().unwrap().clone();
    assert_eq!(outcome.attempts, 4);
    let keys = s.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 4);
    let first = keys[0].clone().expect("a key is generated");
    assert!(uuid::Uuid::parse_str(&first).is_ok());
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(first.as_str())),
        "{keys:?}"
    );
    assert_eq!(outcome.idempotency_key.as_deref(), Some(first.as_str()));
}

#[tokio::test]
async fn a_caller_supplied_key_is_kept() {
    let s = script(vec![(503, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(fast())
        .post(&url)
        .with_extension(IntentKey::new("intent-7"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.retry_outcome().unwrap().attempts, 2);
    assert_eq!(
        *s.keys.lock().unwrap(),
        vec![Some("intent-7".to_owned()); 2]
    );
    // a key set as a header wins too
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    client(fast())
        .post(&url)
        .header("idempotency-key", "hdr-1")
        .send()
        .await
        .unwrap();
    assert_eq!(*s.keys.lock().unwrap(), vec![Some("hdr-1".to_owned())]);
}

#[tokio::test]
async fn client_errors_are_never_retried() {
    for status in [400, 401, 403, 404, 408, 410, 412, 413, 422, 501] {
        let s = script(vec![(status, vec![])]);
        let url = serve(s.clone()).await;
        let r = client(fast()).post(&url).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(
            r.retry_outcome().unwrap().attempts,
            1,
            "{status} must not be retried"
        );
        assert_eq!(s.keys.lock().unwrap().len(), 1);
    }
}

#[tokio::test]
async fn conflicts_and_rate_limits_honour_retry_after() {
    let s = script(vec![
        (409, vec![("retry-after", "1")]),
        (429, vec![("retry-after", "1")]),
    ]);
    let url = serve(s.clone()).await;
    let started = Instant::now();
    let r = client(fast()).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 3);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // a long Retry-After is cut to the configured ceiling
    let s = script(vec![(409, vec![("retry-after", "3600")])]);
    let url = serve(s.clone()).await;
    let capped = IdempotentRetry::builder()
        .max_retry_after(Duration::from_millis(50))
        .build();
    let started = Instant::now();
    client(capped).post(&url).send().await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn replays_are_reported() {
    let app = Router::new().route(
        "/p",
        post(|| async { (StatusCode::CREATED, [("idempotent-replayed", "true")], "x") }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let r = client(fast())
        .post(format!("http://{addr}/p"))
        .send()
        .await
        .unwrap();
    assert!(r.retry_outcome().unwrap().replayed);
}

#[tokio::test]
async fn attempts_and_total_time_are_capped() {
    let s = script(vec![(503, vec![]); 10]);
    let url = serve(s.clone()).await;
    let three = IdempotentRetry::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(1))
        .build();
    let r = client(three).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.retry_outcome().unwrap().attempts, 3);

    let s = script(vec![(503, vec![("retry-after", "1")]); 10]);
    let url = serve(s.clone()).await;
    let brief = IdempotentRetry::builder()
        .max_elapsed(Duration::from_millis(1500))
        .build();
    let started = Instant::now();
    let r = client(brief).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(r.retry_outcome().unwrap().attempts, 2);
}

#[tokio::test]
async fn connection_errors_are_retried_then_reported() {
    // nothing listens on port 1
    let started = Instant::now();
    let err = client(
        IdempotentRetry::builder()
            .max_attempts(3)
            .base_delay(Duration::from_millis(10))
            .build(),
    )
    .post("http://127.0.0.1:1/p")
    .send()
    .await
    .unwrap_err();
    assert!(err.is_connect(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn get_requests_are_retried_without_a_key() {
    let app = {
        let calls = Arc::new(Mutex::new(0));
        Router::new().route(
            "/g",
            axum::routing::get(move |headers: HeaderMap| {
                let calls = calls.clone();
                async move {
                    assert!(headers.get("idempotency-key").is_none());
                    let mut n = calls.lock().unwrap();
                    *n += 1;
                    if *n < 2 {
                        StatusCode::BAD_GATEWAY
                    } else {
                        StatusCode::OK
                    }
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let r = client(fast())
        .get(format!("http://{addr}/g"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.retry_outcome().unwrap().attempts, 2);
    assert_eq!(r.retry_outcome().unwrap().idempotency_key, None);
}
