//! One guarded request's way through the phases: reading it
//! ([`request`](crate::request)), claiming its key ([`claim`](crate::claim)),
//! running the handler on a task of its own, and finishing
//! ([`finish`](crate::finish)).

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::Request;
use idem_core::{ClaimOutcome, ClaimRequest};
use tower::Service;
use tracing::{debug, warn, Instrument};

use crate::claim::{claim_until_decided, claimed, Found};
use crate::config::Config;
use crate::deferred::DeferredClaim;
use crate::extract::{Completion, Idempotency};
use crate::finish::{finish_result, handler_failed, release, ReleaseGuard};
use crate::metrics::{count, Outcome};
use crate::request::{self, Identified};
use idem_once::detached::Running;

/// Serves one request the layer guards.
pub(crate) async fn handle<S>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let (parts, body) = request.into_parts();
    let (scope, key) = match request::identify(&config, &parts) {
        Identified::Guarded { scope, key } => (scope, key),
        Identified::PassThrough => {
            let Some(check) = &config.validate else {
                return inner.call(Request::from_parts(parts, body)).await;
            };
            // Unguarded (no key, none required) but still validated: a
            // handler may count on the check having passed, whether or
            // not the client sent a key.
            let bytes = match request::read_bounded(&config.policy, &parts, body).await {
                Ok(bytes) => bytes,
                Err(refused) => return Ok(refused),
            };
            if let Err(refused) = validated(check.as_ref(), &parts, &bytes) {
                return Ok(refused);
            }
            return inner
                .call(Request::from_parts(parts, Body::from(bytes)))
                .await;
        }
        Identified::Refused(refused) => return Ok(refused),
    };
    // Counted from here (its body still to read) until its handler's task
    // ends, even once the client has gone: taken and checked in one step,
    // so requests arriving together cannot all pass one count.
    let Some(counted) = Running::admit(config.max_running) else {
        count(Outcome::Overloaded);
        debug!(max = ?config.max_running, "too many guarded requests running; refused before the claim");
        return Ok(crate::IdempotencyRejection::Overloaded {
            retry_after: config.policy.retry_after(),
        }
        .into_response());
    };
    // Scope and key come from the client: `?` (Debug) quotes and escapes
    // them, so a newline or a `" level=error` cannot forge a log field.
    let span = tracing::info_span!("idempotency", scope = ?scope, key = ?key.as_str());
    async move {
        let (claim_request, bytes) =
            match request::read_guarded(&config, &parts, body, scope, key).await {
                Ok(read) => read,
                Err(refused) => return Ok(refused),
            };
        if let Some(check) = &config.validate {
            if let Err(refused) = validated(check.as_ref(), &parts, &bytes) {
                return Ok(refused);
            }
        }
        if config.claim_in_handler {
            run_deferred(config, inner, parts, bytes, claim_request, counted).await
        } else {
            run_claimed(config, inner, parts, bytes, claim_request, counted).await
        }
    }
    .instrument(span)
    .await
}

/// The route's validator on a request read whole: its refusal, counted
/// and answered as it is (nothing claimed, nothing stored).
fn validated(
    check: &crate::config::Validator,
    parts: &http::request::Parts,
    bytes: &Bytes,
) -> Result<(), Response> {
    check(parts, bytes).inspect_err(|refused| {
        count(Outcome::Invalid);
        debug!(status = %refused.status(), "refused by validation before the claim; nothing stored");
    })
}

/// Claims the key, then runs the handler holding the claim and finishes.
async fn run_claimed<S>(
    config: Arc<Config>,
    mut inner: S,
    mut parts: http::request::Parts,
    bytes: Bytes,
    request: ClaimRequest,
    counted: Running,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    // The claim and the handler run on a task of their own: a client that
    // disconnects (or times out) cancels neither half-way. Not the handler,
    // so its answer is stored and the client's retry gets the replay; nor
    // the claim, whose store may have committed it before its answer came
    // back: dropped then, it would leave the key held for a lease by a
    // handler that never runs. If the task itself is dropped or panics,
    // the guard releases the claim.
    // The handle, for the answer if the task fails.
    let claimed_handle = Arc::new(std::sync::OnceLock::<Idempotency>::new());
    let watched = claimed_handle.clone();
    let run = async move {
        let _counted = counted;
        let store = config.store.clone();
        let found = claim_until_decided(
            &config.policy,
            &request.fingerprint,
            store.kind(),
            || async {
                let sent = std::time::Instant::now();
                Ok(match store.claim(&request).await? {
                    ClaimOutcome::Acquired(claim) => Found::Acquired((claim, sent)),
                    ClaimOutcome::Existing(record) => Found::Existing(record),
                })
            },
        )
        .await;
        let (claim, claimed_at) = match found {
            Ok(claim) => claim,
            Err(answer) => return Ok(answer),
        };
        claimed(&claim, false);
        let handle = Idempotency::new(claim.clone(), config.policy.clone(), claimed_at);
        let _ = claimed_handle.set(handle.clone());
        parts.extensions.insert(handle.clone());
        let guard = ReleaseGuard::watching(config.store.clone(), &handle);
        let result = inner
            .call(Request::from_parts(parts, Body::from(bytes)))
            .await;
        finish_result(&config, &handle, guard, result).await
    };
    match idem_once::detached::join(tokio::spawn(run.in_current_span())).await {
        Ok(result) => result,
        Err(e) => {
            let kept = watched.get().is_some_and(Idempotency::kept_if_unfinished);
            Ok(handler_failed(&e, kept))
        }
    }
}

