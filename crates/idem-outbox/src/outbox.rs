//! The transactional outbox (PostgreSQL): messages enqueued inside the
//! business transaction, published by a relay after they commit, marked
//! sent only once the broker confirmed them.

use std::collections::HashMap;

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_sql::migrate::Migration;
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;

pub use crate::relay::{Relay, RelayConfig, Round, NOTIFY_CHANNEL};

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

/// Creates or upgrades the outbox table on SQLite (see
/// [`idem_sql::migrate`]).
pub async fn migrate_sqlite(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_sqlite(pool, "idem_outbox", SQLITE_MIGRATIONS).await
}

/// Enqueues a message inside the caller's SQLite transaction; see
/// [`enqueue`]. SQLite has no `NOTIFY`: call [`Relay::wake`] after the
/// commit for prompt delivery (the relay polls otherwise).
pub async fn enqueue_sqlite(
    conn: &mut sqlx::SqliteConnection,
    message: &OutgoingMessage,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&message.message_id)
    .bind(&message.destination)
    .bind(&message.ordering_key)
    .bind(message.payload.as_ref())
    .bind(encode_headers(&message.headers)?)
    .bind(now_ms())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(crate) fn now_ms() -> i64 {
    idem_core::UnixMillis::now().0
}

/// Creates or upgrades the outbox table on PostgreSQL, in the search
/// path's first schema (see [`idem_sql::migrate`]).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_postgres(pool, None, "idem_outbox", POSTGRES_MIGRATIONS).await
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

/// Enqueues a message inside the caller's transaction: it is published
/// only if, and after, the transaction commits. A `message_id` enqueued
/// twice is a unique violation (`idem_outbox_message_id_key`).
pub async fn enqueue(
    conn: &mut sqlx::PgConnection,
    message: &OutgoingMessage,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(&message.message_id)
    .bind(&message.destination)
    .bind(&message.ordering_key)
    .bind(message.payload.as_ref())
    .bind(encode_headers(&message.headers)?)
    .execute(&mut *conn)
    .await?;
    // Delivered to listening relays when (and only if) the transaction commits.
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(NOTIFY_CHANNEL)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Why a publish failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PublishError(pub String);

/// What a publisher says of each message of a batch, by message id: `Ok`
/// only once the broker confirmed it. A message it says nothing of counts
/// as failed (retried later).
///
/// ```
/// use idem_outbox::outbox::{PublishError, Published};
/// let mut published = Published::default();
/// published.record("m1", Ok(()));
/// published.record("m2", Err(PublishError("nack".into())));
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
        count(*) FILTER (WHERE state = 'dead') FROM idem_outbox";

/// Counts rows by state (PostgreSQL).
pub async fn stats(pool: &PgPool) -> Result<OutboxStats, sqlx::Error> {
    let (pending, sent, dead): (i64, i64, i64) = sqlx::query_as(STATS).fetch_one(pool).await?;
    Ok(OutboxStats {
        pending,
        sent,
        dead,
    })
}

/// Counts rows by state (SQLite).
pub async fn stats_sqlite(pool: &SqlitePool) -> Result<OutboxStats, sqlx::Error> {
    let (pending, sent, dead): (i64, i64, i64) = sqlx::query_as(STATS).fetch_one(pool).await?;
    Ok(OutboxStats {
        pending,
        sent,
        dead,
    })
}

const DEAD: &str = "SELECT message_id, destination, attempts, last_error FROM idem_outbox
     WHERE state = 'dead' ORDER BY seq LIMIT $1";

/// A dead-lettered row: (message id, destination, attempts, last error).
pub type DeadLetter = (String, String, i32, Option<String>);

/// The dead-lettered rows (PostgreSQL).
pub async fn dead_letters(pool: &PgPool, limit: i64) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(DEAD).bind(limit).fetch_all(pool).await
}

/// The dead-lettered rows (SQLite).
pub async fn dead_letters_sqlite(
    pool: &SqlitePool,
    limit: i64,
) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(DEAD).bind(limit).fetch_all(pool).await
}
