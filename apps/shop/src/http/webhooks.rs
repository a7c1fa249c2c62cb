//! The bank's webhooks: `POST /webhooks/bank`, acted on once per event id,
//! and `GET /payments/{id}/events`, what was processed for a payment.
//!
//! Providers send no `Idempotency-Key` and no bearer token: the event id is
//! the key. The event row is created with [`create_once`](crate::db::create_once) in the same
//! transaction as its effect, so a delivery repeated any number of times
//! acts once and answers `200` every time. An event id sent again with
//! another type or payment is not a repeat: it is `422` (`event-id-reused`),
//! as a reused `Idempotency-Key` with another body is, and changes nothing.
//!
//! With `--webhook-secret` (`SHOP_WEBHOOK_SECRET`), an event must carry
//! `X-Bank-Signature: sha256=<hex HMAC-SHA256 of the raw body>` made with
//! that secret, as payment providers sign theirs; a missing or wrong
//! signature is `401` and changes nothing. Without a secret, events are
//! trusted as they come (a demo convenience, never a deployment's).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use idem_axum::Problem;
use idem_core::UnixMillis;
use idem_sql::Transition;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::router::UtoipaMethodRouterExt;
use utoipa_axum::routes;

use super::auth::Client;
use super::error::Result;
use super::payments::no_such_payment;
use super::{input, AppState, ProblemDoc};
use crate::db::{self, dialect::BANK_EVENT_KEY, BankEvent, PAYMENT_COLUMNS};

/// The webhook routes.
pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(payment_events)).routes(
        routes!(bank_event).map(|r| r.route_layer(axum::middleware::from_fn(input::require_json))),
    )
}

/// The event type with an effect; others are recorded and acknowledged.
const SETTLED: &str = "charge.settled";

/// A recorded event by its id: what it was, to tell a repeat from another
/// event sent under the same id.
const EVENT_BY_ID: &str = "SELECT type, payment_id FROM shop_bank_events WHERE event_id = $1";

/// An event the bank sends.
#[derive(Debug, Deserialize, ToSchema)]
struct Event {
    /// The bank's id for it: the same event is acted on once.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "evt_1")]
    event_id: String,
    /// `charge.settled` settles the payment; other types are recorded.
    #[serde(rename = "type")]
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "charge.settled")]
    kind: String,
    /// The payment it is about.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$")]
    payment_id: String,
}

impl Event {
    fn parse(body: &[u8]) -> Result<Self> {
        let event: Self = input::json(body)?;
        input::identifier("event_id", &event.event_id)?;
        input::identifier("type", &event.kind)?;
        input::identifier("payment_id", &event.payment_id)?;
        Ok(event)
    }
}

/// What processing an event did.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
enum Outcome {
    /// Acted on now.
    Processed,
    /// Acted on before: nothing done.
    Duplicate,
}

/// What the event's transaction found.
enum Staged {
    /// Processed now, or a repeat of one processed before.
    Done(Outcome),
    /// No payment with the event's id (yet).
    NoPayment,
    /// The event id was processed before for another type or payment.
    Reused,
}

/// The answer to an event.
#[derive(Debug, Serialize, ToSchema)]
struct Receipt {
    /// The event.
    event_id: String,
    /// What was done.
    status: Outcome,
}

