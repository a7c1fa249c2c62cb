//! [`IdempotencyService`]: the middleware itself.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    decide, decision::retry_after, BoxFuture, Claim, ClaimOutcome, ClaimRequest, Decision,
    Fingerprint, IdempotencyKey, KeyError, Policy, Record, RecordState, Situation, Store,
    StoreError, UnixMillis,
};
use tower::Service;
use tracing::{debug, info, warn, Instrument};

use crate::extract::{stored_response, Completion, Idempotency};
use crate::layer::Config;
use crate::pending::PendingClaim;
use crate::problem::Problem;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response future of [`IdempotencyService`].
pub type ResponseFuture<E> = BoxFuture<'static, Result<Response, E>>;

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("policy", &self.config.policy)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was driven to readiness serves this call; a fresh
        // clone stays behind for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if !config.methods.contains(request.method()) {
            let mut inner = inner;
            return Box::pin(inner.call(request));
        }
        Box::pin(handle(config, inner, request))
    }
}

/// Counts one request by how it ended (labels never carry keys or scopes).
pub(crate) fn count(outcome: &'static str) {
    metrics::counter!("idem_requests_total", "outcome" => outcome).increment(1);
}

/// Records how long a store operation took.
pub(crate) fn timed(store: &'static str, op: &'static str, started: std::time::Instant) {
    metrics::histogram!("idem_store_seconds", "store" => store, "op" => op)
        .record(started.elapsed().as_secs_f64());
}

fn rejection(decision: Decision, detail: String) -> Response {
    count(match decision {
        Decision::RejectMissingKey => "missing_key",
        Decision::RejectInvalidKey => "invalid_key",
        _ => "too_large",
    });
    match decision {
        Decision::RejectMissingKey => Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency-key-missing",
            "An Idempotency-Key header is required",
        ),
        Decision::RejectInvalidKey => Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
            "The Idempotency-Key header is invalid",
        ),
        _ => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            "The request body is too large",
        ),
    }
    .detail(detail)
    .into_response()
}

pub(crate) fn store_unavailable(e: &StoreError) -> Response {
    count("store_unavailable");
    warn!(error = %e, source = ?std::error::Error::source(e), "idempotency store unavailable");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "The idempotency store is unavailable",
    )
    .detail("the request was not run; retry it with the same Idempotency-Key")
    .retry_after(1)
    .into_response()
}

fn conflict(retry_after: Duration) -> Response {
    count("conflict");
    Problem::new(
        StatusCode::CONFLICT,
        "idempotency-key-in-use",
        "A request with this Idempotency-Key is still being processed",
    )
    .detail("retry after the time given in Retry-After to get its answer")
    .retry_after(retry_after.as_secs().max(1))
    .into_response()
}

fn mismatch() -> Response {
    count("mismatch");
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
        "This Idempotency-Key was used for a different request",
    )
    .detail("the method, path or body differs from the first request sent with this key; use a new key for a new request")
    .into_response()
}

fn replay(record: &Record) -> Response {
    count("replay");
    let RecordState::Completed {
        response: stored, ..
    } = &record.state
    else {
        return conflict(Duration::from_secs(1));
    };
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.append(n, v);
            }
            _ => warn!(header = %name, "skipping a stored header that is no longer valid"),
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

