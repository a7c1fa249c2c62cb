//! The middleware against real local servers: scripted answers, a port that
//! refuses connections until a server binds it, connections reset on accept.
//!
//! Timing assertions are lower bounds the policy guarantees (a wait of at
//! least the `Retry-After`), measured at the server; upper bounds only where
//! the policy itself sets them, so a busy machine cannot fail them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{any, post};
use axum::Router;
use http::Extensions;
use idem_client::{
    IdempotentRetry, IntentKey, LastFailure, RetryError, RetryErrorExt, RetryOutcomeExt, StopReason,
};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::net::{TcpListener, TcpStream};

/// One scripted answer: a status and extra headers.
type Answer = (u16, Vec<(&'static str, String)>);

/// What the server saw: each request's key and when it arrived.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Arrival>>>);

/// A request's key, and when it arrived (by both clocks).
type Arrival = (Option<String>, Instant, SystemTime);

impl Seen {
    fn keys(&self) -> Vec<Option<String>> {
        self.0.lock().unwrap().iter().map(|s| s.0.clone()).collect()
    }

    fn arrivals(&self) -> Vec<Instant> {
        self.0.lock().unwrap().iter().map(|s| s.1).collect()
    }

    fn wall_arrivals(&self) -> Vec<SystemTime> {
        self.0.lock().unwrap().iter().map(|s| s.2).collect()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Answers with the scripted statuses in turn (201 once they run out), each
/// with optional extra headers, and records what it saw. A header value
/// `"@+N"` is the HTTP-date N seconds after the answer is made.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    seen: Seen,
    /// The HTTP-dates sent, as sent (to the second).
    dates: Arc<Mutex<Vec<SystemTime>>>,
}

fn script(answers: Vec<Answer>) -> Script {
    Script {
        answers: Arc::new(Mutex::new(answers.into())),
        ..Script::default()
    }
}

fn app(script: Script) -> Router {
    Router::new().route(
        "/p",
        any(move |headers: HeaderMap| {
            let script = script.clone();
            async move {
                script.seen.0.lock().unwrap().push((
                    headers
                        .get("idempotency-key")
                        .map(|v| v.to_str().unwrap().to_owned()),
                    Instant::now(),
                    SystemTime::now(),
                ));
                let (status, extra) = script
                    .answers
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or((201, vec![]));
                let mut response = (StatusCode::from_u16(status).unwrap(), "body").into_response();
                for (k, v) in extra {
                    let v = match v.strip_prefix("@+") {
                        Some(secs) => {
                            let at = SystemTime::now() + Duration::from_secs(secs.parse().unwrap());
                            let date = httpdate::fmt_http_date(at);
                            let sent = httpdate::parse_http_date(&date).unwrap();
                            script.dates.lock().unwrap().push(sent);
                            date
                        }
                        None => v,
                    };
                    response.headers_mut().insert(k, v.parse().unwrap());
                }
                response
            }
        }),
    )
}

async fn serve(script: Script) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(script)).await });
    format!("http://{addr}/p")
}

/// An address nothing listens on (yet): connections to it are refused.
fn free_addr() -> SocketAddr {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap()
}

/// Every attempt as it leaves the retry middleware: its key, and whether it
/// failed to connect. It sits under [`IdempotentRetry`] in the chain, so it
/// sees the attempts that never reach a server too.
#[derive(Clone, Default)]
struct Attempts(Arc<Mutex<Vec<Attempt>>>);

/// An attempt's key, and its status or what went wrong.
type Attempt = (Option<String>, Result<u16, String>);

impl Attempts {
    fn keys(&self) -> Vec<Option<String>> {
        self.0.lock().unwrap().iter().map(|a| a.0.clone()).collect()
    }

    fn results(&self) -> Vec<Result<u16, String>> {
        self.0.lock().unwrap().iter().map(|a| a.1.clone()).collect()
    }
}

#[async_trait::async_trait]
impl Middleware for Attempts {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let key = req
            .headers()
            .get("idempotency-key")
            .map(|v| v.to_str().unwrap().to_owned());
        let result = next.run(req, extensions).await;
        let summary = match &result {
            Ok(r) => Ok(r.status().as_u16()),
            Err(e) if e.is_connect() => Err("connect".to_owned()),
            Err(e) => Err(format!("{e:?}")),
        };
        self.0.lock().unwrap().push((key, summary));
        result
    }
}

