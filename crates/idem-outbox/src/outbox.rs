//! The transactional outbox: messages enqueued inside the business
//! transaction, published by a [`Relay`] after they commit, marked sent
//! only once the broker confirmed them. On SQLite, PostgreSQL and MySQL
//! alike: every function here takes any of their pools, connections or
//! transactions, and the database follows from its type.
//!
//! ```no_run
//! use idem_outbox::outbox::{self, OutgoingMessage, OutboxTable};
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! // The default table, `idem_outbox`, wherever `search_path` finds it…
//! outbox::migrate(&pool).await?;
//! // …or one of your own, in a schema of your own.
//! let billing = OutboxTable::new(Some("billing"), "outbox")?;
//! billing.migrate(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! // sqlx::query("INSERT INTO orders …").execute(&mut *tx).await?;
//! let event = OutgoingMessage::new("order-42-placed", "orders.placed", r#"{"order_id":42}"#);
//! billing.enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // published only now, and only if this commits
//! # Ok(()) }
//! ```

use std::sync::LazyLock;
use std::time::Duration;

use idem_sql::dialect::{Arg, DialectConnection, Driver, Statement};
use idem_sql::{Dialect, InvalidIdentifier, MigrateError, TableName};

use crate::db::OutboxDialect;
pub use crate::message::{OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher};
pub use crate::relay::{Relay, RelayConfig, RelayError, Round, NOTIFY_CHANNEL};

/// The longest outbox or inbox table name: the names derived from it
/// (`{table}_message_id_key`) must fit PostgreSQL's 63 bytes.
pub const MAX_TABLE_NAME: usize = 48;

/// The default outbox table's name.
pub const DEFAULT_TABLE: &str = "idem_outbox";

/// Where an outbox lives: its table and its schema (PostgreSQL) or
/// database (MySQL). The default is `idem_outbox`, found through
/// `search_path` (the connection's database on MySQL); name your own so
/// that two services (or two outboxes of one) share a database without
/// sharing a table.
///
/// ```
/// use idem_outbox::outbox::OutboxTable;
/// let t = OutboxTable::new(Some("billing"), "outbox").unwrap();
/// assert_eq!(t.name().qualified(), r#""billing"."outbox""#);
/// assert_eq!(OutboxTable::default().name().qualified(), r#""idem_outbox""#);
/// assert!(OutboxTable::new(None, "outbox; DROP TABLE x").is_err());
/// assert!(OutboxTable::new(None, &"o".repeat(49)).is_err(), "no room for its constraint's name");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable(TableName);

impl Default for OutboxTable {
    fn default() -> Self {
        DEFAULT.clone()
    }
}

static DEFAULT: LazyLock<OutboxTable> =
    LazyLock::new(|| OutboxTable(TableName::new(None, DEFAULT_TABLE).unwrap_or_default()));

/// Counts of the outbox by state, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxStats {
    /// Waiting to be published (or retried).
    pub pending: i64,
    /// Published and confirmed.
    pub sent: i64,
    /// Failed too often; an operator must look.
    pub dead: i64,
}

/// A dead-lettered row: a message the relay gave up on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The message's id.
    pub message_id: String,
    /// Where it was going.
    pub destination: String,
    /// How many times publishing it was tried.
    pub attempts: i64,
    /// The last failure, as the publisher said it.
    pub last_error: Option<String>,
}

impl OutboxTable {
    /// The outbox in table `table` of `schema` (a PostgreSQL schema, a
    /// MySQL database; with `None`, the connection's own). SQLite has no
    /// schemas: a table with one is refused there, by each call.
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, InvalidIdentifier> {
        TableName::with_max_len(schema, table, MAX_TABLE_NAME).map(Self)
    }

    /// The table.
    pub fn name(&self) -> &TableName {
        &self.0
    }

    /// The name of the unique constraint a `message_id` enqueued twice
    /// violates.
    pub fn message_id_key(&self) -> String {
        format!("{}_message_id_key", self.0.table())
    }

    /// A statement of this outbox for dialect `D`.
    pub(crate) fn statement<D: Dialect>(
        &self,
        template: &str,
    ) -> Result<Statement<D>, sqlx::Error> {
        Statement::prepare(template, &self.0)
    }

