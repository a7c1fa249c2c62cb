//! `idem-trivial`: idem's layer in front of a trivial `POST /payments`
//! (sleep for `x-simulate: bank-delay=MS` if asked, answer 201 with a fresh
//! id): the same endpoint the peers guard in `bench/peers`, so that their
//! figures compare like with like. `/bare/payments` is the same handler
//! without idem.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use idem_axum::{IdempotencyLayer, SingleScope};
use idem_core::{Policy, Store};

/// idem in front of a trivial endpoint.
#[derive(Debug, Parser)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:18090")]
    listen: String,
    /// `memory` or `redis`.
    #[arg(long, default_value = "memory")]
    store: String,
    /// Redis, for `--store redis`.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// The prefix of the records' Redis keys (a fresh one each run if not set).
    #[arg(long)]
    redis_prefix: Option<String>,
}

/// Reads the body it ignores, as a real handler would: left unread, hyper
/// may close a keep-alive connection whose body arrived late.
async fn pay(
    headers: HeaderMap,
    _body: axum::body::Bytes,
) -> (StatusCode, Json<serde_json::Value>) {
    let delay = headers
        .get("x-simulate")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bank-delay="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let id = format!("pay_{}", uuid::Uuid::new_v4().simple());
    (
        StatusCode::CREATED,
        Json(serde_json::json!({"id": id, "status": "authorized"})),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let store: Arc<dyn Store> = match args.store.as_str() {
        "memory" => Arc::new(idem_memory::MemoryStore::new()),
        "redis" => Arc::new(
            idem_redis::RedisStore::connect(
                idem_redis::RedisConfig::new(&args.redis_url).prefix(
                    args.redis_prefix
                        .clone()
                        .unwrap_or_else(|| format!("trivial-{}", uuid::Uuid::new_v4().simple())),
                ),
            )
            .await?,
        ),
        other => return Err(format!("unknown store {other:?}").into()),
    };
    let layer = IdempotencyLayer::new(store, Policy::default(), SingleScope("bench".into()));
    // `/bare/payments`: the same handler without the layer, the baseline of
    // the instruction counts (bench/callgrind.sh).
    let app = Router::new()
        .route("/payments", post(pay).route_layer(layer))
        .route("/bare/payments", post(pay));
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!(
        "idem-trivial listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
