//! The client half of idempotency: a [`reqwest_middleware`] middleware that
//! keeps **one `Idempotency-Key` per intent** across every retry, knows
//! which answers to retry, and rides out a few seconds of outage.
//!
//! ```
//! use std::time::Duration;
//! use idem_client::{IdempotentRetry, IntentKey, RetryErrorExt, RetryOutcomeExt};
//! use reqwest_middleware::ClientBuilder;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # // an address nothing listens on: every attempt is refused
//! # let url = {
//! #     let l = std::net::TcpListener::bind("127.0.0.1:0")?;
//! #     format!("http://{}/payments", l.local_addr()?)
//! # };
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     // `IdempotentRetry::default()` keeps trying for 35 s; this gives up sooner
//!     .with(IdempotentRetry::builder().max_elapsed(Duration::from_millis(300)).build())
//!     .build();
//! let sent = client
//!     .post(&url)
//!     .bearer_auth("client-1")
//!     .header("content-type", "application/json")
//!     .body(r#"{"account_id":"acc_1","amount":1000,"currency":"EUR"}"#)
//!     // one key for this intent; omit it and one is generated (UUID v4)
//!     .with_extension(IntentKey::new("order-42-payment"))
//!     // each attempt's own time limit
//!     .timeout(Duration::from_secs(2))
//!     .send()
//!     .await;
//! match sent {
//!     // a final answer: a success, or an error retrying cannot fix (400, 404, 422, ...)
//!     Ok(response) => {
//!         if let Some(outcome) = response.retry_outcome() {
//!             println!("{} after {} attempt(s), replayed: {}",
//!                 response.status(), outcome.attempts, outcome.replayed);
//!         }
//!     }
//!     // given up: how many attempts, under which key, and what the last one got
//!     Err(err) => {
//!         let failed = err.retry_error().ok_or("not from IdempotentRetry")?;
//!         assert_eq!(failed.idempotency_key(), Some("order-42-payment"));
//!         assert!(failed.transport_error().is_some_and(|e| e.is_connect()));
//!         // gave up after 3 attempt(s) in 300.4ms under Idempotency-Key
//!         // "order-42-payment" (time budget spent): error sending request for
//!         // url (...): client error (Connect): tcp connect error: Connection refused
//!         eprintln!("{:#}", anyhow::Error::new(err));
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # What is retried
//!
//! Connection errors (refused, reset, closed before the answer) and
//! time-outs; `5xx` except `501 Not Implemented`; `409 Conflict` with
//! `Retry-After` (the original is still in flight: idem always says when
//! to come back); `429 Too Many Requests`. Never an answer the server
//! replayed (`Idempotent-Replayed: true`), whatever its status: it is the
//! handler's own stored answer and comes back the same every time. Never a
//! `409` without `Retry-After` (the handler's own conflict, the request's
//! outcome), `400`, `401`, `403`, `404`, `422` or any other `4xx`: the
//! request itself is wrong, and sending it again cannot help.
//!
//! # One key per intent
//!
//! The key is the caller's (an `Idempotency-Key` header, or an
//! [`IntentKey`] extension), or one generated before the first attempt and
//! sent on every attempt. It is left in the request's extensions as its
//! [`IntentKey`], so a retry layer outside this one (put this middleware
//! outermost all the same) sends the request again under the same key. A
//! request that names two different keys (the header twice, or the header
//! and an `IntentKey` that differs) is refused with nothing sent
//! ([`StopReason::InvalidKey`], [`LastFailure::KeysDisagree`]).
//!
//! # How long
//!
//! The defaults ([`IdempotentRetry::default`]) keep trying for **35 s**
//! (at most 100 attempts): longer than idem's default lease (30 s), so a
//! key whose holder crashed is taken over within the budget, and a server
//! restarting or a load balancer failing over within it is ridden out:
//!
//! - between attempts, exponential backoff with decorrelated jitter: each
//!   wait drawn from `[100 ms, 3 × the previous wait]`, never over **2 s**;
//! - on `409`, `429` and `503`, the server's `Retry-After` (seconds or an
//!   HTTP-date) instead, cut to at most **5 s** (and at least the base
//!   delay); if that wait would end after the 35 s budget, the middleware
//!   gives up at once rather than retry before the server asked;
//! - a backoff wait is shortened to end with the budget, so the last
//!   attempt starts at the latest as the budget ends, and no sleep runs past
//!   it.
//!
//! All of it is configurable with [`IdempotentRetry::builder`].
//!
//! # What comes back
//!
//! `Ok(response)` is a final answer (a success, or a status not worth
//! retrying), with a [`RetryOutcome`] in its extensions
//! ([`RetryOutcomeExt::retry_outcome`]). Everything else is an `Err` holding
//! a [`RetryError`] (as [`reqwest_middleware::Error::Middleware`]; get it
//! with [`RetryErrorExt::retry_error`]): attempts, key, elapsed time, why it
//! stopped, and the last failure, either the transport error or the last
//! answer itself ([`RetryError::into_response`]), which carries its
//! [`RetryOutcome`] too.
//!
//! Requests whose body cannot be cloned (streams) are sent once. So is a
//! request that carries no key and whose method is not idempotent (a `POST`
//! or `PATCH` outside [`IdempotentRetryBuilder::keyed_methods`]): it is
//! passed through as it is, its answer `Ok` whatever its status, and a
//! transport error as reqwest's own (no [`RetryError`]).