async fn handle<S>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let policy = &config.policy;
    let (mut parts, body) = request.into_parts();

    let scope = match config.scope.scope(&parts) {
        Ok(scope) => scope,
        Err(refusal) => return Ok(refusal),
    };

    let key = match IdempotencyKey::from_header_values(
        parts
            .headers
            .get_all(IDEMPOTENCY_KEY)
            .iter()
            .map(HeaderValue::as_bytes),
    ) {
        Ok(key) => key,
        Err(KeyError::Missing) => match decide(policy, Situation::KeyMissing) {
            Decision::PassThrough => return inner.call(Request::from_parts(parts, body)).await,
            d => {
                debug!("rejecting a request without Idempotency-Key");
                return Ok(rejection(d, "send an Idempotency-Key header, e.g. a fresh UUID, and keep it across retries of this request".into()));
            }
        },
        Err(e) => {
            debug!(error = %e, "rejecting an invalid Idempotency-Key");
            return Ok(rejection(
                decide(policy, Situation::KeyInvalid(&e)),
                e.to_string(),
            ));
        }
    };

    // Scope and key come from the client: `?` (Debug) quotes and escapes
    // them, so a newline or a `" level=error` cannot forge a log field.
    let span = tracing::info_span!("idempotency", scope = ?scope, key = ?key.as_str());
    async {
        let too_large = || {
            rejection(
                decide(policy, Situation::BodyTooLarge),
                format!("the body must not exceed {} bytes", policy.max_body()),
            )
        };
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        // A client that asked to be told before sending (`Expect:
        // 100-continue`) a body declared too large gets `413` at once: the
        // body is never polled, so hyper never sends `100 Continue`.
        let expects_continue = parts
            .headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if expects_continue && declared.is_some_and(|n| n > policy.max_body() as u64) {
            return Ok(too_large());
        }
        let bytes: Bytes = match read_body(body, policy.max_body(), declared).await {
            Ok(bytes) => bytes,
            Err(BodyError::TooLarge) => return Ok(too_large()),
            Err(BodyError::Unreadable(e)) => {
                return Ok(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "body-unreadable",
                    "The request body could not be read",
                )
                .detail(e)
                .into_response())
            }
        };

        let target = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |p| p.as_str());
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        let fingerprint =
            Fingerprint::of_request(parts.method.as_str(), target, content_type, &bytes);

        let claim_request = ClaimRequest {
            scope,
            key: key.into_string(),
            fingerprint,
            lease: policy.lease(),
            retention: policy.retention(),
        };
        if config.claim_in_handler {
            return run_pending(config.clone(), inner, parts, bytes, claim_request).await;
        }
        let claim = match acquire(&config, &claim_request).await {
            Ok(claim) => claim,
            Err(answer) => return Ok(answer),
        };
        count(if claim.takeover { "takeover" } else { "fresh" });
        if claim.takeover {
            info!(operation_id = %claim.operation_id, "took over an expired or released claim");
        } else {
            debug!(operation_id = %claim.operation_id, "claimed");
        }

        let handle = Idempotency::new(claim.clone(), policy.clone());
        parts.extensions.insert(handle.clone());
        // The handler runs on a task of its own: a client that disconnects
        // (or times out) does not cancel it half-way, so its answer is
        // stored and the client's retry gets the replay. If the task itself
        // is dropped or panics, the guard releases the claim.
        let config = config.clone();
        let run = async move {
            let guard = ReleaseGuard::new(config.store.clone(), claim);
            let result = inner
                .call(Request::from_parts(parts, Body::from(bytes)))
                .await;
            settle_result(&config, &handle, guard, result).await
        };
        match tokio::spawn(run.in_current_span()).await {
            Ok(result) => result,
            Err(e) => Ok(handler_failed(&e)),
        }
    }
    .instrument(span)
    .await
}

