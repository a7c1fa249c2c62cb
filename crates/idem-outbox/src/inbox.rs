//! The inbox: an idempotent consumer.
//!
//! Each processed message leaves a row keyed by `(consumer, message_id)`,
//! inserted **first, in the same transaction** as the handler's writes. A
//! redelivered message hits that key's unique constraint (recognised by its
//! name, never by a `SELECT` first): the transaction rolls back, and the
//! caller acknowledges the message as already done. Two consumers handed the
//! same message at once race on the same key; PostgreSQL makes the second
//! wait for the first to commit, SQLite has one writer at a time: one effect.

use std::sync::LazyLock;
use std::time::Duration;

use idem_core::BoxFuture;
use idem_sql::migrate::Migration;
use idem_sql::{InvalidIdentifier, TableName};

use crate::{Db, InboxPool};

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

/// The default inbox table's name.
pub const DEFAULT_TABLE: &str = "idem_inbox";

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

/// Where an inbox lives: its table and, on PostgreSQL, its schema. The
/// default is `idem_inbox`, found through `search_path`.
///
/// ```
/// use idem_outbox::inbox::InboxTable;
/// let t = InboxTable::new(Some("billing"), "inbox").unwrap();
/// assert_eq!(t.name().qualified(), r#""billing"."inbox""#);
/// assert_eq!(InboxTable::default().name().qualified(), r#""idem_inbox""#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxTable(TableName);

static DEFAULT: LazyLock<InboxTable> =
    LazyLock::new(|| InboxTable(TableName::new(None, DEFAULT_TABLE).unwrap_or_default()));

impl Default for InboxTable {
    fn default() -> Self {
        DEFAULT.clone()
    }
}

pub(crate) fn default_table() -> &'static InboxTable {
    &DEFAULT
}

impl InboxTable {
    /// The inbox in table `table` of `schema` (or, with `None`, wherever
    /// `search_path` finds it). SQLite has no schemas: a table with one is
    /// refused there, by each call.
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, InvalidIdentifier> {
        TableName::with_max_len(schema, table, crate::outbox::MAX_TABLE_NAME).map(Self)
    }

    /// The table.
    pub fn name(&self) -> &TableName {
        &self.0
    }

    /// The name of the primary key whose violation means "processed before".
    pub fn key(&self) -> String {
        format!("{}_pkey", self.0.table())
    }

    /// Whether `e` is the violation of this inbox's key: the message was
    /// processed before. PostgreSQL names the constraint; SQLite names the
    /// key's columns.
    fn is_duplicate(&self, e: &sqlx::Error) -> bool {
        let t = self.0.table();
        idem_sql::DuplicateKey::of(e).is_some_and(|d| {
            let c = d.constraint.as_str();
            c.strip_prefix(t) == Some("_pkey")
                || c == format!("{t}.consumer, {t}.message_id").as_str()
        })
    }

    /// `sql` with `{table}` filled in for PostgreSQL (`postgres`) or SQLite.
    fn render(&self, sql: &str, postgres: bool) -> Result<String, sqlx::Error> {
        crate::db::render(&self.0, sql, postgres)
    }

    /// Creates or upgrades this inbox table (see [`idem_sql::migrate`]).
    pub async fn migrate(&self, db: impl Into<Db>) -> Result<(), sqlx::Error> {
        crate::db::migrate(db.into(), &self.0, MIGRATIONS, MIGRATIONS).await
    }

    /// Processes `message_id` for `consumer` once, in this inbox; see
    /// [`process`].
    pub async fn process<P, T, E, F>(
        &self,
        pool: &P,
        consumer: &str,
        message_id: &str,
        handler: F,
    ) -> Result<Handled<T>, InboxError<E>>
    where
        P: InboxPool + ?Sized,
        F: for<'c> FnOnce(&'c mut sqlx::Transaction<'static, P::Db>) -> BoxFuture<'c, Result<T, E>>
            + Send,
        T: Send,
        E: Send,
    {
        pool.process_in(self, consumer, message_id, handler).await
    }

