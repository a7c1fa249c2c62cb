//! The inbox: an idempotent consumer.
//!
//! Each processed message leaves a row keyed by `(consumer, message_id)`,
//! inserted **first, in the same transaction** as the handler's writes. A
//! redelivered message hits that key's unique constraint (recognised by its
//! name, never by a `SELECT` first): the transaction rolls back, and the
//! caller acknowledges the message as already done. Two consumers handed the
//! same message at once race on the same key; PostgreSQL makes the second
//! wait for the first to commit, SQLite has one writer at a time: one effect.

use std::time::Duration;

use idem_core::BoxFuture;
use idem_sql::migrate::Migration;

/// What happened to a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled<T> {
    /// The handler ran and its transaction committed.
    Processed(T),
    /// The message was processed before (or is being processed by another
    /// consumer that committed first): nothing ran; acknowledge it.
    Duplicate,
}

/// An inbox failure: the message was not processed; do not acknowledge it
/// (let the broker redeliver).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E> {
    /// The handler failed; its transaction rolled back.
    #[error("the handler failed")]
    Handler(#[source] E),
    /// The database failed.
    #[error("the inbox could not be written")]
    Database(#[source] sqlx::Error),
}

/// The inbox's table, created by [`migrate_postgres`] / [`migrate_sqlite`].
pub const INBOX_TABLE: &str = "idem_inbox";

/// The primary key whose violation means "processed before".
pub const INBOX_KEY: &str = "idem_inbox_pkey";

/// How long processed ids are kept by default: longer than any redelivery
/// window.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

fn now_ms() -> i64 {
    idem_core::UnixMillis::now().0
}

/// The inbox table's migrations (the same DDL on both backends), in order.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/0001_inbox.sql"),
}];

/// Creates or upgrades the inbox table on PostgreSQL, in the search path's
/// first schema (see [`idem_sql::migrate`]).
pub async fn migrate_postgres(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_postgres(pool, None, INBOX_TABLE, MIGRATIONS).await
}

/// Creates or upgrades the inbox table on SQLite.
pub async fn migrate_sqlite(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_sqlite(pool, INBOX_TABLE, MIGRATIONS).await
}

/// Whether `e` is the violation of the inbox's key: the message was
/// processed before. PostgreSQL names the constraint; SQLite names the
/// key's columns.
fn is_duplicate(e: &sqlx::Error) -> bool {
    idem_sql::DuplicateKey::of(e).is_some_and(|d| {
        d.constraint == INBOX_KEY || d.constraint == "idem_inbox.consumer, idem_inbox.message_id"
    })
}

const MARK: &str =
    "INSERT INTO idem_inbox (consumer, message_id, processed_at) VALUES ($1, $2, $3)";

/// Processes `message_id` for `consumer` once, on PostgreSQL: `handler` gets
/// the open transaction and its writes commit with the inbox row.
///
/// ```no_run
/// use idem_outbox::inbox::{self, Handled};
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outcome = inbox::process_postgres(&pool, "reserve-stock", "msg-42", |tx| Box::pin(async move {
///     sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'tea'").execute(&mut **tx).await?;
///     Ok::<_, sqlx::Error>(())
/// })).await?;
/// match outcome {
///     Handled::Processed(()) => { /* ack */ }
///     Handled::Duplicate => { /* ack too: it was done before */ }
/// }
/// # Ok(()) }
/// ```
pub async fn process_postgres<T, E, F>(
    pool: &sqlx::PgPool,
    consumer: &str,
    message_id: &str,
    handler: F,
) -> Result<Handled<T>, InboxError<E>>
where
    F: for<'c> FnOnce(
        &'c mut sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> BoxFuture<'c, Result<T, E>>,
{
    let tx = pool.begin().await.map_err(InboxError::Database)?;
    process_in(tx, consumer, message_id, handler).await
}

/// Processes `message_id` for `consumer` once, on SQLite (in an immediate
/// transaction); see [`process_postgres`].
pub async fn process_sqlite<T, E, F>(
    pool: &sqlx::SqlitePool,
    consumer: &str,
    message_id: &str,
    handler: F,
) -> Result<Handled<T>, InboxError<E>>
where
    F: for<'c> FnOnce(
        &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    ) -> BoxFuture<'c, Result<T, E>>,
{
    let tx = pool
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(InboxError::Database)?;
    process_in(tx, consumer, message_id, handler).await
}

/// Marks the message processed in `tx`, runs `handler` in it and commits;
/// a mark that hits the inbox's key is a duplicate. Every way out ends the
/// transaction before returning: one left to its drop ends later, holding
/// its locks until it does.
async fn process_in<DB, T, E, F>(
    mut tx: sqlx::Transaction<'static, DB>,
    consumer: &str,
    message_id: &str,
    handler: F,
) -> Result<Handled<T>, InboxError<E>>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    F: for<'c> FnOnce(&'c mut sqlx::Transaction<'static, DB>) -> BoxFuture<'c, Result<T, E>>,
{
    let marked = sqlx::query(MARK)
        .bind(consumer)
        .bind(message_id)
        .bind(now_ms())
        .execute(&mut *tx)
        .await;
    match marked {
        Ok(_) => {}
        Err(e) if is_duplicate(&e) => {
            tx.rollback().await.map_err(InboxError::Database)?;
            return Ok(Handled::Duplicate);
        }
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(InboxError::Database(e));
        }
    }
    let value = match handler(&mut tx).await {
        Ok(value) => value,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(InboxError::Handler(e));
        }
    };
    match tx.commit().await {
        Ok(()) => Ok(Handled::Processed(value)),
        // A commit that meets the key (a racing consumer committed first).
        Err(e) if is_duplicate(&e) => Ok(Handled::Duplicate),
        Err(e) => Err(InboxError::Database(e)),
    }
}

const SWEEP: &str = "DELETE FROM idem_inbox WHERE (consumer, message_id) IN (
    SELECT consumer, message_id FROM idem_inbox WHERE processed_at <= $1 ORDER BY processed_at LIMIT $2)";

/// Deletes at most `batch` processed ids older than `retention` (PostgreSQL).
pub async fn sweep_postgres(
    pool: &sqlx::PgPool,
    retention: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let cutoff = now_ms() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query(SWEEP)
        .bind(cutoff)
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected())
}

/// Deletes at most `batch` processed ids older than `retention` (SQLite).
pub async fn sweep_sqlite(
    pool: &sqlx::SqlitePool,
    retention: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let cutoff = now_ms() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    Ok(sqlx::query(SWEEP)
        .bind(cutoff)
        .bind(batch)
        .execute(pool)
        .await?
        .rows_affected())
}
