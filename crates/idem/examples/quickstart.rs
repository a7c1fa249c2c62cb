//! The README's quick start: an axum handler guarded by idem on SQLite.
use axum::{http::StatusCode, response::Response, routing::post, Router};
use idem::axum::{Guarded, HeaderScope, IdempotencyLayer};
use idem::sqlite::SqliteStore;
use idem::{sqlx, Policy};

async fn create_order(guard: Guarded<SqliteStore>, body: String) -> Response {
    // Stable across retries: give it to other systems (a payment provider) as *their* key.
    let operation_id = guard.operation_id().to_string();
    guard
        .transaction(async |tx| {
            sqlx::query("INSERT INTO orders (operation_id, body) VALUES (?1, ?2)")
                .bind(operation_id)
                .bind(body)
                .execute(&mut *tx)
                .await?; // rolls back: 503 if the database is unavailable, 500 for a bug
            Ok((StatusCode::CREATED, "created")) // commits with the idempotency record
        })
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite:app.db").await?; // created and migrated
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (operation_id TEXT UNIQUE, body TEXT)")
        .execute(store.pool())
        .await?;
    // Keys are per client: the scope is the client id your authentication put in a header.
    let scope = HeaderScope::new("x-client-id");
    let layer = IdempotencyLayer::from_store(store.clone(), Policy::default(), scope);
    let app = Router::new()
        .route("/orders", post(create_order).route_layer(layer))
        .with_state(store); // Guarded<SqliteStore> takes it from here: the compiler checks the type
    let addr = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    Ok(())
}
