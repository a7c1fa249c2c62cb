//! What the middleware returns when it gives up.

use std::fmt;
use std::time::Duration;

use http::StatusCode;
use reqwest::Response;

use crate::{RetryOutcome, RetryOutcomeExt};

/// The error [`IdempotentRetry`](crate::IdempotentRetry) returns when a send
/// ends without a final answer: retries exhausted (by attempts or by time), a
/// failure that is not worth retrying, or a key that cannot be sent. It says
/// how many attempts were made, under which `Idempotency-Key`, for how long,
/// and what the last one got.
///
/// It travels as [`reqwest_middleware::Error::Middleware`]; get it back with
/// [`RetryErrorExt::retry_error`] (a reference), [`RetryError::try_from`]
/// (owned, for [`RetryError::into_response`]), or by hand:
///
/// ```
/// # fn f(err: reqwest_middleware::Error) {
/// use idem_client::RetryError;
/// if let reqwest_middleware::Error::Middleware(e) = &err {
///     if let Some(failed) = e.downcast_ref::<RetryError>() {
///         eprintln!("{} attempt(s) under {:?}", failed.attempts(), failed.idempotency_key());
///     }
/// }
/// # }
/// ```
///
/// Its `Display` names the attempts, the key, the time and why it stopped;
/// the last failure is its [`source`](std::error::Error::source), so print
/// the whole chain (`{:#}` on an `anyhow::Error`, or walk `source()`) to see
/// the transport error or the last status.
#[derive(Debug, thiserror::Error)]
#[error(
    "gave up after {attempts} attempt(s) in {elapsed:.1?} {key} ({reason})",
    key = KeyLabel(self.idempotency_key.as_deref())
)]
pub struct RetryError {
    attempts: u32,
    idempotency_key: Option<String>,
    elapsed: Duration,
    reason: StopReason,
    #[source]
    last: LastFailure,
}

/// Why the middleware stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The last allowed attempt failed
    /// ([`max_attempts`](crate::IdempotentRetryBuilder::max_attempts)).
    AttemptsExhausted,
    /// The time budget
    /// ([`max_elapsed`](crate::IdempotentRetryBuilder::max_elapsed)) was
    /// spent.
    BudgetExhausted,
    /// The server's `Retry-After` (cut to
    /// [`max_retry_after`](crate::IdempotentRetryBuilder::max_retry_after))
    /// ends after the time budget: it would be answered the same, so the
    /// middleware stops at once instead of sleeping.
    RetryAfterBeyondBudget,
    /// The failure is not one sending again can fix: a transport error
    /// other than a connection failure or time-out (a redirect loop, an
    /// invalid URL, ...), or an error from a middleware further down.
    NotRetryable,
    /// The request body is a stream, which cannot be sent twice: it was
    /// sent once.
    BodyNotCloneable,
    /// The `Idempotency-Key` is not a valid key (not 1 to 255 visible
    /// ASCII characters), or the request names two different ones:
    /// nothing was sent.
    InvalidKey,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::AttemptsExhausted => "attempts exhausted",
            Self::BudgetExhausted => "time budget spent",
            Self::RetryAfterBeyondBudget => {
                "time budget spent: the server's Retry-After would end past it"
            }
            Self::NotRetryable => "not retryable",
            Self::BodyNotCloneable => "streamed body, sent once",
            Self::InvalidKey => "invalid Idempotency-Key, nothing sent",
        })
    }
}

/// What the last attempt got.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LastFailure {
    /// No answer: connection refused or reset, time-out, or another error
    /// from reqwest or a middleware further down.
    #[error(transparent)]
    Transport(reqwest_middleware::Error),
    /// An answer the middleware retries (`409`, `429`, `5xx` but `501`),
    /// kept whole, its [`RetryOutcome`] in its extensions.
    #[error("last answer {}", .0.status())]
    Status(Box<Response>),
    /// The key could not be made a header value.
    #[error(transparent)]
    InvalidKey(http::header::InvalidHeaderValue),
    /// The key is not 1 to 255 visible ASCII characters (which the server
    /// would refuse with `400`): nothing was sent.
    #[error("an Idempotency-Key is 1 to 255 visible ASCII characters")]
    KeyNotVisibleAscii,
    /// The request names two different keys (the `Idempotency-Key` header
    /// twice, or the header and an [`IntentKey`](crate::IntentKey) that
    /// differs from it): which one is the intent's cannot be told, so
    /// nothing was sent. The key reported is the header's first; this is
    /// the other.
    #[error("the request names two Idempotency-Keys; the other is {0:?}")]
    KeysDisagree(String),
}

struct KeyLabel<'a>(Option<&'a str>);