fn reqwest_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

fn client(retry: IdempotentRetry) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest_client()).with(retry).build()
}

fn watched(retry: IdempotentRetry, attempts: &Attempts) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest_client())
        .with(retry)
        .with(attempts.clone())
        .build()
}

/// Short waits, so that tests about what is retried take milliseconds.
fn fast() -> IdempotentRetry {
    IdempotentRetry::builder()
        .base_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
        .build()
}

fn gaps(arrivals: &[Instant]) -> Vec<Duration> {
    arrivals.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test]
async fn one_generated_key_across_every_retry() {
    let s = script(vec![
        (503, vec![]),
        (500, vec![]),
        (502, vec![]),
        (504, vec![]),
    ]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 201);
    let outcome = r.retry_outcome().unwrap().clone();
    assert_eq!(outcome.attempts, 5);
    let keys = s.seen.keys();
    assert_eq!(keys.len(), 5);
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
    assert_eq!(s.seen.keys(), vec![Some("intent-7".to_owned()); 2]);
    // a key set as a header wins too
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    client(fast())
        .post(&url)
        .header("idempotency-key", "hdr-1")
        .send()
        .await
        .unwrap();
    assert_eq!(s.seen.keys(), vec![Some("hdr-1".to_owned())]);
}

/// The default policy, unchanged: a server down for 2 s (nothing listening,
/// so every connection is refused) and then up is ridden out, with one key
/// on every attempt, the refused ones included.
#[tokio::test]
async fn the_defaults_ride_out_two_seconds_of_refused_connections() {
    let addr = free_addr();
    let s = script(vec![]);
    let server = s.clone();
    let started = Instant::now();
    let up = Arc::new(Mutex::new(None::<Instant>));
    let up_at = up.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        *up_at.lock().unwrap() = Some(Instant::now());
        axum::serve(listener, app(server)).await
    });

    let attempts = Attempts::default();
    let r = watched(IdempotentRetry::default(), &attempts)
        .post(format!("http://{addr}/p"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let up = up.lock().unwrap().expect("the server came up");
    assert!(up - started >= Duration::from_secs(2));

    let outcome = r.retry_outcome().unwrap().clone();
    let results = attempts.results();
    assert_eq!(outcome.attempts as usize, results.len());
    assert!(outcome.attempts >= 2, "{results:?}");
    let (last, refused) = results.split_last().unwrap();
    assert_eq!(*last, Ok(201));
    assert!(
        refused.iter().all(|r| *r == Err("connect".to_owned())),
        "{results:?}"
    );
    let key = outcome.idempotency_key.clone().expect("a key");
    assert!(
        attempts.keys().iter().all(|k| k.as_deref() == Some(&key)),
        "{:?}",
        attempts.keys()
    );
    assert_eq!(s.seen.keys(), vec![Some(key)], "the server saw one request");
}

/// Holds a listener's first connections up to be reset on accept.
struct Resetting {
    inner: TcpListener,
    resets: usize,
}

impl axum::serve::Listener for Resetting {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, _)) if self.resets > 0 => {
                    self.resets -= 1;
                    // wait for the request, then answer it with a reset
                    let _ = stream.readable().await;
                    let _ = stream.set_zero_linger();
                    drop(stream);
                }
                Ok(pair) => return pair,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

