//! The client half: a tower layer for tonic channels that keeps **one
//! `idempotency-key` per intent** across every retry, knows which statuses
//! to retry, and rides out a few seconds of outage.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use idem_core::{Backoff, BoxFuture};
use tonic::{body::Body, Code};
use tower::{Layer, Service, ServiceExt};
use tracing::debug;

use crate::answer::{code_of, Buffered, IDEMPOTENT_REPLAYED, RETRY_PUSHBACK};
use crate::handle::IDEMPOTENCY_KEY;

/// A boxed error, as tonic's clients take it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The key of one intent (one logical call, whatever its retries), chosen
/// by the caller and put in the request's extensions
/// (`request.extensions_mut().insert(IntentKey::new(..))`). Without one,
/// and without `idempotency-key` metadata, the layer generates a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentKey(String);

impl IntentKey {
    /// A key from the caller: 1 to 255 visible ASCII characters.
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What the retries came to, in the extensions of the answer given back
/// (`response.extensions().get::<RetryOutcome>()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOutcome {
    /// How many times the call was sent.
    pub attempts: u32,
    /// The key every attempt carried.
    pub key: String,
    /// Whether the answer was a replay of the first one.
    pub replayed: bool,
}

/// Why the layer gave up on a call that never got an answer: every attempt
/// failed in transport. (A call that got an answer, even an error status,
/// gives it back as it came.)
#[derive(Debug, thiserror::Error)]
#[error("gave up after {attempts} attempt(s) in {elapsed:?} under idempotency-key {key:?}: {last}")]
pub struct RetryError {
    /// How many times the call was sent.
    pub attempts: u32,
    /// The key every attempt carried: retry later with it to get the
    /// first answer rather than run the call again.
    pub key: String,
    /// How long it tried.
    pub elapsed: Duration,
    /// The last attempt's transport error.
    #[source]
    pub last: BoxError,
}

/// How the layer retries.
#[derive(Debug, Clone)]
struct Config {
    methods: HashSet<String>,
    max_attempts: u32,
    max_elapsed: Duration,
    base_delay: Duration,
    max_delay: Duration,
    max_pushback: Duration,
}

/// A tower [`Layer`] for tonic channels: each call to a chosen unary
/// method is sent with one `idempotency-key` (yours, or a random UUID) and
/// retried under that same key until it gets an answer worth keeping, or
/// the budget runs out.
///
/// Retried: transport errors (refused, reset, closed before the answer),
/// `UNAVAILABLE`, `ABORTED` (the first attempt is still in flight; the
/// server's `grpc-retry-pushback-ms` says when to come back),
/// `RESOURCE_EXHAUSTED`, `INTERNAL`, `UNKNOWN`, `DEADLINE_EXCEEDED` and
/// `CANCELLED` (a tonic server's own time limit ends a call so while its
/// handler goes on). Each of these runs the call again if the server let
/// its key go (as it does for the statuses it does not store). Never any
/// other status: the call itself is wrong (`INVALID_ARGUMENT`,
/// `FAILED_PRECONDITION` for a key reused with another message,
/// `NOT_FOUND`, ...), and sending it again cannot help. Nor a replayed
/// answer (`idempotent-replayed: true`), whatever its status: it is the
/// first answer, stored, and stays so.
///
/// The defaults keep trying for 35 s (longer than idem's default 30 s
/// lease, so a key whose holder crashed is taken over within the budget),
/// backing off from 100 ms to 2 s with jitter, honouring a pushback of at
/// most 5 s.
///
/// ```
/// use std::time::Duration;
/// use idem_tonic::IdempotentRetryLayer;
///
/// let layer = IdempotentRetryLayer::builder()
///     .method("/shop.v1.Payments/CreatePayment")
///     .max_elapsed(Duration::from_secs(10))
///     .build();
/// // let channel = tower::ServiceBuilder::new().layer(layer).service(channel);
/// // let mut client = PaymentsClient::new(channel);
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentRetryLayer {
    config: Arc<Config>,
}

/// Builds an [`IdempotentRetryLayer`].
#[derive(Debug, Clone)]
pub struct IdempotentRetryBuilder(Config);

impl IdempotentRetryLayer {
    /// A builder with the defaults, guarding no method until told which.
    pub fn builder() -> IdempotentRetryBuilder {
        IdempotentRetryBuilder(Config {
            methods: HashSet::new(),
            max_attempts: 100,
            max_elapsed: Duration::from_secs(35),
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            max_pushback: Duration::from_secs(5),
        })
    }
}

impl IdempotentRetryBuilder {
    /// Keys and retries calls to the unary method at `path`
    /// (`/package.Service/Method`). Other calls pass through untouched:
    /// a streaming call is never buffered or sent twice.
    pub fn method(mut self, path: impl Into<String>) -> Self {
        self.0.methods.insert(path.into());
        self
    }

