//! [`DeferredClaim`]: the key a handler claims itself, inside its own
//! transaction (see [`IdempotencyLayer::claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction)).

use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;
use idem_core::{
    on_arrival, Arrival, ClaimInTransaction, ClaimRequest, Fingerprint, Policy, Store,
    TxClaimOutcome, UnixMillis,
};
use idem_once::Refusal;
use tracing::debug;

use crate::claim::{claim_until_decided, claimed, refused, Found};
use crate::extract::Idempotency;
use crate::rejection::IdempotencyRejection;

#[derive(Debug)]
struct Inner {
    request: ClaimRequest,
    policy: Arc<Policy>,
    claimed: Mutex<Option<Idempotency>>,
}

/// A request the layer has checked (key, body size, fingerprint) but not
/// claimed: the handler claims it and gets the transaction that holds the
/// claim, with [`begin`](DeferredClaim::begin). Given to handlers by a layer
/// built with [`IdempotencyLayer::claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction).
///
/// The claim commits before `begin` returns, so the key is bound to this
/// request and its operation id before any effect can leave the process; the
/// transaction then holds it until it ends. End it explicitly (commit, or
/// roll back) before answering.
///
/// ```no_run
/// use axum::response::{IntoResponse, Response};
/// use http::StatusCode;
/// use idem_axum::DeferredClaim;
/// use idem_postgres::PostgresStore;
///
/// async fn pay(store: PostgresStore, pending: DeferredClaim) -> Response {
///     let (mut tx, idem) = match pending.begin(&store).await {
///         Ok(held) => held,
///         // a replay, 409, 422 or 503: answer it as it is (no transaction)
///         Err(answered) => return answered.into_response(),
///     };
///     // ... the effect, on `tx`, under `idem.operation_id()` ...
///     let response = (StatusCode::CREATED, "paid").into_response();
///     match idem.complete_in(&store, &mut *tx, response).await {
///         Ok(response) => match tx.commit().await {
///             Ok(()) => response,
///             Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
///         },
///         Err(e) => {
///             let _ = tx.rollback().await; // end it before answering
///             e.into_response()
///         }
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct DeferredClaim {
    inner: Arc<Inner>,
}

/// What [`DeferredClaim::begin`] answers instead of running the handler: the
/// stored response (a replay), `409` (in flight), `422` (key reused with
/// another request) or `503` (store unavailable). Return it as it is: no
/// transaction was begun.
#[derive(Debug)]
pub struct ClaimRefused {
    response: Response,
}

impl ClaimRefused {
    /// The status of the answer.
    pub fn status(&self) -> StatusCode {
        self.response.status()
    }
}

impl IntoResponse for ClaimRefused {
    fn into_response(self) -> Response {
        self.response
    }
}

impl DeferredClaim {
    pub(crate) fn new(request: ClaimRequest, policy: Arc<Policy>) -> Self {
        Self {
            inner: Arc::new(Inner {
                request,
                policy,
                claimed: Mutex::new(None),
            }),
        }
    }

    /// The idempotency key.
    pub fn key(&self) -> &str {
        &self.inner.request.key
    }

    /// The scope the key belongs to.
    pub fn scope(&self) -> &str {
        &self.inner.request.scope
    }

