//! [`PendingClaim`]: the key a handler claims itself, inside its own
//! transaction (see [`IdempotencyLayer::claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction)).

use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;
use idem_core::{ClaimInTransaction, ClaimRequest, Fingerprint, Policy, TxClaimOutcome};
use tracing::{debug, info};

use crate::extract::{Idempotency, MissingIdempotency};
use crate::service::{count, store_unavailable, timed, Step, Turns};

#[derive(Debug)]
struct Inner {
    request: ClaimRequest,
    policy: Policy,
    claimed: Mutex<Option<Idempotency>>,
}

/// A request the layer has checked (key, body size, fingerprint) but not
/// claimed: the handler claims it inside its own transaction with
/// [`claim_in`](PendingClaim::claim_in). Given to handlers by a layer built
/// with [`IdempotencyLayer::claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction).
///
/// ```no_run
/// use axum::response::{IntoResponse, Response};
/// use http::StatusCode;
/// use idem_axum::PendingClaim;
/// use idem_postgres::PostgresStore;
///
/// async fn pay(store: PostgresStore, pending: PendingClaim) -> Response {
///     let Ok(mut tx) = store.pool().begin().await else {
///         return StatusCode::SERVICE_UNAVAILABLE.into_response();
///     };
///     let idem = match pending.claim_in(&store, &mut *tx).await {
///         Ok(idem) => idem,
///         // a replay, 409 or 422: answer it as it is
///         Err(answered) => return answered.into_response(),
///     };
///     // ... the effect, on `tx`, under `idem.operation_id()` ...
///     let response = (StatusCode::CREATED, "paid").into_response();
///     match idem.complete_in(&store, &mut *tx, response).await {
///         Ok(response) => match tx.commit().await {
///             Ok(()) => response,
///             Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
///         },
///         Err(e) => e.into_response(), // `tx` rolls back when dropped
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct PendingClaim {
    inner: Arc<Inner>,
}

/// What the layer answers instead of the handler: the stored response (a
/// replay), `409` (in flight), `422` (key reused with another request) or
/// `503` (store unavailable). Return it as it is; roll the transaction back.
#[derive(Debug)]
pub struct Answered {
    response: Response,
}

impl Answered {
    /// The status of the answer.
    pub fn status(&self) -> StatusCode {
        self.response.status()
    }
}

impl IntoResponse for Answered {
    fn into_response(self) -> Response {
        self.response
    }
}

impl PendingClaim {
    pub(crate) fn new(request: ClaimRequest, policy: Policy) -> Self {
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

    /// The claim made so far, if any.
    pub(crate) fn claimed(&self) -> Option<Idempotency> {
        self.inner
            .claimed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Claims the key on `conn`, the handler's open transaction on `store`
    /// (the store the layer uses, e.g. a `PostgresStore` with a
    /// `PgConnection`).
    ///
    /// `Ok` gives the claim to run under: complete it in the same
    /// transaction with [`Idempotency::complete_in`] and commit. `Err` is
    /// the answer to send instead of running (drop the transaction). Calling
    /// it again after `Ok` returns the same claim.
    pub async fn claim_in<S, C>(&self, store: &S, conn: &mut C) -> Result<Idempotency, Answered>
    where
        S: ClaimInTransaction<C>,
        C: ?Sized + Send,
    {
        if let Some(claimed) = self.claimed() {
            return Ok(claimed);
        }
        let request = &self.inner.request;
        let mut turns = Turns::new(&self.inner.policy);
        loop {
            let started = std::time::Instant::now();
            let outcome = store.claim_in_tx(conn, request).await;
            timed(store.kind(), "claim", started);
            let step = match outcome {
                Ok(TxClaimOutcome::Acquired(claim)) => {
                    count(if claim.takeover { "takeover" } else { "fresh" });
                    if claim.takeover {
                        info!(operation_id = %claim.operation_id, "took over a released or expired claim");
                    } else {
                        debug!(operation_id = %claim.operation_id, "claimed in the handler's transaction");
                    }
                    let handle = Idempotency::new(claim, self.inner.policy.clone());
                    *self.inner.claimed.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(handle.clone());
                    return Ok(handle);
                }
                Ok(TxClaimOutcome::Existing(record)) => turns.judge(&record, &request.fingerprint),
                Ok(TxClaimOutcome::Busy) => turns.busy(),
                Err(e) => {
                    return Err(Answered {
                        response: store_unavailable(&e),
                    })
                }
            };
            match step {
                Step::Answer(response) => return Err(Answered { response }),
                Step::Again(pause) => tokio::time::sleep(pause).await,
            }
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for PendingClaim {
    type Rejection = MissingIdempotency;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<PendingClaim>()
            .cloned()
            .ok_or(MissingIdempotency)
    }
}
