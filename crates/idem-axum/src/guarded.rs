//! [`Guarded`]: a handler's claim together with the layer's store, and one
//! call that runs the business transaction and completes the record in it.

use std::any::Any;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::{BeginTransaction, BoxFuture, OperationId};
use tracing::{error, warn};

use crate::extract::Idempotency;
use crate::rejection::IdempotencyRejection;

/// The concrete store the layer was built with
/// ([`IdempotencyLayer::from_store`](crate::IdempotencyLayer::from_store)),
/// handed to [`Guarded`] through the request's extensions.
#[derive(Clone)]
pub(crate) struct LayerStore(pub(crate) Arc<dyn Any + Send + Sync>);

/// What a guarded handler gets: its claim ([`Idempotency`]) and the store
/// the layer claimed it in, so the store is named once (in
/// [`IdempotencyLayer::from_store`](crate::IdempotencyLayer::from_store))
/// and the record can only be completed where it was claimed.
///
/// [`transaction`](Guarded::transaction) is the whole of a guarded
/// handler: it begins the transaction, runs your work in it, completes the
/// record in the same transaction (fenced by this attempt's token), and
/// commits, ending the transaction explicitly on every way out.
///
/// ```no_run
/// use axum::{http::StatusCode, response::Response, routing::post, Router};
/// use idem_axum::{Guarded, IdempotencyLayer, SingleScope};
/// use idem_core::Policy;
/// use idem_sqlite::SqliteStore;
///
/// async fn create_order(guard: Guarded<SqliteStore>, body: String) -> Response {
///     let operation_id = guard.operation_id().to_string();
///     guard
///         .transaction(|tx| Box::pin(async move {
///             sqlx::query("INSERT INTO orders (operation_id, body) VALUES (?1, ?2)")
///                 .bind(operation_id)
///                 .bind(body)
///                 .execute(&mut **tx)
///                 .await?; // a database error: rolled back, 503, the claim released
///             Ok((StatusCode::CREATED, "created"))
///         }))
///         .await
/// }
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::connect("sqlite:app.db").await?;
/// let layer = IdempotencyLayer::from_store(store, Policy::default(), SingleScope("app".into()));
/// let app: Router = Router::new().route("/orders", post(create_order).route_layer(layer));
/// # Ok(()) }
/// ```
///
/// Extracting it is a `500` (`idempotency-layer-missing`) on a route the
/// layer does not guard, or whose layer was built with another store type
/// (or with [`IdempotencyLayer::new`](crate::IdempotencyLayer::new), which
/// knows its store only as `dyn Store`). Under
/// [`claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction),
/// use [`DeferredClaim`](crate::DeferredClaim) instead.
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    idempotency: Idempotency,
    store: S,
}

/// What a guarded transaction's work returns instead of its answer: the
/// transaction is rolled back and this is the answer.
///
/// Any error converts with `?` (a database error, say), and answers `503`
/// (`store-unavailable`, with `Retry-After`): nothing committed, the layer
/// releases the claim, and a retry with the same key runs afresh. For an
/// answer of your own (a `4xx` the business refuses with, stored and
/// replayed like any `4xx`), use [`HandlerError::answer`].
pub struct HandlerError {
    response: Response,
}

impl std::fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerError")
            .field("status", &self.response.status())
            .finish()
    }
}

impl HandlerError {
    /// Rolls back and answers with `answer`, an error (`4xx` or `5xx`). A
    /// success here would be stored and replayed for work that never
    /// committed, so it is answered as `500` (`handler-failed`) instead.
    pub fn answer(answer: impl IntoResponse) -> Self {
        let response = answer.into_response();
        if response.status().as_u16() < 400 {
            error!(status = %response.status(), "HandlerError::answer with a success: answered 500");
            return Self {
                response: IdempotencyRejection::HandlerFailed.into_response(),
            };
        }
        Self { response }
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        warn!(error = %e, "the guarded transaction failed; rolled back");
        Self::answer(IdempotencyRejection::StoreUnavailable)
    }
}

impl<S> Guarded<S> {
    /// The claim.
    pub fn idempotency(&self) -> &Idempotency {
        &self.idempotency
    }

    /// The operation id, stable across retries, takeovers and releases:
    /// pass it to external systems as *their* idempotency key.
    pub fn operation_id(&self) -> OperationId {
        self.idempotency.operation_id()
    }

    /// The store the layer claimed in.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Runs `work` in a new transaction on the store's database, completes
    /// the record with its answer in the same transaction (fenced by this
    /// attempt's token) and commits: the business write and the record
    /// commit together, or neither does.
    ///
    /// - `work` fails ([`HandlerError`]): rolled back; its answer is sent.
    /// - `work` answers `5xx` (or a `4xx` the policy does not store):
    ///   rolled back (never committed with an answer that releases the
    ///   claim); sent as it is, and the layer releases the claim.
    /// - Another attempt took the claim over: rolled back; `409`.
    /// - Beginning or committing fails: `503`, and the claim is released.
    ///
    /// Every way out ends the transaction explicitly before answering.
    pub async fn transaction<R, F>(&self, work: F) -> Response
    where
        S: BeginTransaction + Send + Sync,
        R: IntoResponse + Send,
        F: for<'t> FnOnce(&'t mut S::Transaction) -> BoxFuture<'t, Result<R, HandlerError>> + Send,
    {
        let mut tx = match self.store.begin_transaction().await {
            Ok(tx) => tx,
            Err(e) => {
                warn!(error = %e, "the guarded transaction could not begin");
                return IdempotencyRejection::StoreUnavailable.into_response();
            }
        };
        let response = match work(&mut tx).await {
            Ok(answer) => answer.into_response(),
            Err(e) => return rolled_back::<S>(tx, e.response).await,
        };
        if self.idempotency.releases(response.status()) {
            // Never committed with an answer that releases the claim.
            return rolled_back::<S>(tx, response).await;
        }
        let completed = self
            .idempotency
            .complete_in(&self.store, S::connection(&mut tx), response)
            .await;
        let response = match completed {
            Ok(response) => response,
            Err(e) => return rolled_back::<S>(tx, e.into_response()).await,
        };
        match S::commit(tx).await {
            Ok(()) => response,
            Err(e) => {
                warn!(error = %e, "the guarded transaction could not commit");
                IdempotencyRejection::StoreUnavailable.into_response()
            }
        }
    }
}

/// Rolls `tx` back, then answers `response`.
async fn rolled_back<S: BeginTransaction>(tx: S::Transaction, response: Response) -> Response {
    if let Err(e) = S::rollback(tx).await {
        // The connection is gone: so is the transaction.
        warn!(error = %e, "rollback failed");
    }
    response
}

impl<S, State> FromRequestParts<State> for Guarded<S>
where
    S: Clone + Send + Sync + 'static,
    State: Send + Sync,
{
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &State) -> Result<Self, Self::Rejection> {
        let idempotency = parts
            .extensions
            .get::<Idempotency>()
            .cloned()
            .ok_or(IdempotencyRejection::LayerMissing)?;
        let store = parts
            .extensions
            .get::<LayerStore>()
            .and_then(|s| s.0.downcast_ref::<S>())
            .cloned()
            .ok_or_else(|| {
                error!(
                    wanted = std::any::type_name::<S>(),
                    "Guarded: the layer's store is not of this type; build the layer with IdempotencyLayer::from_store"
                );
                IdempotencyRejection::LayerMissing
            })?;
        Ok(Self { idempotency, store })
    }
}
