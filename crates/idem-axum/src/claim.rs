//! Claiming: one loop for both claim modes (the layer's own claim, and the
//! handler's claim in its transaction), and the answers a claim that found
//! someone else's record gives instead of running the handler.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use idem_core::{Claim, Fingerprint, Policy, Record, RecordState, StoreError};
use idem_once::Refusal;
use tracing::{debug, info, warn};

use crate::metrics::{count, timed, Outcome, StoreOp};
use crate::rejection::IdempotencyRejection;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

pub(crate) use idem_once::Found;

/// Claims until the claim is ours, or the answer to send instead: the
/// run-once loop ([`idem_once::claim_until_decided`]), its refusals
/// answered over HTTP.
///
/// `attempt` makes one atomic claim on the store named `store` (for the
/// metrics).
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
    let timed_attempt = || {
        let started = Instant::now();
        let claim = attempt();
        async move {
            let found = claim.await;
            timed(store, StoreOp::Claim, started);
            found
        }
    };
    idem_once::claim_until_decided(policy, fingerprint, timed_attempt)
        .await
        .map_err(|refusal| refused(refusal, policy))
}

/// The answer to a request a claim refused: the replay, `422`, `409` or
/// `503`.
pub(crate) fn refused(refusal: Refusal, policy: &Policy) -> Response {
    match refusal {
        Refusal::Replay(record) => replay(&record, policy),
        Refusal::Mismatch => {
            info!("key reused with a different request");
            count(Outcome::Mismatch);
            IdempotencyRejection::KeyReused.into_response()
        }
        Refusal::InFlight { retry_after } => {
            debug!(?retry_after, "request with this key is in flight");
            conflict(retry_after)
        }
        Refusal::Unavailable(e) => store_unavailable(&e),
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
