//! Claiming: one loop for both claim modes (the layer's own claim, and the
//! handler's claim in its transaction), and the answers a claim that found
//! someone else's record gives instead of running the handler.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use idem_core::{
    decision::retry_after, on_arrival, Arrival, Claim, Fingerprint, Policy, Record, RecordState,
    StoreError, UnixMillis,
};
use tracing::{debug, info, warn};

use crate::metrics::{count, timed, Outcome, StoreOp};
use crate::rejection::IdempotencyRejection;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// What one atomic claim found.
pub(crate) enum Found<T> {
    /// The claim is ours (`T` carries it, and in the transactional mode the
    /// transaction holding it).
    Acquired(T),
    /// Someone else's record, as the store holds it.
    Existing(Record),
    /// A transaction holds the key and has not committed: in flight, for an
    /// unknown while.
    Busy,
}

/// Claims until the claim is ours, or the answer to send instead.
///
/// `attempt` makes one atomic claim on the store named `store` (for the
/// metrics); turns repeat only while waiting (bounded by the policy) for an
/// in-flight holder, or while this process's clock and the store's disagree
/// about a lease (the store's view wins: it decides claims).
pub(crate) async fn claim_until_decided<T, F, Fut>(
    policy: &Policy,
    fingerprint: &Fingerprint,
    store: &'static str,
    mut attempt: F,
) -> Result<T, Response>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Found<T>, StoreError>>,
{
    let mut retry = ClaimRetry::new(policy);
    loop {
        let started = Instant::now();
        let found = attempt().await;
        timed(store, StoreOp::Claim, started);
        let step = match found {
            Ok(Found::Acquired(claimed)) => return Ok(claimed),
            Ok(Found::Existing(record)) => retry.on_existing(&record, fingerprint),
            Ok(Found::Busy) => retry.on_busy(),
            Err(e) => return Err(store_unavailable(&e)),
        };
        match step {
            ClaimStep::Answer(response) => return Err(response),
            ClaimStep::RetryAfter(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// Counts and logs a claim that is ours.
pub(crate) fn claimed(claim: &Claim, held_by_transaction: bool) {
    count(if claim.takeover {
        Outcome::Takeover
    } else {
        Outcome::Fresh
    });
    match (claim.takeover, held_by_transaction) {
        (true, _) => {
            info!(operation_id = %claim.operation_id, "took over an expired, released or abandoned claim")
        }
        (false, false) => debug!(operation_id = %claim.operation_id, "claimed"),
        (false, true) => {
            debug!(operation_id = %claim.operation_id, "claimed; the handler's transaction holds it")
        }
    }
}

/// `503`: the store failed; the request did not run.
pub(crate) fn store_unavailable(e: &StoreError) -> Response {
    count(Outcome::StoreUnavailable);
    warn!(error = %e, source = ?std::error::Error::source(e), "idempotency store unavailable");
    IdempotencyRejection::StoreUnavailable.into_response()
}

/// What to do after a claim found someone else's record.
enum ClaimStep {
    /// Answer this (a replay, `409`, `422`) without running the handler.
    Answer(Response),
    /// Claim again after this pause.
    RetryAfter(Duration),
}

/// How one request's claim is retried: the bounded wait for an in-flight
/// holder, and the bounded retries when the clocks disagree.
struct ClaimRetry<'p> {
    policy: &'p Policy,
    deadline: Option<tokio::time::Instant>,
    pause: Duration,
    disagreements: u32,
}

impl<'p> ClaimRetry<'p> {
    fn new(policy: &'p Policy) -> Self {
        Self {
            policy,
            deadline: policy.wait().map(|w| tokio::time::Instant::now() + w),
            pause: Duration::from_millis(10),
            disagreements: 0,
        }
    }

    /// A record the claim found, per the decision table.
    fn on_existing(&mut self, record: &Record, fingerprint: &Fingerprint) -> ClaimStep {
        let now = UnixMillis::now();
        match on_arrival(self.policy, Some(record), fingerprint, now) {
            Arrival::Replay => ClaimStep::Answer(replay(record, self.policy)),
            Arrival::Mismatch => {
                info!("key reused with a different request");
                count(Outcome::Mismatch);
                ClaimStep::Answer(IdempotencyRejection::KeyReused.into_response())
            }
            Arrival::Conflict { retry_after } => {
                debug!(?retry_after, "request with this key is in flight");
                ClaimStep::Answer(conflict(retry_after))
            }
            Arrival::Wait { .. } => {
                let until = match &record.state {
                    RecordState::InProgress { locked_until, .. } => *locked_until,
                    RecordState::Completed { .. } => now,
                };
                self.wait(retry_after(now, until, self.policy.retry_after()))
            }
            // The store saw a live record where this clock sees none or an
            // expired one (the lease ran out in between, or the clocks
            // differ): claim again, a bounded number of times.
            Arrival::Run | Arrival::TakeOver => {
                self.disagreements += 1;
                if self.disagreements > 5 {
                    ClaimStep::Answer(conflict(Duration::from_secs(1)))
                } else {
                    ClaimStep::RetryAfter(Duration::from_millis(20))
                }
            }
        }
    }

    /// The key is held by a transaction that has not committed.
    fn on_busy(&mut self) -> ClaimStep {
        debug!("request with this key is in flight (uncommitted)");
        let hint = self.policy.retry_after();
        if self.policy.wait().is_some() {
            self.wait(hint)
        } else {
            ClaimStep::Answer(conflict(hint))
        }
    }

    /// Waits for an in-flight holder while the policy allows, then `409`.
    fn wait(&mut self, retry_after: Duration) -> ClaimStep {
        let now = tokio::time::Instant::now();
        match self.deadline {
            Some(deadline) if now < deadline => {
                let pause = self.pause.min(deadline - now);
                self.pause = (self.pause * 2).min(Duration::from_millis(200));
                ClaimStep::RetryAfter(pause)
            }
            _ => {
                debug!("in flight after waiting; answering 409");
                ClaimStep::Answer(conflict(retry_after))
            }
        }
    }
}

/// `409` with `Retry-After`.
fn conflict(retry_after: Duration) -> Response {
    count(Outcome::Conflict);
    IdempotencyRejection::KeyInUse { retry_after }.into_response()
}

/// The stored response, as first sent, marked `Idempotent-Replayed: true`.
fn replay(record: &Record, policy: &Policy) -> Response {
    let RecordState::Completed {
        response: stored, ..
    } = &record.state
    else {
        return conflict(Duration::from_secs(1));
    };
    count(Outcome::Replay);
    debug!(status = stored.status, "replaying the stored response");
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = status;
    *response.headers_mut() = replayed_headers(&stored.headers, policy);
    response
}

/// The headers a replay sends: the stored ones the policy still replays
/// (a record is read from a store, which may hold what this code never
/// wrote: a corrupt row, a shared Redis, an allow-list narrowed since),
/// as far as a `HeaderMap` holds them, and `Idempotent-Replayed: true`.
#[doc(hidden)]
pub fn replayed_headers(stored: &[(String, Vec<u8>)], policy: &Policy) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in stored {
        if !policy.replays_header(name) {
            warn!(header = ?name, "skipping a stored header the policy does not replay");
            continue;
        }
        let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            warn!(header = ?name, "skipping a stored header that is no longer valid");
            continue;
        };
        if headers.len() >= MAX_REPLAYED_HEADERS || headers.try_append(n, v).is_err() {
            warn!("a stored response holds more headers than a replay sends; replaying the first ones");
            break;
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    headers
}

/// The most stored headers a replay sends (a `HeaderMap` panics past about
/// 24,000 distinct names; a real response carries a handful).
const MAX_REPLAYED_HEADERS: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `header_replay` fuzz target: a stored record with tens
    /// of thousands of distinct header names made `HeaderMap::append` panic.
    #[test]
    fn a_record_with_too_many_headers_replays_without_panicking() {
        let many: Vec<(String, Vec<u8>)> = (0..30_000)
            .map(|i| (format!("x-h{i}"), b"v".to_vec()))
            .collect();
        // Not allow-listed: none is replayed.
        let headers = replayed_headers(&many, &Policy::default());
        assert_eq!(headers.len(), 1);
        assert_eq!(headers[IDEMPOTENT_REPLAYED], "true");
        // Allow-listed: at most the cap, and the marker.
        let mut builder = Policy::builder();
        for (name, _) in &many[..2_000] {
            builder = builder.replay_header(name.clone());
        }
        let policy = builder.build().unwrap_or_default();
        let headers = replayed_headers(&many, &policy);
        assert_eq!(headers.len(), MAX_REPLAYED_HEADERS + 1);
        assert_eq!(headers[IDEMPOTENT_REPLAYED], "true");
    }

    /// What the policy never replays stays out, whatever the store holds.
    #[test]
    fn stored_headers_the_policy_does_not_replay_stay_out() {
        let stored = vec![
            ("location".to_owned(), b"/p/1".to_vec()),
            ("set-cookie".to_owned(), b"session=x".to_vec()),
            ("transfer-encoding".to_owned(), b"chunked".to_vec()),
            ("content-length".to_owned(), b"999".to_vec()),
            ("bad name".to_owned(), b"x".to_vec()),
        ];
        let headers = replayed_headers(&stored, &Policy::default());
        assert_eq!(headers["location"], "/p/1");
        for absent in ["set-cookie", "transfer-encoding", "content-length"] {
            assert!(headers.get(absent).is_none(), "{absent}");
        }
        assert_eq!(headers.len(), 2);
    }
}
