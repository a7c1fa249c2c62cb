//! `POST /orders`: created once per natural key `(customer_id,
//! client_reference)`, with or without an `Idempotency-Key`.

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::Problem;
use idem_core::UnixMillis;
use idem_sql::{create_once, Created};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::{caller_and, database_unavailable, AppState};
use crate::db::{on_backend, BeginWrite};
use crate::input::{self, validation};

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Item {
    sku: String,
    qty: i64,
}

/// An order as the API shows it.
#[derive(Debug, Serialize)]
pub(crate) struct Order {
    id: String,
    customer_id: String,
    client_reference: String,
    items: Vec<Item>,
    status: String,
}

/// id, customer, reference, items (JSON), status.
type OrderRow = (String, String, String, String, String);

const COLUMNS: &str = "id, customer_id, client_reference, items, status";

fn order_of(row: OrderRow) -> Result<Order, Response> {
    let (id, customer_id, client_reference, items, status) = row;
    let items = serde_json::from_str(&items).map_err(|e| {
        tracing::error!(order = %id, error = %e, "stored order items do not parse");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "corrupt-order",
            "The stored order is unreadable",
        )
        .into_response()
    })?;
    Ok(Order {
        id,
        customer_id,
        client_reference,
        items,
        status,
    })
}

struct NewOrder {
    customer_id: String,
    client_reference: String,
    items: Vec<Item>,
}

fn parse_order(body: &[u8]) -> Result<NewOrder, Response> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| validation(format!("the body is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(validation("the body must be a JSON object"));
    };
    if let Some(extra) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "customer_id" | "client_reference" | "items"))
    {
        return Err(validation(format!(
            "unknown field {extra:?}; expected customer_id, client_reference, items"
        )));
    }
    let text = |name: &str| match map.get(name) {
        Some(Value::String(s)) => input::identifier(name, s).map(|()| s.clone()),
        _ => Err(validation(format!("{name} is required: a string"))),
    };
    let customer_id = text("customer_id")?;
    let client_reference = text("client_reference")?;
    let Some(Value::Array(raw)) = map.get("items") else {
        return Err(validation(
            "items is required: a non-empty array of {\"sku\", \"qty\"}",
        ));
    };
    if raw.is_empty() || raw.len() > 100 {
        return Err(validation("items must hold 1 to 100 lines"));
    }
    let mut items = Vec::with_capacity(raw.len());
    for (i, line) in raw.iter().enumerate() {
        let sku = line
            .get("sku")
            .and_then(Value::as_str)
            .filter(|s| input::is_identifier(s));
        let qty = line
            .get("qty")
            .and_then(Value::as_i64)
            .filter(|q| (1..=1_000_000).contains(q));
        let extra = line
            .as_object()
            .is_some_and(|o| o.keys().any(|k| k != "sku" && k != "qty"));
        match (sku, qty, extra) {
            (Some(sku), Some(qty), false) => items.push(Item {
                sku: sku.to_owned(),
                qty,
            }),
            _ => {
                return Err(validation(format!(
                    "items[{i}] must be {{\"sku\": 1 to 64 of A-Z a-z 0-9 _ . : -, \"qty\": 1 to 1000000}}"
                )))
            }
        }
    }
    Ok(NewOrder {
        customer_id,
        client_reference,
        items,
    })
}

/// Creates the order once per natural key: `201` the first time, `200` with
/// the same order after that; `422` if the reference was used for other items.
pub(crate) async fn create_order(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let client_id = match input::client_id(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let new = match parse_order(&body) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let id = format!("ord_{}", uuid::Uuid::now_v7().simple());
    let items = match serde_json::to_string(&new.items) {
        Ok(s) => s,
        Err(e) => return validation(e.to_string()),
    };
    let now = UnixMillis::now().0;
    let insert = format!(
        "INSERT INTO shop_orders (id, client_id, customer_id, client_reference, items, status, created_at)
         VALUES ($1, $2, $3, $4, $5, 'placed', $6)
         ON CONFLICT (client_id, customer_id, client_reference) DO NOTHING
         RETURNING {COLUMNS}"
    );
    let fetch = format!(
        "SELECT {COLUMNS} FROM shop_orders
         WHERE client_id = $1 AND customer_id = $2 AND client_reference = $3"
    );
    let created: Result<Created<OrderRow>, sqlx::Error> = on_backend!(&state.db, store => async {
        let mut tx = store.pool().begin_write().await?;
        let staged = async {
            let created: Created<OrderRow> = create_once(
                &mut *tx,
                || {
                    sqlx::query_as(&insert)
                        .bind(&id)
                        .bind(&client_id)
                        .bind(&new.customer_id)
                        .bind(&new.client_reference)
                        .bind(&items)
                        .bind(now)
                },
                || sqlx::query_as(&fetch).bind(&client_id).bind(&new.customer_id).bind(&new.client_reference),
            )
            .await?;
            // The event commits with the order, and only when the order is new.
            if let Created::Created(row) = &created {
                let event = crate::messaging::order_placed(&state.messaging, &row.0, &row.1, &row.3);
                idem_outbox::OutboxConnection::enqueue(&mut *tx, &event).await?;
            }
            Ok(created)
        }
        .await;
        crate::db::finish(tx, staged).await
    }
    .await);
    if created.as_ref().is_ok_and(Created::is_created) {
        state.messaging.wake();
    }
    let created = match created {
        Ok(c) => c,
        Err(e) => return database_unavailable(&e),
    };
    let (status, row) = match created {
        Created::Created(row) => (StatusCode::CREATED, row),
        Created::Existing(row) => (StatusCode::OK, row),
    };
    let order = match order_of(row) {
        Ok(o) => o,
        Err(r) => return r,
    };
    if status == StatusCode::OK && order.items != new.items {
        return Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "client-reference-reused",
            "This client_reference names another order",
        )
        .detail(format!(
            "order {} has other items; use a new client_reference for a new order",
            order.id
        ))
        .into_response();
    }
    let location = format!("/orders/{}", order.id);
    (status, [(header::LOCATION, location)], Json(order)).into_response()
}

/// `GET /orders/{id}`.
/// `GET /orders/{id}`: the calling client's order; another client's is `404`.
pub(crate) async fn get_order(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let client = match caller_and(&headers, "the order id", &id) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let sql = format!("SELECT {COLUMNS} FROM shop_orders WHERE id = $1 AND client_id = $2");
    let row: Result<Option<OrderRow>, sqlx::Error> = on_backend!(&state.db, store => sqlx::query_as(&sql).bind(&id).bind(&client).fetch_optional(store.pool()).await);
    match row {
        Ok(Some(row)) => match order_of(row) {
            Ok(o) => Json(o).into_response(),
            Err(r) => r,
        },
        Ok(None) => Problem::new(StatusCode::NOT_FOUND, "not-found", "No such order")
            .detail(format!("no order {id:?}"))
            .into_response(),
        Err(e) => database_unavailable(&e),
    }
}
