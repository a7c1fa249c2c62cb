//! idem's one database layer, for sqlx on SQLite, PostgreSQL and
//! MySQL/MariaDB (features `sqlite`, `postgres`, `mysql`):
//!
//! - [`Dialect`], a sealed trait with one implementation per database
//!   ([`dialect`]), owns everything that differs between them: write
//!   transactions, qualified table names, checksummed [`migrate`]s, what an
//!   error means ([`ErrorClass`]), the clock, `SKIP LOCKED`; the stores, the
//!   outbox, the inbox, the `idem` CLI and `shop` are written once over it;
//! - [`SqlStore`]: the idempotency records on SQLite and MySQL
//!   (`idem-sqlite`, `idem-mysql`);
//! - and two guards older and cheaper than an idempotency key, below.
//!
//! Idempotent by construction:
//!
//! - [`create_once`]: create a row once per **natural key** (an order's
//!   `(customer_id, client_reference)`, a webhook's event id). The loser of a
//!   race gets the winner's row, never an error.
//! - [`transition`]: move a row from one state to another **once**, with one
//!   conditional `UPDATE`; when it changes nothing, learn why
//!   ([`Transition::AlreadyDone`], [`Transition::NotFound`],
//!   [`Transition::Conflict`]).
//!
//! ```
//! use idem_sql::{create_once, transition, Created, Transition};
//! use sqlx::SqliteConnection;
//!
//! type Order = (i64, String); // id, status
//!
//! async fn place(conn: &mut SqliteConnection, reference: &str) -> Result<Created<Order>, sqlx::Error> {
//!     create_once(conn,
//!         || sqlx::query_as("INSERT INTO orders (ref, status) VALUES ($1, 'placed')
//!                            ON CONFLICT (ref) DO NOTHING RETURNING id, status").bind(reference),
//!         || sqlx::query_as("SELECT id, status FROM orders WHERE ref = $1").bind(reference),
//!     ).await
//! }
//!
//! async fn ship(conn: &mut SqliteConnection, id: i64) -> Result<Transition<Order>, sqlx::Error> {
//!     transition(conn, "shipped", |(_, status): &Order| status.clone(),
//!         || sqlx::query_as("UPDATE orders SET status = 'shipped'
//!                            WHERE id = $1 AND status = 'placed' RETURNING id, status").bind(id),
//!         || sqlx::query_as("SELECT id, status FROM orders WHERE id = $1").bind(id),
//!     ).await
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
//! # let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! # sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, ref TEXT UNIQUE, status TEXT)")
//! #     .execute(&pool).await?;
//! let mut conn = pool.acquire().await?;
//! let first = place(&mut conn, "ord-42").await?;
//! let again = place(&mut conn, "ord-42").await?;
//! assert!(first.is_created() && !again.is_created());
//! let (id, _) = again.into_inner();
//!
//! assert!(matches!(ship(&mut conn, id).await?, Transition::Applied(_)));
//! assert!(matches!(ship(&mut conn, id).await?, Transition::AlreadyDone(_)));
//! assert!(matches!(ship(&mut conn, 999).await?, Transition::NotFound));
//! # Ok(()) }
//! ```
//!
//! Both helpers take closures that build their queries, because a query is
//! consumed when it runs and the helpers may need to run one again.
//!
//! Beneath them, what every SQL part of idem shares (the stores, the
//! outbox, the inbox, and `shop`):
//!
//! - [`is_unavailable`], [`store_error`]: a failed statement told apart
//!   (an outage is worth a retry; nothing else is), on every database;
//!   [`DuplicateKey`], [`insert_unique`]: a unique violation as an answer;
//! - [`fenced`]: a write fenced by a claim's token, or [`idem_core::StoreError::ClaimLost`];
//! - [`decode_record`], [`decode_stats`]: a stored idempotency record, and
//!   the operators' counts, read back from a row;
//! - [`migrate`]: one migration runner with one version table;
//! - [`finish`]: a transaction ended explicitly, commit or rollback.

#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_macros, unused_imports)
)]

pub mod dialect;
mod errors;
pub mod migrate;
mod record;
pub mod store;
mod table;

#[cfg(feature = "mysql")]
pub use dialect::MySql;
#[cfg(feature = "postgres")]
pub use dialect::Postgres;
#[cfg(feature = "sqlite")]
pub use dialect::Sqlite;
pub use dialect::{Arg, Dialect, DialectConnection, Driver, ErrorClass, Statement};
pub use errors::{
    classify, fenced, insert_unique, is_unavailable, store_error, DuplicateKey, Inserted,
};
pub use migrate::{MigrateError, Migration};
pub use record::{decode_record, decode_stats};
pub use store::{RecordDialect, SqlRecords, SqlStore, MAX_RECORD_TABLE_NAME};
pub use table::{InvalidIdentifier, TableName};

