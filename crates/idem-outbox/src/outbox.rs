//! The transactional outbox: messages enqueued inside the business
//! transaction, published by a [`Relay`] after they commit, marked sent
//! only once the broker confirmed them. On PostgreSQL and SQLite alike:
//! every function here takes either pool (see [`crate::Db`]) or
//! either connection (see [`OutboxConnection`]).
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
//! billing.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // published only now, and only if this commits
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::LazyLock;

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_sql::migrate::Migration;
use idem_sql::{InvalidIdentifier, TableName};

pub use crate::relay::{Relay, RelayConfig, RelayError, Round, NOTIFY_CHANNEL};
use crate::Db;

/// The outbox table's migrations on PostgreSQL, in order.
pub const POSTGRES_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/postgres/0001_outbox.sql"),
}];

/// The outbox table's migrations on SQLite, in order.
pub const SQLITE_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/sqlite/0001_outbox.sql"),
}];

/// The longest outbox or inbox table name: the names derived from it
/// (`{table}_message_id_key`) must fit PostgreSQL's 63 bytes.
pub const MAX_TABLE_NAME: usize = 48;

/// The default outbox table's name.
pub const DEFAULT_TABLE: &str = "idem_outbox";

/// Where an outbox lives: its table and, on PostgreSQL, its schema. The
/// default is `idem_outbox`, found through `search_path`; name your own so
/// that two services (or two outboxes of one) share a database without
/// sharing a table, and without `search_path` tricks in the URL.
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

impl OutboxTable {
    /// The outbox in table `table` of `schema` (or, with `None`, wherever
    /// `search_path` finds it). SQLite has no schemas: a table with one is
    /// refused there, by each call.
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

    /// `sql` with `{table}` filled in for `db`'s dialect.
    pub(crate) fn render(&self, sql: &str, postgres: bool) -> Result<String, sqlx::Error> {
        crate::db::render(&self.0, sql, postgres)
    }

    /// Creates or upgrades this outbox table (see [`idem_sql::migrate`]).
    /// On PostgreSQL, a schema that does not exist is created.
    pub async fn migrate(&self, db: impl Into<Db>) -> Result<(), sqlx::Error> {
        crate::db::migrate(db.into(), &self.0, POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS).await
    }

    /// Enqueues `message` inside the transaction open on `conn` (PostgreSQL
    /// or SQLite): it is published only if, and after, that transaction
    /// commits. A `message_id` enqueued twice violates
    /// [`message_id_key`](Self::message_id_key). On PostgreSQL the commit
    /// wakes listening relays; SQLite has no `NOTIFY`, so call
    /// [`Relay::wake`] after the commit for prompt delivery (the relay
    /// polls otherwise).
    pub async fn enqueue<C>(
        &self,
        conn: &mut C,
        message: &OutgoingMessage,
    ) -> Result<(), sqlx::Error>
    where
        C: OutboxConnection + ?Sized,
    {
        conn.enqueue_in(self, message).await
    }

    /// Counts this outbox's rows by state, for operators.
    pub async fn stats(&self, db: impl Into<Db>) -> Result<OutboxStats, sqlx::Error> {
        let (pending, sent, dead): (i64, i64, i64) = match db.into() {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                sqlx::query_as(&self.render(STATS, true)?)
                    .fetch_one(&pool)
                    .await?
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => {
                sqlx::query_as(&self.render(STATS, false)?)
                    .fetch_one(&pool)
                    .await?
            }
        };
        Ok(OutboxStats {
            pending,
            sent,
            dead,
        })
    }