#[tokio::test]
async fn reset_connections_are_retried_with_the_same_key() {
    let s = script(vec![]);
    let listener = Resetting {
        inner: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        resets: 2,
    };
    let addr = listener.inner.local_addr().unwrap();
    let server = app(s.clone());
    tokio::spawn(async move { axum::serve(listener, server).await });
    let attempts = Attempts::default();
    let r = watched(fast(), &attempts)
        .post(format!("http://{addr}/p"))
        .with_extension(IntentKey::new("intent-reset"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 3);
    let results = attempts.results();
    assert!(results[..2].iter().all(Result::is_err), "{results:?}");
    assert_eq!(
        attempts.keys(),
        vec![Some("intent-reset".to_owned()); 3],
        "{results:?}"
    );
    assert_eq!(s.seen.keys(), vec![Some("intent-reset".to_owned())]);
}

#[tokio::test]
async fn client_errors_are_returned_at_once() {
    for status in [400, 401, 403, 404, 408, 410, 412, 413, 422, 501] {
        let s = script(vec![(status, vec![])]);
        let url = serve(s.clone()).await;
        let r = client(fast())
            .post(&url)
            .with_extension(IntentKey::new("intent-4xx"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status);
        let outcome = r.retry_outcome().unwrap();
        assert_eq!(outcome.attempts, 1, "{status} must not be retried");
        assert_eq!(outcome.idempotency_key.as_deref(), Some("intent-4xx"));
        assert_eq!(s.seen.len(), 1);
    }
}

#[tokio::test]
async fn a_503_waits_its_retry_after() {
    let s = script(vec![(503, vec![("retry-after", "1".into())])]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 2);
    // the second attempt left at least a second after the first answer
    let gap = gaps(&s.seen.arrivals())[0];
    assert!(gap >= Duration::from_secs(1), "{gap:?}");
}

#[tokio::test]
async fn conflicts_and_rate_limits_honour_retry_after() {
    let s = script(vec![
        (409, vec![("retry-after", "1".into())]),
        (429, vec![("retry-after", "1".into())]),
    ]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 3);
    for gap in gaps(&s.seen.arrivals()) {
        assert!(gap >= Duration::from_secs(1), "{gap:?}");
    }
}

#[tokio::test]
async fn an_http_date_retry_after_is_waited_for() {
    let s = script(vec![(503, vec![("retry-after", "@+2".into())])]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 2);
    // The date names a whole second, 1 to 2 s after the first answer; the
    // second attempt arrived no earlier than it (give or take the 2 ms the
    // wall clock may drift from the monotonic one the wait is timed by).
    let wall = s.seen.wall_arrivals();
    let dates = s.dates.lock().unwrap().clone();
    assert!(
        dates[0] > wall[0] + Duration::from_secs(1),
        "{dates:?} {wall:?}"
    );
    assert!(
        wall[1] + Duration::from_millis(2) >= dates[0],
        "{dates:?} {wall:?}"
    );
}

#[tokio::test]
async fn a_retry_after_over_the_cap_is_cut_to_it() {
    let cap = Duration::from_millis(300);
    let s = script(vec![
        (429, vec![("retry-after", "3600".into())]),
        (503, vec![("retry-after", "@+86400".into())]),
    ]);
    let url = serve(s.clone()).await;
    let capped = IdempotentRetry::builder()
        .max_retry_after(cap)
        .max_elapsed(Duration::from_secs(5))
        .build();
    // Had the hour (or the day) been honoured, it would end after the 5 s
    // budget and the middleware would have given up: a 201 is the cap at
    // work.
    let r = client(capped).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.retry_outcome().unwrap().attempts, 3);
    for gap in gaps(&s.seen.arrivals()) {
        assert!(gap >= cap, "{gap:?}");
    }
}

#[tokio::test]
async fn a_retry_after_beyond_the_budget_gives_up_at_once() {
    let s = script(vec![(503, vec![("retry-after", "30".into())])]);
    let url = serve(s.clone()).await;
    let budget = Duration::from_secs(10);
    let policy = IdempotentRetry::builder()
        .max_retry_after(Duration::from_secs(60))
        .max_elapsed(budget)
        .build();
    let started = Instant::now();
    let err = client(policy)
        .post(&url)
        .with_extension(IntentKey::new("intent-ra"))
        .send()
        .await
        .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::RetryAfterBeyondBudget);
    assert_eq!(e.attempts(), 1);
    assert_eq!(e.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(e.idempotency_key(), Some("intent-ra"));
    assert_eq!(s.seen.len(), 1);
    // it slept neither the Retry-After nor what was left of the budget
    assert!(started.elapsed() < budget, "{:?}", started.elapsed());
}

#[tokio::test]
async fn exhausted_attempts_return_the_typed_error() {
    let s = script(vec![(503, vec![]); 10]);
    let url = serve(s.clone()).await;
    let three = IdempotentRetry::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(1))
        .build();
    let err = client(three)
        .post(&url)
        .with_extension(IntentKey::new("intent-9"))
        .send()
        .await
        .unwrap_err();

    // the documented way down, by hand
    let reqwest_middleware::Error::Middleware(inner) = &err else {
        panic!("{err:?}")
    };
    let e = inner.downcast_ref::<RetryError>().expect("a RetryError");
    assert_eq!(e.attempts(), 3);
    assert_eq!(e.idempotency_key(), Some("intent-9"));
    assert_eq!(e.reason(), StopReason::AttemptsExhausted);
    assert_eq!(e.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert!(matches!(e.last(), LastFailure::Status(_)));
    assert!(e.elapsed() > Duration::ZERO);
    let outcome = e.outcome();
    assert_eq!(outcome.attempts, 3);
    assert_eq!(outcome.idempotency_key.as_deref(), Some("intent-9"));
    let message = format!("{:#}", anyhow::Error::new(err));
    assert!(
        message.starts_with(r#"gave up after 3 attempt(s) in "#)
            && message.contains(
                r#"under Idempotency-Key "intent-9" (attempts exhausted): last answer 503"#
            ),
        "{message}"
    );
    assert_eq!(s.seen.keys(), vec![Some("intent-9".to_owned()); 3]);

    // owned, the last answer whole, with its outcome
    let s = script(vec![(429, vec![]); 10]);
    let url = serve(s.clone()).await;
    let err = client(
        IdempotentRetry::builder()
            .max_attempts(2)
            .base_delay(Duration::from_millis(1))
            .build(),
    )
    .post(&url)
    .send()
    .await
    .unwrap_err();
    let e = RetryError::try_from(err).expect("a RetryError");
    let key = e.idempotency_key().expect("a generated key").to_owned();
    let response = e.into_response().expect("the last answer");
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let outcome = response.retry_outcome().unwrap();
    assert_eq!(outcome.attempts, 2);
    assert_eq!(outcome.idempotency_key.as_deref(), Some(key.as_str()));
    assert_eq!(response.text().await.unwrap(), "body");
}

#[tokio::test]
async fn a_spent_budget_returns_the_typed_error() {
    let s = script(vec![(502, vec![]); 1000]);
    let url = serve(s.clone()).await;
    let budget = Duration::from_secs(1);
    let brief = IdempotentRetry::builder()
        .max_elapsed(budget)
        .base_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(50))
        .build();
    let err = client(brief).post(&url).send().await.unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::BudgetExhausted);
    assert_eq!(e.status(), Some(StatusCode::BAD_GATEWAY));
    assert!(e.attempts() >= 2, "{e}");
    assert_eq!(e.attempts() as usize, s.seen.len());
    // it kept trying until the budget was spent
    assert!(e.elapsed() >= budget, "{e}");
}

