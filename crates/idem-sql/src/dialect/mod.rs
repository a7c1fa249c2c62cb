//! [`Dialect`]: everything that differs between the SQL databases idem runs
//! on, written once per database and nowhere else.
//!
//! sqlx splits a driver into a `Database` (the types) and what runs on it;
//! idem adds one sealed trait on top, with an implementation per database:
//! [`Sqlite`], [`Postgres`] and [`MySql`] (each behind the crate feature of
//! the same name). The stores, the outbox, the relay, the inbox, the `idem`
//! CLI and `shop` are generic over it.
//!
//! | | SQLite | PostgreSQL | MySQL / MariaDB |
//! |---|---|---|---|
//! | a write transaction | `BEGIN IMMEDIATE` | `BEGIN` | `BEGIN` (READ COMMITTED) |
//! | a qualified table | refused | `"schema"."table"` | `` `database`.`table` `` |
//! | the migrations' lock | the write lock | an advisory lock | `GET_LOCK` |
//! | the clock | `julianday('now')`, in milliseconds | `now()` | `UTC_TIMESTAMP(6)` |
//! | claiming a batch | the write lock | `FOR UPDATE SKIP LOCKED` | `FOR UPDATE SKIP LOCKED` |
//!
//! Statements are written with `$1`, `$2`, … placeholders and named parts
//! (`{table}`, `{now}`, `{skip_locked}`); [`Statement::prepare`] makes them
//! into what runs on one database, once (MySQL's `?` placeholders repeated
//! in the order the text names them).

use std::borrow::Cow;
use std::fmt;

use idem_core::{BoxFuture, Record, StoreError, StoreStats, UnixMillis};

use crate::migrate::{MigrateError, Migration};
use crate::TableName;

mod io;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod statement;

pub(crate) use io::{binder, dialect_io};
pub use statement::{Statement, Value};

#[cfg(feature = "mysql")]
pub use mysql::{open_pool as mysql_pool, MySql, DEFAULT_ACQUIRE_TIMEOUT as MYSQL_ACQUIRE_TIMEOUT};
#[cfg(feature = "postgres")]
pub use postgres::Postgres;
#[cfg(feature = "sqlite")]
pub use sqlite::{
    connect_options as sqlite_connect_options, open_pool as sqlite_pool, Sqlite,
    DEFAULT_BUSY_TIMEOUT as SQLITE_BUSY_TIMEOUT,
};

pub(crate) mod sealed {
    /// Only idem's own dialects implement [`Dialect`](super::Dialect).
    pub trait Sealed {}
}
/// Which database a URL names: the one place idem reads a URL's scheme.
///
/// ```
/// use idem_sql::dialect::DialectKind;
/// assert_eq!(DialectKind::of_url("sqlite:shop.db"), Some(DialectKind::Sqlite));
/// assert_eq!(DialectKind::of_url("postgresql://h/db"), Some(DialectKind::Postgres));
/// assert_eq!(DialectKind::of_url("mariadb://root@h/db"), Some(DialectKind::MySql));
/// assert_eq!(DialectKind::of_url("oracle://h"), None);
/// assert_eq!(DialectKind::driver_url("mariadb://root@h/db"), "mysql://root@h/db");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DialectKind {
    /// `sqlite:FILE`.
    Sqlite,
    /// `postgres://…` or `postgresql://…`.
    Postgres,
    /// `mysql://…` or `mariadb://…`.
    MySql,
}

impl DialectKind {
    /// The database `url` names, if idem runs on it.
    pub fn of_url(url: &str) -> Option<Self> {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        match scheme {
            "sqlite" => Some(Self::Sqlite),
            "postgres" | "postgresql" => Some(Self::Postgres),
            "mysql" | "mariadb" => Some(Self::MySql),
            _ => None,
        }
    }

    /// `url` as sqlx's driver takes it (`mariadb://` is spelled `mysql://`).
    pub fn driver_url(url: &str) -> Cow<'_, str> {
        match url.strip_prefix("mariadb://") {
            Some(rest) => Cow::Owned(format!("mysql://{rest}")),
            None => Cow::Borrowed(url),
        }
    }
}

