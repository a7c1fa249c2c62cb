//! The [`Idempotency`] extractor: what a guarded handler knows about its claim.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http_body_util::BodyExt;
use idem_core::{
    Claim, FencingToken, OperationId, Policy, StoreError, StoredResponse, TransactionalStore,
};

use crate::rejection::IdempotencyRejection;

/// How the handler left the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completion {
    /// The layer completes the record after the handler answers.
    ByLayer,
    /// The handler wrote the completion into its own transaction.
    InTransaction,
    /// The handler found its claim taken over; nothing may be stored.
    Lost,
    /// The handler cannot know whether its effect happened: the claim is
    /// kept (neither completed nor released) until its lease runs out.
    Kept,
    /// The answer is not the request's outcome (a rate limit): the claim
    /// is released whatever its status.
    Released,
    /// The answer is the request's outcome whatever its status: the layer
    /// stores it, a `5xx` too.
    Stored,
}

#[derive(Debug)]
struct Inner {
    claim: Claim,
    policy: Arc<Policy>,
    /// When the winning claim was sent: its lease counts from then.
    claimed_at: std::time::Instant,
    completion: Mutex<Completion>,
    /// Set by the layer once the handler answered an outcome it stores:
    /// from then on a panic (its body stream, the store's driver) keeps
    /// the claim, as a failure to store does. The handler's own word
    /// (`completion`) cannot undo it.
    answering: std::sync::atomic::AtomicBool,
}

/// The claim a guarded handler runs under, given to it by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// - [`operation_id`](Idempotency::operation_id) is stable across retries and
///   takeovers: pass it to external systems as *their* idempotency key.
/// - On a SQL store, complete the record in the handler's own transaction
///   with [`complete_in`](Idempotency::complete_in),
///   so that the business write and the record commit together, fenced by
///   the claim's token. Handlers that don't are completed by the layer after
///   they answer.
///
/// Extracting it outside the layer is a `500`; use `Option<Idempotency>` on
/// routes that may run without it.
#[derive(Debug, Clone)]
pub struct Idempotency {
    inner: Arc<Inner>,
}

