//! The decision table of the HTTP contract, as three pure functions, one
//! per phase of a request; each answers with an enum of its own, so that
//! every `match` on a decision is exhaustive.
//!
//! | phase | situation | decision |
//! |---|---|---|
//! | reading | key missing where required | [`MissingKey::Reject`] (`400`) |
//! | reading | key missing where optional | [`MissingKey::PassThrough`] |
//! | reading | key malformed, body over the limit | always refused (`400`, `413`, nothing stored) |
//! | claiming | new key, or record past its retention | [`Arrival::Run`] |
//! | claiming | same key, same fingerprint, completed | [`Arrival::Replay`] |
//! | claiming | same key, in progress, lease alive | [`Arrival::Conflict`] (`409`) or [`Arrival::Wait`] |
//! | claiming | same key, in progress, lease expired | [`Arrival::TakeOver`] |
//! | claiming | same key, different fingerprint | [`Arrival::Mismatch`] (`422`) |
//! | finishing | handler answered `2xx`/`3xx` | [`Settlement::Store`] |
//! | finishing | handler answered `4xx` | [`Settlement::Store`] (or [`Settlement::Release`] if the policy says so) |
//! | finishing | handler answered `5xx`, panicked, or was dropped | [`Settlement::Release`] |
//!
//! Stores apply the claiming rows atomically (the memory store calls
//! [`on_arrival`] under its lock; the SQL stores spell the same rows in
//! SQL); the HTTP edge applies the rest.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::policy::Policy;
use crate::record::{Record, RecordState, UnixMillis};

/// What to do with a guarded request that came without an
/// `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingKey {
    /// Answer `400`: the policy requires a key.
    Reject,
    /// Run the request without idempotency.
    PassThrough,
}

/// The reading phase: a guarded request came without a key.
pub fn on_missing_key(policy: &Policy) -> MissingKey {
    if policy.require_key() {
        MissingKey::Reject
    } else {
        MissingKey::PassThrough
    }
}

/// What to do with a request whose key and body are valid, given what the
/// store holds under its scope and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Claim the key afresh and run the handler.
    Run,
    /// Take the expired claim over (new token, same operation id) and run.
    TakeOver,
    /// Replay the stored response; do not run the handler.
    Replay,
    /// Answer `409` with `Retry-After`: another request holds the key.
    Conflict {
        /// The `Retry-After`: the policy's hint, capped by the rest of the
        /// holder's lease, at least one second.
        retry_after: Duration,
    },
    /// Wait (at most this long) for the holder to finish, then decide again.
    Wait {
        /// The longest wait.
        at_most: Duration,
    },
    /// Answer `422`: the key was used for a different request.
    Mismatch,
}

/// The claiming phase: a request with `fingerprint` arrived at `now`, and
/// the store holds `stored` (if anything) under the same scope and key.
pub fn on_arrival(
    policy: &Policy,
    stored: Option<&Record>,
    fingerprint: &Fingerprint,
    now: UnixMillis,
) -> Arrival {
    match stored {
        None => Arrival::Run,
        Some(r) if r.is_expired(now) => Arrival::Run,
        Some(r) if r.fingerprint != *fingerprint => Arrival::Mismatch,
        Some(r) => match &r.state {
            RecordState::Completed { .. } => Arrival::Replay,
            RecordState::InProgress { locked_until, .. } if *locked_until <= now => {
                Arrival::TakeOver
            }
            RecordState::InProgress { locked_until, .. } => match policy.wait() {
                Some(at_most) => Arrival::Wait { at_most },
                None => Arrival::Conflict {
                    retry_after: retry_after(now, *locked_until, policy.retry_after()),
                },
            },
        },
    }
}

/// How the handler ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerEnd {
    /// It answered with this HTTP status.
    Answered {
        /// The HTTP status code.
        status: u16,
    },
    /// It panicked, or its future was dropped before it answered.
    Abandoned,
}

/// What to do with the claim once the handler ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Complete the record with the handler's response.
    Store,
    /// Release the claim so that the next retry runs afresh.
    Release,
}