/// Runs a handler that claims the key itself, inside its transaction
/// ([`DeferredClaim::begin`]), then finishes whatever it claimed.
async fn run_deferred<S>(
    config: Arc<Config>,
    mut inner: S,
    mut parts: http::request::Parts,
    bytes: Bytes,
    request: ClaimRequest,
    counted: Running,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    let deferred = DeferredClaim::new(request, config.policy.clone());
    parts.extensions.insert(deferred.clone());
    let watched = deferred.clone();
    let finish_config = config.clone();
    let run = async move {
        let _counted = counted;
        let result = inner
            .call(Request::from_parts(parts, Body::from(bytes)))
            .await;
        // No claim: the handler answered before claiming, or returned what
        // `begin` answered for it (a replay, 409, 422); nothing to finish.
        let Some(handle) = deferred.claimed() else {
            return result;
        };
        if matches!(
            handle.completion(),
            Completion::ByLayer | Completion::Stored
        ) && result.as_ref().is_ok_and(|r| !handle.releases(r.status()))
        {
            // Its transaction ended without completing the record: until the
            // layer completes it below, the claim looks abandoned, and a
            // duplicate arriving now would run again.
            count(Outcome::CompletedOutsideTransaction);
            warn!("the handler answered without completing its record in its transaction (Idempotency::complete_in); the layer completes it now");
        }
        let guard = ReleaseGuard::watching(finish_config.store.clone(), &handle);
        let finished = finish_result(&finish_config, &handle, guard, result).await;
        // A kept claim, or one whose answer was to be stored but never came
        // (the service failed): its effect may be going on, or done.
        let kept = match handle.completion() {
            Completion::Kept => true,
            Completion::Stored => finished.is_err(),
            _ => false,
        };
        if kept {
            hold_kept(&*finish_config.store, deferred.request()).await;
        }
        finished
    };
    match idem_once::detached::join(tokio::spawn(run.in_current_span())).await {
        Ok(result) => result,
        Err(e) => {
            // The handler's transaction rolled back with it; a claim it had
            // committed is released, unless the handler kept it.
            if let Some(handle) = watched.claimed() {
                if handle.kept_if_unfinished() {
                    hold_kept(&*config.store, watched.request()).await;
                    return Ok(handler_failed(&e, true));
                }
                release(&*config.store, handle.claim()).await;
            }
            Ok(handler_failed(&e, false))
        }
    }
}

/// A claim held by the handler's transaction, which the handler kept (its
/// outcome unknown, [`Idempotency::keep_claim`]): the committed claim's
/// lease ended as it was made (the transaction was its lease), so once the
/// transaction ended nothing holds the key, and a retry would run at once
/// beside an effect that may still be going on. Taken over now for a
/// lease, under the same operation id: a retry before it ends gets `409`,
/// one after it runs, as in the default mode.
async fn hold_kept(store: &dyn idem_core::Store, request: &ClaimRequest) {
    match store.claim(request).await {
        Ok(ClaimOutcome::Acquired(held)) => {
            debug!(key = ?held.key, "the kept claim is held for its lease");
        }
        // A retry got in between the transaction's end and this: it runs
        // (under the same operation id), or the record answers.
        Ok(ClaimOutcome::Existing(_)) => {
            warn!(key = ?request.key, "the kept claim could not be held: another attempt has the key");
        }
        Err(e) => {
            warn!(key = ?request.key, error = %e, "the kept claim could not be held for its lease; a retry may run at once");
        }
    }
}
