//! The HTTP API.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes as Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_axum::{Idempotency, IdempotencyLayer, PendingClaim, Problem};
use idem_core::{Policy, Store, UnixMillis};
use serde_json::Value;
use tracing::{error, warn};

use crate::bank::{Bank, BankError, ChargeRequest};
use crate::db::{
    on_backend, BeginWrite, Database, Payment, PaymentRow, INSERT_PAYMENT, PAYMENT_COLUMNS,
};
use crate::input::{self, validation};
use idem_sql::{create_once, transition, Created, Transition};

/// Shared state of the handlers.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) db: Database,
    /// The fake bank, with connections of its own.
    pub(crate) bank: Bank,
    pub(crate) messaging: Arc<crate::messaging::Messaging>,
    /// Whether idempotency records live in `db`, so that handlers complete
    /// them in their own transaction (not so with Redis alone).
    pub(crate) transactional: bool,
    /// Whether `POST /payments` claims inside its own transaction.
    pub(crate) claim_in_transaction: bool,
    /// The secret the bank signs its webhooks with, if one is configured.
    pub(crate) webhook_secret: Option<Arc<[u8]>>,
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// The routes. Only `POST /payments` is guarded by the idempotency layer.
pub(crate) fn router(state: AppState, store: Arc<dyn Store>, policy: Policy) -> Router {
    // Payments need a key; orders are deduplicated by their natural key
    // anyway, so a key there is optional (but honoured when sent).
    let max_body = policy.max_body();
    let key_required = IdempotencyLayer::new(store.clone(), policy.clone(), bearer_client_id);
    let payments = if state.claim_in_transaction {
        post(create_payment_in_tx).route_layer(key_required.clone().claim_in_transaction())
    } else {
        post(create_payment).route_layer(key_required.clone())
    };
    let key_optional = match policy.to_builder().require_key(false).build() {
        Ok(p) => IdempotencyLayer::new(store, p, bearer_client_id),
        // unreachable: the settings came from a valid policy
        Err(_) => key_required.clone(),
    };
    // A client's routes that read a JSON body: credentials first (401),
    // then anything but JSON is 415, before the idempotency layer
    // fingerprints it.
    let json = || axum::middleware::from_fn(input::require_client_json);
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(get_metrics))
        .route("/", get(demo_page))
        .route("/payments", payments.route_layer(json()))
        .route(
            "/bare/payments",
            post(create_payment_bare).route_layer(json()),
        )
        .route("/payments/{id}", get(get_payment))
        .route("/payments/{id}/capture", post(capture_payment))
        .route(
            "/payments/{id}/events",
            get(crate::webhooks::payment_events),
        )
        .route("/accounts/{account_id}", get(get_account))
        .route(
            "/orders",
            post(crate::orders::create_order)
                .route_layer(key_optional)
                .route_layer(json()),
        )
        .route("/orders/{id}", get(crate::orders::get_order))
        .route(
            "/products/{sku}",
            get(crate::catalog::get_product).put(axum::handler::Handler::layer(
                crate::catalog::put_product,
                json(),
            )),
        )
        .route(
            "/webhooks/bank",
            post(crate::webhooks::bank_event)
                .route_layer(axum::middleware::from_fn(input::require_json)),
        )
        .route("/stock/{sku}", get(get_stock))
        .route("/emails", get(get_emails))
        .fallback(not_found)
        // One body limit for every route, the idempotency layer's: declared
        // sizes are refused before any read, streamed ones when they pass it.
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            max_body,
            input::refuse_oversized,
        ))
        .layer(axum::middleware::from_fn(input::problems_everywhere))
        .with_state(state)
}

async fn not_found() -> Response {
    Problem::new(StatusCode::NOT_FOUND, "not-found", "No such resource").into_response()
}

/// Demo authentication: `Authorization: Bearer <client-id>`. The client id
/// is the idempotency scope, so clients never see each other's keys.
fn bearer_client_id(parts: &axum::http::request::Parts) -> Result<String, Response> {
    input::client_id(&parts.headers)
}

/// `GET /`: the live demo page, embedded in the binary.
async fn demo_page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("../assets/index.html"),
    )
        .into_response()
}

