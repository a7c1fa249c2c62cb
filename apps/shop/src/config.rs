//! Command-line flags and their environment variables.

use std::time::Duration;

use clap::{Parser, ValueEnum};
use idem_core::{Policy, PolicyError};

/// A demo payments service that cannot charge twice.
#[derive(Debug, Parser)]
#[command(name = "shop", version)]
pub(crate) struct Config {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, env = "SHOP_LISTEN", default_value = "127.0.0.1:8080")]
    pub(crate) listen: String,
    /// Also serve the gRPC API (`shop.v1.Payments`, proto/shop.proto) on this address (port 0 picks a free one).
    #[arg(long, env = "SHOP_GRPC_LISTEN")]
    pub(crate) grpc_listen: Option<String>,
    /// Where clients reach this service (`https://api.example.com`): the
    /// base of every problem `type`, `<public-url>/problems#<slug>`, a page
    /// this service serves. Default: `http://` and the address it listens on.
    #[arg(long, env = "SHOP_PUBLIC_URL")]
    pub(crate) public_url: Option<String>,

    /// Database URL: `sqlite:FILE` (created if missing), `postgres://…` or
    /// `mysql://…` (MySQL 8 or MariaDB 10.6+).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite:shop.db"
    )]
    pub(crate) database_url: String,

    /// SQLite only: when a commit reaches the disk. `full` (the default)
    /// syncs the write-ahead log at every commit: a committed payment and
    /// its record survive a power loss. `normal` syncs at checkpoints only:
    /// faster, and a commit survives a crash of shop, but a power loss or
    /// an operating-system crash can undo the last commits (a retry of
    /// their keys then runs again, and a client may have heard of a payment
    /// that is gone).
    #[arg(long, env = "SHOP_SQLITE_SYNCHRONOUS", value_enum)]
    pub(crate) sqlite_synchronous: Option<SqliteSynchronous>,

    /// How long a request holds its idempotency key before a retry may take over, in milliseconds.
    #[arg(long, env = "IDEM_LEASE_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) lease_ms: u64,

    /// How long idempotency records are kept, in seconds.
    #[arg(long, env = "IDEM_TTL_SECS", default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) ttl_secs: u64,

    /// Redis in front of the database, for replays and in-flight collisions (`redis://host:port`).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub(crate) redis_url: Option<String>,

    /// --redis-url names a Redis Cluster: one or more of its nodes, comma-separated.
    #[arg(long, env = "IDEM_REDIS_CLUSTER")]
    pub(crate) redis_cluster: bool,

    /// Where idempotency records live.
    #[arg(long, env = "IDEM_STORE", value_enum, default_value_t = IdemStore::Database)]
    pub(crate) idem_store: IdemStore,

    /// With `--idem-store redis`: a claim counts only once this many
    /// replicas have it (`WAIT`), so that a failover to one of them keeps
    /// it; fewer within `--redis-wait-timeout-ms` answers 503 and the
    /// payment does not run. 0: do not wait (the default).
    #[arg(long, env = "SHOP_REDIS_WAIT_REPLICAS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub(crate) redis_wait_replicas: u32,

    /// How long a claim waits for `--redis-wait-replicas`, in milliseconds
    /// (below Redis's 500 ms command time-out).
    #[arg(long, env = "SHOP_REDIS_WAIT_TIMEOUT_MS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=450))]
    pub(crate) redis_wait_timeout_ms: u64,

    /// The prefix of idem's keys in Redis (two services sharing a Redis need different ones).
    #[arg(long, env = "IDEM_REDIS_PREFIX", default_value = "idem")]
    pub(crate) redis_prefix: String,

    /// A broker for the events (`amqp://…` RabbitMQ, `nats://…` JetStream); in process without one.
    #[arg(long, env = "BROKER_URL", hide_env_values = true)]
    pub(crate) broker_url: Option<String>,

    /// The prefix of queue names and subjects (two shops sharing a broker need different ones).
    #[arg(long, env = "SHOP_BROKER_PREFIX", default_value = "shop")]
    pub(crate) broker_prefix: String,

    /// Completed records kept in this process for replays without a round trip (0: off).
    #[arg(long, env = "IDEM_REPLAY_CACHE", default_value_t = 0)]
    pub(crate) replay_cache: usize,

    /// Hold each claim with the transaction that records the payment
    /// (PostgreSQL alone): the claim commits first, then that transaction
    /// holds it, so a crash or a rollback frees the key at once instead of
    /// after the lease.
    #[arg(long, env = "IDEM_CLAIM_IN_TX")]
    pub(crate) claim_in_transaction: bool,

    /// With `--claim-in-transaction`: how many payments may hold their
    /// transaction (a database connection, for the whole bank call) at
    /// once. More wait for a turn (`--claim-tx-wait-ms`, holding no
    /// connection), then are answered 503 with Retry-After, nothing
    /// claimed: a slow bank cannot take the connections every other request
    /// needs. Keep it below the pool's 16 connections less the 4 kept for
    /// claims.
    #[arg(long, env = "SHOP_CLAIM_TX_LIMIT", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) claim_tx_limit: u32,

    /// With `--claim-in-transaction`: how long a payment waits for a turn
    /// under `--claim-tx-limit`, in milliseconds, before it is answered 503.
    #[arg(long, env = "SHOP_CLAIM_TX_WAIT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub(crate) claim_tx_wait_ms: u64,

    /// How long one database statement (or connection, `BEGIN`, `COMMIT`),
    /// and one call to the idempotency store, may take, in milliseconds.
    /// Past it the request is answered 503 with Retry-After instead of
    /// waiting for a network partition to heal; the claim it may hold is
    /// left to its lease. Keep it well below the lease. A consumer's inbox
    /// transaction is bounded step by step the same way (a step past it
    /// fails the event, which comes again). On PostgreSQL a write
    /// transaction's statements are bounded by the server as well
    /// (`statement_timeout`), so one cut here stops waiting there too.
    #[arg(long, env = "SHOP_STATEMENT_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub(crate) statement_timeout_ms: u64,

    /// How long the oldest event waiting in the outbox may have waited
    /// before `/healthz` answers `503` (`outbox-lagging`), in seconds: the
    /// relay is not keeping up with the rate events are written at (or the
    /// broker does not confirm them). The gauge `idem_outbox_lag_seconds`
    /// gives the figure.
    #[arg(long, env = "SHOP_OUTBOX_MAX_LAG_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub(crate) outbox_max_lag_secs: u64,

    /// Events each consumer handles at once (1 to 64). Each is one inbox
    /// transaction; side by side they share the database's commits, and
    /// settle in whatever order they end (shop's effects do not depend on
    /// the order of events). 1 handles one at a time, in order.
    #[arg(long, env = "SHOP_CONSUMER_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(crate) consumer_concurrency: u16,

    /// Connections in the database pool the payments, the reads and the
    /// idempotency records share (PostgreSQL and MySQL: 16 by default;
    /// SQLite: sqlx's default). On PostgreSQL 4 of them are kept for claims,
    /// so it takes at least 5. `/healthz` has one of its own, the outbox
    /// relay's `LISTEN` one of its own, and the demo's fake bank a pool of
    /// its own.
    #[arg(long, env = "SHOP_DB_CONNECTIONS", value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub(crate) db_connections: Option<u32>,

    /// Start `--claim-in-transaction` even when the PostgreSQL primary has
    /// an asynchronous standby. Without it shop refuses: a failover to a
    /// standby that had not received the last commits loses records that
    /// were answered, and their keys run again (the guarantees guide).
    #[arg(long, env = "SHOP_ALLOW_ASYNC_STANDBY")]
    pub(crate) allow_async_standby: bool,

    /// The Retry-After of a 409 for a request in flight, in seconds (never more than the rest of the holder's lease).
    #[arg(long, env = "IDEM_RETRY_AFTER_SECS", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) retry_after_secs: u64,

    /// The secret the bank signs its webhooks with: `POST /webhooks/bank` then
    /// requires `X-Bank-Signature: sha256=<hex HMAC-SHA256 of the raw body>`.
    /// An empty secret is refused (anyone can sign with it).
    #[arg(long, env = "SHOP_WEBHOOK_SECRET", hide_env_values = true, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub(crate) webhook_secret: Option<String>,

    /// How long a client may take to send a request's headers, in seconds; a slower one is disconnected.
    #[arg(long, env = "SHOP_HEADER_TIMEOUT_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) header_timeout_secs: u64,

    /// How long a request body may stall between two chunks, in seconds, before the request fails.
    #[arg(long, env = "SHOP_BODY_TIMEOUT_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) body_timeout_secs: u64,

    /// The average a request body must keep up once its first --body-timeout-secs are over, in bytes a second (0: no minimum): a client trickling a byte every few seconds is cut off.
    #[arg(long, env = "SHOP_BODY_MIN_RATE", default_value_t = 500, value_parser = clap::value_parser!(u64).range(0..=1 << 30))]
    pub(crate) body_min_rate: u64,

    /// How many connections are served at once; more are closed at once, as is a new one while as many guarded handlers run on whose clients went away (over gRPC a new guarded call is refused UNAVAILABLE while as many guarded calls and requests run).
    #[arg(long, env = "SHOP_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) max_connections: u64,

    /// On SIGTERM or Ctrl-C: how long in-flight requests may finish, in seconds, before the process exits anyway.
    #[arg(long, env = "SHOP_SHUTDOWN_GRACE_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub(crate) shutdown_grace_secs: u64,

    /// What the demo's `X-Simulate` header may ask for. `all` (the demo's
    /// default) includes crashing the process: expose shop with `off`.
    #[arg(long, env = "SHOP_FAULT_INJECTION", value_enum, default_value_t = FaultInjection::All)]
    pub(crate) fault_injection: FaultInjection,

    /// How long a duplicate of an in-flight request waits for its answer before getting 409, in milliseconds (0: don't wait).
    #[arg(long, env = "IDEM_WAIT_MS", default_value_t = 0)]
    pub(crate) wait_ms: u64,
}