    /// This outbox's dead-lettered rows, oldest first, at most `limit`.
    pub async fn dead_letters(
        &self,
        db: impl Into<Db>,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, sqlx::Error> {
        match db.into() {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                sqlx::query_as(&self.render(DEAD, true)?)
                    .bind(limit)
                    .fetch_all(&pool)
                    .await
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => {
                sqlx::query_as(&self.render(DEAD, false)?)
                    .bind(limit)
                    .fetch_all(&pool)
                    .await
            }
        }
    }
}

/// Creates or upgrades the default outbox table, `idem_outbox` (on
/// PostgreSQL in the search path's first schema); see
/// [`OutboxTable::migrate`].
pub async fn migrate(db: impl Into<Db>) -> Result<(), sqlx::Error> {
    DEFAULT.migrate(db).await
}

/// Enqueues `message` in the default outbox table inside the transaction
/// open on `conn`; see [`OutboxTable::enqueue`].
pub async fn enqueue<C>(conn: &mut C, message: &OutgoingMessage) -> Result<(), sqlx::Error>
where
    C: OutboxConnection + ?Sized,
{
    conn.enqueue_in(&DEFAULT, message).await
}

/// Counts the default outbox table's rows by state; see
/// [`OutboxTable::stats`].
pub async fn stats(db: impl Into<Db>) -> Result<OutboxStats, sqlx::Error> {
    DEFAULT.stats(db).await
}

/// The default outbox table's dead-lettered rows; see
/// [`OutboxTable::dead_letters`].
pub async fn dead_letters(db: impl Into<Db>, limit: i64) -> Result<Vec<DeadLetter>, sqlx::Error> {
    DEFAULT.dead_letters(db, limit).await
}

/// A connection an outbox row can be enqueued on, inside its open
/// transaction: PostgreSQL's or SQLite's (`&mut *tx` of a
/// `sqlx::Transaction`), so code is written once for both.
pub trait OutboxConnection: Send {
    /// Enqueues `message` in `table`, in the open transaction on this
    /// connection; see [`OutboxTable::enqueue`].
    fn enqueue_in<'a>(
        &'a mut self,
        table: &'a OutboxTable,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Enqueues `message` in the default table; see [`enqueue`].
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        self.enqueue_in(&DEFAULT, message)
    }
}

#[cfg(feature = "postgres")]
impl OutboxConnection for sqlx::PgConnection {
    fn enqueue_in<'a>(
        &'a mut self,
        table: &'a OutboxTable,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let insert = table.render(
                "INSERT INTO {table} (message_id, destination, ordering_key, payload, headers)
                 VALUES ($1, $2, $3, $4, $5)",
                true,
            )?;
            sqlx::query(&insert)
                .bind(&message.message_id)
                .bind(&message.destination)
                .bind(&message.ordering_key)
                .bind(message.payload.as_ref())
                .bind(encode_headers(&message.headers)?)
                .execute(&mut *self)
                .await?;
            // Delivered to listening relays when (and only if) the
            // transaction commits.
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(NOTIFY_CHANNEL)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }
}

#[cfg(feature = "sqlite")]
impl OutboxConnection for sqlx::SqliteConnection {
    fn enqueue_in<'a>(
        &'a mut self,
        table: &'a OutboxTable,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let insert = table.render(
                "INSERT INTO {table} (message_id, destination, ordering_key, payload, headers, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6)",
                false,
            )?;
            sqlx::query(&insert)
                .bind(&message.message_id)
                .bind(&message.destination)
                .bind(&message.ordering_key)
                .bind(message.payload.as_ref())
                .bind(encode_headers(&message.headers)?)
                .bind(now_ms())
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }
}

/// A transaction enqueues on its connection: `outbox::enqueue(&mut tx, …)`.
impl<DB> OutboxConnection for sqlx::Transaction<'_, DB>
where
    DB: sqlx::Database,
    DB::Connection: OutboxConnection,
{
    fn enqueue_in<'a>(
        &'a mut self,
        table: &'a OutboxTable,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        (**self).enqueue_in(table, message)
    }
}

#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn now_ms() -> i64 {
    idem_core::UnixMillis::now().0
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The id consumers deduplicate on; sent to the broker as its message id.
    pub message_id: String,
    /// Where it goes (a RabbitMQ routing key, a NATS subject, a queue name).
    pub destination: String,
    /// Messages with the same key are published in enqueue order, one at a
    /// time; `None`: no ordering.
    pub ordering_key: Option<String>,
    /// The body.
    pub payload: Bytes,
    /// Headers carried to the broker.
    pub headers: Vec<(String, String)>,
}

