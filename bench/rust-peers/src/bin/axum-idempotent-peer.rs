//! `axum-idempotent-peer`: the `axum-idempotent` crate in front of the
//! trivial `POST /payments`, for side-by-side load tests with idem.
//!
//! The crate keeps its records in a `ruts` session: in memory (moka) with
//! `--store memory`, in a Redis hash per session with `--store redis`
//! (Redis 7.4 or later, for `HEXPIRE`). It keys records by the
//! `Idempotency-Key` header alone, and only for a request that carries a
//! session cookie: it never creates a session, so a client without one
//! (`idem-load` sends no cookies) gets no deduplication at all. Send a fixed
//! `cookie: session=<22 base64url characters>` to put every request in one
//! session.

use std::sync::Arc;

use axum::Router;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use clap::Parser;
use fred::prelude::{Builder, ClientLike, Config};
use idem_rust_peers::{routes, serve, Args, Store};
use ruts::store::moka::MokaStore;
use ruts::store::redis::RedisStore;
use ruts::store::SessionStore;
use ruts::{CookieOptions, SessionLayer};
use tower_cookies::CookieManagerLayer;

/// The name of the session cookie.
const SESSION_COOKIE: &str = "session";

/// The routes behind the idempotency layer, the session layer it reads and
/// the cookie layer that one reads, in the order the crate's README gives.
fn app<T: SessionStore>(store: T) -> Router {
    let options = IdempotentOptions::default()
        // Key by the header, as idem does; a request without one passes.
        .use_idempotency_key_header(Some("idempotency-key"), false)
        .expire_after(24 * 60 * 60);
    let cookie = CookieOptions::build().name(SESSION_COOKIE).path("/");
    routes()
        .layer(IdempotentLayer::<T>::new(options))
        .layer(SessionLayer::new(Arc::new(store)).with_cookie_options(cookie))
        .layer(CookieManagerLayer::new())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let app = match args.store {
        Store::Memory => app(MokaStore::builder().build()),
        Store::Redis => {
            let client = Builder::from_config(Config::from_url(&args.redis_url)?).build()?;
            client.init().await?;
            // ruts writes each field with HEXPIRE; on an older server the write
            // fails after its HSET, so records would be kept with no expiry.
            if let Some(v) = client.server_version() {
                if (v.major, v.minor) < (7, 4) {
                    return Err(
                        format!("ruts' Redis store needs Redis 7.4 or later, not {v}").into(),
                    );
                }
            }
            app(RedisStore::new(Arc::new(client)).await?)
        }
    };
    serve("axum-idempotent", &args.listen, app).await?;
    Ok(())
}