use std::time::{Duration, SystemTime};

use http::{HeaderName, Method, StatusCode};
use reqwest::Response;

mod error;
mod retry;
mod wait;

pub use error::{LastFailure, RetryError, RetryErrorExt, StopReason};

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
/// [`RetryOutcomeExt::retry_outcome`]); when the middleware gives up, the
/// same account is [`RetryError::outcome`], and the last answer, if any,
/// carries it too.
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
    /// Rides out a crashed holder's whole lease (idem's default lease is
    /// 30 s, during which a retry gets `409`) and about as long an
    /// outage: at most 100 attempts within 35 s; backoff with decorrelated
    /// jitter from 100 ms, each wait at most 2 s; `Retry-After` honoured up
    /// to 5 s; UUID v4 keys on `POST` and `PATCH`.
    fn default() -> Self {
        Self {
            max_attempts: 100,
            max_elapsed: Duration::from_secs(35),
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            max_retry_after: Duration::from_secs(5),
            key_kind: KeyKind::V4,
            keyed_methods: vec![Method::POST, Method::PATCH],
        }
    }
}

/// Builds an [`IdempotentRetry`].
#[derive(Debug, Clone)]
pub struct IdempotentRetryBuilder(IdempotentRetry);

impl IdempotentRetry {
    /// A builder starting from the defaults (see [`IdempotentRetry::default`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// let retry = idem_client::IdempotentRetry::builder()
    ///     .max_attempts(3)
    ///     .max_elapsed(Duration::from_secs(20))
    ///     .build();
    /// ```
    pub fn builder() -> IdempotentRetryBuilder {
        IdempotentRetryBuilder(Self::default())
    }
}

impl IdempotentRetryBuilder {
    /// The most attempts per request, the first included (at least 1;
    /// default 100). Every backoff wait is at least
    /// [`base_delay`](Self::base_delay), so with the defaults 100 attempts
    /// span at least 9.9 s whatever the jitter draws; in practice the time
    /// budget ends the retries first (35 s of refused connections take
    /// about 20 to 40 attempts).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.0.max_attempts = n.max(1);
        self
    }

    /// The time budget (default 35 s: more than idem's default 30 s lease),
    /// from the first attempt's start: no
    /// attempt starts after it and no wait runs past it. A backoff wait that
    /// would is shortened to end with it; a `Retry-After` that would makes
    /// the middleware give up at once
    /// ([`StopReason::RetryAfterBeyondBudget`]). An attempt already under
    /// way is not cut: bound each with `RequestBuilder::timeout`.
    pub fn max_elapsed(mut self, d: Duration) -> Self {
        self.0.max_elapsed = d;
        self
    }

    /// The shortest backoff wait (default 100 ms): each wait is drawn
    /// uniformly from `[base_delay, 3 × the previous wait]` (decorrelated
    /// jitter; the first from `[base_delay, 3 × base_delay]`), then cut to
    /// [`max_delay`](Self::max_delay). Also the least a `Retry-After` makes
    /// the middleware wait.
    pub fn base_delay(mut self, d: Duration) -> Self {
        self.0.base_delay = d;
        self
    }

    /// The longest backoff wait (default 2 s).
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.0.max_delay = d;
        self
    }

    /// The longest `Retry-After` honoured (default 5 s); a longer one is cut
    /// to this, and the next attempt comes sooner than the server asked.
    pub fn max_retry_after(mut self, d: Duration) -> Self {
        self.0.max_retry_after = d;
        self
    }

    /// How generated keys look (default [`KeyKind::V4`]).
    pub fn key_kind(mut self, kind: KeyKind) -> Self {
        self.0.key_kind = kind;
        self
    }

    /// The methods that get an `Idempotency-Key` (default `POST`, `PATCH`).
    /// A request of another method gets one only when the caller gave it
    /// (the header, or an [`IntentKey`]); without one it is retried only if
    /// its method is idempotent by definition (`GET`, `HEAD`, `PUT`,
    /// `DELETE`, `OPTIONS`, `TRACE`): any other is sent once, its answer
    /// passed on as it is, since a retry without a key could apply it
    /// twice.
    pub fn keyed_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.0.keyed_methods = methods.into_iter().collect();
        self
    }

    /// The middleware.
    pub fn build(self) -> IdempotentRetry {
        self.0
    }
}

