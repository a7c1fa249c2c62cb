//! The catalog, shared by every client: products, written with optimistic
//! concurrency (`GET` sends an `ETag` derived from the version column; `PUT`
//! updates `WHERE version = $seen`), and the stock the reserve-stock
//! consumer reserved. Reads are public; writing needs a bearer.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::conditional::{
    precondition_failed, precondition_required, ETag, IfMatch, IfNoneMatch,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::router::UtoipaMethodRouterExt;
use utoipa_axum::routes;

use super::auth::Client;
use super::error::{Error, Result};
use super::{input, AppState, ProblemDoc};
use crate::db::{self, dialect::PRODUCT_KEY, Row};

/// The catalog's routes.
pub(super) fn router() -> OpenApiRouter<AppState> {
    // The layer goes on the method router: it guards PUT alone, and another
    // method still gets 405.
    OpenApiRouter::new()
        .routes(routes!(get_product))
        .routes(
            routes!(put_product).map(|r| {
                r.route_layer(axum::middleware::from_fn(super::auth::require_client_json))
            }),
        )
        .routes(routes!(get_stock))
}

/// A product as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
struct Product {
    /// Its SKU.
    sku: String,
    /// Its name.
    name: String,
    /// In minor units.
    price: i64,
    /// Bumped by every write; the `ETag` is derived from it.
    version: i64,
}

/// A product to write.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ProductBody {
    /// 1 to 255 bytes of UTF-8, no control characters.
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]+$",
        example = "Tea"
    )]
    name: String,
    /// In minor units, 0 to 1,000,000,000.
    #[schema(minimum = 0, maximum = 1_000_000_000)]
    price: i64,
}

impl ProductBody {
    fn parse(body: &[u8]) -> Result<Self> {
        let new: Self = input::json(body)?;
        input::text("name", &new.name, 255)?;
        if !(0..=input::MAX_AMOUNT).contains(&new.price) {
            return Err(Error::validation(format!(
                "price must be an integer from 0 to {} (minor units)",
                input::MAX_AMOUNT
            )));
        }
        Ok(new)
    }
}

const COLUMNS: &str = "sku, name, price, version";

impl TryFrom<&Row> for Product {
    type Error = sqlx::Error;
    fn try_from(r: &Row) -> Result<Self, sqlx::Error> {
        Ok(Self {
            sku: r.text("sku")?,
            name: r.text("name")?,
            price: r.int("price")?,
            version: r.int("version")?,
        })
    }
}

fn answer(status: StatusCode, p: Product) -> Response {
    let etag = ETag::from_version(p.version);
    let location = format!("/products/{}", p.sku);
    (status, etag, [(header::LOCATION, location)], Json(p)).into_response()
}

async fn current(state: &AppState, sku: &str) -> Result<Option<Product>> {
    let sql = format!("SELECT {COLUMNS} FROM shop_products WHERE sku = $1");
    Ok(db::query_one(&*state.db, &sql, &[sku.into()])
        .await?
        .as_ref()
        .map(Product::try_from)
        .transpose()?)
}

/// `412` with the current version's `ETag` (if the product exists).
async fn stale(state: &AppState, sku: &str) -> Result<Response> {
    let product = current(state, sku).await?;
    Ok(precondition_failed(
        product.map(|p| ETag::from_version(p.version)).as_ref(),
    ))
}