/// `GET /metrics`: Prometheus text format.
async fn get_metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(state): State<AppState>) -> Response {
    match state.db.ping().await {
        Ok(_) => (StatusCode::OK, "ok").into_response(),
        Err(e) => {
            warn!(error = %e, "health check failed");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "database-unavailable",
                "The database is unavailable",
            )
            .into_response()
        }
    }
}

/// A validated payment request.
#[derive(Debug)]
struct NewPayment {
    account_id: String,
    amount: i64,
    currency: String,
}

fn parse_payment(body: &[u8]) -> Result<NewPayment, Response> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| validation(format!("the body is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(validation("the body must be a JSON object"));
    };
    if let Some(extra) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "account_id" | "amount" | "currency"))
    {
        return Err(validation(format!(
            "unknown field {:?}; expected account_id, amount, currency",
            extra
        )));
    }
    let account_id = match map.get("account_id") {
        Some(Value::String(s)) => {
            input::identifier("account_id", s)?;
            s.clone()
        }
        _ => return Err(validation("account_id is required and must be a string")),
    };
    Ok(NewPayment {
        account_id,
        amount: input::amount(map.get("amount"))?,
        currency: input::currency(map.get("currency"))?,
    })
}

/// Demo-only fault injection from the `X-Simulate` header.
#[derive(Debug, Default)]
struct Simulate {
    bank_delay: Option<Duration>,
    bank_error: bool,
    crash_before_bank: bool,
    crash_after_bank: bool,
}

fn parse_simulate(headers: &HeaderMap) -> Result<Simulate, Response> {
    let mut sim = Simulate::default();
    for value in headers.get_all("x-simulate") {
        let value = value
            .to_str()
            .map_err(|_| validation("X-Simulate must be ASCII"))?;
        for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            match directive {
                "bank-error" => sim.bank_error = true,
                "crash-before-bank" => sim.crash_before_bank = true,
                "crash-after-bank" => sim.crash_after_bank = true,
                d => match d.strip_prefix("bank-delay=").map(str::parse::<u64>) {
                    Some(Ok(ms)) => sim.bank_delay = Some(Duration::from_millis(ms)),
                    _ => {
                        return Err(validation(format!(
                            "unknown X-Simulate directive {d:?}; expected bank-delay=MS, bank-error, crash-before-bank, crash-after-bank"
                        )))
                    }
                },
            }
        }
    }
    Ok(sim)
}

/// Aborts the process at once, as a killed pod would: no unwinding, no
/// response, no cleanup.
fn crash(at: &str) -> ! {
    eprintln!("shop: simulated crash {at}");
    std::process::abort()
}

async fn create_payment(
    State(state): State<AppState>,
    idem: Idempotency,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let operation_id = idem.operation_id();
    match charge(&state, idem.scope(), operation_id, &headers, &body).await {
        Ok(payment) => {
            record_payment(
                &state,
                Some(&idem),
                idem.scope(),
                operation_id,
                &payment,
                None,
            )
            .await
        }
        Err(response) => response,
    }
}