    /// Creates or upgrades this outbox table (see [`idem_sql::migrate`]).
    /// A schema (PostgreSQL) or database (MySQL) that does not exist is
    /// created.
    pub async fn migrate<DB>(&self, pool: &sqlx::Pool<DB>) -> Result<(), MigrateError>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        crate::db::migrate(
            pool,
            &self.0,
            <DB::Dialect as OutboxDialect>::OUTBOX.migrations,
        )
        .await
    }

    /// Enqueues `message` inside the transaction open on `conn` (a
    /// transaction, `&mut tx`, or its connection, `&mut *tx`): it is
    /// published only if, and after, that transaction commits. A
    /// `message_id` enqueued twice violates
    /// [`message_id_key`](Self::message_id_key). On PostgreSQL the commit
    /// wakes listening relays; elsewhere call [`Relay::wake`] after the
    /// commit for prompt delivery (the relay polls otherwise).
    ///
    /// A message no transport could carry is refused here, with
    /// `sqlx::Error::Encode` and nothing written: a message id or
    /// destination empty or over 255 bytes, a line break in the id or in a
    /// header value, a header name that is not 1 to 255 visible ASCII
    /// characters without `:`.
    pub async fn enqueue<C>(
        &self,
        conn: &mut C,
        message: &OutgoingMessage,
    ) -> Result<(), sqlx::Error>
    where
        C: DialectConnection + ?Sized,
        C::Dialect: OutboxDialect,
    {
        crate::message::check_sendable(message)?;
        let sql = <C::Dialect as OutboxDialect>::OUTBOX;
        let insert = self.statement::<C::Dialect>(sql.enqueue)?;
        let headers = crate::message::encode_headers(&message.headers)?;
        let args = [
            Arg::Text(&message.message_id),
            Arg::Text(&message.destination),
            Arg::OptText(message.ordering_key.as_deref()),
            Arg::Bytes(&message.payload),
            Arg::Bytes(&headers),
        ];
        let conn = conn.connection();
        C::Dialect::execute(conn, &insert, &args).await?;
        if let Some(notify) = sql.notify {
            // Delivered to listening relays when (and only if) the
            // transaction commits.
            C::Dialect::execute(conn, &Statement::raw(notify), &[]).await?;
        }
        Ok(())
    }

    /// Counts this outbox's rows by state, for operators.
    pub async fn stats<DB>(&self, pool: &sqlx::Pool<DB>) -> Result<OutboxStats, sqlx::Error>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        let stats = self.statement::<DB::Dialect>(<DB::Dialect as OutboxDialect>::OUTBOX.stats)?;
        let mut conn = pool.acquire().await?;
        let row = DB::Dialect::fetch_optional(&mut conn, &stats, &[])
            .await?
            .ok_or_else(|| sqlx::Error::RowNotFound)?;
        let count = |c: &str| DB::Dialect::get(&row, c).and_then(|v| v.int(c));
        Ok(OutboxStats {
            pending: count("pending")?,
            sent: count("sent")?,
            dead: count("dead")?,
        })
    }

    /// Deletes at most `batch` rows of this outbox that were sent more
    /// than `retention` ago (by the database's clock), oldest first;
    /// returns how many. Pending and dead rows are never touched. Sent rows
    /// are otherwise kept for good, and the table grows with every message:
    /// call it on a schedule (`shop` does, every minute, keeping a day),
    /// again at once while it returns `batch`.
    pub async fn sweep_sent<DB>(
        &self,
        pool: &sqlx::Pool<DB>,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        let sweep =
            self.statement::<DB::Dialect>(<DB::Dialect as OutboxDialect>::OUTBOX.sweep_sent)?;
        let age = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        crate::db::write_once::<DB>(pool, &sweep, &[Arg::Int(age), Arg::Int(batch)]).await
    }

    /// This outbox's dead-lettered rows, oldest first, at most `limit`.
    pub async fn dead_letters<DB>(
        &self,
        pool: &sqlx::Pool<DB>,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, sqlx::Error>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        let dead = self.statement::<DB::Dialect>(<DB::Dialect as OutboxDialect>::OUTBOX.dead)?;
        let mut conn = pool.acquire().await?;
        let rows = DB::Dialect::fetch_all(&mut conn, &dead, &[Arg::Int(limit)]).await?;
        rows.iter()
            .map(|row| {
                let get = |c: &str| DB::Dialect::get(row, c);
                Ok(DeadLetter {
                    message_id: get("message_id")?.text("message_id")?,
                    destination: get("destination")?.text("destination")?,
                    attempts: get("attempts")?.int("attempts")?,
                    last_error: match get("last_error")? {
                        idem_sql::dialect::Value::Null => None,
                        v => Some(v.text("last_error")?),
                    },
                })
            })
            .collect()
    }
}

/// Creates or upgrades the default outbox table, `idem_outbox`; see
/// [`OutboxTable::migrate`].
pub async fn migrate<DB>(pool: &sqlx::Pool<DB>) -> Result<(), MigrateError>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.migrate(pool).await
}

/// Enqueues `message` in the default outbox table inside the transaction
/// open on `conn`; see [`OutboxTable::enqueue`].
pub async fn enqueue<C>(conn: &mut C, message: &OutgoingMessage) -> Result<(), sqlx::Error>
where
    C: DialectConnection + ?Sized,
    C::Dialect: OutboxDialect,
{
    DEFAULT.enqueue(conn, message).await
}

/// Counts the default outbox table's rows by state; see
/// [`OutboxTable::stats`].
pub async fn stats<DB>(pool: &sqlx::Pool<DB>) -> Result<OutboxStats, sqlx::Error>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.stats(pool).await
}

/// Deletes at most `batch` rows of the default outbox sent more than
/// `retention` ago; see [`OutboxTable::sweep_sent`].
pub async fn sweep_sent<DB>(
    pool: &sqlx::Pool<DB>,
    retention: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.sweep_sent(pool, retention, batch).await
}

/// The default outbox table's dead-lettered rows; see
/// [`OutboxTable::dead_letters`].
pub async fn dead_letters<DB>(
    pool: &sqlx::Pool<DB>,
    limit: i64,
) -> Result<Vec<DeadLetter>, sqlx::Error>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.dead_letters(pool, limit).await
}