/// A value bound to a statement's placeholder.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Arg<'a> {
    /// Text.
    Text(&'a str),
    /// A 64-bit integer.
    Int(i64),
    /// Bytes.
    Bytes(&'a [u8]),
    /// Text or `NULL`.
    OptText(Option<&'a str>),
    /// An integer `NULL`.
    Null,
}

/// What a failed statement means for the caller, the same way on every
/// database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The database could not be had: unreachable, shutting down, out of
    /// connections, busy past the timeout. A later retry may succeed.
    Unavailable,
    /// A unique constraint held: the natural key exists already.
    UniqueViolation,
    /// The table does not exist (not migrated, or another schema).
    MissingTable,
    /// A deadlock or a serialization failure: the whole transaction was
    /// (or must be) rolled back and may be retried at once.
    RetryTransaction,
    /// An error that waiting cannot mend: permission denied, an unknown
    /// column, a syntax error (SQLSTATE class 42 and its like). Report it;
    /// never retry it forever.
    Fatal,
    /// Anything else (a check constraint, bad data).
    Other,
}

impl ErrorClass {
    /// Whether retrying the same work later may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Unavailable | Self::RetryTransaction)
    }
}

/// The SQL database idem's tables live in: one implementation per database,
/// sealed. See the [module docs](self).
pub trait Dialect:
    sealed::Sealed + Copy + Default + fmt::Debug + Send + Sync + Unpin + 'static
{
    /// The sqlx driver.
    type Database: Driver<Dialect = Self>;

    /// The database's name, as its URL scheme spells it (`sqlite`,
    /// `postgres`, `mysql`).
    const NAME: &'static str;

    /// The database's clock, in milliseconds since the Unix epoch, as SQL
    /// (what `{now}` becomes).
    const NOW_MILLIS: &'static str;

    /// What claims a batch of rows that no other transaction holds, after a
    /// `SELECT … ORDER BY … LIMIT …` (what `{skip_locked}` becomes): `FOR
    /// UPDATE SKIP LOCKED`, or nothing on SQLite, whose write transaction
    /// holds the whole database.
    const SKIP_LOCKED: &'static str;

    /// `table` as this database writes it in a statement: quoted, and
    /// qualified by its schema (PostgreSQL) or database (MySQL). SQLite
    /// has neither and refuses a qualified name.
    fn qualify(table: &TableName) -> Result<String, sqlx::Error>;

    /// What `e` means for the caller.
    fn classify(e: &sqlx::Error) -> ErrorClass;

    /// Whether `e`, from a migration run again after it was cut off
    /// between its change and the row that records it (possible where DDL
    /// commits by itself: MySQL), says the change is already made. Asked
    /// only of a migration that is one `CREATE INDEX` or one `ALTER TABLE
    /// … ADD COLUMN`.
    fn already_applied(e: &sqlx::Error) -> bool {
        let _ = e;
        false
    }

    /// The pool that the writers of `pool`'s database in this process take
    /// their connection from: `pool` itself, but on SQLite (one writer at a
    /// time) a pool of one connection of its own to the same file, with
    /// `pool`'s settings and connection hooks. There writers queue for that connection in the
    /// order they came, each woken when the one before it is done; rather
    /// than each finding the file locked and sleeping in SQLite's busy
    /// handler (1, 2, 5, 10 … ms), past the moment the lock is free. A
    /// pool of one connection (an in-memory database) is its own writers'.
    fn writers(pool: &sqlx::Pool<Self::Database>) -> sqlx::Pool<Self::Database> {
        pool.clone()
    }

    /// Begins a transaction that writes: on SQLite the write lock first
    /// (`BEGIN IMMEDIATE`), so two writers wait for each other instead of
    /// failing at their first write; on MySQL under READ COMMITTED, so a
    /// statement after a wait reads what committed meanwhile. Begun with
    /// [`begin_detached`], so a caller that stops waiting leaves no
    /// connection inside a transaction nobody sees.
    fn begin_write(
        pool: &sqlx::Pool<Self::Database>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, sqlx::Error>>;

    /// [`begin_write`](Self::begin_write), where the database can bound
    /// the transaction's statements itself with each one bounded by
    /// `timeout` on the server too (PostgreSQL: `SET LOCAL
    /// statement_timeout`, sent with the `BEGIN` as one simple query, no
    /// round trip of its own): a statement past it is cancelled there, its
    /// locks and connection freed, rather than left waiting after its
    /// caller stopped. The setting ends with the transaction. Elsewhere (and
    /// for a time-out beyond what PostgreSQL's setting holds, 2^31 - 1 ms)
    /// the same as `begin_write`: bound the statements on the caller's side.
    fn begin_write_bounded(
        pool: &sqlx::Pool<Self::Database>,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, sqlx::Error>> {
        let _ = timeout;
        Self::begin_write(pool)
    }

    /// Applies `migrations` to `table`, once each, refusing an applied one
    /// whose text has changed; see [`crate::migrate`].
    fn migrate<'a>(
        pool: &'a sqlx::Pool<Self::Database>,
        table: &'a TableName,
        migrations: &'a [Migration],
    ) -> BoxFuture<'a, Result<(), MigrateError>>;

    /// Runs `statement` with `args` (in `$1`, `$2`, … order); the rows it
    /// changed (on MySQL: matched).
    fn execute<'e>(
        conn: &'e mut Conn<Self>,
        statement: &'e Statement<Self>,
        args: &'e [Arg<'e>],
    ) -> BoxFuture<'e, Result<u64, sqlx::Error>>;

    /// Runs `statement`; its first row, if any.
    fn fetch_optional<'e>(
        conn: &'e mut Conn<Self>,
        statement: &'e Statement<Self>,
        args: &'e [Arg<'e>],
    ) -> BoxFuture<'e, Result<Option<Row<Self>>, sqlx::Error>>;

    /// Runs `statement`; all its rows.
    fn fetch_all<'e>(
        conn: &'e mut Conn<Self>,
        statement: &'e Statement<Self>,
        args: &'e [Arg<'e>],
    ) -> BoxFuture<'e, Result<Vec<Row<Self>>, sqlx::Error>>;

    /// Whether `e` is a lock not had in time (MySQL's 1205, PostgreSQL's
    /// `55P03`): a transaction holds the row for longer than the wait
    /// allowed, and waiting again at once would most likely end the same
    /// way. A deadlock is not: retried, it goes through.
    fn is_lock_timeout(e: &sqlx::Error) -> bool {
        let _ = e;
        false
    }

    /// Runs a script of several statements, without arguments (a
    /// migration).
    fn run_script<'e>(
        conn: &'e mut Conn<Self>,
        script: &'e str,
    ) -> BoxFuture<'e, Result<(), sqlx::Error>>;

    /// Reads column `column` of `row`.
    fn get<'r>(row: &'r Row<Self>, column: &str) -> Result<Value<'r>, sqlx::Error>;

    /// The names of `row`'s columns, in order.
    fn columns(row: &Row<Self>) -> Vec<String>;

    /// Decodes an idempotency record (see [`crate::decode_record`]).
    fn decode_record(row: &Row<Self>) -> Result<Record, StoreError>;

    /// Decodes the operators' counts (see [`crate::decode_stats`]).
    fn decode_stats(row: &Row<Self>, now: UnixMillis) -> Result<StoreStats, StoreError>;

    /// The placeholder of the `n`th argument (from 1).
    #[doc(hidden)]
    fn placeholder(n: usize) -> Cow<'static, str>;

    /// Whether placeholders name their argument (`$2`, `?2`), so arguments
    /// bind in their own order; MySQL's `?` takes them as the text names
    /// them, repeated where it repeats one.
    #[doc(hidden)]
    const NUMBERED: bool;
}