/// The finishing phase: the handler ended as `end`.
pub fn on_handler_end(policy: &Policy, end: HandlerEnd) -> Settlement {
    match end {
        HandlerEnd::Answered { status: 500..=599 } => Settlement::Release,
        HandlerEnd::Answered { status } if policy.releases_client_error(status) => {
            Settlement::Release
        }
        HandlerEnd::Answered { .. } => Settlement::Store,
        HandlerEnd::Abandoned => Settlement::Release,
    }
}

/// The `Retry-After` for a conflict: the policy's `hint`, but never more
/// than the rest of the holder's lease; rounded up to whole seconds, at
/// least one.
pub fn retry_after(now: UnixMillis, locked_until: UnixMillis, hint: Duration) -> Duration {
    let rest = now.until(locked_until).min(hint);
    let ms = u64::try_from(rest.as_millis()).unwrap_or(u64::MAX);
    Duration::from_secs(ms.div_ceil(1000).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{FencingToken, OperationId, StoredResponse};

    const NOW: UnixMillis = UnixMillis(1_000_000);

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_request("POST", "/p", Some("application/json"), body.as_bytes())
    }

    fn record(body: &str, state: RecordState, expires_at: UnixMillis) -> Record {
        Record {
            scope: "s".into(),
            key: "k".into(),
            fingerprint: fp(body),
            operation_id: OperationId::generate(),
            created_at: UnixMillis(0),
            expires_at,
            shortest_retention: None,
            state,
        }
    }

    fn completed() -> RecordState {
        RecordState::Completed {
            response: StoredResponse {
                status: 201,
                headers: vec![],
                body: Default::default(),
            },
            completed_at: UnixMillis(10),
        }
    }

    fn in_progress(locked_until: i64) -> RecordState {
        RecordState::InProgress {
            token: FencingToken(7),
            locked_until: UnixMillis(locked_until),
        }
    }

    fn arrived(p: &Policy, stored: Option<&Record>, body: &str) -> Arrival {
        on_arrival(p, stored, &fp(body), NOW)
    }

    const LATER: UnixMillis = UnixMillis(NOW.0 + 86_400_000);

    #[test]
    fn row_new_key_runs() {
        assert_eq!(arrived(&Policy::default(), None, "{}"), Arrival::Run);
    }

    #[test]
    fn row_completed_same_fingerprint_replays() {
        let r = record(r#"{"a":1}"#, completed(), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), r#"{ "a" : 1 }"#),
            Arrival::Replay
        );
    }

    #[test]
    fn row_in_progress_lease_alive_conflicts_with_a_short_retry_after() {
        // The hint (1 s by default), not the rest of a 29 s lease.
        let r = record("{}", in_progress(NOW.0 + 29_000), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), "{}"),
            Arrival::Conflict {
                retry_after: Duration::from_secs(1)
            }
        );
        let p = Policy::builder()
            .retry_after(Duration::from_secs(5))
            .build()
            .unwrap();
        assert_eq!(
            arrived(&p, Some(&r), "{}"),
            Arrival::Conflict {
                retry_after: Duration::from_secs(5)
            }
        );
        // Capped by the lease: 2.5 s left rounds up to 3, not 5.
        let r = record("{}", in_progress(NOW.0 + 2_500), LATER);
        assert_eq!(
            arrived(&p, Some(&r), "{}"),
            Arrival::Conflict {
                retry_after: Duration::from_secs(3)
            }
        );
        let almost = record("{}", in_progress(NOW.0 + 1), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&almost), "{}"),
            Arrival::Conflict {
                retry_after: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn row_in_progress_lease_alive_waits_when_configured() {
        let p = Policy::builder()
            .wait_for_in_flight(Duration::from_secs(2))
            .build()
            .unwrap();
        let r = record("{}", in_progress(NOW.0 + 2_500), LATER);
        assert_eq!(
            arrived(&p, Some(&r), "{}"),
            Arrival::Wait {
                at_most: Duration::from_secs(2)
            }
        );
    }

    #[test]
    fn row_in_progress_lease_expired_takes_over() {
        let r = record("{}", in_progress(NOW.0), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), "{}"),
            Arrival::TakeOver
        );
    }

    #[test]
    fn row_different_fingerprint_mismatches() {
        let p = Policy::default();
        let done = record(r#"{"a":1}"#, completed(), LATER);
        assert_eq!(arrived(&p, Some(&done), r#"{"a":2}"#), Arrival::Mismatch);
        let live = record(r#"{"a":1}"#, in_progress(NOW.0 + 5_000), LATER);
        assert_eq!(arrived(&p, Some(&live), r#"{"a":2}"#), Arrival::Mismatch);
        // an expired lease is not taken over by a different request
        let dead = record(r#"{"a":1}"#, in_progress(NOW.0 - 1), LATER);
        assert_eq!(arrived(&p, Some(&dead), r#"{"a":2}"#), Arrival::Mismatch);
    }

    #[test]
    fn row_key_missing_where_required() {
        assert_eq!(on_missing_key(&Policy::default()), MissingKey::Reject);
        let optional = Policy::builder().require_key(false).build().unwrap();
        assert_eq!(on_missing_key(&optional), MissingKey::PassThrough);
    }

    #[test]
    fn row_handler_answers() {
        let p = Policy::default();
        for (status, want) in [
            (200, Settlement::Store),
            (201, Settlement::Store),
            (303, Settlement::Store),
            (400, Settlement::Store),
            (404, Settlement::Store),
            (407, Settlement::Store),
            (408, Settlement::Release),
            (409, Settlement::Store),
            (422, Settlement::Store),
            (424, Settlement::Store),
            (425, Settlement::Release),
            (426, Settlement::Store),
            (428, Settlement::Store),
            (429, Settlement::Release),
            (430, Settlement::Store),
            (499, Settlement::Store),
            (500, Settlement::Release),
            (502, Settlement::Release),
            (503, Settlement::Release),
            (599, Settlement::Release),
        ] {
            assert_eq!(
                on_handler_end(&p, HandlerEnd::Answered { status }),
                want,
                "{status}"
            );
        }
        let no4xx = Policy::builder()
            .store_client_errors(false)
            .build()
            .unwrap();
        for (status, want) in [
            (399, Settlement::Store),
            (400, Settlement::Release),
            (409, Settlement::Release),
            (499, Settlement::Release),
            (201, Settlement::Store),
            (500, Settlement::Release),
        ] {
            assert_eq!(
                on_handler_end(&no4xx, HandlerEnd::Answered { status }),
                want,
                "{status}"
            );
        }
    }

    #[test]
    fn row_handler_answers_try_again_later_as_configured() {
        let p = Policy::builder()
            .store_client_error(429)
            .release_client_error(423)
            .build()
            .unwrap();
        for (status, want) in [
            (408, Settlement::Release),
            (422, Settlement::Store),
            (423, Settlement::Release),
            (425, Settlement::Release),
            (429, Settlement::Store),
            (503, Settlement::Release),
        ] {
            assert_eq!(
                on_handler_end(&p, HandlerEnd::Answered { status }),
                want,
                "{status}"
            );
        }
        // Stored again once released, and the other way round: the last
        // word counts.
        let back = p
            .to_builder()
            .release_client_error(429)
            .store_client_error(423)
            .build()
            .unwrap();
        assert_eq!(
            on_handler_end(&back, HandlerEnd::Answered { status: 429 }),
            Settlement::Release
        );
        assert_eq!(
            on_handler_end(&back, HandlerEnd::Answered { status: 423 }),
            Settlement::Store
        );
    }

    #[test]
    fn row_handler_panicked_or_dropped_releases() {
        assert_eq!(
            on_handler_end(&Policy::default(), HandlerEnd::Abandoned),
            Settlement::Release
        );
    }

    #[test]
    fn row_record_past_retention_is_new_again() {
        let p = Policy::default();
        let old = record(r#"{"a":1}"#, completed(), NOW);
        assert_eq!(arrived(&p, Some(&old), r#"{"a":1}"#), Arrival::Run);
        // ... even with another body
        assert_eq!(arrived(&p, Some(&old), r#"{"a":2}"#), Arrival::Run);
        // but a live holder is never evicted by retention
        let held = record("{}", in_progress(NOW.0 + 1_000), NOW);
        assert!(matches!(
            arrived(&p, Some(&held), "{}"),
            Arrival::Conflict { .. }
        ));
    }
}
