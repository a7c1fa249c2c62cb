//! `POST /orders/{id}/checkout`: paying an order in two named steps, each
//! done once per `Idempotency-Key` whatever crashes between them.
//!
//! 1. `charge`: the bank charges the account under the step's own key
//!    (derived from the operation id and the step's name), so a retry after
//!    a crash between the bank's answer and the step's record charges
//!    nothing more: the bank deduplicates on that key.
//! 2. `mark-paid`: the payment row, the order's `paid` status and the
//!    `OrderPaid` event (its receipt email) commit in one transaction, with
//!    the step's record when the records live in this database.
//!
//! A run resumed after a crash (the retry takes the key over after the
//! lease, under the same operation id) gets the stored output of each step
//! it finds done, and runs the rest.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::{Idempotency, IdempotencyLayer, Problem};
use idem_core::{OperationId, UnixMillis};
use idem_once::{Operation, StepError, StepStart};
use idem_sql::Created;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::router::UtoipaMethodRouterExt;
use utoipa_axum::routes;

use super::error::{Error, Result};
use super::orders::{order_view, Order};
use super::payments::{crash, NewPayment, Simulate, SimulateOn};
use super::{input, AppState, ProblemDoc};
use crate::bank::ChargeRequest;
use crate::db::dialect::{CHECKOUT_KEY, PAYMENT_KEY};
use crate::db::{self, Payment, ShopTx, PAYMENT_COLUMNS};

/// The checkout route; `layer` requires an `Idempotency-Key`, and refuses
/// a malformed request (body, order id, `X-Simulate`) before the claim.
pub(super) fn router(state: &AppState, layer: IdempotencyLayer) -> OpenApiRouter<AppState> {
    let allowed = state.fault_injection;
    let layer = layer.validate(move |parts, body| {
        order_id_of(parts.uri.path())
            .and_then(|_| Simulate::parse(&parts.headers, allowed, SimulateOn::Checkout))
            .and_then(|_| NewPayment::parse(body))
            .map(drop)
            .map_err(IntoResponse::into_response)
    });
    OpenApiRouter::new().routes(
        routes!(checkout)
            .map(|r| r.route_layer(layer))
            .map(|r| r.route_layer(axum::middleware::from_fn(super::auth::require_client_json))),
    )
}

/// The order id of a checkout's path, checked.
fn order_id_of(path: &str) -> Result<&str> {
    let id = path
        .strip_prefix("/orders/")
        .and_then(|rest| rest.strip_suffix("/checkout"))
        .unwrap_or_default();
    input::identifier("the order id", id)?;
    Ok(id)
}

/// What the `charge` step stores: the bank's charge.
#[derive(Debug, Serialize, Deserialize)]
struct Charged {
    bank_charge_id: String,
}

/// What the `mark-paid` step stores: the payment it recorded.
#[derive(Debug, Serialize, Deserialize)]
struct Paid {
    payment_id: String,
}