/// Whether an answer's status is worth another attempt: `409`, `429`, and
/// `5xx` except `501`. The middleware also asks a `409` to say when to come
/// back (`Retry-After`, which idem's "still in flight" always carries): one
/// without it is the handler's own conflict, the request's outcome, and is
/// returned at once.
pub fn is_retryable_status(status: StatusCode) -> bool {
    match status.as_u16() {
        501 => false,
        500..=599 => true,
        409 | 429 => true,
        _ => false,
    }
}

/// Whether a transport error is worth another attempt: the connection could
/// not be made (refused, unreachable), broke before the answer (reset,
/// closed), or timed out.
fn is_retryable_error(e: &reqwest_middleware::Error) -> bool {
    match e {
        reqwest_middleware::Error::Reqwest(e) => e.is_timeout() || e.is_connect() || e.is_request(),
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

/// The statuses whose `Retry-After` is honoured.
fn honours_retry_after(status: StatusCode) -> bool {
    matches!(status.as_u16(), 409 | 429 | 503)
}

/// What one attempt came to.
enum Verdict {
    /// A final answer.
    Done(Response),
    /// Worth another attempt, after the server's `Retry-After` if it gave
    /// one.
    Retry(LastFailure, Option<Duration>),
    /// Not worth another attempt.
    Fail(LastFailure),
}

fn judge(result: reqwest_middleware::Result<Response>) -> Verdict {
    match result {
        // A stored answer replayed (`Idempotent-Replayed: true`): the same
        // key gets it again on every attempt, whatever its status. A `409`
        // replayed is the handler's own (a state conflict), not "still in
        // flight"; a `429` replayed carries a `Retry-After` long stale.
        Ok(r) if is_replayed(&r) => Verdict::Done(r),
        // A `409` without `Retry-After` is not idem's "still in flight"
        // (which always says when to come back) but the handler's own
        // conflict, answered the first time: the request's outcome. Sent
        // again it is replayed (a round trip for nothing), or, where the
        // server releases 4xx answers, run again until it turns into
        // another answer the caller never chose.
        Ok(r)
            if r.status() == StatusCode::CONFLICT
                && !r.headers().contains_key(http::header::RETRY_AFTER) =>
        {
            Verdict::Done(r)
        }
        Ok(r) if is_retryable_status(r.status()) => {
            let after = if honours_retry_after(r.status()) {
                r.headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| wait::parse_retry_after(v, SystemTime::now()))
            } else {
                None
            };
            Verdict::Retry(LastFailure::Status(Box::new(r)), after)
        }
        Ok(r) => Verdict::Done(r),
        Err(e) if is_retryable_error(&e) => Verdict::Retry(LastFailure::Transport(e), None),
        Err(e) => Verdict::Fail(LastFailure::Transport(e)),
    }
}

/// Whether the server says `r` is a stored answer replayed.
fn is_replayed(r: &Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

fn attach_outcome(r: &mut Response, attempts: u32, key: &Option<String>) {
    let replayed = is_replayed(r);
    r.extensions_mut().insert(RetryOutcome {
        attempts,
        replayed,
        idempotency_key: key.clone(),
    });
}

#[cfg(test)]
mod tests;