#[tokio::test]
async fn no_wait_runs_past_the_budget() {
    let s = script(vec![(503, vec![]); 10]);
    let url = serve(s.clone()).await;
    let budget = Duration::from_millis(500);
    let wait = Duration::from_secs(10);
    // every backoff wait is 10 s, far past the budget: the wait is cut to
    // end with the budget, one more attempt goes out then, and that is all
    let policy = IdempotentRetry::builder()
        .max_elapsed(budget)
        .base_delay(wait)
        .max_delay(wait)
        .build();
    let err = client(policy).post(&url).send().await.unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::BudgetExhausted);
    assert_eq!(e.attempts() as usize, s.seen.len());
    assert!(e.elapsed() >= budget, "{e}");
    assert!(e.elapsed() < wait, "{e}");
}

#[tokio::test]
async fn refused_connections_end_in_the_typed_error() {
    let addr = free_addr();
    let attempts = Attempts::default();
    let err = watched(
        IdempotentRetry::builder()
            .max_attempts(4)
            .base_delay(Duration::from_millis(5))
            .build(),
        &attempts,
    )
    .post(format!("http://{addr}/p"))
    .send()
    .await
    .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.attempts(), 4);
    assert_eq!(e.reason(), StopReason::AttemptsExhausted);
    let key = e.idempotency_key().expect("a generated key").to_owned();
    assert!(uuid::Uuid::parse_str(&key).is_ok());
    assert_eq!(attempts.keys(), vec![Some(key.clone()); 4]);
    assert!(e.transport_error().is_some_and(|t| t.is_connect()), "{e:?}");
    assert_eq!(e.status(), None);
    assert_eq!(e.outcome().attempts, 4);
    // the source chain reaches the operating system's answer
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut refused = false;
    while let Some(s) = source {
        refused |= s
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        source = s.source();
    }
    let message = format!("{:#}", anyhow::Error::new(err));
    assert!(refused, "{message}");
    assert!(
        message.starts_with("gave up after 4 attempt(s) in ")
            && message.contains(&format!(
                r#"under Idempotency-Key "{key}" (attempts exhausted): error sending request"#
            )),
        "{message}"
    );
}

