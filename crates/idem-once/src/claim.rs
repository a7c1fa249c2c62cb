//! Claiming a key until it is decided: the one loop every edge runs (the
//! axum layer, the run-once API), whatever it answers with.

use std::future::Future;
use std::time::Duration;

use idem_core::{
    decision::retry_after, on_arrival, Arrival, Fingerprint, Policy, Record, RecordState,
    StoreError, UnixMillis,
};
use tracing::debug;

/// What one atomic claim found.
#[derive(Debug)]
pub enum Found<T> {
    /// The claim is ours (`T` carries it, and for a claim held by a
    /// transaction, the transaction).
    Acquired(T),
    /// Someone else's record, as the store holds it.
    Existing(Record),
    /// A transaction holds the key and has not committed: in flight, for an
    /// unknown while.
    Busy,
}

/// Why a claim did not become ours: what to answer instead of running.
#[derive(Debug)]
pub enum Refusal {
    /// The key's operation completed: replay this record (it is
    /// [`RecordState::Completed`]).
    Replay(Record),
    /// The key was first used with other input (HTTP `422`).
    Mismatch,
    /// Another caller holds the key under a live lease, and the policy's
    /// wait (if any) ran out: retry after `retry_after` (HTTP `409`).
    InFlight {
        /// When a retry may find it settled: the policy's hint, capped by
        /// the rest of the holder's lease, at least one second.
        retry_after: Duration,
    },
    /// The store failed; nothing ran.
    Unavailable(StoreError),
}

/// Claims until the claim is ours, or the refusal to answer instead.
///
/// `attempt` makes one atomic claim. Attempts repeat only while waiting
/// (bounded by [`Policy::wait`]) for an in-flight holder, or, a bounded
/// number of times, while this process's clock and the store's disagree
/// about a lease (the store's view wins: it decides claims).
pub async fn claim_until_decided<T, F, Fut>(
    policy: &Policy,
    fingerprint: &Fingerprint,
    mut attempt: F,
) -> Result<T, Refusal>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Found<T>, StoreError>>,
{
    let mut retry = ClaimRetry::new(policy);
    loop {
        let step = match attempt().await {
            Ok(Found::Acquired(claimed)) => return Ok(claimed),
            Ok(Found::Existing(record)) => retry.on_existing(record, fingerprint),
            Ok(Found::Busy) => retry.on_busy(),
            Err(e) => return Err(Refusal::Unavailable(e)),
        };
        match step {
            Step::Refuse(refusal) => return Err(refusal),
            Step::RetryAfter(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// What to do after a claim found someone else's record.
enum Step {
    Refuse(Refusal),
    RetryAfter(Duration),
}

/// How one claim is retried: the bounded wait for an in-flight holder,
/// and the bounded retries when the clocks disagree.
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
    fn on_existing(&mut self, record: Record, fingerprint: &Fingerprint) -> Step {
        self.on_existing_at(record, fingerprint, UnixMillis::now())
    }

    /// [`on_existing`](Self::on_existing), with this process's clock at
    /// `now`.
    fn on_existing_at(
        &mut self,
        record: Record,
        fingerprint: &Fingerprint,
        now: UnixMillis,
    ) -> Step {
        // The store returned the record as live, judging its retention by
        // its own clock. This one may run ahead of it: near the record's
        // end it would see the record expired, and turn a replay, or a
        // `422`, into claims again and then a `409`. The store's word on
        // the retention stands; a lease is still judged here (a takeover
        // goes back to the store, which decides it).
        let now = now.min(UnixMillis(record.expires_at.0.saturating_sub(1)));
        match on_arrival(self.policy, Some(&record), fingerprint, now) {
            Arrival::Replay => Step::Refuse(Refusal::Replay(record)),
            Arrival::Mismatch => Step::Refuse(Refusal::Mismatch),
            Arrival::Conflict { retry_after } => Step::Refuse(Refusal::InFlight { retry_after }),
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
                    Step::Refuse(Refusal::InFlight {
                        retry_after: Duration::from_secs(1),
                    })
                } else {
                    Step::RetryAfter(Duration::from_millis(20))
                }
            }
        }
    }

    /// The key is held by a transaction that has not committed.
    fn on_busy(&mut self) -> Step {
        debug!("the key is in flight (uncommitted)");
        let hint = self.policy.retry_after();
        if self.policy.wait().is_some() {
            self.wait(hint)
        } else {
            Step::Refuse(Refusal::InFlight { retry_after: hint })
        }
    }

    /// Waits for an in-flight holder while the policy allows, then refuses.
    fn wait(&mut self, retry_after: Duration) -> Step {
        let now = tokio::time::Instant::now();
        match self.deadline {
            Some(deadline) if now < deadline => {
                let pause = self.pause.min(deadline - now);
                self.pause = (self.pause * 2).min(Duration::from_millis(200));
                Step::RetryAfter(pause)
            }
            _ => {
                debug!("in flight after waiting");
                Step::Refuse(Refusal::InFlight { retry_after })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_core::{FencingToken, OperationId, StoredResponse};

    use super::*;

    fn record(fingerprint: Fingerprint, expires_at: UnixMillis, state: RecordState) -> Record {
        Record {
            scope: "s".into(),
            key: "k".into(),
            fingerprint,
            operation_id: OperationId::generate(),
            created_at: UnixMillis(expires_at.0 - 60_000),
            expires_at,
            shortest_retention: None,
            state,
        }
    }

    /// A record the store returned as live, which this process's clock
    /// (5 s ahead of the store's) sees past its retention: replayed, or
    /// refused as another request's, as the store judged it. Before, each
    /// was claimed again five times and answered `409`.
    #[test]
    fn the_stores_word_on_the_retention_stands() {
        let policy = Policy::default();
        let now = UnixMillis::now();
        let ended = UnixMillis(now.0 - 5_000);
        let ours = Fingerprint::from_bytes([1; 32]);
        let theirs = Fingerprint::from_bytes([2; 32]);
        let done = RecordState::Completed {
            response: StoredResponse {
                status: 201,
                headers: vec![],
                body: "x".into(),
            },
            completed_at: UnixMillis(ended.0 - 30_000),
        };
        let mut retry = ClaimRetry::new(&policy);
        let replayed = retry.on_existing_at(record(ours, ended, done.clone()), &ours, now);
        assert!(matches!(replayed, Step::Refuse(Refusal::Replay(_))));
        let refused = retry.on_existing_at(record(theirs, ended, done), &ours, now);
        assert!(matches!(refused, Step::Refuse(Refusal::Mismatch)));
        // A lease this clock sees ended still goes back to the store.
        let held = RecordState::InProgress {
            token: FencingToken::generate(),
            locked_until: UnixMillis(now.0 - 1_000),
        };
        let again =
            retry.on_existing_at(record(ours, UnixMillis(now.0 + 60_000), held), &ours, now);
        assert!(matches!(again, Step::RetryAfter(_)));
    }
}
