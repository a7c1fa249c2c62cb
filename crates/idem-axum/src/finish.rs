//! Finishing: after the handler, the claim is completed with its answer or
//! released, per the decision table; a guard releases it if the handler
//! never finishes (it panicked, or its task was dropped).

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use idem_core::{on_handler_end, Claim, HandlerEnd, Settlement, Store, StoreError};
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::extract::{stored_response, Completion, Idempotency};
use crate::metrics::{count, timed, Outcome, StoreOp};
use crate::rejection::IdempotencyRejection;

/// After the inner service returned: finish with its response, or release
/// the claim if the service failed.
pub(crate) async fn finish_result<E>(
    config: &Config,
    handle: &Idempotency,
    mut guard: ReleaseGuard,
    result: Result<Response, E>,
) -> Result<Response, E> {
    match result {
        Ok(response) => Ok(finish(config, handle, &mut guard, response).await),
        // A claim the handler kept (its outcome unknown, or done with an
        // answer to store) stays kept, as when its task is dropped: the
        // service failing says no more.
        Err(e) if handle.kept_if_unfinished() => {
            count(Outcome::Kept);
            guard.leave().await;
            Err(e)
        }
        Err(e) => {
            guard.release_now().await;
            Err(e)
        }
    }
}

/// After the handler answered: complete the record with its answer, or
/// release the claim, per the decision table.
async fn finish(
    config: &Config,
    handle: &Idempotency,
    guard: &mut ReleaseGuard,
    response: Response,
) -> Response {
    let status = response.status().as_u16();
    if handle.completion() == Completion::Released {
        info!(
            status,
            "the answer is not the request's outcome; releasing the claim"
        );
        count(Outcome::Released);
        guard.release_now().await;
        return response;
    }
    if handle.completion() == Completion::Kept {
        count(Outcome::Kept);
        info!(
            status,
            "the outcome is unknown; the claim is kept until its lease runs out"
        );
        guard.leave().await;
        return response;
    }
    // The layer's own "in flight" answer, returned by a handler (a step an
    // earlier attempt still holds): nothing happened that a replay should
    // give; the claim is released for the retry. Its status is `409`: the
    // header on any other answer (one an upstream behind `idem proxy`
    // wrote) says nothing of this claim.
    let refusal = response
        .headers()
        .get(crate::rejection::IDEMPOTENCY_REJECTION);
    let in_flight =
        status == 409 && refusal.is_some_and(|v| v.as_bytes().ends_with(b"idempotency-key-in-use"));
    // The handler's word that its answer is the outcome, unless the answer
    // is one of the layer's own refusals (nothing ran: a store away as its
    // transaction began, a step in flight).
    let settlement = if handle.completion() == Completion::Stored && refusal.is_none() {
        Settlement::Store
    } else if in_flight
        && matches!(
            handle.completion(),
            Completion::ByLayer | Completion::Stored
        )
    {
        Settlement::Release
    } else {
        on_handler_end(&config.policy, HandlerEnd::Answered { status })
    };
    match settlement {
        Settlement::Store => {}
        Settlement::Release => {
            info!(status, "handler failed; releasing the claim");
            count(Outcome::Released);
            guard.release_now().await;
            return response;
        }
    }
    match handle.completion() {
        Completion::InTransaction => {
            debug!(status, "completed in the handler's transaction");
            guard.leave().await;
            return response;
        }
        Completion::Lost => {
            count(Outcome::ClaimLost);
            warn!("the handler's claim was taken over; nothing stored");
            guard.leave().await;
            return response;
        }
        Completion::ByLayer | Completion::Kept | Completion::Released | Completion::Stored => {}
    }
    // From here the answer is the request's outcome: a panic while its body
    // is read or stored (a body stream, a store driver) keeps the claim, as
    // a failure to store it does, rather than free the key for a retry
    // beside an effect that happened.
    handle.answering();
    let (parts, body) = response.into_parts();
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        // The handler answered a status that is its outcome (a status
        // that releases returned above): its effect may have happened, and
        // only the body to store is missing. Keep the claim, as when the
        // store cannot take the answer: only a retry after the lease runs
        // again, under the same operation id. (Released at once, the retry
        // would run beside or after an effect that happened.)
        Err(e) => {
            warn!(error = %e, status, "the handler's response body failed after it answered; the claim stays until its lease runs out");
            count(Outcome::Kept);
            // Said as the handler would: a claim held by its transaction
            // is then held for a lease again (`hold_kept`).
            handle.keep_claim();
            guard.leave().await;
            return IdempotencyRejection::ResponseUnreadable.into_response();
        }
    };
    let stored = stored_response(&config.policy, &parts, bytes.clone());
    let started = std::time::Instant::now();
    let completed = config.store.complete(guard.claim(), &stored).await;
    timed(config.store.kind(), StoreOp::Complete, started);
    match completed {
        Ok(()) => debug!(status, "stored the response"),
        Err(StoreError::ClaimLost) => {
            count(Outcome::ClaimLost);
            warn!("the claim was taken over while the handler ran, or rolled back with its transaction; its response is not stored")
        }
        // The effect happened but its record did not complete: keep the
        // claim (do not release), so that only a retry after the lease runs
        // out can run again, under the same operation id.
        Err(e) => {
            warn!(error = %e, "could not store the response; the claim stays until its lease runs out");
            handle.keep_claim();
        }
    }
    guard.disarm();
    Response::from_parts(parts, Body::from(bytes))
}