    /// At most this many attempts (default 100; at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.0.max_attempts = n.max(1);
        self
    }

    /// Gives up once this much time has passed since the first attempt
    /// (default 35 s), or the call's own deadline (`grpc-timeout`, as
    /// `Request::set_timeout` sets it) has, whichever comes first; no wait
    /// runs past it, and each retry is sent with the deadline's time left.
    pub fn max_elapsed(mut self, d: Duration) -> Self {
        self.0.max_elapsed = d;
        self
    }

    /// The shortest backoff wait (default 100 ms).
    pub fn base_delay(mut self, d: Duration) -> Self {
        self.0.base_delay = d;
        self
    }

    /// The longest backoff wait (default 2 s).
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.0.max_delay = d;
        self
    }

    /// The longest server pushback honoured (default 5 s); a longer one is
    /// cut to it.
    pub fn max_pushback(mut self, d: Duration) -> Self {
        self.0.max_pushback = d;
        self
    }

    /// The layer.
    pub fn build(self) -> IdempotentRetryLayer {
        IdempotentRetryLayer {
            config: Arc::new(self.0),
        }
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`IdempotentRetryLayer`].
#[derive(Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for IdempotentRetry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentRetry")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Whether a call that ended with `code` is sent again
/// (`RESOURCE_EXHAUSTED` only when the answer names a pushback,
/// `grpc-retry-pushback-ms`: without one it is a limit the same message
/// meets again, such as its size). `CANCELLED` is how a tonic server's own
/// time limit (`Server::timeout`) ends a call whose handler may go on: sent
/// again under its key, it finds that handler in flight, then its answer.
pub fn is_retryable_code(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Internal
            | Code::Unknown
            | Code::DeadlineExceeded
            | Code::Cancelled
    )
}

impl<S, B> Service<Request<Body>> for IdempotentRetry<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Response<Body>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.methods.contains(request.uri().path()) {
            let call = inner.call(request);
            return Box::pin(async move { Ok(call.await.map_err(Into::into)?.map(Body::new)) });
        }
        Box::pin(send_with_retries(self.config.clone(), inner, request))
    }
}

/// Sends one intent, as many times as it takes.
async fn send_with_retries<S, B>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, BoxError>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let key = key_for(&mut parts)?;
    let body = body.collect().await?.to_bytes();
    let started = Instant::now();
    // The caller's deadline bounds the retries too, and each attempt is
    // sent with the time left of it.
    let deadline = grpc_timeout(&parts.headers).map(|timeout| started + timeout);
    let mut backoff = Backoff::new(config.base_delay, config.max_delay);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut attempt = copy(&parts, body.clone());
        if let Some(deadline) = deadline.filter(|_| attempts > 1) {
            let left = deadline.saturating_duration_since(Instant::now());
            attempt
                .headers_mut()
                .insert(GRPC_TIMEOUT, grpc_timeout_value(left));
        }
        let sent = match inner.ready().await {
            Ok(ready) => ready.call(attempt).await,
            Err(e) => Err(e),
        };
        let (wait, last) = match sent.map_err(Into::into) {
            Ok(response) => {
                let (head, body) = response.into_parts();
                match body.collect().await.map_err(Into::into) {
                    Ok(collected) => {
                        let trailers = collected.trailers().cloned();
                        let code = code_of(head.status, &head.headers, trailers.as_ref());
                        let pushback = pushback(&head.headers, trailers.as_ref());
                        let mut response = Response::from_parts(
                            head,
                            Body::new(Buffered::new(collected.to_bytes(), trailers)),
                        );
                        let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
                        response.extensions_mut().insert(RetryOutcome {
                            attempts,
                            key: key.clone(),
                            replayed,
                        });
                        // A replay is the first answer, and will stay so:
                        // sending it again cannot change it. Nor can a
                        // `RESOURCE_EXHAUSTED` that names no time to come
                        // back (a message over the server's limit, as
                        // servers say it): only one with a pushback (a
                        // rate limit) is worth sending again.
                        // A pushback that is negative or unreadable says
                        // not to come back (gRPC's retry design, A6).
                        let exhausted_for_good =
                            code == Code::ResourceExhausted && matches!(pushback, Pushback::None);
                        let told_to_stop = matches!(pushback, Pushback::Stop);
                        if replayed
                            || !is_retryable_code(code)
                            || exhausted_for_good
                            || told_to_stop
                        {
                            return Ok(response);
                        }
                        debug!(?code, attempts, "retrying under the same key");
                        (pushback.after(), Last::Answer(response))
                    }
                    Err(e) => (None, Last::Error(e)),
                }
            }
            Err(e) => {
                debug!(error = %e, attempts, "transport error; retrying under the same key");
                (None, Last::Error(e))
            }
        };
        let wait = match wait {
            Some(pushback) => pushback.min(config.max_pushback).max(config.base_delay),
            None => backoff.next_wait(),
        };
        let elapsed = started.elapsed();
        let mut left = config.max_elapsed.saturating_sub(elapsed);
        if let Some(deadline) = deadline {
            left = left.min(deadline.saturating_duration_since(Instant::now()));
        }
        if attempts >= config.max_attempts || left.is_zero() || wait > left {
            return match last {
                Last::Answer(response) => Ok(response),
                Last::Error(last) => Err(Box::new(RetryError {
                    attempts,
                    key,
                    elapsed,
                    last,
                })),
            };
        }
        tokio::time::sleep(wait).await;
    }
}