/// A transactional completion failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompleteError {
    /// Another attempt took the claim over; roll the transaction back.
    #[error("the idempotency claim was taken over by another attempt; roll back")]
    ClaimLost,
    /// The store failed; roll the transaction back.
    #[error("the idempotency store failed")]
    Store(#[source] StoreError),
    /// The handler's response body could not be read.
    #[error("the response body could not be read")]
    Body(#[source] axum::Error),
    /// The answer is one the policy does not store (a `5xx`, a "try again
    /// later" `408`, `425` or `429`, or any `4xx` under
    /// `store_client_errors(false)`): the layer releases the claim
    /// and a retry runs again, so the transaction must not commit either.
    /// Roll it back and send the answer (this error's response is it).
    #[error("an answer that is not stored ({}): roll the transaction back", .0.status())]
    NotStored(Response),
}

impl IntoResponse for CompleteError {
    fn into_response(self) -> Response {
        match self {
            CompleteError::ClaimLost => IdempotencyRejection::TakenOver,
            CompleteError::Store(_) => IdempotencyRejection::StoreUnavailable,
            CompleteError::Body(_) => IdempotencyRejection::ResponseUnreadable,
            CompleteError::NotStored(response) => return response,
        }
        .into_response()
    }
}

impl Idempotency {
    pub(crate) fn new(claim: Claim, policy: Arc<Policy>, claimed_at: std::time::Instant) -> Self {
        Self {
            inner: Arc::new(Inner {
                claim,
                policy,
                claimed_at,
                completion: Mutex::new(Completion::ByLayer),
                answering: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// The operation id, stable across retries, takeovers and releases.
    pub fn operation_id(&self) -> OperationId {
        self.inner.claim.operation_id
    }

    /// The idempotency key.
    pub fn key(&self) -> &str {
        &self.inner.claim.key
    }

    /// The scope the key belongs to.
    pub fn scope(&self) -> &str {
        &self.inner.claim.scope
    }

    /// How much of this attempt's lease is left, on this process's clock
    /// (counted from when the claim was sent, so never more than the
    /// store's): past it, a retry may take the key over.
    pub fn lease_left(&self) -> std::time::Duration {
        self.inner
            .policy
            .lease()
            .saturating_sub(self.inner.claimed_at.elapsed())
    }

    /// This attempt's fencing token.
    pub fn token(&self) -> FencingToken {
        self.inner.claim.token
    }

    /// Whether this attempt took over an earlier one that crashed, stalled
    /// past its lease, or failed with `5xx`.
    pub fn is_takeover(&self) -> bool {
        self.inner.claim.takeover
    }

    /// The whole claim.
    pub fn claim(&self) -> &Claim {
        &self.inner.claim
    }

    /// This request's operation, for named steps
    /// ([`Operation::step`](idem_once::Operation::step)) on `store`, the
    /// store the layer claims in: each step runs once per operation, and a
    /// retry that takes the request over after a crash resumes at the
    /// first step not done, under the same operation id.
    pub fn operation<'s, S: idem_core::Store + ?Sized>(
        &self,
        store: &'s S,
    ) -> idem_once::Operation<'s, S> {
        idem_once::Operation::new(
            store,
            self.inner.claim.clone(),
            &self.inner.policy,
            self.inner.claimed_at,
        )
    }

    /// Whether an answer with `status` releases the claim rather than
    /// being stored (`5xx`; `4xx` when the policy does not store client
    /// errors): the one rule the layer applies after the handler.
    pub(crate) fn releases(&self, status: http::StatusCode) -> bool {
        if self.completion() == Completion::Stored {
            return false;
        }
        idem_core::on_handler_end(
            &self.inner.policy,
            idem_core::HandlerEnd::Answered {
                status: status.as_u16(),
            },
        ) == idem_core::Settlement::Release
    }

    /// Whether a handler that ends without a stored answer (a panic, a
    /// failed service, a dropped task) leaves this claim held until its
    /// lease runs out rather than releasing it: its outcome is unknown
    /// ([`keep_claim`](Self::keep_claim)), or it answered an outcome that
    /// was being stored ([`store_answer`](Self::store_answer), or the
    /// layer reading and storing it).
    pub(crate) fn kept_if_unfinished(&self) -> bool {
        self.inner
            .answering
            .load(std::sync::atomic::Ordering::SeqCst)
            || matches!(self.completion(), Completion::Kept | Completion::Stored)
    }

    /// Marks the handler's answer as the outcome being stored: a panic
    /// from here on keeps the claim.
    pub(crate) fn answering(&self) {
        self.inner
            .answering
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn completion(&self) -> Completion {
        *self
            .inner
            .completion
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the layer that this attempt lost its claim: its lease ran
    /// out (a step said [`StepError::LeaseLost`](idem_once::StepError::LeaseLost))
    /// or another attempt took it over. Whatever the handler answers is
    /// then not stored, and the claim is neither completed nor released:
    /// the retry takes it over (after the lease) and resumes. Answer the
    /// client `409` (`IdempotencyRejection::TakenOver`) so that it retries.
    pub fn abandon(&self) {
        self.set_completion(Completion::Lost);
    }

    /// Tells the layer that this attempt's outcome is unknown (a call it
    /// made timed out, or its connection broke after the request was
    /// sent): whatever the handler answers (`504`, `502`) is passed on but
    /// neither stored nor releases the claim, which stays until its lease
    /// runs out. A retry before then gets `409`; one after it takes the
    /// claim over under the same operation id, so the effect is never
    /// attempted twice at once. This is how `idem proxy` treats an
    /// upstream that did not answer.
    ///
    /// Call it **before** starting an effect whose outcome may be lost, and
    /// [`settle_by_answer`](Self::settle_by_answer) once the outcome is
    /// known: if the handler panics or its task is dropped in between (a
    /// process shutting down), the claim is kept rather than released, so
    /// no retry runs beside an effect that may still be going on.
    ///
    /// With a claim held by the handler's transaction
    /// ([`DeferredClaim`](crate::DeferredClaim)), the transaction is the
    /// claim's lease: once it ends nothing holds the key, so the layer
    /// takes the key over for a lease as the handler returns (or panics).
    /// A retry arriving between the transaction's end and the handler's
    /// return is not held off: end the transaction just before answering.
    pub fn keep_claim(&self) {
        self.set_completion(Completion::Kept);
    }

    /// Tells the layer that the answer is not the outcome of the request
    /// (a rate limit, `429`, or `408`/`425` from a system called): the
    /// claim is released whatever the status, so the retry runs, under
    /// the same operation id.
    pub fn release_claim(&self) {
        self.set_completion(Completion::Released);
    }

    /// Tells the layer that the answer is the request's outcome whatever
    /// its status: it is stored and replayed, a `5xx` too. For an answer
    /// that reports an effect which happened but cannot be given back, as
    /// `idem proxy`'s `502` for an upstream answer too large to keep: the
    /// upstream acted, so a retry must get that answer, never reach the
    /// upstream again. Call it just before returning that answer: a
    /// handler that ends without answering after it (a panic, a dropped
    /// task) keeps its claim until its lease runs out, as with
    /// [`keep_claim`](Self::keep_claim). The layer's own refusals (a
    /// `503` when the store is away, the `409` of a step in flight) still
    /// release the claim: they say nothing ran.
    pub fn store_answer(&self) {
        self.set_completion(Completion::Stored);
    }

    /// Undoes [`keep_claim`](Self::keep_claim),
    /// [`release_claim`](Self::release_claim) or
    /// [`store_answer`](Self::store_answer): the answer is stored or
    /// releases the claim by its status, as usual.
    pub fn settle_by_answer(&self) {
        let mut completion = self
            .inner
            .completion
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if matches!(
            *completion,
            Completion::Kept | Completion::Released | Completion::Stored
        ) {
            *completion = Completion::ByLayer;
        }
    }

    fn set_completion(&self, c: Completion) {
        *self
            .inner
            .completion
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = c;
    }

    /// Buffers `response` and returns what the store keeps of it (status,
    /// allow-listed headers, body) with the response rebuilt for sending.
    /// The building block of transactional completion for any SQL store.
    pub(crate) async fn stage(
        &self,
        response: Response,
    ) -> Result<(StoredResponse, Response), CompleteError> {
        let (parts, body) = response.into_parts();
        let bytes = body
            .collect()
            .await
            .map_err(CompleteError::Body)?
            .to_bytes();
        let stored = stored_response(&self.inner.policy, &parts, bytes.clone());
        Ok((stored, Response::from_parts(parts, Body::from(bytes))))
    }

    /// Records the outcome of a completion the handler wrote itself, through
    /// a store's own transactional API: `Ok` tells the layer not to complete
    /// the record again; [`StoreError::ClaimLost`] tells it to store nothing.
    /// Returns the error for the handler to act on (roll back).
    pub(crate) fn record_transactional_completion(
        &self,
        result: Result<(), StoreError>,
    ) -> Result<(), CompleteError> {
        match result {
            Ok(()) => {
                self.set_completion(Completion::InTransaction);
                Ok(())
            }
            Err(StoreError::ClaimLost) => {
                self.set_completion(Completion::Lost);
                Err(CompleteError::ClaimLost)
            }
            Err(e) => Err(CompleteError::Store(e)),
        }
    }

    /// Completes the record inside the handler's own transaction `conn` on
    /// `store` (the store the layer uses, e.g. a `SqliteStore` with a
    /// `SqliteConnection`, a `PostgresStore` with a `PgConnection`), fenced
    /// by this attempt's token, and returns the response to send.
    ///
    /// On `Err`, drop (roll back) the transaction and answer with the error
    /// (it is [`IntoResponse`]): the effect must not commit. If the commit
    /// itself fails afterwards, answer `5xx` and the layer releases the claim.
    ///
    /// An answer the policy does not store (a `5xx`, a "try again later"
    /// `408`, `425` or `429`, or any `4xx` under
    /// `store_client_errors(false)`) is not written, and comes back as
    /// [`CompleteError::NotStored`]: the layer releases the claim, the
    /// retry runs again, so the transaction's effect must roll back with
    /// it (the error's response is the answer, unchanged).
    pub async fn complete_in<S, C>(
        &self,
        store: &S,
        conn: &mut C,
        response: Response,
    ) -> Result<Response, CompleteError>
    where
        S: TransactionalStore<C>,
        C: ?Sized,
    {
        if self.releases(response.status()) {
            return Err(CompleteError::NotStored(response));
        }
        let (stored, response) = self.stage(response).await?;
        let result = store.complete_in_tx(conn, &self.inner.claim, &stored).await;
        self.record_transactional_completion(result)?;
        Ok(response)
    }
}

/// What the store keeps of a response: status, allow-listed headers, body.
pub(crate) fn stored_response(
    policy: &Policy,
    parts: &http::response::Parts,
    body: bytes::Bytes,
) -> StoredResponse {
    StoredResponse {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| policy.replays_header(name.as_str()))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect(),
        body,
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Idempotency {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Idempotency>()
            .cloned()
            .ok_or(IdempotencyRejection::LayerMissing)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Idempotency {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Idempotency>().cloned())
    }
}
