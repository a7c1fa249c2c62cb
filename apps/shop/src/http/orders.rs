//! Orders: created once per natural key `(client, customer_id,
//! client_reference)`, with or without an `Idempotency-Key`.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::{IdempotencyLayer, Problem};
use idem_core::UnixMillis;
use idem_sql::Created;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::router::UtoipaMethodRouterExt;
use utoipa_axum::routes;

use super::auth::Client;
use super::error::{Error, Result};
use super::{input, AppState, ProblemDoc};
use crate::db::{self, dialect::ORDER_KEY, Row};

/// The order routes; `layer` honours an `Idempotency-Key` on
/// `POST /orders` when one is sent.
pub(super) fn router(layer: IdempotencyLayer) -> OpenApiRouter<AppState> {
    // Layers on the method router: another method still gets 405.
    // A malformed order is refused before the key is claimed: not stored.
    let layer = layer.validate(|_, body| {
        NewOrder::parse(body)
            .map(drop)
            .map_err(IntoResponse::into_response)
    });
    OpenApiRouter::new().routes(routes!(get_order)).routes(
        routes!(create_order)
            .map(|r| r.route_layer(layer))
            .map(|r| r.route_layer(axum::middleware::from_fn(super::auth::require_client_json))),
    )
}

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Item {
    /// The product.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "sku-1")]
    sku: String,
    /// How many.
    #[schema(minimum = 1, maximum = 1_000_000)]
    qty: i64,
}

/// An order to place.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    /// The customer.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "cust-1")]
    customer_id: String,
    /// The client's own reference: the same reference names the same order.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "cart-42")]
    client_reference: String,
    /// 1 to 100 lines.
    #[schema(min_items = 1, max_items = 100)]
    items: Vec<Item>,
}

impl NewOrder {
    fn parse(body: &[u8]) -> Result<Self> {
        let new: Self = input::json(body)?;
        input::identifier("customer_id", &new.customer_id)?;
        input::identifier("client_reference", &new.client_reference)?;
        if new.items.is_empty() || new.items.len() > 100 {
            return Err(Error::validation("items must hold 1 to 100 lines"));
        }
        for (i, item) in new.items.iter().enumerate() {
            if !input::is_identifier(&item.sku) || !(1..=1_000_000).contains(&item.qty) {
                return Err(Error::validation(format!(
                    "items[{i}] must be {{\"sku\": 1 to 64 of A-Z a-z 0-9 _ . : -, \"qty\": 1 to 1000000}}"
                )));
            }
        }
        Ok(new)
    }
}

/// An order as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Order {
    /// The order's id (`ord_…`).
    id: String,
    /// The customer.
    customer_id: String,
    /// The client's reference.
    client_reference: String,
    /// Its lines.
    items: Vec<Item>,
    /// `placed`, or `paid` once checked out.
    status: String,
    /// How many charges the bank holds for this order: 1 once paid,
    /// whatever the retries and crashes.
    bank_charges: i64,
}

/// An order's row; `items` is JSON text.
#[derive(Debug)]
struct OrderRow {
    id: String,
    customer_id: String,
    client_reference: String,
    items: String,
    status: String,
}

impl TryFrom<&Row> for OrderRow {
    type Error = sqlx::Error;
    fn try_from(r: &Row) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: r.text("id")?,
            customer_id: r.text("customer_id")?,
            client_reference: r.text("client_reference")?,
            items: r.text("items")?,
            status: r.text("status")?,
        })
    }
}

const COLUMNS: &str = "id, customer_id, client_reference, items, status";

impl TryFrom<OrderRow> for Order {
    type Error = Error;

    fn try_from(row: OrderRow) -> Result<Self> {
        let items = serde_json::from_str(&row.items).map_err(|e| {
            tracing::error!(order = %row.id, error = %e, "stored order items do not parse");
            Error::from(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "corrupt-order",
                "The stored order is unreadable",
            ))
        })?;
        Ok(Order {
            id: row.id,
            customer_id: row.customer_id,
            client_reference: row.client_reference,
            items,
            status: row.status,
            bank_charges: 0,
        })
    }
}

/// The calling client's order `id`, with the bank's charges for it;
/// another client's is `404`.
pub(super) async fn order_view(state: &AppState, client: &str, id: &str) -> Result<Order> {
    let sql = format!("SELECT {COLUMNS} FROM shop_orders WHERE id = $1 AND client_id = $2");
    let row = db::query_one(&*state.db, &sql, &[id.into(), client.into()])
        .await?
        .as_ref()
        .map(OrderRow::try_from)
        .transpose()?;
    let Some(row) = row else {
        return Err(Error::NotFound {
            what: "order",
            id: id.to_owned(),
        });
    };
    let mut order = Order::try_from(row)?;
    order.bank_charges = bank_charges(state, client, id).await?;
    Ok(order)
}

