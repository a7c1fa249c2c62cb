//! The client half of idempotency: a [`reqwest_middleware`] middleware that
//! keeps **one `Idempotency-Key` per intent** across every retry, and knows
//! which answers to retry.
//!
//! ```no_run
//! use idem_client::{IntentKey, IdempotentRetry, RetryOutcomeExt};
//! use reqwest_middleware::ClientBuilder;
//!
//! # async fn pay() -> Result<(), reqwest_middleware::Error> {
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetry::default())
//!     .build();
//! let response = client
//!     .post("http://127.0.0.1:8080/payments")
//!     .bearer_auth("client-1")
//!     .header("content-type", "application/json")
//!     .body(r#"{"account_id":"acc_1","amount":1000,"currency":"EUR"}"#)
//!     // one key for this intent; omit it and one is generated (UUID v4)
//!     .with_extension(IntentKey::new("order-42-payment"))
//!     .timeout(std::time::Duration::from_secs(2))
//!     .send()
//!     .await?;
//! let outcome = response.retry_outcome().expect("set by the middleware");
//! println!("{} after {} attempt(s), replayed: {}", response.status(), outcome.attempts, outcome.replayed);
//! # Ok(()) }
//! ```
//!
//! # What is retried
//!
//! Connection errors and time-outs; `5xx` except `501 Not Implemented`;
//! `409 Conflict` (the original is still in flight; honours `Retry-After`);
//! `429 Too Many Requests` (honours `Retry-After`). Never `400`, `401`, `403`,
//! `404`, `422` or any other `4xx`: the request itself is wrong, and sending
//! it again cannot help. Between attempts: exponential backoff with full
//! jitter, capped by attempts and by total time.
//!
//! Requests whose body cannot be cloned (streams) are sent once.

use std::time::{Duration, Instant};

use http::{Extensions, HeaderName, HeaderValue, Method, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next, Result};
use tracing::debug;

/// The reqwest this middleware is built on (0.12): build the client with
/// it, so that a different reqwest in your tree cannot make the types
/// differ.
pub use reqwest;
/// The reqwest-middleware this middleware implements (0.4): its
/// `ClientBuilder` and `Middleware` must be this version's.
pub use reqwest_middleware;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(idem_core::IDEMPOTENCY_KEY_HEADER);

/// The key of one intent (one logical request, whatever its retries), chosen
/// by the caller and passed with
/// `RequestBuilder::with_extension`. Without one (and without an
/// `Idempotency-Key` header), the middleware generates a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentKey(String);

impl IntentKey {
    /// A key from the caller: 1 to 255 visible ASCII characters.
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// A fresh random key (UUID v4).
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// A fresh time-ordered key (UUID v7), friendlier to B-tree indexes.
    pub fn time_ordered() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How keys are generated when the caller supplies none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyKind {
    /// UUID v4 (random).
    #[default]
    V4,
    /// UUID v7 (time-ordered).
    V7,
}

/// What happened, attached to the final response's extensions (read it with
/// [`RetryOutcomeExt::retry_outcome`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOutcome {
    /// How many attempts were sent, the last included.
    pub attempts: u32,
    /// Whether the server said the answer is a replay
    /// (`Idempotent-Replayed: true`): the effect happened on an earlier
    /// attempt, possibly one whose answer was lost.
    pub replayed: bool,
    /// The key sent with every attempt, if the request carried one.
    pub idempotency_key: Option<String>,
}

/// Reads the [`RetryOutcome`] off a response.
pub trait RetryOutcomeExt {
    /// The outcome, if the response came through [`IdempotentRetry`].
    fn retry_outcome(&self) -> Option<&RetryOutcome>;
}

impl RetryOutcomeExt for Response {
    fn retry_outcome(&self) -> Option<&RetryOutcome> {
        self.extensions().get::<RetryOutcome>()
    }
}

/// The middleware; configure it with [`IdempotentRetry::builder`].
#[derive(Debug, Clone)]
pub struct IdempotentRetry {
    max_attempts: u32,
    max_elapsed: Duration,
    base_delay: Duration,
    max_delay: Duration,
    max_retry_after: Duration,
    key_kind: KeyKind,
    keyed_methods: Vec<Method>,
}

impl Default for IdempotentRetry {
    /// 5 attempts within 30 s, backoff from 100 ms up to 5 s, `Retry-After`
    /// honoured up to 10 s, UUID v4 keys on `POST` and `PATCH`.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            max_elapsed: Duration::from_secs(30),
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(10),
            key_kind: KeyKind::V4,
            keyed_methods: vec![Method::POST, Method::PATCH],
        }
    }
}

/// Builds an [`IdempotentRetry`].
#[derive(Debug, Clone)]
pub struct IdempotentRetryBuilder(IdempotentRetry);