/// A product, with its `ETag`.
#[utoipa::path(
    get,
    path = "/products/{sku}",
    tag = "catalog",
    params(("sku" = String, Path, description = "The product", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses(
        (status = 200, description = "The product", body = Product,
            headers(("ETag" = String, description = "Its version"))),
        (status = 404, description = "No such product", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn get_product(State(state): State<AppState>, Path(sku): Path<String>) -> Result<Response> {
    input::identifier("the sku", &sku)?;
    match current(&state, &sku).await? {
        Some(p) => Ok(answer(StatusCode::OK, p)),
        None => Err(Error::NotFound {
            what: "product",
            id: sku,
        }),
    }
}

/// Creates or updates a product:
/// - with `If-Match`: update if the version is still one of those listed
///   (or any, with `*`): `200`, else `412`;
/// - without it (or with `If-None-Match: *`): create if absent (`201`); if
///   the product exists, `428` (updates need `If-Match`), or `412` under
///   `If-None-Match: *`.
#[utoipa::path(
    put,
    path = "/products/{sku}",
    tag = "catalog",
    security(("bearer" = [])),
    params(
        ("sku" = String, Path, description = "The product", pattern = "^[A-Za-z0-9_.:-]{1,64}$"),
        ("If-Match" = Option<String>, Header, description = "`*` or a list of the entity tags seen (at most 64): update only from one of them"),
        ("If-None-Match" = Option<String>, Header, description = "`*`: create only"),
    ),
    request_body(content = ProductBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Updated", body = Product, headers(("ETag" = String, description = "The new version"))),
        (status = 201, description = "Created", body = Product, headers(("ETag" = String, description = "Its version"))),
        (status = 412, description = "The version changed since it was read (or the product exists, under If-None-Match: *)", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 428, description = "The product exists: an update needs If-Match", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn put_product(
    State(state): State<AppState>,
    _: Client,
    Path(sku): Path<String>,
    if_match: Option<IfMatch>,
    if_none_match: Option<IfNoneMatch>,
    body: Bytes,
) -> Result<Response> {
    input::identifier("the sku", &sku)?;
    let new = ProductBody::parse(&body)?;
    if if_none_match.as_ref().is_some_and(|inm| !inm.is_any()) {
        return Err(Error::validation(
            "only If-None-Match: * is supported on PUT",
        ));
    }
    if let Some(if_match) = if_match {
        // `*` matches any existing version; tags name the ones seen.
        let versions = if_match.versions();
        if versions.len() > 64 {
            return Err(Error::validation(
                "If-Match may list at most 64 entity tags",
            ));
        }
        let sql = if if_match.is_any() {
            "UPDATE shop_products SET name = $2, price = $3, version = version + 1 WHERE sku = $1"
                .to_owned()
        } else if versions.is_empty() {
            // Tags we did not issue never match.
            return stale(&state, &sku).await;
        } else {
            let listed: Vec<String> = (0..versions.len()).map(|i| format!("${}", i + 4)).collect();
            format!(
                "UPDATE shop_products SET name = $2, price = $3, version = version + 1 WHERE sku = $1 AND version IN ({})",
                listed.join(", ")
            )
        };
        let mut params: Vec<db::Param<'_>> =
            vec![(&sku).into(), (&new.name).into(), new.price.into()];
        params.extend(versions.iter().map(|v| db::Param::Int(*v)));
        // One write transaction: the update, and the row it wrote read back.
        let mut tx = state.db.begin().await?;
        let staged = async {
            if tx.execute(&sql, &params).await? != 1 {
                return Ok(None);
            }
            let fetch = format!("SELECT {COLUMNS} FROM shop_products WHERE sku = $1");
            db::fetch_optional(&mut *tx, &fetch, &[(&sku).into()]).await
        }
        .await;
        let updated = match staged {
            Ok(row) => {
                tx.commit().await?;
                row
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(e.into());
            }
        };
        return match updated {
            Some(row) => Ok(answer(StatusCode::OK, Product::try_from(&row)?)),
            // Someone else wrote first (or the product is gone).
            None => stale(&state, &sku).await,
        };
    }
    let fetch = format!("SELECT {COLUMNS} FROM shop_products WHERE sku = $1");
    let mut conn = state.db.write_conn().await?;
    let created = db::create_once(
        &mut *conn,
        (state.db.sql().insert_product, PRODUCT_KEY),
        &[(&sku).into(), (&new.name).into(), new.price.into()],
        &fetch,
        &[(&sku).into()],
    )
    .await?;
    match created {
        idem_sql::Created::Created(row) => {
            Ok(answer(StatusCode::CREATED, Product::try_from(&row)?))
        }
        idem_sql::Created::Existing(_) if if_none_match.is_some() => stale(&state, &sku).await,
        idem_sql::Created::Existing(_) => Ok(precondition_required()),
    }
}

/// Units reserved for a SKU.
#[derive(Debug, Serialize, ToSchema)]
struct Stock {
    /// The product.
    sku: String,
    /// Units reserved by the reserve-stock consumer, once per order.
    reserved: i64,
}

/// Units reserved so far by the reserve-stock consumer.
#[utoipa::path(
    get,
    path = "/stock/{sku}",
    tag = "catalog",
    params(("sku" = String, Path, description = "The product", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses((status = 200, description = "The units reserved", body = Stock))
)]
async fn get_stock(State(state): State<AppState>, Path(sku): Path<String>) -> Result<Json<Stock>> {
    input::identifier("the sku", &sku)?;
    let reserved = db::reserved(&*state.db, &sku).await?;
    Ok(Json(Stock { sku, reserved }))
}
