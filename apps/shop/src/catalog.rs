//! Products, written with optimistic concurrency: `GET` sends an `ETag`
//! derived from the version column; `PUT` updates `WHERE version = $seen`.

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::conditional::{
    precondition_failed, precondition_required, ETag, IfMatch, IfNoneMatch,
};
use idem_axum::Problem;
use serde::Serialize;
use serde_json::Value;

use crate::api::{database_unavailable, AppState};
use crate::db::on_backend;
use crate::input::{self, validation};

/// A product as the API shows it.
#[derive(Debug, Serialize)]
struct Product {
    sku: String,
    name: String,
    price: i64,
    version: i64,
}

type ProductRow = (String, String, i64, i64);

fn product((sku, name, price, version): ProductRow) -> Product {
    Product {
        sku,
        name,
        price,
        version,
    }
}

fn answer(status: StatusCode, p: Product) -> Response {
    let etag = ETag::from_version(p.version);
    let location = format!("/products/{}", p.sku);
    (status, etag, [(header::LOCATION, location)], Json(p)).into_response()
}

async fn current(state: &AppState, sku: &str) -> Result<Option<ProductRow>, sqlx::Error> {
    on_backend!(&state.db, store => sqlx::query_as("SELECT sku, name, price, version FROM shop_products WHERE sku = $1")
        .bind(sku)
        .fetch_optional(store.pool())
        .await)
}

/// `GET /products/{sku}`, with its `ETag`.
pub(crate) async fn get_product(
    State(state): State<AppState>,
    Path(sku): Path<String>,
) -> Response {
    if let Err(r) = input::identifier("the sku", &sku) {
        return r;
    }
    match current(&state, &sku).await {
        Ok(Some(row)) => answer(StatusCode::OK, product(row)),
        Ok(None) => {
            Problem::new(StatusCode::NOT_FOUND, "not-found", "No such product").into_response()
        }
        Err(e) => database_unavailable(&e),
    }
}

fn parse_product(body: &[u8]) -> Result<(String, i64), Response> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| validation(format!("the body is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(validation("the body must be a JSON object"));
    };
    if let Some(extra) = map.keys().find(|k| !matches!(k.as_str(), "name" | "price")) {
        return Err(validation(format!(
            "unknown field {extra:?}; expected name, price"
        )));
    }
    let name = match map.get("name") {
        Some(Value::String(s)) => {
            input::text("name", s, 255)?;
            s.clone()
        }
        _ => return Err(validation("name is required: a string")),
    };
    let price = match map.get("price").and_then(Value::as_i64) {
        Some(p) if (0..=input::MAX_AMOUNT).contains(&p) => p,
        _ => {
            return Err(validation(format!(
                "price is required: an integer from 0 to {} (minor units)",
                input::MAX_AMOUNT
            )))
        }
    };
    Ok((name, price))
}

/// `PUT /products/{sku}`:
/// - with `If-Match`: update if the version is still the one seen (`200`),
///   else `412`;
/// - without it (or with `If-None-Match: *`): create if absent (`201`); if
///   the product exists, `428` (updates need `If-Match`), or `412` under
///   `If-None-Match: *`.
///
/// `If-Match` may list several tags: the update applies if the current
/// version is any of them. The catalog is shared: anyone reads it, a
/// signed-in client writes it.
pub(crate) async fn put_product(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    Path(sku): Path<String>,
    if_match: Option<IfMatch>,
    if_none_match: Option<IfNoneMatch>,
    body: axum::body::Bytes,
) -> Response {
    if let Err(r) = crate::api::caller_and(&headers, "the sku", &sku) {
        return r;
    }
    let (name, price) = match parse_product(&body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if let Some(inm) = &if_none_match {
        if !inm.is_any() {
            return validation("only If-None-Match: * is supported on PUT");
        }
    }
    const RETURNING: &str = "RETURNING sku, name, price, version";
    if let Some(if_match) = if_match {
        // `*` matches any existing version; tags name the ones seen.
        let versions = if_match.versions();
        if versions.len() > 64 {
            return validation("If-Match may list at most 64 entity tags");
        }
        let sql = if if_match.is_any() {
            format!("UPDATE shop_products SET name = $2, price = $3, version = version + 1 WHERE sku = $1 {RETURNING}")
        } else if versions.is_empty() {
            // Tags we did not issue never match.
            return match current(&state, &sku).await {
                Ok(row) => precondition_failed(row.map(|r| ETag::from_version(r.3)).as_ref()),
                Err(e) => database_unavailable(&e),
            };
        } else {
            let listed: Vec<String> = (0..versions.len()).map(|i| format!("${}", i + 4)).collect();
            format!(
                "UPDATE shop_products SET name = $2, price = $3, version = version + 1 WHERE sku = $1 AND version IN ({}) {RETURNING}",
                listed.join(", ")
            )
        };
        let updated: Result<Option<ProductRow>, sqlx::Error> = on_backend!(&state.db, store => {
            let mut q = sqlx::query_as(&sql).bind(&sku).bind(&name).bind(price);
            for v in &versions {
                q = q.bind(*v);
            }
            q.fetch_optional(store.pool()).await
        });
        return match updated {
            Ok(Some(row)) => answer(StatusCode::OK, product(row)),
            // Someone else wrote first (or the product is gone).
            Ok(None) => match current(&state, &sku).await {
                Ok(row) => precondition_failed(row.map(|r| ETag::from_version(r.3)).as_ref()),
                Err(e) => database_unavailable(&e),
            },
            Err(e) => database_unavailable(&e),
        };
    }
    let sql = format!(
        "INSERT INTO shop_products (sku, name, price, version) VALUES ($1, $2, $3, 1)
         ON CONFLICT (sku) DO NOTHING {RETURNING}"
    );
    let created: Result<Option<ProductRow>, sqlx::Error> = on_backend!(&state.db, store =>
        sqlx::query_as(&sql).bind(&sku).bind(&name).bind(price).fetch_optional(store.pool()).await);
    match created {
        Ok(Some(row)) => answer(StatusCode::CREATED, product(row)),
        Ok(None) if if_none_match.is_some() => match current(&state, &sku).await {
            Ok(row) => precondition_failed(row.map(|r| ETag::from_version(r.3)).as_ref()),
            Err(e) => database_unavailable(&e),
        },
        Ok(None) => precondition_required(),
        Err(e) => database_unavailable(&e),
    }
}
