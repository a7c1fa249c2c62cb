//! `POST /webhooks/bank`: the bank's events, acted on once per event id.
//!
//! Providers send no `Idempotency-Key` and no bearer token: the event id is
//! the key. The event row is created with [`create_once`] in the same
//! transaction as its effect, so a delivery repeated any number of times
//! acts once and answers `200` every time.
//!
//! With `--webhook-secret` (`SHOP_WEBHOOK_SECRET`), an event must carry
//! `X-Bank-Signature: sha256=<hex HMAC-SHA256 of the raw body>` made with
//! that secret, as payment providers sign theirs; a missing or wrong
//! signature is `401` and changes nothing. Without a secret, events are
//! trusted as they come (a demo convenience, never a deployment's).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_core::UnixMillis;
use idem_sql::{create_once, transition, Created, Transition};
use serde_json::{json, Value};

use crate::api::{caller_and, database_unavailable, no_such_payment, AppState};
use crate::db::{on_backend, BeginWrite, PaymentRow, PAYMENT_COLUMNS};
use crate::input::{self, validation};

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
        Some(Value::String(s)) => input::identifier(name, s).map(|()| s.clone()),
        _ => Err(validation(format!("{name} is required: a string"))),
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

/// Whether `signature` (`sha256=<hex>`) is the HMAC-SHA256 of `body` under
/// `secret`, compared in constant time.
pub(crate) fn signature_valid(secret: &[u8], body: &[u8], signature: &str) -> bool {
    use hmac::Mac;
    let Some(hex) = signature.trim().strip_prefix("sha256=") else {
        return false;
    };
    if hex.len() != 64 {
        return false;
    }
    let mut expected = [0u8; 32];
    for (i, byte) in expected.iter_mut().enumerate() {
        match u8::from_str_radix(&hex[2 * i..2 * i + 2], 16) {
            Ok(b) => *byte = b,
            Err(_) => return false,
        }
    }
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret) else {
        return false;
    };
    mac.update(body);
    mac.verify_slice(&expected).is_ok()
}

pub(crate) async fn bank_event(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(secret) = &state.webhook_secret {
        let mut signatures = headers.get_all("x-bank-signature").iter();
        let valid = match (signatures.next(), signatures.next()) {
            (Some(sig), None) => sig
                .to_str()
                .is_ok_and(|sig| signature_valid(secret, &body, sig)),
            _ => false,
        };
        if !valid {
            return idem_axum::Problem::new(
                StatusCode::UNAUTHORIZED,
                "bad-signature",
                "The event's signature is missing or wrong",
            )
            .detail("send X-Bank-Signature: sha256=<hex HMAC-SHA256 of the raw body>")
            .into_response();
        }
    }
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
    headers: axum::http::HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let client = match caller_and(&headers, "the payment id", &id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match state.db.payment(&client, &id).await {
        Ok(Some(_)) => {}
        Ok(None) => return no_such_payment(&id),
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

#[cfg(test)]
mod tests {
    use super::signature_valid;
    use hmac::Mac;

    fn sign(secret: &[u8], body: &[u8]) -> String {
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
        mac.update(body);
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("sha256={hex}")
    }

    #[test]
    fn signatures() {
        let body = br#"{"event_id":"e1"}"#;
        let good = sign(b"s3cret", body);
        assert!(signature_valid(b"s3cret", body, &good));
        assert!(!signature_valid(b"other", body, &good));
        assert!(!signature_valid(b"s3cret", b"{}", &good));
        assert!(!signature_valid(
            b"s3cret",
            body,
            &good.replace("sha256=", "sha1=")
        ));
        assert!(!signature_valid(b"s3cret", body, "sha256=zz"));
        assert!(!signature_valid(
            b"s3cret",
            body,
            &format!("{}é", &good[..good.len() - 2])
        ));
        assert!(!signature_valid(b"s3cret", body, ""));
    }
}