/// `POST /payments` with `--claim-in-transaction`: the claim commits
/// first (binding the key to this request and its operation id before the
/// bank is called), then the transaction that records the payment holds it:
/// duplicates get 409 while it is open, and a crash or rollback frees it at
/// once for a retry of the same request.
async fn create_payment_in_tx(
    State(state): State<AppState>,
    pending: PendingClaim,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Database::Postgres(store) = &state.db else {
        error!("--claim-in-transaction needs PostgreSQL");
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let (mut tx, idem) = match pending.begin(store).await {
        Ok(held) => held,
        // a replay, 409, 422 or 503; no transaction was begun
        Err(answered) => return answered.into_response(),
    };
    let operation_id = idem.operation_id();
    match charge(&state, idem.scope(), operation_id, &headers, &body).await {
        Ok(payment) => {
            record_payment(
                &state,
                Some(&idem),
                idem.scope(),
                operation_id,
                &payment,
                Some(tx),
            )
            .await
        }
        // A client error is an answer: it commits with the claim, for replay.
        Err(response) if response.status().is_client_error() => {
            match idem.complete_in(store, &mut *tx, response).await {
                Ok(response) => match tx.commit().await {
                    Ok(()) => response,
                    Err(e) => db_error(e),
                },
                Err(e) => {
                    rollback(tx).await;
                    e.into_response()
                }
            }
        }
        // Anything else rolls back: the claim is free for the retry.
        Err(response) => {
            rollback(tx).await;
            response
        }
    }
}

/// Ends a transaction that must not commit, now, before the answer leaves:
/// a transaction left to its drop ends later, holding its locks (and, with
/// `--claim-in-transaction`, the claim) until it does.
async fn rollback<DB: sqlx::Database>(tx: sqlx::Transaction<'static, DB>) {
    if let Err(e) = tx.rollback().await {
        // The connection broke: the server ended the transaction with it.
        warn!(error = %e, "rollback failed");
    }
}

/// `POST /bare/payments`: the same work with no idempotency at all, the
/// baseline the benchmarks compare against. A retry here charges again.
async fn create_payment_bare(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let client_id = match input::client_id(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let operation_id = idem_core::OperationId::generate();
    match charge(&state, &client_id, operation_id, &headers, &body).await {
        Ok(payment) => record_payment(&state, None, &client_id, operation_id, &payment, None).await,
        Err(response) => response,
    }
}

/// Validates the request and charges the bank under `operation_id`. `Err`
/// is the answer to send, with nothing of ours written.
async fn charge(
    state: &AppState,
    client_id: &str,
    operation_id: idem_core::OperationId,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Payment, Response> {
    let simulate = parse_simulate(headers)?;
    let new = parse_payment(body)?;
    if simulate.crash_before_bank {
        crash("before the bank call");
    }
    if simulate.bank_error {
        return Err(bank_failed(&BankError::Simulated));
    }
    let charge = ChargeRequest {
        client_id,
        operation_id,
        account_id: &new.account_id,
        amount: new.amount,
        currency: &new.currency,
    };
    let bank_charge_id = state
        .bank
        .charge(&charge)
        .await
        .map_err(|e| bank_failed(&e))?;
    // The bank charged; its answer is slow to come back.
    if let Some(d) = simulate.bank_delay {
        tokio::time::sleep(d).await;
    }
    if simulate.crash_after_bank {
        crash("after the bank call");
    }
    Ok(Payment {
        id: format!("pay_{}", uuid::Uuid::now_v7().simple()),
        account_id: new.account_id,
        amount: new.amount,
        currency: new.currency,
        status: "authorized".to_owned(),
        bank_charge_id,
    })
}

/// Writes the payment and completes the idempotency record in one
/// transaction — `open`, if the handler claimed in it, or a new one: both
/// commit, or neither.
///
/// The payment is created once per operation id: if another attempt of the
/// same operation recorded it already (an attempt that outlived its lease,
/// with records outside this database), this one answers with that payment,
/// the effect that exists, instead of an error.
async fn record_payment(
    state: &AppState,
    idem: Option<&Idempotency>,
    client_id: &str,
    operation_id: idem_core::OperationId,
    payment: &Payment,
    open: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
) -> Response {
    let operation_id = operation_id.to_string();
    let now = UnixMillis::now().0;
    let insert = format!(
        "{INSERT_PAYMENT} ON CONFLICT (operation_id) DO NOTHING RETURNING {PAYMENT_COLUMNS}"
    );
    let fetch = format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE operation_id = $1");
    let written: Result<Response, Response> = on_backend!(&state.db, store => async {
        let mut tx = store.pool().begin_in(open).await.map_err(db_error)?;
        let staged = async {
            let created = create_once(
                &mut *tx,
                || {
                    sqlx::query_as::<_, PaymentRow>(&insert)
                        .bind(&payment.id)
                        .bind(client_id)
                        .bind(&payment.account_id)
                        .bind(payment.amount)
                        .bind(&payment.currency)
                        .bind(&payment.status)
                        .bind(&payment.bank_charge_id)
                        .bind(&operation_id)
                        .bind(now)
                },
                || sqlx::query_as::<_, PaymentRow>(&fetch).bind(&operation_id),
            )
            .await
            .map_err(db_error)?;
            let recorded = match created {
                Created::Created(row) => {
                    // The event commits with the payment.
                    let event = crate::messaging::payment_authorized(&state.messaging, payment);
                    idem_outbox::OutboxConnection::enqueue(&mut *tx, &event)
                        .await
                        .map_err(db_error)?;
                    Payment::from(row)
                }
                // The safety net caught a second attempt of this operation:
                // converge on the payment that exists (its event went with it).
                Created::Existing(row) => {
                    warn!(operation_id = %operation_id, "payment recorded by another attempt of this operation; answering with it");
                    Payment::from(row)
                }
            };
            let response = payment_created(&recorded);
            // Fenced by the claim's token: if a retry took this request
            // over, this fails and the transaction rolls back.
            // With a store outside this database (Redis alone), the layer
            // completes the record after the handler returns instead.
            match idem {
                Some(idem) if state.transactional => idem
                    .complete_in(store, &mut *tx, response)
                    .await
                    .map_err(IntoResponse::into_response),
                _ => Ok(response),
            }
        }
        .await;
        match staged {
            Ok(response) => {
                tx.commit().await.map_err(db_error)?;
                state.messaging.wake();
                Ok(response)
            }
            Err(response) => {
                rollback(tx).await;
                Err(response)
            }
        }
    }.await);
    written.unwrap_or_else(|response| response)
}

/// `201 Created` with the payment and its `Location`.
fn payment_created(payment: &Payment) -> Response {
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{}", payment.id))],
        Json(payment),
    )
        .into_response()
}

/// `GET /stock/{sku}`: units reserved so far by the reserve-stock consumer.
async fn get_stock(State(state): State<AppState>, Path(sku): Path<String>) -> Response {
    if let Err(r) = input::identifier("the sku", &sku) {
        return r;
    }
    match state.db.reserved(&sku).await {
        Ok(reserved) => Json(serde_json::json!({"sku": sku, "reserved": reserved})).into_response(),
        Err(e) => database_unavailable(&e),
    }
}

/// `GET /emails?account_id=…`: confirmation emails sent by the send-email
/// consumer, one per payment.
async fn get_emails(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    let Some(account_id) = q.get("account_id") else {
        return match input::client_id(&headers) {
            Ok(_) => validation("the account_id query parameter is required"),
            Err(r) => r,
        };
    };
    let client = match caller_and(&headers, "account_id", account_id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match state.db.emails(&client, account_id).await {
        Ok(emails) => {
            let emails: Vec<_> = emails
                .into_iter()
                .map(|(payment_id, subject)| {
                    serde_json::json!({"payment_id": payment_id, "account_id": account_id, "subject": subject})
                })
                .collect();
            Json(serde_json::json!({"emails": emails})).into_response()
        }
        Err(e) => database_unavailable(&e),
    }
}

fn db_error(e: sqlx::Error) -> Response {
    error!(error = %e, "could not record the payment");
    if is_unavailable(&e) {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "The payment could not be recorded",
        )
        .detail("retry with the same Idempotency-Key; the bank will not charge twice")
        .retry_after(1)
        .into_response();
    }
    sql_failure(&e)
}

/// Whether `e` means the database could not be reached or is busy: the
/// only failure a retry helps with.
fn is_unavailable(e: &sqlx::Error) -> bool {
    idem_postgres::is_unavailable(e)
        || idem_sqlite::is_unavailable(e)
        // the session ended for sitting idle in its transaction past the
        // lease (a claim held by the transaction): the retry takes over
        || matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("25P03"))
}

/// A statement that reached the database and failed: a constraint or a
/// value it refused is the request's fault (4xx, no `Retry-After`); the
/// rest is ours (500, no `Retry-After`: the same request would fail again).
fn sql_failure(e: &sqlx::Error) -> Response {
    if let sqlx::Error::Database(d) = e {
        if d.is_unique_violation() {
            return Problem::new(
                StatusCode::CONFLICT,
                "conflict",
                "The request conflicts with what exists",
            )
            .into_response();
        }
        if d.is_check_violation()
            || d.is_foreign_key_violation()
            || d.code().is_some_and(|c| c.starts_with("22"))
        {
            return validation("a value was refused by the database");
        }
    }
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "The request failed",
    )
    .into_response()
}

