//! The README's quick start: an axum handler guarded by idem on SQLite.
use axum::{
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use idem::axum::{Idempotency, IdempotencyLayer};
use idem::sqlite::SqliteStore;
use idem::sqlx;
use idem::Policy;
use std::sync::Arc;

async fn create_order(
    State(store): State<SqliteStore>,
    idem: Idempotency,
    body: String,
) -> Response {
    let mut tx = match store.pool().begin().await {
        Ok(tx) => tx,
        Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
    };
    // Your business write. Give idem.operation_id() to any external system
    // (payment provider, mailer) as *its* idempotency key.
    if sqlx::query("INSERT INTO orders (operation_id, body) VALUES (?1, ?2)")
        .bind(idem.operation_id().to_string())
        .bind(&body)
        .execute(&mut *tx)
        .await
        .is_err()
    {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let response = (StatusCode::CREATED, "created").into_response();
    // The record commits with the order, fenced by this attempt's token.
    let response = match idem.complete_in(&store, &mut *tx, response).await {
        Ok(r) => r,
        Err(e) => return e.into_response(), // a retry took over: drop tx, nothing commits
    };
    match tx.commit().await {
        Ok(()) => response,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(), // 5xx releases the claim
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite:app.db").await?; // created and migrated
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (operation_id TEXT UNIQUE, body TEXT)")
        .execute(store.pool())
        .await?;
    // The scope keeps one client's keys away from another's: take it from
    // your authentication. Err(response) refuses the request.
    let scope = |parts: &axum::http::request::Parts| {
        parts
            .headers
            .get("x-client-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| StatusCode::UNAUTHORIZED.into_response())
    };
    let layer = IdempotencyLayer::new(Arc::new(store.clone()), Policy::default(), scope);
    let app = Router::new()
        .route("/orders", post(create_order).route_layer(layer))
        .with_state(store);
    axum::serve(tokio::net::TcpListener::bind("127.0.0.1:3000").await?, app).await?;
    Ok(())
}
