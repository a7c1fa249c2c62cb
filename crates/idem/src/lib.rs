//! idem makes retried requests safe: a `POST` that arrives twice produces
//! its effect once, and every repeat gets the answer the first got.
//!
//! Put [`IdempotencyLayer`](axum::IdempotencyLayer) in front of a handler,
//! and let [`Guarded::transaction`](axum::Guarded::transaction) run the
//! handler's business write and commit the idempotency record in the same
//! transaction:
//!
//! ```
//! use ::axum::{body::Body, http::StatusCode, response::Response, routing::post, Router};
//! use idem::axum::{Guarded, IdempotencyLayer, SingleScope};
//! use idem::sqlite::SqliteStore;
//! use idem::sqlx; // the sqlx idem is built on
//! use idem::Policy;
//! use tower::ServiceExt;
//!
//! async fn create_order(guard: Guarded<SqliteStore>, body: String) -> Response {
//!     let operation_id = guard.operation_id().to_string();
//!     guard
//!         .transaction(async |tx| {
//!             sqlx::query("INSERT INTO orders (operation_id, body) VALUES (?1, ?2)")
//!                 .bind(operation_id)
//!                 .bind(body)
//!                 .execute(&mut *tx)
//!                 .await?; // rolls back: 503 if the database is unavailable, 500 for a bug
//!             // Fenced by this attempt's token: if a retry took over, nothing commits.
//!             Ok((StatusCode::CREATED, "order created"))
//!         })
//!         .await
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE orders (operation_id TEXT UNIQUE, body TEXT)").execute(store.pool()).await?;
//!
//! let layer = IdempotencyLayer::from_store(store.clone(), Policy::default(), SingleScope("shop".into()));
//! let app = Router::new()
//!     .route("/orders", post(create_order).route_layer(layer))
//!     .with_state(store.clone()); // where Guarded<SqliteStore> finds its store
//!
//! let order = || ::axum::http::Request::post("/orders")
//!     .header("idempotency-key", "c0ffee-1")
//!     .body(Body::from("2 espressos"))
//!     .unwrap();
//! let first = app.clone().oneshot(order()).await?;
//! let retry = app.clone().oneshot(order()).await?; // the network timed out; the client retries
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(store.pool()).await?;
//! assert_eq!(orders, 1);
//! # Ok(()) }
//! ```
//!
//! # Guides
//!
//! | guide | what |
//! |---|---|
//! | [the HTTP contract](guide::contract) | every answer, every problem type, which `4xx` are stored; the five guards and which fits where |
//! | [guarantees and their limits](guide::guarantees) | what holds in each mode, and what idem does not do |
//! | [databases](guide::postgres) | SQLite, PostgreSQL or MySQL/MariaDB; records shared by every instance; a claim held by your transaction |
//! | [Redis](guide::redis) | the fast tier in front of SQL, the in-process cache, Redis alone |
//! | [messages](guide::messages) | the transactional outbox, its relay, the inbox; a whole service with NATS |
//! | [the client](guide::client) | one key per intent, safe retries |
//! | [run once, step by step](guide::once) | any async work once per key, named steps that resume after a crash, `idem once` for cron on many hosts |
//! | [operations](guide::operations) | the `idem` CLI and the metrics |
//!
//! # Crates
//!
//! | module | crate | what |
//! |---|---|---|
//! | (root) | `idem-core` | keys, fingerprints, records, the decision table, [`Policy`], the [`Store`] trait; no I/O |
//! | [`once`](once/index.html) | `idem-once` | run any async work once per key; named steps; the claim loop every edge uses |
//! | [`memory`](memory/index.html) | `idem-memory` | an in-memory store for tests |
//! | [`cache`](cache/index.html) | `idem-cache` | the in-process replay tier in front of any store (feature `cache`) |
//! | [`sqlite`](sqlite/index.html) | `idem-sqlite` | the embedded SQLite store (feature `sqlite`) |
//! | [`postgres`](postgres/index.html) | `idem-postgres` | the PostgreSQL store (feature `postgres`) |
//! | [`mysql`](mysql/index.html) | `idem-mysql` | the MySQL / MariaDB store (feature `mysql`) |
//! | [`axum`](axum/index.html) | `idem-axum` | the tower layer, axum extractor, `ETag` / `If-Match` (feature `axum`) |
//! | [`redis`](redis/index.html) | `idem-redis` | the Redis store and `TieredStore` (feature `redis`) |
//! | [`sql`](sql/index.html) | `idem-sql` | the database layer (the `Dialect` trait), `create_once`, guarded `transition` (feature `sql`) |
//! | [`client`](client/index.html) | `idem-client` | the reqwest retry middleware (feature `client`) |
//! | [`tonic`](tonic/index.html) | `idem-tonic` | the gRPC layer for tonic's unary methods, and its client layer (feature `tonic`) |
//! | [`outbox`](outbox/index.html) | `idem-outbox` | the transactional outbox, its relay, idempotent consumers (feature `outbox`) |
//! | [`nats`](nats/index.html) | `idem-nats` | the outbox's publisher and consumers over NATS JetStream (feature `nats`) |
//! | [`rabbitmq`](rabbitmq/index.html) | `idem-rabbitmq` | the outbox's publisher and consumers over RabbitMQ (feature `rabbitmq`) |
//!
//! `idem::sqlx` is the sqlx (0.8) the stores are built on, and
//! `idem::client::{reqwest, reqwest_middleware}` the reqwest (0.12) and
//! reqwest-middleware (0.4) the client middleware is: name those in your
//! signatures (or depend on the same versions), and a second copy of them in
//! your tree cannot make the types differ.