/// Runs a handler that claims the key itself, inside its transaction
/// ([`PendingClaim::begin`]), then settles whatever it claimed.
async fn run_pending<S>(
    config: Arc<Config>,
    mut inner: S,
    mut parts: http::request::Parts,
    bytes: Bytes,
    request: ClaimRequest,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let pending = PendingClaim::new(request, config.policy.clone());
    parts.extensions.insert(pending.clone());
    let watched = pending.clone();
    let settle_config = config.clone();
    let run = async move {
        let result = inner
            .call(Request::from_parts(parts, Body::from(bytes)))
            .await;
        // No claim: the handler answered before claiming, or returned what
        // `begin` answered for it (a replay, 409, 422); nothing to settle.
        let Some(handle) = pending.claimed() else {
            return result;
        };
        if handle.completion() == Completion::ByLayer
            && result.as_ref().is_ok_and(|r| !r.status().is_server_error())
        {
            // Its transaction ended without completing the record: until the
            // layer completes it below, the claim looks abandoned, and a
            // duplicate arriving now would run again.
            count("completed_outside_transaction");
            warn!("the handler answered without completing its record in its transaction (Idempotency::complete_in); the layer completes it now");
        }
        let guard = ReleaseGuard::new(settle_config.store.clone(), handle.claim().clone());
        settle_result(&settle_config, &handle, guard, result).await
    };
    match tokio::spawn(run.in_current_span()).await {
        Ok(result) => result,
        Err(e) => {
            // The handler's transaction rolled back with it; a claim it had
            // committed is released.
            if let Some(handle) = watched.claimed() {
                release(&*config.store, handle.claim()).await;
            }
            Ok(handler_failed(&e))
        }
    }
}

fn handler_failed(e: &tokio::task::JoinError) -> Response {
    count("released");
    warn!(
        panicked = e.is_panic(),
        "the handler did not finish; its claim was released"
    );
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        "The request failed",
    )
    .detail("retry with the same Idempotency-Key")
    .into_response()
}

enum BodyError {
    TooLarge,
    Unreadable(String),
}

/// How much of an oversized body is read and thrown away before answering
/// `413`, so that a client still sending it reads the answer instead of a
/// broken pipe; beyond it (or after a few seconds) the connection is cut.
const DRAIN_LIMIT: u64 = 32 * 1024 * 1024;

/// Reads the body up to `max` bytes. Past it (declared or found), drains
/// what the client is still sending, within bounds, and reports `TooLarge`;
/// nothing of it is kept.
async fn read_body(mut body: Body, max: usize, declared: Option<u64>) -> Result<Bytes, BodyError> {
    let mut buf = bytes::BytesMut::new();
    let mut too_large = declared.is_some_and(|n| n > max as u64);
    let mut drained: u64 = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let frame = if too_large {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(f) => f,
                Err(_) => return Err(BodyError::TooLarge),
            }
        } else {
            body.frame().await
        };
        let Some(frame) = frame else { break };
        let frame = match frame {
            Ok(f) => f,
            Err(_) if too_large => return Err(BodyError::TooLarge),
            Err(e) => return Err(BodyError::Unreadable(e.to_string())),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if too_large {
            drained += data.len() as u64;
            if drained > DRAIN_LIMIT {
                return Err(BodyError::TooLarge);
            }
        } else if buf.len() + data.len() > max {
            too_large = true;
            drained = (buf.len() + data.len()) as u64;
            buf = bytes::BytesMut::new();
        } else {
            buf.extend_from_slice(&data);
        }
    }
    if too_large {
        Err(BodyError::TooLarge)
    } else {
        Ok(buf.freeze())
    }
}