/// Begins a transaction on `pool` (with `statement` instead of `BEGIN`) on
/// a task of its own, so that a caller who stops waiting (a time-out, a
/// dropped request) cannot leave a connection whose `BEGIN` ran on the
/// server while sqlx never saw the transaction: that connection would go
/// back to the pool inside an open transaction, and the next caller's
/// statements on it would never commit. Here the task runs to its end, and
/// a transaction nobody took is dropped, which rolls it back.
pub fn begin_detached<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    statement: Option<std::borrow::Cow<'static, str>>,
) -> BoxFuture<'static, Result<sqlx::Transaction<'static, DB>, sqlx::Error>> {
    let pool = pool.clone();
    let begin = async move {
        match statement {
            Some(s) => pool.begin_with(s).await,
            None => pool.begin().await,
        }
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Box::pin(async {
            Err(sqlx::Error::Io(std::io::Error::other(
                "a transaction can only begin inside a Tokio runtime",
            )))
        });
    };
    let begun = runtime.spawn(begin);
    Box::pin(async move {
        begun.await.unwrap_or_else(|e| {
            Err(sqlx::Error::Io(std::io::Error::other(format!(
                "the task beginning a transaction failed: {e}"
            ))))
        })
    })
}

/// What a failure outside the database's own answers means: trouble
/// reaching it is [`ErrorClass::Unavailable`], the rest
/// [`ErrorClass::Other`].
pub(crate) fn classify_io(e: &sqlx::Error) -> ErrorClass {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => ErrorClass::Unavailable,
        _ => ErrorClass::Other,
    }
}