/// The answer when the handler's task panicked or was cancelled: its
/// claim was released, or `kept` until its lease runs out (its outcome
/// unknown, or its answer being stored).
pub(crate) fn handler_failed(e: &tokio::task::JoinError, kept: bool) -> Response {
    if kept {
        count(Outcome::Kept);
        warn!(
            panicked = e.is_panic(),
            "the request did not finish; its claim is kept until its lease runs out"
        );
    } else {
        count(Outcome::Released);
        warn!(
            panicked = e.is_panic(),
            "the handler did not finish; its claim was released"
        );
    }
    IdempotencyRejection::HandlerFailed.into_response()
}

/// Releases the claim if the request ends without finishing it: the
/// handler panicked, or its task was dropped.
pub(crate) struct ReleaseGuard {
    store: Arc<dyn Store>,
    /// The handler's handle, which holds the claim: a claim the handler
    /// keeps ([`Idempotency::keep_claim`]) is not released when the request
    /// ends unfinished.
    handle: Idempotency,
    armed: bool,
}

impl ReleaseGuard {
    /// A guard of `claim`, as for a handler that never touched its handle.
    #[cfg(test)]
    pub(crate) fn new(store: Arc<dyn Store>, claim: Claim) -> Self {
        let policy = Arc::new(idem_core::Policy::default());
        let handle = Idempotency::new(claim, policy, std::time::Instant::now());
        Self::watching(store, &handle)
    }

    /// A guard of `handle`'s claim that leaves it alone if `handle` keeps it.
    pub(crate) fn watching(store: Arc<dyn Store>, handle: &Idempotency) -> Self {
        Self {
            store,
            handle: handle.clone(),
            armed: true,
        }
    }

    fn claim(&self) -> &Claim {
        self.handle.claim()
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    /// Leaves the claim as it stands (completed, kept, or lost to another
    /// attempt): neither released nor completed here, and the store told
    /// this process is done with it.
    async fn leave(&mut self) {
        self.armed = false;
        self.store.settled(self.handle.claim()).await;
    }

    async fn release_now(&mut self) {
        self.armed = false;
        release(&*self.store, self.handle.claim()).await;
    }
}

/// Releases `claim` so that the next retry runs afresh.
pub(crate) async fn release(store: &dyn Store, claim: &Claim) {
    let started = std::time::Instant::now();
    let released = store.release(claim).await;
    timed(store.kind(), StoreOp::Release, started);
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
        if self.handle.kept_if_unfinished() {
            warn!(key = ?self.claim().key, panicking, "the request did not finish while its outcome was unknown or being stored; the claim is kept until its lease runs out");
            return;
        }
        warn!(key = ?self.claim().key, panicking, "the handler did not finish; releasing the claim");
        // The decision table's "handler panicked or was dropped" row: release.
        let store = self.store.clone();
        let claim = self.claim().clone();
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
    use std::time::Duration;

    use super::*;
    use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, RecordState};
    use idem_memory::MemoryStore;

    #[tokio::test]
    async fn dropping_an_unfinished_guard_releases_the_claim() {
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
        let again = loop {
            match store.claim(&request).await.unwrap() {
                ClaimOutcome::Acquired(again) => break again,
                // the release runs on a task of its own
                ClaimOutcome::Existing(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        assert!(again.takeover);
        assert_eq!(again.operation_id, claim.operation_id);

        // a guard whose handler keeps its claim (the outcome is unknown)
        // leaves it alone
        let handle = Idempotency::new(
            again.clone(),
            Arc::new(idem_core::Policy::default()),
            std::time::Instant::now(),
        );
        handle.keep_claim();
        drop(ReleaseGuard::watching(store.clone(), &handle));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let record = store.get("s", "k").await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::InProgress { token, .. } if token == again.token)
        );
        // ... and releases it once the outcome is known
        handle.settle_by_answer();
        drop(ReleaseGuard::watching(store.clone(), &handle));
        let released = loop {
            match store.claim(&request).await.unwrap() {
                ClaimOutcome::Acquired(c) => break c,
                ClaimOutcome::Existing(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        assert_eq!(released.operation_id, claim.operation_id);
        let again = released;

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