impl fmt::Display for KeyLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(key) => write!(f, "under Idempotency-Key {key:?}"),
            None => f.write_str("without an Idempotency-Key"),
        }
    }
}

impl RetryError {
    pub(crate) fn new(
        attempts: u32,
        idempotency_key: Option<String>,
        elapsed: Duration,
        reason: StopReason,
        last: LastFailure,
    ) -> Self {
        Self {
            attempts,
            idempotency_key,
            elapsed,
            reason,
            last,
        }
    }

    /// How many attempts were sent, the last included (`0` when nothing
    /// was sent).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The `Idempotency-Key` every attempt carried: the caller's, or one
    /// generated for a keyed method; `None` for a request sent without one.
    /// With [`StopReason::InvalidKey`] it is the key refused (nothing was
    /// sent).
    pub fn idempotency_key(&self) -> Option<&str> {
        self.idempotency_key.as_deref()
    }

    /// The time from the first attempt's start to giving up.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// Why the middleware stopped.
    pub fn reason(&self) -> StopReason {
        self.reason
    }

    /// What the last attempt got.
    pub fn last(&self) -> &LastFailure {
        &self.last
    }

    /// The status of the last answer, when the last attempt got one.
    pub fn status(&self) -> Option<StatusCode> {
        self.response().map(Response::status)
    }

    /// The last answer, when the last attempt got one.
    pub fn response(&self) -> Option<&Response> {
        match &self.last {
            LastFailure::Status(r) => Some(r),
            _ => None,
        }
    }

    /// The last answer, to read its body (a problem document, say).
    pub fn into_response(self) -> Option<Response> {
        match self.last {
            LastFailure::Status(r) => Some(*r),
            _ => None,
        }
    }

    /// The last transport error, when the last attempt got no answer
    /// (`is_connect()`, `is_timeout()` tell which).
    pub fn transport_error(&self) -> Option<&reqwest_middleware::Error> {
        match &self.last {
            LastFailure::Transport(e) => Some(e),
            _ => None,
        }
    }

    /// The same account a successful response carries in its extensions:
    /// attempts, key, and whether the last answer said it was a replay.
    pub fn outcome(&self) -> RetryOutcome {
        match self.response().and_then(|r| r.retry_outcome()) {
            Some(outcome) => outcome.clone(),
            None => RetryOutcome {
                attempts: self.attempts,
                replayed: false,
                idempotency_key: self.idempotency_key.clone(),
            },
        }
    }
}

impl From<RetryError> for reqwest_middleware::Error {
    /// [`reqwest_middleware::Error::Middleware`], from which
    /// `downcast_ref::<RetryError>()` gets it back.
    fn from(e: RetryError) -> Self {
        reqwest_middleware::Error::Middleware(anyhow::Error::new(e))
    }
}

impl TryFrom<reqwest_middleware::Error> for RetryError {
    type Error = reqwest_middleware::Error;

    /// The [`RetryError`] inside, or the error as it was if it holds none.
    fn try_from(e: reqwest_middleware::Error) -> Result<Self, Self::Error> {
        match e {
            reqwest_middleware::Error::Middleware(e) => e
                .downcast::<RetryError>()
                .map_err(reqwest_middleware::Error::Middleware),
            other => Err(other),
        }
    }
}

/// Finds the [`RetryError`] in the error a [`reqwest_middleware`] client
/// returned.
pub trait RetryErrorExt {
    /// The [`RetryError`], if the error came from
    /// [`IdempotentRetry`](crate::IdempotentRetry).
    fn retry_error(&self) -> Option<&RetryError>;
}

impl RetryErrorExt for reqwest_middleware::Error {
    fn retry_error(&self) -> Option<&RetryError> {
        match self {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<RetryError>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_travels_through_anyhow() {
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<RetryError>();

        let e = RetryError::new(
            3,
            Some("k-1".into()),
            Duration::from_millis(1500),
            StopReason::AttemptsExhausted,
            LastFailure::Transport(reqwest_middleware::Error::Middleware(anyhow::anyhow!(
                "boom"
            ))),
        );
        assert_eq!(
            e.to_string(),
            r#"gave up after 3 attempt(s) in 1.5s under Idempotency-Key "k-1" (attempts exhausted)"#
        );
        let err: reqwest_middleware::Error = e.into();
        let found = err.retry_error().map(|e| (e.attempts(), e.outcome()));
        assert_eq!(
            found,
            Some((
                3,
                RetryOutcome {
                    attempts: 3,
                    replayed: false,
                    idempotency_key: Some("k-1".into())
                }
            ))
        );
        assert_eq!(
            format!("{:#}", anyhow::Error::new(err))
                .matches("boom")
                .count(),
            1
        );
    }
}
