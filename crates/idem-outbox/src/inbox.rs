//! The inbox: an idempotent consumer.
//!
//! Each processed message leaves a row keyed by `(consumer, message_id)`,
//! inserted **first, in the same transaction** as the handler's writes. A
//! redelivered message hits that key's unique constraint (never a `SELECT`
//! first): the transaction rolls back, and the caller acknowledges the
//! message as already done. Two consumers handed the same message at once
//! race on the same key; PostgreSQL and MySQL make the second wait for the
//! first to commit, SQLite has one writer at a time: one effect.

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use idem_sql::dialect::{Arg, Statement};
use idem_sql::{Dialect, Driver, ErrorClass, InvalidIdentifier, MigrateError, TableName};

use crate::db::OutboxDialect;
use tracing::warn;

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

/// Where an inbox lives: its table and its schema (PostgreSQL) or database
/// (MySQL). The default is `idem_inbox`, found through `search_path` (the
/// connection's database on MySQL).
///
/// ```
/// use idem_outbox::inbox::InboxTable;
/// let t = InboxTable::new(Some("billing"), "inbox").unwrap();
/// assert_eq!(t.name().qualified(), r#""billing"."inbox""#);
/// assert_eq!(InboxTable::default().name().qualified(), r#""idem_inbox""#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxTable {
    name: TableName,
    /// How long each step of [`InboxTable::process`] may take.
    timeout: Option<Duration>,
}

static DEFAULT: LazyLock<InboxTable> = LazyLock::new(|| InboxTable {
    name: TableName::new(None, DEFAULT_TABLE).unwrap_or_default(),
    timeout: None,
});

impl Default for InboxTable {
    fn default() -> Self {
        DEFAULT.clone()
    }
}

impl InboxTable {
    /// The inbox in table `table` of `schema` (or, with `None`, wherever
    /// `search_path` finds it). SQLite has no schemas: a table with one is
    /// refused there, by each call.
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, InvalidIdentifier> {
        TableName::with_max_len(schema, table, crate::outbox::MAX_TABLE_NAME).map(|name| Self {
            name,
            timeout: None,
        })
    }

    /// Bounds each step of [`process`](Self::process) by `timeout`: the
    /// transaction's begin, the mark, the handler, the commit. A step past
    /// it fails with [`InboxError::Database`] (a time-out) instead of
    /// holding the message for as long as the database does not answer (a
    /// network partition that resets nothing): the transaction is rolled
    /// back on a task of its own (itself bounded), and the message is
    /// delivered again. A commit past it may still land, in the
    /// background: the message then comes again as a duplicate. On
    /// PostgreSQL the transaction's `statement_timeout` is set to it too
    /// (with its `BEGIN`, no round trip of its own), so a statement waiting on a lock
    /// is cancelled by the server and frees its connection; elsewhere a
    /// statement cut here goes on waiting on its connection until the
    /// database answers.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The table.
    pub fn name(&self) -> &TableName {
        &self.name
    }

    /// The name of the primary key whose violation means "processed before".
    pub fn key(&self) -> String {
        format!("{}_pkey", self.name.table())
    }

    /// Whether `e`, from the commit, is the violation of this inbox's key:
    /// the message was processed before. PostgreSQL names the constraint;
    /// SQLite names the key's columns.
    fn is_duplicate(&self, e: &sqlx::Error) -> bool {
        let t = self.name.table();
        idem_sql::DuplicateKey::of(e).is_some_and(|d| {
            let c = d.constraint.as_str();
            c.strip_prefix(t) == Some("_pkey")
                || c == format!("{t}.consumer, {t}.message_id").as_str()
                || c == "PRIMARY"
        })
    }