fn bank_failed(e: &BankError) -> Response {
    warn!(error = ?e, "bank call failed");
    match e {
        // The fake bank keeps its ledger in our database: when that is down,
        // say so, as every other path does.
        BankError::Ledger(e) if is_unavailable(e) => database_unavailable(e),
        _ => Problem::new(
            StatusCode::BAD_GATEWAY,
            "bank-unavailable",
            "The bank could not be reached",
        )
        .detail("retry with the same Idempotency-Key; the bank will not charge twice")
        .into_response(),
    }
}

pub(crate) fn database_unavailable(e: &sqlx::Error) -> Response {
    error!(error = %e, "database query failed");
    if !is_unavailable(e) {
        return sql_failure(e);
    }
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "database-unavailable",
        "The database is unavailable",
    )
    .retry_after(1)
    .into_response()
}

/// The calling client, and an identifier from the path checked: `401`
/// without credentials, `400` for an id that cannot exist.
pub(crate) fn caller_and(headers: &HeaderMap, name: &str, id: &str) -> Result<String, Response> {
    let client = input::client_id(headers)?;
    input::identifier(name, id)?;
    Ok(client)
}

pub(crate) fn no_such_payment(id: &str) -> Response {
    Problem::new(StatusCode::NOT_FOUND, "not-found", "No such payment")
        .detail(format!("no payment {id:?}"))
        .into_response()
}