/// Ends `tx` now: commits if `staged` is `Ok`, rolls back if not, and
/// returns `staged` (or the commit's error). A transaction left to its drop
/// ends later, holding its locks (on SQLite, the one write lock) until it
/// does; end every one before answering.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let mut tx = pool.begin().await?;
/// let staged = sqlx::query("SELECT 1").execute(&mut *tx).await.map(|_| ());
/// idem_sql::finish(tx, staged).await?;
/// # Ok(()) }
/// ```
pub async fn finish<DB: sqlx::Database, T>(
    tx: sqlx::Transaction<'_, DB>,
    staged: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    match staged {
        Ok(value) => {
            tx.commit().await?;
            Ok(value)
        }
        Err(e) => {
            // The connection broke, most likely: the server ended the
            // transaction with it. The error that matters is `e`.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

use sqlx::query::QueryAs;
use sqlx::{Database, Executor, FromRow, IntoArguments};

/// The outcome of [`create_once`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created<T> {
    /// This call inserted the row.
    Created(T),
    /// The natural key existed already: the row that holds it.
    Existing(T),
}

impl<T> Created<T> {
    /// Whether this call created the row.
    pub fn is_created(&self) -> bool {
        matches!(self, Created::Created(_))
    }

    /// The row, created or existing.
    pub fn into_inner(self) -> T {
        match self {
            Created::Created(t) | Created::Existing(t) => t,
        }
    }
}

/// The row could not be created or found after several tries: it kept
/// disappearing between the insert and the read (deleted concurrently).
fn vanished() -> sqlx::Error {
    sqlx::Error::Protocol(
        "create_once: the conflicting row vanished before it could be read, 5 times".into(),
    )
}

/// Creates a row once per natural key.
///
/// `insert` must be `INSERT … ON CONFLICT (<natural key>) DO NOTHING
/// RETURNING …`: it returns the new row, or nothing when the key exists.
/// `fetch` reads the row by the same natural key. Two callers racing on one
/// key both succeed: one gets [`Created::Created`], the other
/// [`Created::Existing`] with the winner's row (PostgreSQL makes the loser's
/// insert wait for the winner's commit; SQLite has one writer at a time).
///
/// The same helper makes an effect converge on its **operation id**: with
/// a unique constraint on the operation id where the effect lands, an
/// attempt that finds the effect recorded by another attempt of the same
/// operation (one that outlived its lease, where the idempotency record
/// cannot fence the write, as with Redis alone) gets
/// [`Created::Existing`] and answers with that effect, as the first
/// attempt did, instead of a conflict that would be stored and replayed:
///
/// ```
/// # use idem_sql::{create_once, Created};
/// # async fn record(conn: &mut sqlx::SqliteConnection, operation_id: &str, amount: i64)
/// #     -> Result<(String, i64), sqlx::Error> {
/// let payment = create_once(conn,
///     || sqlx::query_as("INSERT INTO payments (operation_id, amount) VALUES ($1, $2)
///                        ON CONFLICT (operation_id) DO NOTHING RETURNING operation_id, amount")
///         .bind(operation_id).bind(amount),
///     || sqlx::query_as("SELECT operation_id, amount FROM payments WHERE operation_id = $1")
///         .bind(operation_id),
/// ).await?;
/// // Created or found, the answer is the same payment.
/// Ok(payment.into_inner())
/// # }
/// ```
///
/// Run it inside a transaction to commit other writes with the creation.
/// Under PostgreSQL's REPEATABLE READ or SERIALIZABLE, the loser may not see
/// the winner's row; use READ COMMITTED (the default) or retry the
/// transaction.
pub async fn create_once<'q, C, DB, T, A, I, F>(
    conn: &mut C,
    insert: I,
    fetch: F,
) -> Result<Created<T>, sqlx::Error>
where
    C: ?Sized,
    DB: Database,
    for<'c> &'c mut C: Executor<'c, Database = DB>,
    T: for<'r> FromRow<'r, DB::Row> + Send + Unpin,
    A: 'q + IntoArguments<'q, DB>,
    I: Fn() -> QueryAs<'q, DB, T, A>,
    F: Fn() -> QueryAs<'q, DB, T, A>,
{
    for _ in 0..5 {
        if let Some(row) = insert().fetch_optional(&mut *conn).await? {
            return Ok(Created::Created(row));
        }
        if let Some(row) = fetch().fetch_optional(&mut *conn).await? {
            return Ok(Created::Existing(row));
        }
    }
    Err(vanished())
}

/// The outcome of [`transition`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition<T> {
    /// This call moved the row to the target state.
    Applied(T),
    /// The row was in the target state already (an earlier call moved it).
    AlreadyDone(T),
    /// No such row.
    NotFound,
    /// The row is in another state, from which the transition does not apply.
    Conflict {
        /// The state the row is in.
        current: String,
        /// The row.
        row: T,
    },
}

/// Moves a row from one state to `target` once, with one conditional
/// `UPDATE` and no read-modify-write window.
///
/// `update` must be `UPDATE … SET <state> = <target> WHERE <id> = … AND
/// <state> = <from> RETURNING …` and `fetch` the same row's `SELECT … WHERE
/// <id> = …`; `state_of` reads the state from a row. When the update changes
/// nothing, `fetch` tells why: the row is already in `target`
/// ([`Transition::AlreadyDone`]), missing ([`Transition::NotFound`]), or in
/// another state ([`Transition::Conflict`]). The decision itself is the
/// `UPDATE`'s alone: under READ COMMITTED, a concurrent transition makes it
/// wait and then re-check its `WHERE` against the new row, so exactly one
/// caller gets [`Transition::Applied`].
pub async fn transition<'q, C, DB, T, A, S, U, F>(
    conn: &mut C,
    target: &str,
    state_of: S,
    update: U,
    fetch: F,
) -> Result<Transition<T>, sqlx::Error>
where
    C: ?Sized,
    DB: Database,
    for<'c> &'c mut C: Executor<'c, Database = DB>,
    T: for<'r> FromRow<'r, DB::Row> + Send + Unpin,
    A: 'q + IntoArguments<'q, DB>,
    S: Fn(&T) -> String,
    U: FnOnce() -> QueryAs<'q, DB, T, A>,
    F: FnOnce() -> QueryAs<'q, DB, T, A>,
{
    if let Some(row) = update().fetch_optional(&mut *conn).await? {
        return Ok(Transition::Applied(row));
    }
    Ok(match fetch().fetch_optional(&mut *conn).await? {
        None => Transition::NotFound,
        Some(row) => {
            let current = state_of(&row);
            if current == target {
                Transition::AlreadyDone(row)
            } else {
                Transition::Conflict { current, row }
            }
        }
    })
}