/// Claims the key, answering duplicates per the decision table. `Ok` means
/// this request holds the claim and must run.
async fn acquire(config: &Config, request: &ClaimRequest) -> Result<Claim, Response> {
    let mut turns = Turns::new(&config.policy);
    loop {
        let started = std::time::Instant::now();
        let claimed = config.store.claim(request).await;
        timed(config.store.kind(), "claim", started);
        let step = match claimed {
            Ok(ClaimOutcome::Acquired(claim)) => return Ok(claim),
            Ok(ClaimOutcome::Existing(record)) => turns.judge(&record, &request.fingerprint),
            Err(e) => return Err(store_unavailable(&e)),
        };
        match step {
            Step::Answer(response) => return Err(response),
            Step::Again(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// What to do after a claim found someone else's record.
pub(crate) enum Step {
    /// Answer this (a replay, `409`, `422`) without running the handler.
    Answer(Response),
    /// Claim again after this pause.
    Again(Duration),
}

/// The turns of one request's claim: each turn is one atomic claim; turns
/// repeat only while waiting (bounded) for an in-flight holder, or while
/// this process's clock and the store's disagree about a lease (the store's
/// view wins: it decides claims).
pub(crate) struct Turns<'p> {
    policy: &'p Policy,
    deadline: Option<tokio::time::Instant>,
    pause: Duration,
    disagreements: u32,
}

impl<'p> Turns<'p> {
    pub(crate) fn new(policy: &'p Policy) -> Self {
        Self {
            policy,
            deadline: policy.wait().map(|w| tokio::time::Instant::now() + w),
            pause: Duration::from_millis(10),
            disagreements: 0,
        }
    }

    /// Judges a record the claim found, per the decision table.
    pub(crate) fn judge(&mut self, record: &Record, fingerprint: &Fingerprint) -> Step {
        let now = UnixMillis::now();
        let decision = decide(
            self.policy,
            Situation::Arrived {
                stored: Some(record),
                fingerprint,
                now,
            },
        );
        match decision {
            Decision::Replay => {
                debug!(status = ?record_status(record), "replaying the stored response");
                Step::Answer(replay(record))
            }
            Decision::Mismatch => {
                info!("key reused with a different request");
                Step::Answer(mismatch())
            }
            Decision::Conflict { retry_after } => {
                debug!(?retry_after, "request with this key is in flight");
                Step::Answer(conflict(retry_after))
            }
            Decision::Wait { .. } => {
                let until = match &record.state {
                    RecordState::InProgress { locked_until, .. } => *locked_until,
                    RecordState::Completed { .. } => now,
                };
                self.wait(retry_after(now, until, self.policy.retry_after()))
            }
            // The store saw a live record where this clock sees an expired
            // one (the lease ran out in between, or the clocks differ):
            // claim again, a bounded number of times.
            _ => {
                self.disagreements += 1;
                if self.disagreements > 5 {
                    Step::Answer(conflict(Duration::from_secs(1)))
                } else {
                    Step::Again(Duration::from_millis(20))
                }
            }
        }
    }

    /// The key is held by a transaction that has not committed: in flight,
    /// for an unknown while.
    pub(crate) fn busy(&mut self) -> Step {
        debug!("request with this key is in flight (uncommitted)");
        let hint = self.policy.retry_after();
        if self.policy.wait().is_some() {
            self.wait(hint)
        } else {
            Step::Answer(conflict(hint))
        }
    }

    /// Waits for an in-flight holder while the policy allows, then `409`.
    fn wait(&mut self, retry_after: Duration) -> Step {
        let now = tokio::time::Instant::now();
        match self.deadline {
            Some(deadline) if now < deadline => {
                let pause = self.pause.min(deadline - now);
                self.pause = (self.pause * 2).min(Duration::from_millis(200));
                Step::Again(pause)
            }
            _ => {
                debug!("in flight after waiting; answering 409");
                Step::Answer(conflict(retry_after))
            }
        }
    }
}

fn record_status(record: &Record) -> Option<u16> {
    match &record.state {
        RecordState::Completed { response, .. } => Some(response.status),
        RecordState::InProgress { .. } => None,
    }
}

/// After the inner service returned: settle its response, or release the
/// claim if it failed.
async fn settle_result<E>(
    config: &Config,
    handle: &Idempotency,
    mut guard: ReleaseGuard,
    result: Result<Response, E>,
) -> Result<Response, E> {
    match result {
        Ok(response) => Ok(settle(config, handle, &mut guard, response).await),
        Err(e) => {
            guard.release_now().await;
            Err(e)
        }
    }
}

/// After the handler answered: store or release, per the decision table.
async fn settle(
    config: &Config,
    handle: &Idempotency,
    guard: &mut ReleaseGuard,
    response: Response,
) -> Response {
    let status = response.status().as_u16();
    match decide(&config.policy, Situation::HandlerAnswered { status }) {
        Decision::Store => {}
        _ => {
            info!(status, "handler failed; releasing the claim");
            count("released");
            guard.release_now().await;
            return response;
        }
    }
    match handle.completion() {
        Completion::InTransaction => {
            debug!(status, "completed in the handler's transaction");
            guard.disarm();
            config.store.settled(&guard.claim).await;
            return response;
        }
        Completion::Lost => {
            count("claim_lost");
            warn!("the handler's claim was taken over; nothing stored");
            guard.disarm();
            config.store.settled(&guard.claim).await;
            return response;
        }
        Completion::ByLayer => {}
    }
    let (parts, body) = response.into_parts();
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            warn!(error = %e, "the handler's response body failed; releasing the claim");
            guard.release_now().await;
            return Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-unreadable",
                "The response could not be read",
            )
            .into_response();
        }
    };
    let stored = stored_response(&config.policy, &parts, bytes.clone());
    let started = std::time::Instant::now();
    let completed = config.store.complete(&guard.claim, &stored).await;
    timed(config.store.kind(), "complete", started);
    match completed {
        Ok(()) => debug!(status, "stored the response"),
        Err(StoreError::ClaimLost) => {
            count("claim_lost");
            warn!("the claim was taken over while the handler ran, or rolled back with its transaction; its response is not stored")
        }
        // The effect happened but its record did not complete: keep the
        // claim (do not release), so that only a retry after the lease runs
        // out can run again, under the same operation id.
        Err(e) => {
            warn!(error = %e, "could not store the response; the claim stays until its lease runs out")
        }
    }
    guard.disarm();
    Response::from_parts(parts, Body::from(bytes))
}