    /// Deletes at most `batch` processed ids older than `retention` from
    /// this inbox; returns how many.
    pub async fn sweep(
        &self,
        db: impl Into<Db>,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let cutoff = now_ms() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        Ok(match db.into() {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => sqlx::query(&self.render(SWEEP, true)?)
                .bind(cutoff)
                .bind(batch)
                .execute(&pool)
                .await?
                .rows_affected(),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => sqlx::query(&self.render(SWEEP, false)?)
                .bind(cutoff)
                .bind(batch)
                .execute(&pool)
                .await?
                .rows_affected(),
        })
    }
}

/// Creates or upgrades the default inbox table, `idem_inbox` (on
/// PostgreSQL in the search path's first schema); see
/// [`InboxTable::migrate`].
pub async fn migrate(db: impl Into<Db>) -> Result<(), sqlx::Error> {
    DEFAULT.migrate(db).await
}

/// Deletes at most `batch` processed ids older than `retention` from the
/// default inbox; see [`InboxTable::sweep`].
pub async fn sweep(db: impl Into<Db>, retention: Duration, batch: i64) -> Result<u64, sqlx::Error> {
    DEFAULT.sweep(db, retention, batch).await
}

/// Processes `message_id` for `consumer` once, in the default inbox, on
/// PostgreSQL or SQLite (whichever `pool` is): `handler` gets the open
/// transaction and its writes commit with the inbox row. SQLite's
/// transaction is an immediate one (the write lock taken first).
///
/// ```no_run
/// use idem_outbox::inbox::{self, Handled};
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outcome = inbox::process(&pool, "reserve-stock", "msg-42", |tx| Box::pin(async move {
///     sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'tea'").execute(&mut **tx).await?;
///     Ok::<_, sqlx::Error>(())
/// })).await?;
/// match outcome {
///     Handled::Processed(()) => { /* ack */ }
///     Handled::Duplicate => { /* ack too: it was done before */ }
/// }
/// # Ok(()) }
/// ```
pub async fn process<P, T, E, F>(
    pool: &P,
    consumer: &str,
    message_id: &str,
    handler: F,
) -> Result<Handled<T>, InboxError<E>>
where
    P: InboxPool + ?Sized,
    F: for<'c> FnOnce(&'c mut sqlx::Transaction<'static, P::Db>) -> BoxFuture<'c, Result<T, E>>
        + Send,
    T: Send,
    E: Send,
{
    pool.process_in(&DEFAULT, consumer, message_id, handler)
        .await
}

/// Marks the message processed in `tx`, runs `handler` in it and commits;
/// a mark that hits the inbox's key is a duplicate. Every way out ends the
/// transaction before returning: one left to its drop ends later, holding
/// its locks until it does.
pub(crate) async fn process_in<DB, T, E, F>(
    table: &InboxTable,
    postgres: bool,
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
    let mark = match table.render(MARK, postgres) {
        Ok(sql) => sql,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(InboxError::Database(e));
        }
    };
    let marked = sqlx::query(&mark)
        .bind(consumer)
        .bind(message_id)
        .bind(now_ms())
        .execute(&mut *tx)
        .await;
    match marked {
        Ok(_) => {}
        Err(e) if table.is_duplicate(&e) => {
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
        Err(e) if table.is_duplicate(&e) => Ok(Handled::Duplicate),
        Err(e) => Err(InboxError::Database(e)),
    }
}

const MARK: &str = "INSERT INTO {table} (consumer, message_id, processed_at) VALUES ($1, $2, $3)";

const SWEEP: &str = "DELETE FROM {table} WHERE (consumer, message_id) IN (
    SELECT consumer, message_id FROM {table} WHERE processed_at <= $1 ORDER BY processed_at LIMIT $2)";