/// The connections of a PostgreSQL pool that are not the payments' and
/// reads': 4 kept for claims. (The outbox relay listens on a connection
/// outside the pool.)
const POSTGRES_RESERVED: u32 = 4;

/// Where idempotency records live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum IdemStore {
    /// In the database (SQLite, PostgreSQL or MySQL), completed in the handler's
    /// transaction; with --redis-url, Redis in front of it.
    Database,
    /// In Redis alone (needs --redis-url), completed after the handler
    /// returns.
    Redis,
}

/// `--sqlite-synchronous`: SQLite's `synchronous` setting, in WAL mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum SqliteSynchronous {
    /// Every commit synced: it survives a power loss.
    #[default]
    Full,
    /// Synced at checkpoints: a commit survives a crash of the process,
    /// not a power loss.
    Normal,
}

/// What `X-Simulate` may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum FaultInjection {
    /// Everything, crashes included: a demo's and a test's setting, never a
    /// deployment's (any client could abort the process).
    All,
    /// A slow bank (`bank-delay`) and a failing one (`bank-error`); crash
    /// directives are refused with 400.
    Safe,
    /// None: a request with `X-Simulate` is refused with 400.
    Off,
}

impl Config {
    /// Refuses flag combinations that cannot work together.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.redis_wait_replicas > 0 && self.idem_store != IdemStore::Redis {
            return Err("--redis-wait-replicas applies to --idem-store redis (with the records in the database, the database is the guard and Redis only a cache)".into());
        }
        if self.db_connections.is_some()
            && (self.database_url.contains(":memory:") || self.database_url.contains("mode=memory"))
        {
            return Err("--db-connections does not apply to an in-memory SQLite database (one connection is the database)".into());
        }
        let sqlite = idem_sql::dialect::DialectKind::of_url(&self.database_url)
            == Some(idem_sql::dialect::DialectKind::Sqlite);
        if self.sqlite_synchronous.is_some() && !sqlite {
            return Err("--sqlite-synchronous applies to a SQLite --database-url (sqlite:FILE); PostgreSQL and MySQL keep their own durability settings".into());
        }
        if self.sqlite_synchronous == Some(SqliteSynchronous::Normal)
            && (self.database_url.contains(":memory:") || self.database_url.contains("mode=memory"))
        {
            return Err("--sqlite-synchronous normal does not apply to an in-memory SQLite database (nothing reaches a disk)".into());
        }
        let postgres = idem_sql::dialect::DialectKind::of_url(&self.database_url)
            == Some(idem_sql::dialect::DialectKind::Postgres);
        if let (true, Some(n)) = (postgres, self.db_connections) {
            // 4 kept for claims, and at least one for the payments and
            // reads.
            let least = POSTGRES_RESERVED + 1;
            if n < least {
                return Err(format!(
                    "--db-connections {n} is too few on PostgreSQL: 4 are kept for claims; give at least {least}"
                ));
            }
            if self.claim_in_transaction && self.claim_tx_limit + POSTGRES_RESERVED >= n {
                return Err(format!(
                    "--claim-tx-limit {} leaves no connection of --db-connections {n} for reads (4 serve claims): keep it below {}",
                    self.claim_tx_limit,
                    n - POSTGRES_RESERVED
                ));
            }
        }
        if self.claim_in_transaction {
            let postgres = idem_sql::dialect::DialectKind::of_url(&self.database_url)
                == Some(idem_sql::dialect::DialectKind::Postgres);
            if !postgres || self.idem_store != IdemStore::Database {
                return Err("--claim-in-transaction needs a PostgreSQL --database-url holding the records (--idem-store database)".into());
            }
            if self.redis_url.is_some() || self.replay_cache > 0 {
                return Err("--claim-in-transaction claims in the database transaction; it does not combine with --redis-url or --replay-cache".into());
            }
        }
        Ok(())
    }

    pub(crate) fn policy(&self) -> Result<Policy, PolicyError> {
        Policy::builder()
            .lease(Duration::from_millis(self.lease_ms))
            .retention(Duration::from_secs(self.ttl_secs))
            .wait_for_in_flight(Duration::from_millis(self.wait_ms))
            .retry_after(Duration::from_secs(self.retry_after_secs))
            .store_timeout(self.statement_timeout())
            .build()
    }

    /// `--statement-timeout-ms`.
    pub(crate) fn statement_timeout(&self) -> Duration {
        Duration::from_millis(self.statement_timeout_ms)
    }
}