/// Releases the claim if the request ends without settling it: the handler
/// panicked, or the future was dropped (client gone, timeout).
struct ReleaseGuard {
    store: Arc<dyn Store>,
    claim: Claim,
    armed: bool,
}

impl ReleaseGuard {
    fn new(store: Arc<dyn Store>, claim: Claim) -> Self {
        Self {
            store,
            claim,
            armed: true,
        }
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    async fn release_now(&mut self) {
        self.armed = false;
        release(&*self.store, &self.claim).await;
    }
}

async fn release(store: &dyn Store, claim: &Claim) {
    let started = std::time::Instant::now();
    let released = store.release(claim).await;
    timed(store.kind(), "release", started);
    match released {
        Ok(()) => debug!(key = ?claim.key, "released the claim"),
        Err(StoreError::ClaimLost) => {
            debug!(key = ?claim.key, "nothing to release: the claim had moved on")
        }
        Err(e) => {
            warn!(key = ?claim.key, error = %e, "could not release the claim; it frees itself when its lease runs out")
        }
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let panicking = std::thread::panicking();
        warn!(key = ?self.claim.key, panicking, "the handler did not finish; releasing the claim");
        // The decision table's "handler panicked or was dropped" row: release.
        let store = self.store.clone();
        let claim = self.claim.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move { release(&*store, &claim).await });
            }
            Err(_) => warn!(
                "no tokio runtime to release the claim on; it frees itself when its lease runs out"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Fingerprint, RecordState};
    use idem_memory::MemoryStore;

    #[tokio::test]
    async fn dropping_an_unsettled_guard_releases_the_claim() {
        let store = Arc::new(MemoryStore::new());
        let request = ClaimRequest {
            scope: "s".into(),
            key: "k".into(),
            fingerprint: Fingerprint::of_request("POST", "/", None, b""),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(600),
        };
        let ClaimOutcome::Acquired(claim) = store.claim(&request).await.unwrap() else {
            panic!("expected to acquire")
        };
        drop(ReleaseGuard::new(store.clone(), claim.clone()));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let ClaimOutcome::Acquired(again) = store.claim(&request).await.unwrap() else {
            panic!("the released claim is taken over at once")
        };
        assert!(again.takeover);
        assert_eq!(again.operation_id, claim.operation_id);

        // a disarmed guard leaves the claim alone
        let mut kept = ReleaseGuard::new(store.clone(), again.clone());
        kept.disarm();
        drop(kept);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let record = store.get("s", "k").await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::InProgress { token, .. } if token == again.token)
        );
    }
}
