//! The decision table of the HTTP contract, as one pure function.
//!
//! | situation | decision |
//! |---|---|
//! | key missing where required | [`Decision::RejectMissingKey`] (`400`) |
//! | key missing where optional | [`Decision::PassThrough`] |
//! | key malformed | [`Decision::RejectInvalidKey`] (`400`) |
//! | body over the limit | [`Decision::RejectTooLarge`] (`413`, nothing stored) |
//! | new key, or record past its retention | [`Decision::Run`] |
//! | same key, same fingerprint, completed | [`Decision::Replay`] |
//! | same key, in progress, lease alive | [`Decision::Conflict`] (`409`) or [`Decision::Wait`] |
//! | same key, in progress, lease expired | [`Decision::TakeOver`] |
//! | same key, different fingerprint | [`Decision::Mismatch`] (`422`) |
//! | handler answered `2xx`/`3xx` | [`Decision::Store`] |
//! | handler answered `4xx` | [`Decision::Store`] (or [`Decision::Release`] if the policy says so) |
//! | handler answered `5xx`, panicked, or was dropped | [`Decision::Release`] |
//!
//! Stores apply the "arrived" rows atomically (the memory store calls
//! [`decide`] under its lock; the SQL stores spell the same rows in SQL);
//! the HTTP edge applies the rest.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::key::KeyError;
use crate::policy::Policy;
use crate::record::{Record, RecordState, UnixMillis};

/// What is known at one step of handling a request.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Situation<'a> {
    /// A guarded request came without an `Idempotency-Key`.
    KeyMissing,
    /// The `Idempotency-Key` header could not be parsed.
    KeyInvalid(&'a KeyError),
    /// The body is larger than the policy allows.
    BodyTooLarge,
    /// A request with a valid key and body arrived; `stored` is what the store
    /// holds under its `(scope, key)`, if anything.
    Arrived {
        /// The record under the same scope and key, if any.
        stored: Option<&'a Record>,
        /// The arriving request's fingerprint.
        fingerprint: &'a Fingerprint,
        /// The current time.
        now: UnixMillis,
    },
    /// The handler produced a response with this status.
    HandlerAnswered {
        /// The HTTP status code.
        status: u16,
    },
    /// The handler panicked, or its future was dropped before it answered.
    HandlerAbandoned,
}

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Answer `400`: the key is required and missing.
    RejectMissingKey,
    /// Answer `400`: the key is malformed.
    RejectInvalidKey,
    /// Answer `413`: the body is too large; store nothing.
    RejectTooLarge,
    /// Run the request without idempotency (no key, and none required).
    PassThrough,
    /// Claim the key afresh and run the handler.
    Run,
    /// Take the expired claim over (new token, same operation id) and run.
    TakeOver,
    /// Replay the stored response; do not run the handler.
    Replay,
    /// Answer `409` with `Retry-After`: another request holds the key.
    Conflict {
        /// How long until the holder's lease runs out (at least one second).
        retry_after: Duration,
    },
    /// Wait (at most this long) for the holder to finish, then decide again.
    Wait {
        /// The longest wait.
        at_most: Duration,
    },
    /// Answer `422`: the key was used for a different request.
    Mismatch,
    /// Complete the record with the handler's response.
    Store,
    /// Release the claim so that the next retry runs afresh.
    Release,
}