/// The bank's charges made for the client's order `id`.
async fn bank_charges(state: &AppState, client: &str, id: &str) -> Result<i64> {
    const SQL: &str =
        "SELECT count(*) AS n FROM bank_charges WHERE reference = $1 AND client_id = $2";
    let row = db::query_one(&*state.db, SQL, &[id.into(), client.into()])
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    Ok(row.int("n")?)
}

/// Places an order once per natural key: `201` the first time, `200` with
/// the same order after that; `422` if the reference was used for other
/// items. An `Idempotency-Key` is optional here (honoured when sent).
#[utoipa::path(
    post,
    path = "/orders",
    tag = "orders",
    security(("bearer" = [])),
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "Optional: the natural key deduplicates anyway. 1 to 255 visible ASCII characters.", pattern = "^[!-~]{1,255}$"),
    ),
    request_body(content = NewOrder, content_type = "application/json"),
    responses(
        (status = 201, description = "Placed", body = Order, headers(("Location" = String, description = "The order"))),
        (status = 200, description = "Placed before under this reference, with these items", body = Order, headers(("Location" = String, description = "The order"))),
        (status = 409, description = "The same Idempotency-Key is in flight", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "The reference (or the Idempotency-Key) names another order", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn create_order(
    State(state): State<AppState>,
    Client(client_id): Client,
    body: Bytes,
) -> Result<Response> {
    let new = NewOrder::parse(&body)?;
    let id = format!("ord_{}", uuid::Uuid::now_v7().simple());
    let items = serde_json::to_string(&new.items).map_err(|e| Error::validation(e.to_string()))?;
    let now = UnixMillis::now().0;
    let fetch = format!(
        "SELECT {COLUMNS} FROM shop_orders
         WHERE client_id = $1 AND customer_id = $2 AND client_reference = $3"
    );
    let mut tx = state.db.begin().await?;
    let staged = async {
        let created = db::create_once(
            &mut *tx,
            (state.db.sql().insert_order, ORDER_KEY),
            &[
                (&id).into(),
                (&client_id).into(),
                (&new.customer_id).into(),
                (&new.client_reference).into(),
                (&items).into(),
                now.into(),
            ],
            &fetch,
            &[
                (&client_id).into(),
                (&new.customer_id).into(),
                (&new.client_reference).into(),
            ],
        )
        .await?;
        let created = match created {
            Created::Created(r) => Created::Created(OrderRow::try_from(&r)?),
            Created::Existing(r) => Created::Existing(OrderRow::try_from(&r)?),
        };
        // The event commits with the order, and only when the order is new.
        if let Created::Created(row) = &created {
            let event = crate::messaging::order_placed(
                &state.messaging,
                &row.id,
                &row.customer_id,
                &row.items,
            );
            tx.enqueue(&event).await?;
        }
        Ok::<_, sqlx::Error>(created)
    }
    .await;
    let created = match staged {
        Ok(created) => {
            tx.commit().await?;
            created
        }
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e.into());
        }
    };
    let (status, row) = match created {
        Created::Created(row) => {
            state.messaging.wake();
            (StatusCode::CREATED, row)
        }
        Created::Existing(row) => (StatusCode::OK, row),
    };
    let order = Order::try_from(row)?;
    if status == StatusCode::OK && order.items != new.items {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "client-reference-reused",
            "This client_reference names another order",
        )
        .detail(format!(
            "order {} has other items; use a new client_reference for a new order",
            order.id
        ))
        .into());
    }
    let location = format!("/orders/{}", order.id);
    Ok((status, [(header::LOCATION, location)], Json(order)).into_response())
}

/// The calling client's order; another client's is `404`.
#[utoipa::path(
    get,
    path = "/orders/{id}",
    tag = "orders",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The order id", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses(
        (status = 200, description = "The order, with `status` and the bank's charges for it (`bank_charges`)", body = Order),
        (status = 404, description = "No such order for this client", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn get_order(
    State(state): State<AppState>,
    Client(client): Client,
    Path(id): Path<String>,
) -> Result<Json<Order>> {
    input::identifier("the order id", &id)?;
    Ok(Json(order_view(&state, &client, &id).await?))
}