    /// Creates or upgrades this inbox table (see [`idem_sql::migrate`]).
    pub async fn migrate<DB>(&self, pool: &sqlx::Pool<DB>) -> Result<(), MigrateError>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        crate::db::migrate(
            pool,
            &self.name,
            <DB::Dialect as OutboxDialect>::INBOX.migrations,
        )
        .await
    }

    /// Processes `message_id` for `consumer` once, in this inbox; see
    /// [`process`].
    pub async fn process<DB, T, E, F>(
        &self,
        pool: &sqlx::Pool<DB>,
        consumer: &str,
        message_id: &str,
        handler: F,
    ) -> Result<Handled<T>, InboxError<E>>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
        F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    {
        // The database's own bound as well where it has one (PostgreSQL):
        // a statement past it is cancelled there, and its connection freed,
        // rather than waiting on after this side stopped waiting.
        let begin = match self.timeout {
            Some(t) => DB::Dialect::begin_write_bounded(pool, t),
            None => DB::Dialect::begin_write(pool),
        };
        let tx = self.bounded(begin).await.map_err(InboxError::Database)?;
        self.process_in(tx, consumer, message_id, handler).await
    }

    /// `work`, within the statement timeout if one is set.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        match self.timeout {
            None => work.await,
            Some(t) => tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| Err(timed_out(t))),
        }
    }

    /// Rolls `tx` back, waited for within the statement timeout if one is
    /// set (on a task of its own, so that one cut by it still ends by
    /// itself when the database answers, never half-way).
    async fn rollback<DB: Driver>(&self, tx: sqlx::Transaction<'static, DB>) {
        let Some(t) = self.timeout else {
            let _ = tx.rollback().await;
            return;
        };
        let ending = tokio::spawn(tx.rollback());
        if tokio::time::timeout(t, ending).await.is_err() {
            warn!(
                timeout_ms = t.as_millis(),
                "an inbox rollback got no answer in time; it ends when the database answers"
            );
        }
    }

    /// Commits `tx`, within the statement timeout if one is set (on a task
    /// of its own: a commit is never cut half-way; past the time-out its
    /// outcome is unknown, and the message comes again, a duplicate if it
    /// landed).
    async fn commit<DB: Driver>(
        &self,
        tx: sqlx::Transaction<'static, DB>,
    ) -> Result<(), sqlx::Error> {
        let Some(t) = self.timeout else {
            return tx.commit().await;
        };
        match tokio::time::timeout(t, tokio::spawn(tx.commit())).await {
            Ok(Ok(committed)) => committed,
            Ok(Err(e)) => Err(sqlx::Error::Io(std::io::Error::other(format!(
                "the task committing an inbox transaction failed: {e}"
            )))),
            Err(_) => Err(timed_out(t)),
        }
    }

    /// Marks the message processed in `tx`, runs `handler` in it and
    /// commits; a mark that hits the inbox's key is a duplicate. Every way
    /// out ends the transaction before returning: one left to its drop ends
    /// later, holding its locks until it does.
    async fn process_in<DB, T, E, F>(
        &self,
        mut tx: sqlx::Transaction<'static, DB>,
        consumer: &str,
        message_id: &str,
        handler: F,
    ) -> Result<Handled<T>, InboxError<E>>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
        F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    {
        let mark = match Statement::<DB::Dialect>::prepare(
            <DB::Dialect as OutboxDialect>::INBOX.mark,
            &self.name,
        ) {
            Ok(sql) => sql,
            Err(e) => {
                self.rollback(tx).await;
                return Err(InboxError::Database(e));
            }
        };
        let args = [
            Arg::Text(consumer),
            Arg::Text(message_id),
            Arg::Int(now_ms()),
        ];
        match self
            .bounded(DB::Dialect::execute(&mut tx, &mark, &args))
            .await
        {
            Ok(_) => {}
            // The mark is the transaction's first write, to the inbox's
            // table alone, whose one unique key is the message's.
            Err(e) if DB::Dialect::classify(&e) == ErrorClass::UniqueViolation => {
                self.rollback(tx).await;
                return Ok(Handled::Duplicate);
            }
            Err(e) => {
                self.rollback(tx).await;
                return Err(InboxError::Database(e));
            }
        }
        let handled = match self.timeout {
            None => Ok(handler(&mut *tx).await),
            Some(t) => tokio::time::timeout(t, handler(&mut *tx))
                .await
                .map_err(|_| timed_out(t)),
        };
        let value = match handled {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => {
                self.rollback(tx).await;
                return Err(InboxError::Handler(e));
            }
            Err(e) => {
                self.rollback(tx).await;
                return Err(InboxError::Database(e));
            }
        };
        match self.commit(tx).await {
            Ok(()) => Ok(Handled::Processed(value)),
            // A commit that meets the key (a racing consumer committed first).
            Err(e) if self.is_duplicate(&e) => Ok(Handled::Duplicate),
            Err(e) => Err(InboxError::Database(e)),
        }
    }

    /// Deletes at most `batch` processed ids older than `retention` from
    /// this inbox; returns how many.
    pub async fn sweep<DB>(
        &self,
        pool: &sqlx::Pool<DB>,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error>
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        let cutoff = now_ms() - i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let sweep = Statement::<DB::Dialect>::prepare(
            <DB::Dialect as OutboxDialect>::INBOX.sweep,
            &self.name,
        )?;
        crate::db::write_once::<DB>(pool, &sweep, &[Arg::Int(cutoff), Arg::Int(batch)]).await
    }
}

/// Creates or upgrades the default inbox table, `idem_inbox`; see
/// [`InboxTable::migrate`].
pub async fn migrate<DB>(pool: &sqlx::Pool<DB>) -> Result<(), MigrateError>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.migrate(pool).await
}

/// Deletes at most `batch` processed ids older than `retention` from the
/// default inbox; see [`InboxTable::sweep`].
pub async fn sweep<DB>(
    pool: &sqlx::Pool<DB>,
    retention: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    DEFAULT.sweep(pool, retention, batch).await
}

/// Processes `message_id` for `consumer` once, in the default inbox, on
/// whichever database `pool` is: `handler` gets the open (write)
/// transaction's connection, and its writes commit with the inbox row.
///
/// ```no_run
/// use idem_outbox::inbox::{self, Handled};
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outcome = inbox::process(&pool, "reserve-stock", "msg-42", async |tx| {
///     sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'tea'")
///         .execute(&mut *tx)
///         .await?;
///     Ok::<_, sqlx::Error>(())
/// })
/// .await?;
/// match outcome {
///     Handled::Processed(()) => { /* ack */ }
///     Handled::Duplicate => { /* ack too: it was done before */ }
/// }
/// # Ok(()) }
/// ```
pub async fn process<DB, T, E, F>(
    pool: &sqlx::Pool<DB>,
    consumer: &str,
    message_id: &str,
    handler: F,
) -> Result<Handled<T>, InboxError<E>>
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
    F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
{
    DEFAULT.process(pool, consumer, message_id, handler).await
}

/// The error a step past the inbox's statement timeout fails with.
fn timed_out(timeout: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer from the database within {} ms",
            timeout.as_millis()
        ),
    ))
}