/// Pays an order once per `Idempotency-Key`: charges the account at the
/// bank, then marks the order paid and sends its receipt.
///
/// A retry with the same key replays the answer; after a crash it resumes
/// at the first step not done (the bank is never charged twice: it
/// deduplicates on the charge step's key). Another key for an order being
/// paid, or paid, is `409`; so is this key back after its record expired
/// with another account, amount or currency.
#[utoipa::path(
    post,
    path = "/orders/{id}/checkout",
    tag = "orders",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "The order id", pattern = "^[A-Za-z0-9_.:-]{1,64}$"),
        ("Idempotency-Key" = String, Header, description = "One key per intended checkout, 1 to 255 visible ASCII characters; retries send the same key.", pattern = "^[!-~]{1,255}$"),
        ("X-Simulate" = Option<String>, Header, description = "Demo fault injection (see --fault-injection): bank-delay=MS, bank-error, crash-after-bank, crash-after-charge; comma-separated.", pattern = "^(bank-error|bank-delay=[0-9]{1,3})$"),
    ),
    request_body(content = NewPayment, content_type = "application/json"),
    responses(
        (status = 200, description = "Paid; a replay answers the same with `Idempotent-Replayed: true`", body = Order),
        (status = 404, description = "No such order for this client", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "The same key is in flight (`Retry-After`), or the order is paid (or being paid) under another key, or under this one with other payment details after its record expired", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "The key was used for another request", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 502, description = "The bank could not be reached (or X-Simulate: bank-error); retry with the same key", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn checkout(
    State(state): State<AppState>,
    idem: Idempotency,
    Path(order_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response> {
    // Checked before the claim (the layer's validator); read for the values.
    input::identifier("the order id", &order_id)?;
    let simulate = Simulate::parse(&headers, state.fault_injection, SimulateOn::Checkout)?;
    let new = NewPayment::parse(&body)?;
    let client = idem.scope();
    // Another client's order is not there.
    order_view(&state, client, &order_id).await?;
    let bound = bind(&state, client, &order_id, &idem, &new).await?;
    // The bank's key: the charge step's, of the operation bound to the
    // order (this one, unless the same Idempotency-Key came back with a new
    // operation id after its record expired or was lost: then the bank
    // answers with the charge it made).
    let charge_key = idem_once::step_key(bound, "charge");

    let op = idem.operation(&*state.records);
    let paid = async {
        let charged: Charged = op
            .step("charge", async |_| {
                if simulate.crash_before_bank {
                    crash("before the bank call");
                }
                if simulate.bank_error {
                    return Err(Error::Bank(crate::bank::BankError::Simulated));
                }
                let bank_charge_id = state
                    .bank
                    .charge(&ChargeRequest {
                        client_id: client,
                        operation_id: OperationId(charge_key),
                        account_id: &new.account_id,
                        amount: new.amount,
                        currency: &new.currency,
                        reference: &order_id,
                    })
                    .await?;
                if let Some(d) = simulate.bank_delay {
                    tokio::time::sleep(d).await;
                }
                if simulate.crash_after_bank {
                    crash("after the bank charged, before the charge step was stored");
                }
                Ok(Charged { bank_charge_id })
            })
            .await?;
        if simulate.crash_after_charge {
            crash("after the charge step was stored, before the order was marked paid");
        }
        mark_paid(&state, &op, client, &order_id, &new, &charged, charge_key).await
    }
    .await;
    let paid = match paid {
        Ok(paid) => paid,
        Err(StepError::LeaseLost) => {
            // This attempt ran past its lease: its answer must not be
            // stored, nor its claim released under a newer holder. The
            // retry takes the key over and resumes at the first step not
            // done.
            warn!(order = %order_id, "the checkout ran past its lease; the retry resumes it");
            idem.abandon();
            return Err(Error::Answered(
                idem_axum::IdempotencyRejection::TakenOver.into_response(),
            ));
        }
        Err(StepError::InFlight { retry_after }) => {
            // An earlier attempt still holds a step: nothing ran; the
            // layer releases this claim rather than store its 409.
            return Err(Error::Answered(
                idem_axum::IdempotencyRejection::KeyInUse { retry_after }.into_response(),
            ));
        }
        Err(e) => return Err(step_failed(e)),
    };
    info!(order = %order_id, payment = %paid.payment_id, "order paid");
    let order = order_view(&state, client, &order_id).await?;
    Ok((StatusCode::OK, Json(order)).into_response())
}

/// Binds the order to this checkout's operation and key, once: another
/// key for the same order is `409`, before anything is charged. The same
/// key back with another operation id (its record expired, or Redis lost
/// it) resumes under the operation bound first if it pays with the same
/// account, amount and currency; with other ones it is another checkout
/// (the key is new again once its record expired), so `409` too (stored
/// for the key: its record is bound to this request's body anyway).
/// Returns the bound operation.
async fn bind(
    state: &AppState,
    client: &str,
    order_id: &str,
    idem: &Idempotency,
    new: &NewPayment,
) -> Result<OperationId> {
    let (op, key) = (idem.operation_id().to_string(), idem.key());
    let intent = intent_of(&new.account_id, new.amount, &new.currency);
    let mut tx = state.db.begin().await?;
    let staged: Result<(Bound, Option<String>), sqlx::Error> = async {
        let created = db::create_once(
            &mut *tx,
            (state.db.sql().insert_checkout, CHECKOUT_KEY),
            &[
                order_id.into(),
                client.into(),
                (&op).into(),
                UnixMillis::now().0.into(),
                key.into(),
                (&intent).into(),
            ],
            "SELECT operation_id, idempotency_key, intent FROM shop_checkouts WHERE order_id = $1",
            &[order_id.into()],
        )
        .await?;
        let row = match created {
            Created::Created(row) | Created::Existing(row) => row,
        };
        let bound = Bound {
            op: row.text("operation_id")?,
            key: row.text("idempotency_key")?,
            intent: row.text("intent")?,
        };
        if bound.op == op || bound.key != key || !bound.intent.is_empty() {
            return Ok((bound, None));
        }
        // A row an instance from before `intent` made: what it pays with is
        // its payment's, if it got that far.
        let Ok(bound_op) = uuid::Uuid::parse_str(&bound.op).map(OperationId) else {
            return Ok((bound, None));
        };
        let charge_key = idem_once::step_key(bound_op, "charge").to_string();
        let paid = db::fetch_optional(
            &mut *tx,
            "SELECT account_id, amount, currency FROM shop_payments WHERE operation_id = $1 AND client_id = $2",
            &[(&charge_key).into(), client.into()],
        )
        .await?
        .map(|row| -> Result<String, sqlx::Error> {
            Ok(intent_of(&row.text("account_id")?, row.int("amount")?, &row.text("currency")?))
        })
        .transpose()?;
        Ok((bound, paid))
    }
    .await;
    let (bound, paid) = match staged {
        Ok(staged) => {
            tx.commit().await?;
            staged
        }
        Err(e) => {
            rollback(tx).await;
            return Err(e.into());
        }
    };
    if bound.op != op && bound.key != key {
        return Err(already_paid(
            "The order is paid, or being paid, under another Idempotency-Key",
            format!("order {order_id} has its own checkout; retry that one with its key"),
        ));
    }
    let recorded = if bound.intent.is_empty() {
        paid
    } else {
        Some(bound.intent)
    };
    if bound.op != op && recorded.is_some_and(|r| r != intent) {
        return Err(already_paid(
            "The order is paid, or being paid, with other payment details",
            format!("order {order_id} was checked out under this key with another account, amount or currency, and its record has expired; retry with those, or pay another order"),
        ));
    }
    uuid::Uuid::parse_str(&bound.op)
        .map(OperationId)
        .map_err(|e| Error::Problem(internal(format!("a stored operation id: {e}"))))
}

/// What a checkout pays with, as kept and compared: the account, the
/// amount, and the currency in upper case (`eur` is `EUR`).
pub(super) fn intent_of(account_id: &str, amount: i64, currency: &str) -> String {
    format!("{account_id}\n{amount}\n{}", currency.to_ascii_uppercase())
}

/// `409 order-already-paid`.
fn already_paid(title: &str, detail: String) -> Error {
    Problem::new(StatusCode::CONFLICT, "order-already-paid", title)
        .detail(detail)
        .into()
}

/// The checkout an order is bound to.
struct Bound {
    /// Its operation id.
    op: String,
    /// Its `Idempotency-Key`.
    key: String,
    /// What it pays with (account, amount, currency; empty in rows from
    /// before it was kept).
    intent: String,
}

/// The `mark-paid` step: the payment, the order's status and its event
/// commit in one transaction, with the step's record when the records live
/// in this database (else the step's record is stored right after the
/// commit, and a crash between re-runs a transaction that changes nothing).
async fn mark_paid(
    state: &AppState,
    op: &Operation<'_, dyn idem_core::Store>,
    client: &str,
    order_id: &str,
    new: &NewPayment,
    charged: &Charged,
    charge_key: uuid::Uuid,
) -> Result<Paid, StepError<Error>> {
    let step = match op.start_step::<Paid, Error>("mark-paid").await? {
        StepStart::Done(paid) => return Ok(paid),
        StepStart::Run(step) => step,
    };
    let failed = |e: Error| StepError::Failed(e);
    // Every database failure here comes after the bank charged:
    // `Error::Recording`, a 5xx that lets the key go (as `POST /payments`
    // does), never a 4xx that would be stored and replayed as a refusal.
    let mut tx = match state.db.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            op.release_step(&step).await;
            return Err(failed(Error::Recording(e)));
        }
    };
    let staged = async {
        // The payment, once per charge (its operation id is the charge
        // step's key, which the bank charged under).
        let charge_key = charge_key.to_string();
        let payment_id = format!("pay_{}", uuid::Uuid::now_v7().simple());
        let fetch = format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE operation_id = $1");
        let created = db::create_once(
            &mut *tx,
            (state.db.sql().insert_payment, PAYMENT_KEY),
            &[
                (&payment_id).into(),
                client.into(),
                (&new.account_id).into(),
                new.amount.into(),
                (&new.currency).into(),
                "authorized".into(),
                (&charged.bank_charge_id).into(),
                (&charge_key).into(),
                UnixMillis::now().0.into(),
            ],
            &fetch,
            &[(&charge_key).into()],
        )
        .await?;
        let payment = match created {
            Created::Created(row) => {
                let payment = Payment::try_from(&row)?;
                let event = crate::messaging::order_paid(&state.messaging, order_id, &payment);
                tx.enqueue(&event).await?;
                payment
            }
            // This transaction committed before, and its step's record did
            // not (records outside this database): converge on it.
            Created::Existing(row) => Payment::try_from(&row)?,
        };
        tx.execute(
            "UPDATE shop_orders SET status = 'paid' WHERE id = $1 AND client_id = $2",
            &[order_id.into(), client.into()],
        )
        .await?;
        Ok::<_, sqlx::Error>(Paid {
            payment_id: payment.id,
        })
    }
    .await;
    let paid = match staged {
        Ok(paid) => paid,
        Err(e) => {
            rollback(tx).await;
            op.release_step(&step).await;
            return Err(failed(Error::Recording(e)));
        }
    };
    if state.transactional {
        let stored = match step.stored(&paid) {
            Ok(stored) => stored,
            Err(e) => {
                rollback(tx).await;
                op.release_step(&step).await;
                return Err(StepError::Codec(e.to_string()));
            }
        };
        // Fenced by the step's token: a takeover makes this fail, and
        // nothing of this attempt commits.
        match tx.complete_record(step.claim(), &stored).await {
            Ok(()) => {}
            Err(idem_core::StoreError::ClaimLost) => {
                rollback(tx).await;
                return Err(StepError::LeaseLost);
            }
            Err(e) => {
                rollback(tx).await;
                op.release_step(&step).await;
                return Err(StepError::Store(e));
            }
        }
        tx.commit().await.map_err(|e| failed(Error::Recording(e)))?;
        op.step_committed(&step).await;
    } else {
        tx.commit().await.map_err(|e| failed(Error::Recording(e)))?;
        op.step_done(&step, &paid).await?;
    }
    state.messaging.wake();
    Ok(paid)
}

/// A step that gave no output (its lease aside), as the answer.
fn step_failed(e: StepError<Error>) -> Error {
    match e {
        StepError::Failed(e) => e,
        StepError::Store(e) => {
            warn!(error = %e, "a checkout step's record failed");
            Error::Answered(idem_axum::IdempotencyRejection::StoreUnavailable.into_response())
        }
        other => Error::Problem(internal(other)),
    }
}

/// `500`, logged: a failure of ours.
fn internal(e: impl std::fmt::Display) -> Problem {
    tracing::error!(error = %e, "checkout failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "A failure of ours",
    )
}

/// Ends a transaction that must not commit, now.
async fn rollback(tx: Box<dyn ShopTx>) {
    if let Err(e) = tx.rollback().await {
        warn!(error = %e, "rollback failed");
    }
}