/// The last attempt's result, given back when the layer stops.
enum Last {
    Answer(Response<Body>),
    Error(BoxError),
}

/// The intent's key: the metadata the caller set, or its [`IntentKey`],
/// or a new random one; set as the call's metadata.
fn key_for(parts: &mut http::request::Parts) -> Result<String, BoxError> {
    if let Some(v) = parts.headers.get(IDEMPOTENCY_KEY) {
        return Ok(v.to_str()?.to_owned());
    }
    let key = match parts.extensions.get::<IntentKey>() {
        Some(k) => k.0.clone(),
        None => uuid::Uuid::new_v4().to_string(),
    };
    parts
        .headers
        .insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&key)?);
    Ok(key)
}

/// One attempt: the same head, the same message.
fn copy(parts: &http::request::Parts, body: Bytes) -> Request<Body> {
    let mut request = Request::new(Body::new(Full::new(body)));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    request
}

/// The header of a call's deadline.
const GRPC_TIMEOUT: &str = "grpc-timeout";

/// The caller's `grpc-timeout` (up to 8 digits and a unit: `H M S m u n`),
/// if it set a valid one.
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(GRPC_TIMEOUT)?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `left` as a `grpc-timeout` value, in the finest unit that fits 8 digits.
fn grpc_timeout_value(left: Duration) -> HeaderValue {
    let micros = left.as_micros();
    let value = if micros < 100_000_000 {
        format!("{micros}u")
    } else if left.as_millis() < 100_000_000 {
        format!("{}m", left.as_millis())
    } else {
        format!("{}S", left.as_secs().min(99_999_999))
    };
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("0u"))
}

/// What the server's `grpc-retry-pushback-ms` says.
#[derive(Debug, PartialEq, Eq)]
enum Pushback {
    /// It sent none.
    None,
    /// Come back after this long.
    After(Duration),
    /// A negative or unreadable value: do not come back.
    Stop,
}

impl Pushback {
    fn after(&self) -> Option<Duration> {
        match self {
            Self::After(d) => Some(*d),
            Self::None | Self::Stop => None,
        }
    }
}

/// The server's `grpc-retry-pushback-ms` (its trailers' first).
fn pushback(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Pushback {
    let Some(value) = trailers
        .and_then(|t| t.get(RETRY_PUSHBACK))
        .or_else(|| headers.get(RETRY_PUSHBACK))
    else {
        return Pushback::None;
    };
    match value.to_str().ok().and_then(|v| v.parse::<u64>().ok()) {
        Some(ms) => Pushback::After(Duration::from_millis(ms)),
        None => Pushback::Stop,
    }
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    #[test]
    fn a_pushback_read_as_grpc_says() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(RETRY_PUSHBACK, HeaderValue::from_str(v).unwrap());
            pushback(&h, None)
        };
        assert_eq!(pushback(&HeaderMap::new(), None), Pushback::None);
        assert_eq!(with("250"), Pushback::After(Duration::from_millis(250)));
        assert_eq!(with("-1"), Pushback::Stop);
        assert_eq!(with("soon"), Pushback::Stop);
    }

    #[test]
    fn grpc_timeouts_read_and_written() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(GRPC_TIMEOUT, HeaderValue::from_str(v).unwrap());
            grpc_timeout(&h)
        };
        assert_eq!(with("2S"), Some(Duration::from_secs(2)));
        assert_eq!(with("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(with("3M"), Some(Duration::from_secs(180)));
        assert_eq!(with("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(with("250u"), Some(Duration::from_micros(250)));
        assert_eq!(with("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "S", "123456789S", "1x", "-1S", "1.5S"] {
            assert_eq!(with(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout_value(Duration::from_millis(1500)), "1500000u");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200)), "200000m");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        for d in [
            Duration::ZERO,
            Duration::from_millis(7),
            Duration::from_secs(99_999),
        ] {
            let v = grpc_timeout_value(d);
            let mut h = HeaderMap::new();
            h.insert(GRPC_TIMEOUT, v);
            let back = grpc_timeout(&h).unwrap();
            assert!(
                back <= d && d - back < Duration::from_secs(1),
                "{d:?} {back:?}"
            );
        }
    }
}