    /// The request's fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.inner.request.fingerprint
    }

    /// What the layer asked to claim (with the policy's lease).
    pub(crate) fn request(&self) -> &ClaimRequest {
        &self.inner.request
    }

    /// The claim made so far, if any.
    pub(crate) fn claimed(&self) -> Option<Idempotency> {
        self.inner
            .claimed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The answer the key's record gives without a claim, if it gives one:
    /// the replay of a completed request, or `422` for a key bound to
    /// another request. One read of `store` (the store the layer uses);
    /// nothing is written, claimed or begun.
    ///
    /// For a handler that must wait for a turn before [`begin`](Self::begin)
    /// (a bulkhead on the transactions it holds open): repeats of finished
    /// requests are answered without waiting behind new ones. `None` (no
    /// record, or none past its retention; one in flight, whose lease only
    /// the store's clock and, on PostgreSQL, the holding transaction's lock
    /// decide; or a store that could not be read): go on to `begin`, which
    /// decides. The read is bounded by the policy's store timeout (an
    /// answer then: `None`); bound the wait for a turn yourself.
    pub async fn answered_by_record<S>(&self, store: &S) -> Option<ClaimRefused>
    where
        S: Store + ?Sized,
    {
        let request = &self.inner.request;
        let read = store.get(&request.scope, &request.key);
        let record = match within_store_timeout(&self.inner.policy, read).await {
            Ok(Some(record)) => record,
            Ok(None) => return None,
            Err(e) => {
                debug!(error = %e, "the key's record could not be read; the claim decides");
                return None;
            }
        };
        let policy = &self.inner.policy;
        let refusal = match on_arrival(
            policy,
            Some(&record),
            &request.fingerprint,
            UnixMillis::now(),
        ) {
            Arrival::Replay => Refusal::Replay(record),
            Arrival::Mismatch => Refusal::Mismatch,
            // In flight, or a lease to take over: this process's clock is
            // not the store's, which decides leases (and, on PostgreSQL, the
            // lock of the transaction holding it): the claim decides, as it
            // does a new key.
            Arrival::Conflict { .. } | Arrival::Wait { .. } | Arrival::TakeOver | Arrival::Run => {
                return None
            }
        };
        Some(ClaimRefused {
            response: refused(refusal, policy),
        })
    }

    /// Claims the key on `store` (the store the layer uses) and begins the
    /// transaction that holds the claim.
    ///
    /// `Ok` gives the open transaction and the claim to run under: complete
    /// it in that transaction with [`Idempotency::complete_in`] and commit,
    /// or roll back (the claim is then free for a retry of the same request
    /// at once). `Err` is the answer to send instead of running. A second
    /// call after `Ok` answers `500`: the claim has its transaction already.
    pub async fn begin<S>(&self, store: &S) -> Result<(S::Transaction, Idempotency), ClaimRefused>
    where
        S: ClaimInTransaction,
    {
        if self.claimed().is_some() {
            return Err(ClaimRefused {
                response: IdempotencyRejection::ClaimedTwice.into_response(),
            });
        }
        let request = &self.inner.request;
        let (claim, transaction, claimed_at) = claim_until_decided(
            &self.inner.policy,
            &request.fingerprint,
            store.kind(),
            || async {
                let sent = std::time::Instant::now();
                let claimed = store.claim_and_begin(request);
                Ok(
                    match within_store_timeout(&self.inner.policy, claimed).await? {
                        TxClaimOutcome::Acquired { claim, transaction } => {
                            Found::Acquired((claim, transaction, sent))
                        }
                        TxClaimOutcome::Existing(record) => Found::Existing(record),
                        TxClaimOutcome::Busy => Found::Busy,
                    },
                )
            },
        )
        .await
        .map_err(|response| ClaimRefused { response })?;
        claimed(&claim, true);
        let handle = Idempotency::new(claim, self.inner.policy.clone(), claimed_at);
        *self.inner.claimed.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle.clone());
        Ok((transaction, handle))
    }
}

/// `call`'s answer, or the store unavailable once the policy's store
/// timeout passed without one (a network partition): the handler answers
/// `503` rather than wait, as the layer's own store calls do. A claim the
/// call may have committed meanwhile is held by no transaction, so its
/// lease (none, for a claim held by a transaction) frees it.
async fn within_store_timeout<T>(
    policy: &Policy,
    call: impl std::future::Future<Output = Result<T, idem_core::StoreError>>,
) -> Result<T, idem_core::StoreError> {
    let limit = policy.store_timeout();
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(idem_core::StoreError::Unavailable(Box::new(
            idem_once::StoreTimedOut(limit),
        )))
    })
}

impl<S: Send + Sync> FromRequestParts<S> for DeferredClaim {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<DeferredClaim>()
            .cloned()
            .ok_or(IdempotencyRejection::LayerMissing)
    }
}