/// Ends a migration's transaction: commits what `staged` applied, or rolls
/// it back and returns the error.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) async fn finish_migration<DB: sqlx::Database>(
    tx: sqlx::Transaction<'static, DB>,
    staged: Result<(), MigrateError>,
    table: &TableName,
) -> Result<(), MigrateError> {
    match staged {
        Ok(()) => tx.commit().await.map_err(MigrateError::database(table)),
        Err(e) => {
            // The error that matters is `e`; a broken connection ends the
            // transaction with it.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// A sqlx driver idem runs on, and its [`Dialect`]: what lets a pool or a
/// transaction name its dialect (`&PgPool` is a PostgreSQL one), so one
/// function serves every database: `outbox::migrate(&pool)`.
pub trait Driver: sqlx::Database<Connection: DialectConnection<Dialect = Self::Dialect>> {
    /// The dialect.
    type Dialect: Dialect<Database = Self>;
}

#[cfg(feature = "sqlite")]
impl Driver for sqlx::Sqlite {
    type Dialect = Sqlite;
}

#[cfg(feature = "postgres")]
impl Driver for sqlx::Postgres {
    type Dialect = Postgres;
}

#[cfg(feature = "mysql")]
impl Driver for sqlx::MySql {
    type Dialect = MySql;
}

/// Something statements run on, of one [`Dialect`]: a connection
/// (`&mut *tx`), a transaction (`&mut tx`) or a pooled connection, of any
/// database idem runs on.
pub trait DialectConnection: Send {
    /// The dialect.
    type Dialect: Dialect;

    /// The connection underneath.
    fn connection(&mut self) -> &mut Conn<Self::Dialect>;
}

macro_rules! connection_of {
    ($feature:literal, $conn:ty, $dialect:ty) => {
        #[cfg(feature = $feature)]
        impl DialectConnection for $conn {
            type Dialect = $dialect;
            fn connection(&mut self) -> &mut Conn<$dialect> {
                self
            }
        }
    };
}
connection_of!("sqlite", sqlx::SqliteConnection, Sqlite);
connection_of!("postgres", sqlx::PgConnection, Postgres);
connection_of!("mysql", sqlx::MySqlConnection, MySql);

impl<DB: Driver> DialectConnection for sqlx::Transaction<'_, DB> {
    type Dialect = DB::Dialect;
    fn connection(&mut self) -> &mut Conn<DB::Dialect> {
        self
    }
}

impl<DB: Driver> DialectConnection for sqlx::pool::PoolConnection<DB> {
    type Dialect = DB::Dialect;
    fn connection(&mut self) -> &mut Conn<DB::Dialect> {
        self
    }
}

/// A dialect's connection.
pub type Conn<D> = <<D as Dialect>::Database as sqlx::Database>::Connection;
/// A dialect's row.
pub type Row<D> = <<D as Dialect>::Database as sqlx::Database>::Row;
/// A dialect's pool.
pub type Pool<D> = sqlx::Pool<<D as Dialect>::Database>;
/// A dialect's transaction.
pub type Transaction<D> = sqlx::Transaction<'static, <D as Dialect>::Database>;