/// Decides what happens in `situation` under `policy`. Pure: no I/O, no clock.
pub fn decide(policy: &Policy, situation: Situation<'_>) -> Decision {
    match situation {
        Situation::KeyMissing if policy.require_key() => Decision::RejectMissingKey,
        Situation::KeyMissing => Decision::PassThrough,
        Situation::KeyInvalid(_) => Decision::RejectInvalidKey,
        Situation::BodyTooLarge => Decision::RejectTooLarge,
        Situation::Arrived {
            stored,
            fingerprint,
            now,
        } => match stored {
            None => Decision::Run,
            Some(r) if r.is_expired(now) => Decision::Run,
            Some(r) if r.fingerprint != *fingerprint => Decision::Mismatch,
            Some(r) => match &r.state {
                RecordState::Completed { .. } => Decision::Replay,
                RecordState::InProgress { locked_until, .. } if *locked_until <= now => {
                    Decision::TakeOver
                }
                RecordState::InProgress { locked_until, .. } => match policy.wait() {
                    Some(at_most) => Decision::Wait { at_most },
                    None => Decision::Conflict {
                        retry_after: retry_after(now, *locked_until, policy.retry_after()),
                    },
                },
            },
        },
        Situation::HandlerAnswered { status } => match status {
            500..=599 => Decision::Release,
            400..=499 if !policy.store_client_errors() => Decision::Release,
            _ => Decision::Store,
        },
        Situation::HandlerAbandoned => Decision::Release,
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

    fn arrived(p: &Policy, stored: Option<&Record>, body: &str) -> Decision {
        decide(
            p,
            Situation::Arrived {
                stored,
                fingerprint: &fp(body),
                now: NOW,
            },
        )
    }

    const LATER: UnixMillis = UnixMillis(NOW.0 + 86_400_000);

    #[test]
    fn row_new_key_runs() {
        assert_eq!(arrived(&Policy::default(), None, "{}"), Decision::Run);
    }

    #[test]
    fn row_completed_same_fingerprint_replays() {
        let r = record(r#"{"a":1}"#, completed(), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), r#"{ "a" : 1 }"#),
            Decision::Replay
        );
    }

    #[test]
    fn row_in_progress_lease_alive_conflicts_with_a_short_retry_after() {
        // The hint (1 s by default), not the rest of a 29 s lease.
        let r = record("{}", in_progress(NOW.0 + 29_000), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), "{}"),
            Decision::Conflict {
                retry_after: Duration::from_secs(1)
            }
        );
        let p = Policy::builder()
            .retry_after(Duration::from_secs(5))
            .build()
            .unwrap();
        assert_eq!(
            arrived(&p, Some(&r), "{}"),
            Decision::Conflict {
                retry_after: Duration::from_secs(5)
            }
        );
        // Capped by the lease: 2.5 s left rounds up to 3, not 5.
        let r = record("{}", in_progress(NOW.0 + 2_500), LATER);
        assert_eq!(
            arrived(&p, Some(&r), "{}"),
            Decision::Conflict {
                retry_after: Duration::from_secs(3)
            }
        );
        let almost = record("{}", in_progress(NOW.0 + 1), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&almost), "{}"),
            Decision::Conflict {
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
            Decision::Wait {
                at_most: Duration::from_secs(2)
            }
        );
    }

    #[test]
    fn row_in_progress_lease_expired_takes_over() {
        let r = record("{}", in_progress(NOW.0), LATER);
        assert_eq!(
            arrived(&Policy::default(), Some(&r), "{}"),
            Decision::TakeOver
        );
    }

    #[test]
    fn row_different_fingerprint_mismatches() {
        let p = Policy::default();
        let done = record(r#"{"a":1}"#, completed(), LATER);
        assert_eq!(arrived(&p, Some(&done), r#"{"a":2}"#), Decision::Mismatch);
        let live = record(r#"{"a":1}"#, in_progress(NOW.0 + 5_000), LATER);
        assert_eq!(arrived(&p, Some(&live), r#"{"a":2}"#), Decision::Mismatch);
        // an expired lease is not taken over by a different request
        let dead = record(r#"{"a":1}"#, in_progress(NOW.0 - 1), LATER);
        assert_eq!(arrived(&p, Some(&dead), r#"{"a":2}"#), Decision::Mismatch);
    }

    #[test]
    fn row_key_missing_where_required() {
        assert_eq!(
            decide(&Policy::default(), Situation::KeyMissing),
            Decision::RejectMissingKey
        );
        let optional = Policy::builder().require_key(false).build().unwrap();
        assert_eq!(
            decide(&optional, Situation::KeyMissing),
            Decision::PassThrough
        );
    }

    #[test]
    fn row_key_malformed() {
        assert_eq!(
            decide(&Policy::default(), Situation::KeyInvalid(&KeyError::Empty)),
            Decision::RejectInvalidKey
        );
    }

    #[test]
    fn row_body_too_large() {
        assert_eq!(
            decide(&Policy::default(), Situation::BodyTooLarge),
            Decision::RejectTooLarge
        );
    }

    #[test]
    fn row_handler_answers() {
        let p = Policy::default();
        for (status, want) in [
            (200, Decision::Store),
            (201, Decision::Store),
            (303, Decision::Store),
            (400, Decision::Store),
            (404, Decision::Store),
            (422, Decision::Store),
            (500, Decision::Release),
            (502, Decision::Release),
            (503, Decision::Release),
        ] {
            assert_eq!(
                decide(&p, Situation::HandlerAnswered { status }),
                want,
                "{status}"
            );
        }
        let no4xx = Policy::builder()
            .store_client_errors(false)
            .build()
            .unwrap();
        assert_eq!(
            decide(&no4xx, Situation::HandlerAnswered { status: 409 }),
            Decision::Release
        );
        assert_eq!(
            decide(&no4xx, Situation::HandlerAnswered { status: 201 }),
            Decision::Store
        );
    }

    #[test]
    fn row_handler_panicked_or_dropped_releases() {
        assert_eq!(
            decide(&Policy::default(), Situation::HandlerAbandoned),
            Decision::Release
        );
    }

    #[test]
    fn row_record_past_retention_is_new_again() {
        let p = Policy::default();
        let old = record(r#"{"a":1}"#, completed(), NOW);
        assert_eq!(arrived(&p, Some(&old), r#"{"a":1}"#), Decision::Run);
        // ... even with another body
        assert_eq!(arrived(&p, Some(&old), r#"{"a":2}"#), Decision::Run);
        // but a live holder is never evicted by retention
        let held = record("{}", in_progress(NOW.0 + 1_000), NOW);
        assert!(matches!(
            arrived(&p, Some(&held), "{}"),
            Decision::Conflict { .. }
        ));
    }
}
