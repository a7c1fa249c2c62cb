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
//! | the clock | `unixepoch('subsec')` | `now()` | `UTC_TIMESTAMP(6)` |
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

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

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

    /// Begins a transaction that writes: on SQLite the write lock first
    /// (`BEGIN IMMEDIATE`), so two writers wait for each other instead of
    /// failing at their first write; on MySQL under READ COMMITTED, so a
    /// statement after a wait reads what committed meanwhile.
    fn begin_write(
        pool: &sqlx::Pool<Self::Database>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, sqlx::Error>>;

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

/// A column's value, read by [`Dialect::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Value<'r> {
    /// `NULL`.
    Null,
    /// An integer.
    Int(i64),
    /// Text.
    Text(Cow<'r, str>),
    /// Bytes.
    Bytes(Cow<'r, [u8]>),
}

impl Value<'_> {
    /// The value, owning what it borrowed from its row.
    pub fn into_owned(self) -> Value<'static> {
        match self {
            Value::Null => Value::Null,
            Value::Int(i) => Value::Int(i),
            Value::Text(s) => Value::Text(Cow::Owned(s.into_owned())),
            Value::Bytes(b) => Value::Bytes(Cow::Owned(b.into_owned())),
        }
    }

    /// The integer, or an error naming `column`.
    pub fn int(&self, column: &str) -> Result<i64, sqlx::Error> {
        match self {
            Value::Int(v) => Ok(*v),
            other => Err(mismatch(column, "an integer", other)),
        }
    }

    /// The integer, `None` for `NULL`.
    pub fn opt_int(&self, column: &str) -> Result<Option<i64>, sqlx::Error> {
        match self {
            Value::Null => Ok(None),
            other => other.int(column).map(Some),
        }
    }

    /// The text (bytes that are UTF-8 pass too), or an error naming
    /// `column`.
    pub fn text(&self, column: &str) -> Result<String, sqlx::Error> {
        match self {
            Value::Text(s) => Ok(s.clone().into_owned()),
            Value::Bytes(b) => {
                String::from_utf8(b.to_vec()).map_err(|_| mismatch(column, "UTF-8 text", self))
            }
            other => Err(mismatch(column, "text", other)),
        }
    }

    /// The bytes (text passes too), or an error naming `column`.
    pub fn bytes(&self, column: &str) -> Result<Vec<u8>, sqlx::Error> {
        match self {
            Value::Bytes(b) => Ok(b.to_vec()),
            Value::Text(s) => Ok(s.as_bytes().to_vec()),
            other => Err(mismatch(column, "bytes", other)),
        }
    }

    /// The bytes, `None` for `NULL`.
    pub fn opt_bytes(&self, column: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        match self {
            Value::Null => Ok(None),
            other => other.bytes(column).map(Some),
        }
    }
}

fn mismatch(column: &str, wanted: &str, got: &Value<'_>) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: format!("expected {wanted}, found {got:?}").into(),
    }
}

/// A statement made for one database and one table: the text as it runs,
/// and which argument each placeholder takes.
#[derive(Debug, Clone)]
pub struct Statement<D> {
    sql: String,
    // For each placeholder in the text, in order, the argument (from 0).
    order: Box<[usize]>,
    dialect: D,
}

impl<D: Dialect> Statement<D> {
    /// Makes `template` into a statement on `table`: `{table}` becomes the
    /// qualified table ([`Dialect::qualify`]), `{name}` its bare name,
    /// `{now}` the clock ([`Dialect::NOW_MILLIS`]), `{skip_locked}`
    /// [`Dialect::SKIP_LOCKED`], and `$1`, `$2`, … the database's own
    /// placeholders. Fails only when the table cannot live on this
    /// database (a schema on SQLite).
    pub fn prepare(template: &str, table: &TableName) -> Result<Self, sqlx::Error> {
        let filled = template
            .replace("{table}", &D::qualify(table)?)
            .replace("{name}", table.table())
            .replace("{now}", D::NOW_MILLIS)
            .replace("{skip_locked}", D::SKIP_LOCKED);
        Ok(Self::placeholders(&filled))
    }

    /// `sql` (no named parts) with its `$n` placeholders made the
    /// database's own.
    pub fn raw(sql: &str) -> Self {
        Self::placeholders(sql)
    }