pub use idem_core::*;

/// The guides: how to use each part, with its guarantees. Each page is
/// also a file under `crates/idem/guide/` in the repository.
pub mod guide {
    #[doc = include_str!("../guide/contract.md")]
    pub mod contract {}
    #[doc = include_str!("../guide/guarantees.md")]
    pub mod guarantees {}
    #[doc = include_str!("../guide/postgres.md")]
    pub mod postgres {}
    #[doc = include_str!("../guide/redis.md")]
    pub mod redis {}
    // The whole program on this page is compiled as a test when the
    // features it needs are on (the test command turns them all on).
    #[cfg_attr(
        any(
            doc,
            all(
                feature = "axum",
                feature = "postgres",
                feature = "redis",
                feature = "nats",
                feature = "client"
            )
        ),
        doc = include_str!("../guide/messages.md")
    )]
    #[cfg_attr(
        not(any(
            doc,
            all(
                feature = "axum",
                feature = "postgres",
                feature = "redis",
                feature = "nats",
                feature = "client"
            )
        )),
        doc = "The messages guide: the outbox, its relay and the inbox (its whole \
               program builds with the features axum, postgres, redis, nats and client)."
    )]
    pub mod messages {}
    #[doc = include_str!("../guide/client.md")]
    pub mod client {}
    #[doc = include_str!("../guide/once.md")]
    pub mod once {}
    #[doc = include_str!("../guide/operations.md")]
    pub mod operations {}
}

/// Run once: any async work at most once per key, named steps that
/// resume after a crash; see the [run-once guide](crate::guide::once).
pub mod once {
    pub use idem_once::*;
}

/// The in-memory store, for tests and examples.
pub mod memory {
    pub use idem_memory::*;
}

/// The in-process replay tier in front of any store.
#[cfg(feature = "cache")]
pub mod cache {
    pub use idem_cache::*;
}

/// The embedded SQLite store: the quick start above; guarantees in the
/// [guarantees guide](crate::guide::guarantees), and when to move to
/// PostgreSQL or MySQL in the [databases guide](crate::guide::postgres).
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idem_sqlite::*;
}

/// The PostgreSQL store: records shared by every instance, and a claim
/// held by the business transaction. See the
/// [databases guide](crate::guide::postgres).
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idem_postgres::*;
}

/// The MySQL / MariaDB store: records shared by every instance, committed
/// with the business write. See the [databases guide](crate::guide::postgres).
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use idem_mysql::*;
}

/// Redis: a store of its own, and the tier in front of SQL. See the
/// [Redis guide](crate::guide::redis): what Redis alone does not
/// guarantee.
#[cfg(feature = "redis")]
pub mod redis {
    pub use idem_redis::*;
}

/// Idempotent by construction: natural keys and guarded transitions.
#[cfg(feature = "sql")]
pub mod sql {
    pub use idem_sql::*;
}

/// The client middleware: one key per intent, safe retries. See the
/// [client guide](crate::guide::client).
#[cfg(feature = "client")]
pub mod client {
    pub use idem_client::*;
}

/// The gRPC edge: a tower layer for tonic servers' unary methods
/// (`idempotency-key` metadata, the same contract in gRPC statuses), and a
/// client layer for channels that keeps one key per intent.
#[cfg(feature = "tonic")]
pub mod tonic {
    pub use idem_tonic::*;
}

/// The sqlx idem's stores are built on (0.8), with the drivers of the
/// features enabled.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "sql",
    feature = "outbox"
))]
pub use sqlx;

/// The transactional outbox, its relay, and idempotent consumers (inbox):
/// the outbox's names here (`idem::outbox::migrate`, `enqueue`, `Relay`),
/// the inbox's under [`inbox`](idem_outbox::inbox) (`idem::outbox::inbox::process`).
/// See the [messages guide](crate::guide::messages), with a whole service.
#[cfg(feature = "outbox")]
pub mod outbox {
    pub use idem_outbox::outbox::*;
    pub use idem_outbox::{
        consumer, inbox, transport, Consumer, Delivery, Handled, InboxError, InboxTable,
        OutboxDialect, RelayErrorKind,
    };
}

/// The outbox over NATS JetStream; see the
/// [messages guide](crate::guide::messages).
#[cfg(feature = "nats")]
pub mod nats {
    pub use idem_nats::*;
}

/// The outbox over RabbitMQ; see the
/// [messages guide](crate::guide::messages).
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    pub use idem_rabbitmq::*;
}

/// The tower layer and axum extractors ([`Guarded`](axum::Guarded),
/// `Idempotency`, `DeferredClaim`), `ETag` / `If-Match`. See the
/// [HTTP contract](crate::guide::contract).
#[cfg(feature = "axum")]
pub mod axum {
    pub use idem_axum::*;
}
