//! `idempotent-peer`: aklanti's `idempotent` crate (its tower
//! `IdempotencyLayer`) in front of the trivial `POST /payments`, for
//! side-by-side load tests with idem.
//!
//! With `--store memory` the records live in the crate's in-process
//! `MemoryStore`; with `--store redis` in its `ValkeyStore`, under a fresh
//! key prefix each run unless `--redis-prefix` names one (two instances
//! with one prefix share their records). The layer keys by the
//! `Idempotency-Key` header, fingerprints the method, path, query and body,
//! answers 409 to a duplicate still running and 400 to a key reused with
//! another body.

use clap::Parser;
use idem_rust_peers::{routes, serve, Args, Store};
use idempotent::memory::MemoryStore;
use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let app = match args.store {
        Store::Memory => routes().layer(IdempotencyLayer::new(MemoryStore::builder().try_build()?)),
        Store::Redis => {
            let store = ValkeyStore::with_url(&args.redis_url)
                .prefix(
                    args.redis_prefix
                        .unwrap_or_else(|| format!("peer-{}", uuid::Uuid::new_v4().simple())),
                )
                .try_build()
                .await?;
            routes().layer(IdempotencyLayer::new(store))
        }
    };
    serve("idempotent", &args.listen, app).await?;
    Ok(())
}
