//! [`Guarded`]: a handler's claim together with its store, and one call
//! that runs the business transaction and completes the record in it.

use axum::extract::{FromRef, FromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::{BeginTransaction, OperationId, StoreError};
use tracing::{error, warn};

use crate::extract::Idempotency;
use crate::rejection::IdempotencyRejection;

/// What a guarded handler gets: its claim ([`Idempotency`]) and the store,
/// taken from the router's state like axum's `State<S>` (through
/// [`FromRef`]), so the compiler checks the store's type: a handler asking
/// for `Guarded<B>` on a router whose state holds an `A` does not compile.
/// Give the state the store the layer was built on (`from_store(store.clone(),
/// …)` and `.with_state(store)`); a record completed in another store is
/// fenced out (`409`), never committed twice.
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
///         .transaction(async |tx| {
///             sqlx::query("INSERT INTO orders (operation_id, body) VALUES (?1, ?2)")
///                 .bind(operation_id)
///                 .bind(body)
///                 .execute(&mut *tx)
///                 .await?; // unavailable: rolled back, 503, the claim released
///             Ok((StatusCode::CREATED, "created"))
///         })
///         .await
/// }
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::connect("sqlite:app.db").await?;
/// let layer = IdempotencyLayer::from_store(store.clone(), Policy::default(), SingleScope("app".into()));
/// let app: Router = Router::new()
///     .route("/orders", post(create_order).route_layer(layer))
///     .with_state(store);
/// # Ok(()) }
/// ```
///
/// Asking for a store the router's state does not hold does not compile:
///
/// ```compile_fail
/// # use axum::{response::Response, routing::post, Router};
/// # use idem_axum::Guarded;
/// async fn pay(guard: Guarded<idem_postgres::PostgresStore>) -> Response { todo!() }
/// # fn f(store: idem_sqlite::SqliteStore) {
/// let app: Router = Router::new().route("/pay", post(pay)).with_state(store); // SqliteStore
/// # }
/// ```
///
/// Extracting it is a `500` (`idempotency-layer-missing`) on a route the
/// layer does not guard. Under
/// [`claim_in_transaction`](crate::IdempotencyLayer::claim_in_transaction),
/// use [`DeferredClaim`](crate::DeferredClaim) instead.
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    idempotency: Idempotency,
    store: S,
}

/// What a guarded transaction's work returns instead of its answer: the
/// transaction is rolled back and this is the answer. Every way to make
/// one names the answer:
///
/// - [`HandlerError::answer`]: an answer of your own (a `4xx` the business
///   refuses with, stored and replayed like any `4xx`);
/// - [`HandlerError::unavailable`]: `503` (`store-unavailable`, with
///   `Retry-After`): nothing committed, the layer releases the claim, and a
///   retry with the same key runs afresh;
/// - [`HandlerError::failed`]: `500` (`handler-failed`), logged: a bug;
///   the claim is released too;
/// - `?` on a [`sqlx::Error`] (feature `sqlx`, on by default): `503` when a
///   retry may get past it (the database unreachable, a deadlock, a
///   serialization failure; see `idem_sql::ErrorClass`), `500` for
///   anything else (a constraint, a syntax error), never a blanket `503`;
/// - `?` on a [`StoreError`]: `503` when unavailable, `500` otherwise.
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

    /// Rolls back and answers `503` with `Retry-After`: what stopped the
    /// work may pass (the database was unreachable); the claim is released.
    pub fn unavailable(cause: impl std::fmt::Display) -> Self {
        warn!(error = %cause, "the guarded transaction could not finish; rolled back, 503");
        Self::answer(IdempotencyRejection::StoreUnavailable)
    }

    /// Rolls back and answers `500` (`handler-failed`), logging `cause`: a
    /// failure a retry will not mend. The claim is released.
    pub fn failed(cause: impl std::fmt::Display) -> Self {
        error!(error = %cause, "the guarded transaction failed; rolled back, 500");
        Self::answer(IdempotencyRejection::HandlerFailed)
    }
}

impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(_) => Self::unavailable(e),
            other => Self::failed(other),
        }
    }
}

#[cfg(feature = "sqlx")]
impl From<sqlx::Error> for HandlerError {
    /// `503` when a retry may get past it, `500` otherwise.
    fn from(e: sqlx::Error) -> Self {
        if idem_sql::classify(&e).is_retryable() {
            Self::unavailable(e)
        } else {
            Self::failed(e)
        }
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

    /// The scope (tenant, client) the key belongs to, as the layer's scope
    /// extractor found it.
    pub fn scope(&self) -> &str {
        self.idempotency.scope()
    }

    /// The store, from the router's state.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// This request's operation, for named steps on the store: each step
    /// runs once per operation (an external call under
    /// [`Step::key`](idem_once::Step::key), a transactional write with
    /// [`step_in_transaction`](idem_once::Operation::step_in_transaction)),
    /// and a retry that takes over after a crash resumes at the first step
    /// not done.
    pub fn operation(&self) -> idem_once::Operation<'_, S>
    where
        S: idem_core::Store,
    {
        self.idempotency.operation(&self.store)
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
    ///
    /// `work` is an async closure given the transaction's connection:
    /// `guard.transaction(async |tx| { … .execute(&mut *tx) … })`.
    pub async fn transaction<R, F>(&self, work: F) -> Response
    where
        S: BeginTransaction + Send + Sync,
        R: IntoResponse,
        F: AsyncFnOnce(&mut S::Connection) -> Result<R, HandlerError>,
    {
        let mut tx = match self.store.begin_transaction().await {
            Ok(tx) => tx,
            Err(e) => {
                warn!(error = %e, "the guarded transaction could not begin");
                return IdempotencyRejection::StoreUnavailable.into_response();
            }
        };
        let response = match work(S::connection(&mut tx)).await {
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
    S: FromRef<State> + Send + Sync + 'static,
    State: Send + Sync,
{
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, state: &State) -> Result<Self, Self::Rejection> {
        let idempotency = parts
            .extensions
            .get::<Idempotency>()
            .cloned()
            .ok_or(IdempotencyRejection::LayerMissing)?;
        Ok(Self {
            idempotency,
            store: S::from_ref(state),
        })
    }
}