impl IdempotentRetry {
    /// A builder starting from the defaults.
    ///
    /// ```
    /// use std::time::Duration;
    /// let retry = idem_client::IdempotentRetry::builder()
    ///     .max_attempts(3)
    ///     .max_elapsed(Duration::from_secs(10))
    ///     .build();
    /// ```
    pub fn builder() -> IdempotentRetryBuilder {
        IdempotentRetryBuilder(Self::default())
    }
}

impl IdempotentRetryBuilder {
    /// The most attempts per request, the first included (at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.0.max_attempts = n.max(1);
        self
    }

    /// No new attempt starts after this long since the first.
    pub fn max_elapsed(mut self, d: Duration) -> Self {
        self.0.max_elapsed = d;
        self
    }

    /// The backoff before the second attempt; it doubles each time (full
    /// jitter: a random delay between zero and the doubled value).
    pub fn base_delay(mut self, d: Duration) -> Self {
        self.0.base_delay = d;
        self
    }

    /// The longest backoff.
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.0.max_delay = d;
        self
    }

    /// The longest `Retry-After` honoured; longer ones are cut to this.
    pub fn max_retry_after(mut self, d: Duration) -> Self {
        self.0.max_retry_after = d;
        self
    }

    /// How generated keys look.
    pub fn key_kind(mut self, kind: KeyKind) -> Self {
        self.0.key_kind = kind;
        self
    }

    /// The methods that get an `Idempotency-Key` (default `POST`, `PATCH`).
    /// Other methods are retried without one (they are idempotent by
    /// definition, or not yours to guard).
    pub fn keyed_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.0.keyed_methods = methods.into_iter().collect();
        self
    }

    /// The middleware.
    pub fn build(self) -> IdempotentRetry {
        self.0
    }
}

/// Whether an answer is worth another attempt.
pub fn is_retryable_status(status: StatusCode) -> bool {
    match status.as_u16() {
        501 => false,
        500..=599 => true,
        409 | 429 => true,
        _ => false,
    }
}

fn is_retryable_error(e: &reqwest_middleware::Error) -> bool {
    match e {
        reqwest_middleware::Error::Reqwest(e) => e.is_timeout() || e.is_connect() || e.is_request(),
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not honoured).
fn retry_after(response: &Response) -> Option<Duration> {
    let v = response
        .headers()
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// A uniformly random duration in `[0, max]` (full jitter).
fn jitter(max: Duration) -> Duration {
    let r = uuid::Uuid::new_v4().as_u64_pair().0;
    let fraction = (r >> 11) as f64 / (1u64 << 53) as f64;
    max.mul_f64(fraction)
}

impl IdempotentRetry {
    fn backoff(&self, retry: u32) -> Duration {
        let exp = self.base_delay.saturating_mul(1u32 << retry.min(20));
        jitter(exp.min(self.max_delay))
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response> {
        let key = if self.keyed_methods.contains(req.method()) {
            let existing = req
                .headers()
                .get(IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let key = match (existing, extensions.get::<IntentKey>()) {
                (Some(k), _) => k,
                (None, Some(k)) => k.0.clone(),
                (None, None) => match self.key_kind {
                    KeyKind::V4 => IntentKey::random().0,
                    KeyKind::V7 => IntentKey::time_ordered().0,
                },
            };
            let value = HeaderValue::from_str(&key).map_err(|e| {
                reqwest_middleware::Error::Middleware(anyhow::Error::msg(format!(
                    "invalid Idempotency-Key {key:?}: {e}"
                )))
            })?;
            req.headers_mut().insert(IDEMPOTENCY_KEY, value);
            Some(key)
        } else {
            None
        };

        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let finish = |result: Result<Response>, attempts: u32| {
                result.map(|mut r| {
                    let replayed = r
                        .headers()
                        .get("idempotent-replayed")
                        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                    r.extensions_mut().insert(RetryOutcome {
                        attempts,
                        replayed,
                        idempotency_key: key.clone(),
                    });
                    r
                })
            };
            // The last attempt, or a body that cannot be cloned (a stream),
            // sends the request itself: no retry after it.
            let copy = if attempts < self.max_attempts {
                req.try_clone()
            } else {
                None
            };
            let Some(copy) = copy else {
                return finish(next.run(req, extensions).await, attempts);
            };
            let result = next.clone().run(copy, extensions).await;
            let pause = match &result {
                Ok(r) if is_retryable_status(r.status()) => {
                    Some(match (r.status().as_u16(), retry_after(r)) {
                        (409 | 429 | 503, Some(after)) => after.min(self.max_retry_after),
                        _ => self.backoff(attempts - 1),
                    })
                }
                Ok(_) => None,
                Err(e) if is_retryable_error(e) => Some(self.backoff(attempts - 1)),
                Err(_) => None,
            };
            match pause {
                Some(pause) if started.elapsed() + pause <= self.max_elapsed => {
                    debug!(attempt = attempts, ?pause, key = ?key, "retrying");
                    tokio::time::sleep(pause).await;
                }
                _ => return finish(result, attempts),
            }
        }
    }
}