impl OutgoingMessage {
    /// A message with id `message_id` (what consumers deduplicate on: make
    /// it follow from the business write, e.g. `order-42-placed`, never
    /// random per attempt) to `destination`, unordered, without headers.
    pub fn new(
        message_id: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        Self {
            message_id: message_id.into(),
            destination: destination.into(),
            ordering_key: None,
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Publishes it after every earlier message with the same `key`.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds a header carried to the broker.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The headers as the outbox row keeps them. A name over 65,535 bytes or a
/// value over 4 GiB does not fit the encoding: refused (nothing enqueued)
/// rather than cut, so a message never loses its headers on the way.
fn encode_headers(headers: &[(String, String)]) -> Result<Vec<u8>, sqlx::Error> {
    if let Some((name, _)) = headers
        .iter()
        .find(|(n, v)| n.len() > usize::from(u16::MAX) || u32::try_from(v.len()).is_err())
    {
        let shown: String = name.chars().take(40).collect();
        return Err(sqlx::Error::Encode(
            format!(
                "outbox header {shown:?}…: a name is at most 65,535 bytes, a value at most 4 GiB"
            )
            .into(),
        ));
    }
    Ok(idem_core::StoredResponse {
        status: 0,
        headers: headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect(),
        body: Bytes::new(),
    }
    .encode_headers())
}

pub(crate) fn decode_headers(bytes: &[u8]) -> Vec<(String, String)> {
    idem_core::StoredResponse::decode_headers(bytes)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect()
}

/// What kind of failure a [`PublishError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The broker could not be reached (connection, channel, timeout):
    /// worth retrying as it is.
    Unreachable,
    /// The broker refused the message (a nack, a rejected publish).
    Rejected,
    /// The message was sent but its confirmation never came or was lost:
    /// it may have been published (a republish is absorbed by the broker's
    /// duplicate window and the consumers' inboxes).
    Unconfirmed,
    /// The publisher said nothing of the message, or another failure.
    Other,
}

impl std::fmt::Display for PublishErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unreachable => "broker unreachable",
            Self::Rejected => "rejected by the broker",
            Self::Unconfirmed => "not confirmed by the broker",
            Self::Other => "not published",
        })
    }
}

/// Why a publish failed: its [kind](PublishErrorKind) and the broker's
/// words. The relay retries it with backoff, then dead-letters the row
/// with this text as `last_error`.
///
/// ```
/// use idem_outbox::outbox::{PublishError, PublishErrorKind};
/// let e = PublishError::new(PublishErrorKind::Rejected, "nack");
/// assert_eq!(e.kind(), PublishErrorKind::Rejected);
/// assert_eq!(e.to_string(), "rejected by the broker: nack");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
}

impl PublishError {
    /// A failure of `kind`, described by `message`.
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A failure of kind [`PublishErrorKind::Other`].
    pub fn other(message: impl Into<String>) -> Self {
        Self::new(PublishErrorKind::Other, message)
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    /// The broker's (or the publisher's) words.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// What a publisher says of each message of a batch, by message id: `Ok`
/// only once the broker confirmed it. A message it says nothing of counts
/// as failed (retried later).
///
/// ```
/// use idem_outbox::outbox::{PublishError, Published};
/// let mut published = Published::default();
/// published.record("m1", Ok(()));
/// published.record("m2", Err(PublishError::other("nack")));
/// assert!(published.get("m1").is_some_and(|r| r.is_ok()));
/// assert!(published.get("m3").is_none());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Published(HashMap<String, Result<(), PublishError>>);

impl Published {
    /// Records what became of `message_id`.
    pub fn record(&mut self, message_id: &str, result: Result<(), PublishError>) {
        self.0.insert(message_id.to_owned(), result);
    }

    /// What became of `message_id`, if the publisher said.
    pub fn get(&self, message_id: &str) -> Option<&Result<(), PublishError>> {
        self.0.get(message_id)
    }

    /// Whether the broker confirmed `message_id`.
    pub fn confirmed(&self, message_id: &str) -> bool {
        self.get(message_id).is_some_and(Result::is_ok)
    }

    /// Whether the broker confirmed every message of `batch`.
    pub fn all_confirmed(&self, batch: &[OutgoingMessage]) -> bool {
        batch.iter().all(|m| self.confirmed(&m.message_id))
    }

    /// How many messages the publisher said something of.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the publisher said nothing at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromIterator<(String, Result<(), PublishError>)> for Published {
    fn from_iter<I: IntoIterator<Item = (String, Result<(), PublishError>)>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

/// Sends messages to a broker, saying of each (by message id) whether the
/// broker confirmed it (publisher confirms, JetStream acks).
pub trait Publisher: Send + Sync + 'static {
    /// Publishes a batch.
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published>;
}

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

const STATS: &str =
    "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'sent'),
        count(*) FILTER (WHERE state = 'dead') FROM {table}";

const DEAD: &str = "SELECT message_id, destination, attempts, last_error FROM {table}
     WHERE state = 'dead' ORDER BY seq LIMIT $1";

/// A dead-lettered row: (message id, destination, attempts, last error).
pub type DeadLetter = (String, String, i32, Option<String>);