/// Fails every request as a middleware error: nothing to retry.
struct Broken;

#[async_trait::async_trait]
impl Middleware for Broken {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        Err(reqwest_middleware::Error::Middleware(anyhow::anyhow!(
            "broken"
        )))
    }
}

#[tokio::test]
async fn other_errors_are_not_retried_but_still_typed() {
    let c = ClientBuilder::new(reqwest_client())
        .with(fast())
        .with(Broken)
        .build();
    let err = c
        .post("http://127.0.0.1:9/p")
        .with_extension(IntentKey::new("intent-b"))
        .send()
        .await
        .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::NotRetryable);
    assert_eq!(e.attempts(), 1);
    assert_eq!(e.idempotency_key(), Some("intent-b"));
    assert!(format!("{:#}", anyhow::Error::new(err)).ends_with(": broken"));

    // a key that cannot be a header value: nothing is sent
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    let err = client(fast())
        .post(&url)
        .with_extension(IntentKey::new("bad\nkey"))
        .send()
        .await
        .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::InvalidKey);
    assert_eq!((e.attempts(), e.idempotency_key()), (0, Some("bad\nkey")));
    assert_eq!(s.seen.len(), 0);
}

#[tokio::test]
async fn replays_are_reported() {
    let app = Router::new().route(
        "/p",
        post(|| async { (StatusCode::CREATED, [("idempotent-replayed", "true")], "x") }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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

/// An answer the server replayed (`Idempotent-Replayed: true`) is the
/// handler's stored outcome: every attempt with the key gets it again, so
/// it is returned at once, whatever its status. A `409` replayed is the
/// handler's own conflict, not "still in flight"; a `429` replayed (its
/// `Retry-After` long stale) would otherwise be retried until the time
/// budget ran out, and the caller get an error instead of the answer.
#[tokio::test]
async fn a_replayed_answer_is_returned_at_once_whatever_its_status() {
    for status in [409, 429, 503] {
        let s = script(vec![(
            status,
            vec![
                ("idempotent-replayed", "true".to_owned()),
                ("retry-after", "1".to_owned()),
            ],
        )]);
        let url = serve(s.clone()).await;
        let r = client(fast()).post(&url).send().await.unwrap();
        assert_eq!(r.status(), status);
        assert_eq!(r.retry_outcome().unwrap().attempts, 1, "{status}");
        assert!(r.retry_outcome().unwrap().replayed);
        assert_eq!(s.seen.len(), 1, "{status}");
    }
}

/// The caller's own key that is not visible ASCII is refused with nothing
/// sent; it is never swapped for a generated one (which the caller's next
/// retry of the intent would not share).
#[tokio::test]
async fn a_caller_key_that_is_not_ascii_is_refused_not_replaced() {
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    let err = client(fast())
        .post(&url)
        .header(
            "idempotency-key",
            http::HeaderValue::from_bytes("zahlung-ä".as_bytes()).unwrap(),
        )
        .send()
        .await
        .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::InvalidKey);
    assert_eq!(e.attempts(), 0);
    assert_eq!(e.idempotency_key(), Some("zahlung-ä"));
    // Nor one the server would refuse for its length.
    let err = client(fast())
        .post(&url)
        .with_extension(IntentKey::new("k".repeat(256)))
        .send()
        .await
        .unwrap_err();
    let e = err.retry_error().expect("a RetryError");
    assert_eq!(e.reason(), StopReason::InvalidKey);
    assert!(matches!(e.last(), LastFailure::KeyNotVisibleAscii), "{e}");
    assert_eq!(s.seen.len(), 0);
}

/// With `keyed_methods` narrowed to `POST`, a `PATCH` gets no key, so it is
/// sent once (a retry without a key could apply it twice), its `503`
/// passed on; given a key by its caller (an [`IntentKey`] or the header) it
/// is keyed and retried under that key, whatever the method.
#[tokio::test]
async fn an_unkeyed_request_is_retried_only_if_its_method_is_idempotent() {
    let only_post = || {
        IdempotentRetry::builder()
            .base_delay(Duration::from_millis(5))
            .max_delay(Duration::from_millis(20))
            .keyed_methods([http::Method::POST])
            .build()
    };
    let s = script(vec![(503, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(only_post()).patch(&url).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(s.seen.keys(), [None], "sent once, without a key");

    let s = script(vec![(503, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(only_post())
        .patch(&url)
        .with_extension(IntentKey::new("patch-intent-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(
        s.seen.keys(),
        [
            Some("patch-intent-1".to_owned()),
            Some("patch-intent-1".to_owned())
        ]
    );

    let s = script(vec![(503, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(only_post())
        .patch(&url)
        .header("idempotency-key", "patch-intent-2")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(s.seen.len(), 2);
}

/// A `409` that does not say when to come back is the handler's own
/// conflict, the request's outcome, not idem's "still in flight" (which
/// always carries `Retry-After`): returned at once, sent once. Before, it
/// was retried: a round trip for its replay, or, on a server that releases
/// 4xx answers, the handler run again until the conflict cleared.
#[tokio::test]
async fn a_conflict_without_retry_after_is_the_outcome() {
    let s = script(vec![(409, vec![])]);
    let url = serve(s.clone()).await;
    let r = client(fast()).post(&url).send().await.unwrap();
    assert_eq!(r.status(), 409);
    let outcome = r.retry_outcome().unwrap();
    assert_eq!(outcome.attempts, 1);
    assert!(!outcome.replayed);
    assert_eq!(s.seen.len(), 1);
}

/// A retry layer outside this middleware that sends the same request
/// again (with the same extensions, as reqwest-middleware's own do)
/// sends it under the key the first pass chose, not a second generated
/// one that would let the server run the intent twice.
#[tokio::test]
async fn a_retry_layer_outside_sends_the_same_key() {
    #[derive(Clone)]
    struct Twice;
    #[async_trait::async_trait]
    impl Middleware for Twice {
        async fn handle(
            &self,
            req: Request,
            extensions: &mut Extensions,
            next: Next<'_>,
        ) -> reqwest_middleware::Result<Response> {
            let copy = req.try_clone().unwrap();
            next.clone().run(copy, extensions).await?;
            next.run(req, extensions).await
        }
    }
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    let c = ClientBuilder::new(reqwest_client())
        .with(Twice)
        .with(fast())
        .build();
    c.post(&url).body("{}").send().await.unwrap();
    let keys = s.seen.keys();
    assert_eq!(keys.len(), 2);
    assert!(keys[0].is_some());
    assert_eq!(keys[0], keys[1], "one key for the intent");
}

/// A request that names two different keys (the header twice, or the
/// header and an `IntentKey` that differs) is refused with nothing sent:
/// before, the header's first value was sent and the rest dropped. The
/// same key named twice, or both ways, is one key.
#[tokio::test]
async fn a_request_naming_two_keys_is_refused() {
    let s = script(vec![]);
    let url = serve(s.clone()).await;
    let twice = client(fast())
        .post(&url)
        .header("idempotency-key", "k-1")
        .header("idempotency-key", "k-2")
        .send()
        .await
        .unwrap_err();
    let mixed = client(fast())
        .post(&url)
        .header("idempotency-key", "k-1")
        .with_extension(IntentKey::new("k-3"))
        .send()
        .await
        .unwrap_err();
    for (err, other) in [(twice, "k-2"), (mixed, "k-3")] {
        let e = err.retry_error().expect("a RetryError");
        assert_eq!(e.reason(), StopReason::InvalidKey);
        assert_eq!(e.attempts(), 0);
        assert_eq!(e.idempotency_key(), Some("k-1"));
        assert!(
            matches!(e.last(), LastFailure::KeysDisagree(k) if k == other),
            "{e}"
        );
    }
    assert_eq!(s.seen.len(), 0);
    let r = client(fast())
        .post(&url)
        .header("idempotency-key", "k-4")
        .header("idempotency-key", "k-4")
        .with_extension(IntentKey::new("k-4"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(s.seen.keys(), [Some("k-4".to_owned())]);
}