/// `GET /payments/{id}`: the calling client's payment; another client's
/// is `404`, as if it did not exist.
async fn get_payment(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let client = match caller_and(&headers, "the payment id", &id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match state.db.payment(&client, &id).await {
        Ok(Some(p)) => Json(p).into_response(),
        Ok(None) => no_such_payment(&id),
        Err(e) => database_unavailable(&e),
    }
}

/// `POST /payments/{id}/capture`: authorized → captured, once. A repeat
/// answers `200` with the captured payment; another state is `409`.
async fn capture_payment(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let client = match caller_and(&headers, "the payment id", &id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    // Another client's payment is not found: it is neither moved nor shown.
    let update = format!(
        "UPDATE shop_payments SET status = 'captured'
         WHERE id = $1 AND client_id = $2 AND status = 'authorized' RETURNING {PAYMENT_COLUMNS}"
    );
    let fetch =
        format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1 AND client_id = $2");
    let moved: Result<Transition<PaymentRow>, sqlx::Error> = on_backend!(&state.db, store => async {
        let mut conn = store.pool().acquire().await?;
        transition(
            &mut *conn,
            "captured",
            |p: &PaymentRow| p.4.clone(),
            || sqlx::query_as(&update).bind(&id).bind(&client),
            || sqlx::query_as(&fetch).bind(&id).bind(&client),
        )
        .await
    }
    .await);
    match moved {
        Ok(Transition::Applied(p) | Transition::AlreadyDone(p)) => {
            Json(Payment::from(p)).into_response()
        }
        Ok(Transition::NotFound) => no_such_payment(&id),
        Ok(Transition::Conflict { current, .. }) => Problem::new(
            StatusCode::CONFLICT,
            "payment-state-conflict",
            "The payment cannot be captured in its current state",
        )
        .detail(format!(
            "payment {id} is {current}; only an authorized payment can be captured"
        ))
        .into_response(),
        Err(e) => database_unavailable(&e),
    }
}

/// `GET /accounts/{account_id}`: what the calling client's payments
/// charged the account (another client's payments are not counted).
async fn get_account(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(account_id): Path<String>,
) -> Response {
    let client = match caller_and(&headers, "account_id", &account_id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match state.db.account(&client, &account_id).await {
        Ok(account) => Json(account).into_response(),
        Err(e) => database_unavailable(&e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Database failures are told apart: only an unreachable database is a
    /// 503 with Retry-After.
    #[tokio::test]
    async fn refused_values_are_4xx_and_only_an_outage_says_retry() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER CHECK (n > 0))")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO t VALUES ('a', 1)")
            .execute(&pool)
            .await
            .unwrap();
        let fail = |sql: &'static str| {
            let pool = pool.clone();
            async move { sqlx::query(sql).execute(&pool).await.unwrap_err() }
        };
        let unique = database_unavailable(&fail("INSERT INTO t VALUES ('a', 2)").await);
        assert_eq!(unique.status(), StatusCode::CONFLICT);
        let check = database_unavailable(&fail("INSERT INTO t VALUES ('b', 0)").await);
        assert_eq!(check.status(), StatusCode::BAD_REQUEST);
        let ours = database_unavailable(&fail("SELECT * FROM missing").await);
        assert_eq!(ours.status(), StatusCode::INTERNAL_SERVER_ERROR);
        for r in [&unique, &check, &ours] {
            assert!(r.headers().get(header::RETRY_AFTER).is_none());
        }
        pool.close().await;
        let closed = database_unavailable(&fail("SELECT 1").await);
        assert_eq!(closed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(closed.headers().get(header::RETRY_AFTER).is_some());
    }
}
