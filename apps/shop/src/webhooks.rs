//! `POST /webhooks/bank`: the bank's events, acted on once per event id.
//!
//! Providers send no `Idempotency-Key` and no bearer token: the event id is
//! the key. The event row is created with [`create_once`] in the same
//! transaction as its effect, so a delivery repeated any number of times
//! acts once and answers `200` every time.
//!
//! A real deployment verifies the provider's signature (an HMAC of the body
//! with a shared secret, as most payment providers send) before trusting an
//! event; this demo does not.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_core::UnixMillis;
use idem_sql::{create_once, transition, Created, Transition};
use serde_json::{json, Value};

use crate::api::{database_unavailable, validation, AppState};
use crate::db::{on_backend, BeginWrite, PaymentRow, PAYMENT_COLUMNS};

/// The event types with an effect; others are recorded and acknowledged.
const SETTLED: &str = "charge.settled";

struct Event {
    event_id: String,
    kind: String,
    payment_id: String,
}

fn parse_event(body: &[u8]) -> Result<Event, Response> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| validation(format!("the body is not JSON: {e}")))?;
    let text = |name: &str| match value.get(name) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 255 => Ok(s.clone()),
        _ => Err(validation(format!(
            "{name} is required: a string of 1 to 255 characters"
        ))),
    };
    Ok(Event {
        event_id: text("event_id")?,
        kind: text("type")?,
        payment_id: text("payment_id")?,
    })
}

/// What processing an event did.
enum Outcome {
    Processed,
    Duplicate,
    UnknownPayment,
}

pub(crate) async fn bank_event(State(state): State<AppState>, body: axum::body::Bytes) -> Response {
    let event = match parse_event(&body) {
        Ok(e) => e,
        Err(r) => return r,
    };
    let now = UnixMillis::now().0;
    let update = format!(
        "UPDATE shop_payments SET status = 'settled'
         WHERE id = $1 AND status IN ('authorized', 'captured') RETURNING {PAYMENT_COLUMNS}"
    );
    let fetch = format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1");
    let outcome: Result<Outcome, sqlx::Error> = on_backend!(&state.db, store => async {
        let mut tx = store.pool().begin_write().await?;
        let staged = async {
            let exists: Option<(String,)> = sqlx::query_as("SELECT id FROM shop_payments WHERE id = $1")
                .bind(&event.payment_id)
                .fetch_optional(&mut *tx)
                .await?;
            if exists.is_none() {
                return Ok(Outcome::UnknownPayment);
            }
            let recorded: Created<(String,)> = create_once(
                &mut *tx,
                || {
                    sqlx::query_as(
                        "INSERT INTO shop_bank_events (event_id, type, payment_id, received_at) VALUES ($1, $2, $3, $4)
                         ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
                    )
                    .bind(&event.event_id)
                    .bind(&event.kind)
                    .bind(&event.payment_id)
                    .bind(now)
                },
                || sqlx::query_as("SELECT event_id FROM shop_bank_events WHERE event_id = $1").bind(&event.event_id),
            )
            .await?;
            let outcome = match recorded {
                Created::Existing((_,)) => Outcome::Duplicate,
                Created::Created((_,)) => {
                    if event.kind == SETTLED {
                        let moved: Transition<PaymentRow> = transition(
                            &mut *tx,
                            "settled",
                            |p: &PaymentRow| p.4.clone(),
                            || sqlx::query_as(&update).bind(&event.payment_id),
                            || sqlx::query_as(&fetch).bind(&event.payment_id),
                        )
                        .await?;
                        if let Transition::Conflict { current, .. } = moved {
                            tracing::warn!(payment = %event.payment_id, %current, "settlement for a payment in another state");
                        }
                    }
                    Outcome::Processed
                }
            };
            Ok(outcome)
        }
        .await;
        crate::db::finish(tx, staged).await
    }
    .await);
    let status = match outcome {
        Ok(Outcome::Processed) => "processed",
        Ok(Outcome::Duplicate) => "duplicate",
        // The bank may send an event before our payment commits: ask it to
        // retry later rather than drop the event.
        Ok(Outcome::UnknownPayment) => {
            return idem_axum::Problem::new(StatusCode::NOT_FOUND, "not-found", "No such payment")
                .detail(format!("no payment {:?}", event.payment_id))
                .into_response()
        }
        Err(e) => return database_unavailable(&e),
    };
    (
        StatusCode::OK,
        Json(json!({"event_id": event.event_id, "status": status})),
    )
        .into_response()
}

/// `GET /payments/{id}/events`: the bank events processed for a payment.
pub(crate) async fn payment_events(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match state.db.payment(&id).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            return idem_axum::Problem::new(StatusCode::NOT_FOUND, "not-found", "No such payment")
                .into_response()
        }
        Err(e) => return database_unavailable(&e),
    }
    match state.db.bank_events(&id).await {
        Ok(events) => {
            let events: Vec<Value> = events
                .into_iter()
                .map(|(event_id, kind)| json!({"event_id": event_id, "type": kind}))
                .collect();
            Json(json!({"payment_id": id, "events": events})).into_response()
        }
        Err(e) => database_unavailable(&e),
    }
}
