//! What the Rust peer servers share: the command line, the trivial
//! `POST /payments` handler that `bench/trivial` also serves, and binding
//! and announcing the listener the way `bench/run.sh` expects.

use std::io::Write;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};

/// Serves `POST /payments` behind a Rust idempotency library, for load tests.
#[derive(Debug, clap::Parser)]
pub struct Args {
    /// Where to listen; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Where the peer keeps its records.
    #[arg(long, value_enum, default_value_t = Store::Memory)]
    pub store: Store,
    /// Redis (or Valkey), for `--store redis`.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// The key prefix in Redis, for a peer that takes one (`idempotent`);
    /// a fresh one each run by default, so that runs do not meet.
    #[arg(long)]
    pub redis_prefix: Option<String>,
}

/// The peer's store.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Store {
    /// In the process.
    Memory,
    /// In Redis or Valkey.
    Redis,
}

/// The unguarded routes: `POST /payments`.
pub fn routes() -> Router {
    Router::new().route("/payments", post(pay))
}

/// Sleeps for `x-simulate: bank-delay=MS` if asked, then answers 201 with a
/// fresh payment id.
///
/// It reads the body it ignores: a layer that does not buffer the body
/// (axum-idempotent's header-key mode, either layer without a key) would
/// otherwise leave it unread, and hyper then closes a keep-alive connection
/// whose body arrived after the response.
async fn pay(headers: HeaderMap, _body: Bytes) -> (StatusCode, Json<serde_json::Value>) {
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

/// Binds `listen`, prints `<name> listening on http://<addr>` on stdout, and
/// serves `app` until the process is stopped.
pub async fn serve(name: &str, listen: &str, app: Router) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{name} listening on http://{}", listener.local_addr()?)?;
    out.flush()?;
    drop(out);
    axum::serve(listener, app).await
}