/// Whether `signature` (`sha256=<hex>`) is the HMAC-SHA256 of `body` under
/// `secret`, compared in constant time.
fn signature_valid(secret: &[u8], body: &[u8], signature: &str) -> bool {
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

/// Receives a bank event, acted on once per `event_id`; every delivery of
/// it answers `200`.
#[utoipa::path(
    post,
    path = "/webhooks/bank",
    tag = "webhooks",
    params(("X-Bank-Signature" = Option<String>, Header, description = "`sha256=<hex HMAC-SHA256 of the raw body>`; required with --webhook-secret")),
    request_body(content = Event, content_type = "application/json"),
    responses(
        (status = 200, description = "Processed now, or a duplicate", body = Receipt),
        (status = 401, description = "The signature is missing or wrong (with --webhook-secret)", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 404, description = "No such payment (yet): the bank retries later", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "The event id was processed before for another type or payment: nothing done", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn bank_event(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Receipt>> {
    if let Some(secret) = &state.webhook_secret {
        let mut signatures = headers.get_all("x-bank-signature").iter();
        let valid = match (signatures.next(), signatures.next()) {
            (Some(sig), None) => sig
                .to_str()
                .is_ok_and(|sig| signature_valid(secret, &body, sig)),
            _ => false,
        };
        if !valid {
            return Err(Problem::new(
                StatusCode::UNAUTHORIZED,
                "bad-signature",
                "The event's signature is missing or wrong",
            )
            .detail("send X-Bank-Signature: sha256=<hex HMAC-SHA256 of the raw body>")
            .into());
        }
    }
    let event = Event::parse(&body)?;
    let now = UnixMillis::now().0;
    let update = "UPDATE shop_payments SET status = 'settled'
                  WHERE id = $1 AND status IN ('authorized', 'captured')";
    let fetch = format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1");
    let mut tx = state.db.begin().await?;
    let staged = async {
        let exists = db::fetch_optional(
            &mut *tx,
            "SELECT id FROM shop_payments WHERE id = $1",
            &[(&event.payment_id).into()],
        )
        .await?;
        if exists.is_none() {
            // An event id already recorded (for a payment that exists) is
            // not this event: the bank's retry of it would never succeed.
            let recorded = db::fetch_optional(&mut *tx, EVENT_BY_ID, &[(&event.event_id).into()])
            .await?;
            return Ok(if recorded.is_some() {
                Staged::Reused
            } else {
                Staged::NoPayment
            });
        }
        let recorded = db::create_once(
            &mut *tx,
            (state.db.sql().insert_bank_event, BANK_EVENT_KEY),
            &[
                (&event.event_id).into(),
                (&event.kind).into(),
                (&event.payment_id).into(),
                now.into(),
            ],
            EVENT_BY_ID,
            &[(&event.event_id).into()],
        )
        .await?;
        if let idem_sql::Created::Existing(first) = recorded {
            // The same event again, or another under its id.
            let same = first.text("type")? == event.kind
                && first.text("payment_id")? == event.payment_id;
            return Ok(if same {
                Staged::Done(Outcome::Duplicate)
            } else {
                Staged::Reused
            });
        }
        if event.kind == SETTLED {
            let moved =
                db::transition(&mut *tx, "settled", update, &fetch, &[(&event.payment_id).into()])
                    .await?;
            if let Transition::Conflict { current, .. } = moved {
                tracing::warn!(payment = %event.payment_id, %current, "settlement for a payment in another state");
            }
        }
        Ok::<_, sqlx::Error>(Staged::Done(Outcome::Processed))
    }
    .await;
    let outcome = match staged {
        Ok(outcome) => {
            tx.commit().await?;
            outcome
        }
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e.into());
        }
    };
    match outcome {
        Staged::Done(status) => Ok(Json(Receipt {
            event_id: event.event_id,
            status,
        })),
        // The bank may send an event before our payment commits: it retries
        // later rather than the event being dropped.
        Staged::NoPayment => Err(no_such_payment(event.payment_id)),
        Staged::Reused => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "event-id-reused",
            "This event id was processed before for another type or payment",
        )
        .detail(format!(
            "event {} is already recorded with other contents; nothing was done",
            event.event_id
        ))
        .into()),
    }
}

/// The bank events processed for a payment.
#[derive(Debug, Serialize, ToSchema)]
struct PaymentEvents {
    /// The payment.
    payment_id: String,
    /// Oldest first: the newest 1,000.
    events: Vec<BankEvent>,
}

/// The bank events processed for the calling client's payment.
#[utoipa::path(
    get,
    path = "/payments/{id}/events",
    tag = "webhooks",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The payment id", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses(
        (status = 200, description = "The events", body = PaymentEvents),
        (status = 404, description = "No such payment for this client", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn payment_events(
    State(state): State<AppState>,
    Client(client): Client,
    Path(id): Path<String>,
) -> Result<Json<PaymentEvents>> {
    input::identifier("the payment id", &id)?;
    if db::payment(&*state.db, &client, &id).await?.is_none() {
        return Err(no_such_payment(id));
    }
    let events = db::bank_events(&*state.db, &id).await?;
    Ok(Json(PaymentEvents {
        payment_id: id,
        events,
    }))
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