    fn placeholders(text: &str) -> Self {
        let mut sql = String::with_capacity(text.len());
        let mut order = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find(['$', '\'', '-']) {
            sql.push_str(&rest[..at]);
            let (head, after) = rest[at..].split_at(1);
            rest = match head {
                // A `--` comment runs to the end of its line: dropped, so a
                // `$1` in it is no placeholder (MySQL counts none there).
                "-" if after.starts_with('-') => after.find('\n').map_or("", |n| &after[n..]),
                // A string literal is copied as it is.
                "'" => {
                    let end = after.find('\'').map_or(after.len(), |n| n + 1);
                    sql.push('\'');
                    sql.push_str(&after[..end]);
                    &after[end..]
                }
                "$" => {
                    let digits = after.bytes().take_while(u8::is_ascii_digit).count();
                    match after[..digits].parse::<usize>() {
                        Ok(n) if n > 0 => {
                            sql.push_str(&D::placeholder(n));
                            order.push(n - 1);
                        }
                        _ => sql.push('$'),
                    }
                    &after[digits..]
                }
                other => {
                    sql.push_str(other);
                    after
                }
            };
        }
        sql.push_str(rest);
        if D::NUMBERED {
            let count = order.iter().max().map_or(0, |max| max + 1);
            order = (0..count).collect();
        }
        Self {
            sql,
            order: order.into_boxed_slice(),
            dialect: D::default(),
        }
    }

    /// The text, as it runs.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The arguments in the order the placeholders take them.
    pub fn bind_order<'a, 'b>(&'b self, args: &'b [Arg<'a>]) -> impl Iterator<Item = Arg<'a>> + 'b {
        let _ = self.dialect;
        self.order
            .iter()
            .map(move |&i| args.get(i).copied().unwrap_or(Arg::Null))
    }
}

/// The one implementation of [`Dialect`]'s I/O, instantiated for each
/// database's concrete types (where sqlx's traits hold without the bounds
/// that generic code would have to spell out).
macro_rules! dialect_io {
    ($dialect:ty, $db:ty) => {
        fn execute<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let query = bind(statement, args);
                Ok(query.execute(&mut *conn).await?.rows_affected())
            })
        }

        fn fetch_optional<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<Option<$crate::dialect::Row<Self>>, sqlx::Error>> {
            Box::pin(async move { bind(statement, args).fetch_optional(&mut *conn).await })
        }

        fn fetch_all<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<Vec<$crate::dialect::Row<Self>>, sqlx::Error>> {
            Box::pin(async move { bind(statement, args).fetch_all(&mut *conn).await })
        }

        fn run_script<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            script: &'e str,
        ) -> idem_core::BoxFuture<'e, Result<(), sqlx::Error>> {
            Box::pin(async move {
                // A `&str` runs as a script of several statements (the
                // simple / text protocol).
                sqlx::Executor::execute(&mut *conn, script).await?;
                Ok(())
            })
        }

        fn get<'r>(
            row: &'r $crate::dialect::Row<Self>,
            column: &str,
        ) -> Result<$crate::dialect::Value<'r>, sqlx::Error> {
            use sqlx::{Row as _, ValueRef as _};
            use $crate::dialect::Value;
            if row.try_get_raw(column)?.is_null() {
                return Ok(Value::Null);
            }
            if let Ok(v) = row.try_get::<i64, _>(column) {
                return Ok(Value::Int(v));
            }
            if let Ok(v) = row.try_get::<&str, _>(column) {
                return Ok(Value::Text(std::borrow::Cow::Borrowed(v)));
            }
            let v: &[u8] = row.try_get(column)?;
            Ok(Value::Bytes(std::borrow::Cow::Borrowed(v)))
        }

        fn columns(row: &$crate::dialect::Row<Self>) -> Vec<String> {
            use sqlx::{Column as _, Row as _};
            row.columns().iter().map(|c| c.name().to_owned()).collect()
        }

        fn decode_record(
            row: &$crate::dialect::Row<Self>,
        ) -> Result<idem_core::Record, idem_core::StoreError> {
            $crate::decode_record(row)
        }

        fn decode_stats(
            row: &$crate::dialect::Row<Self>,
            now: idem_core::UnixMillis,
        ) -> Result<idem_core::StoreStats, idem_core::StoreError> {
            $crate::decode_stats(row, now)
        }
    };
}
pub(crate) use dialect_io;

/// `fn bind`: `statement`'s query with `args` bound in its placeholder
/// order, for one database.
macro_rules! binder {
    ($dialect:ty, $db:ty) => {
        fn bind<'q>(
            statement: &'q $crate::dialect::Statement<$dialect>,
            args: &[$crate::dialect::Arg<'q>],
        ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>> {
            let mut query = sqlx::query(statement.sql());
            for arg in statement.bind_order(args) {
                query = match arg {
                    $crate::dialect::Arg::Text(s) => query.bind(s),
                    $crate::dialect::Arg::Int(i) => query.bind(i),
                    $crate::dialect::Arg::Bytes(b) => query.bind(b),
                    $crate::dialect::Arg::OptText(s) => query.bind(s),
                    $crate::dialect::Arg::Null => query.bind(None::<i64>),
                };
            }
            query
        }
    };
}
pub(crate) use binder;
