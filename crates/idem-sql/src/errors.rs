//! Telling failed statements apart, the same way on PostgreSQL and SQLite:
//! the database could not be had (retrying may help), a unique violation
//! (the natural key exists already), or anything else.

use idem_core::StoreError;

#[allow(unused_imports)]
use crate::dialect::Dialect;
use crate::dialect::ErrorClass;

/// What `e` means, by the dialect whose driver raised it (see
/// [`Dialect::classify`]): for code that holds an error but not its
/// dialect.
pub fn classify(e: &sqlx::Error) -> ErrorClass {
    let sqlx::Error::Database(d) = e else {
        return crate::dialect::classify_io(e);
    };
    #[cfg(feature = "postgres")]
    if d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return crate::Postgres::classify(e);
    }
    #[cfg(feature = "sqlite")]
    if d.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return crate::Sqlite::classify(e);
    }
    #[cfg(feature = "mysql")]
    if d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return crate::MySql::classify(e);
    }
    let _ = d;
    ErrorClass::Other
}

/// Whether `e` means the database could not be reached, is going away, or
/// stayed busy (as opposed to rejecting the statement): the only failure a
/// retry of the same request may get past. See [`ErrorClass::Unavailable`]
/// and each [`Dialect::classify`].
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    classify(e) == ErrorClass::Unavailable
}

/// A sqlx error as a store error: [`StoreError::Unavailable`] when a retry
/// may get past it ([`ErrorClass::is_retryable`]: unavailable, a deadlock,
/// a serialization failure), [`StoreError::Backend`] otherwise.
pub fn store_error(e: sqlx::Error) -> StoreError {
    if classify(&e).is_retryable() {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

/// A unique violation, with what it hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateKey {
    /// PostgreSQL: the violated constraint (or unique index) name. SQLite,
    /// which names no constraint: the columns its message names, as
    /// `table.column, table.column`. MySQL: the unique index's name (its
    /// message's `for key '…'`, without the table MySQL 8 puts first).
    pub constraint: String,
    /// The table, when the database says.
    pub table: Option<String>,
}

impl DuplicateKey {
    /// The unique violation inside `e`, if that is what it is: SQLSTATE
    /// `23505` on PostgreSQL, `SQLITE_CONSTRAINT_UNIQUE` (2067) or
    /// `SQLITE_CONSTRAINT_PRIMARYKEY` (1555) on SQLite, 1062 on MySQL.
    pub fn of(e: &sqlx::Error) -> Option<Self> {
        let sqlx::Error::Database(db) = e else {
            return None;
        };
        #[cfg(feature = "mysql")]
        if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            if classify(e) != ErrorClass::UniqueViolation {
                return None;
            }
            let key = my
                .message()
                .rsplit_once("for key '")?
                .1
                .trim_end_matches('\'');
            let key = key.rsplit_once('.').map_or(key, |(_, k)| k);
            return Some(Self {
                constraint: key.to_owned(),
                table: None,
            });
        }
        match db.code().as_deref() {
            Some("23505") => Some(Self {
                constraint: db.constraint()?.to_owned(),
                table: db.table().map(str::to_owned),
            }),
            Some("2067" | "1555") => {
                let columns = db.message().split_once("constraint failed: ")?.1.trim();
                let table = columns
                    .split_once('.')
                    .map(|(table, _)| table.trim().to_owned());
                Some(Self {
                    constraint: columns.to_owned(),
                    table,
                })
            }
            _ => None,
        }
    }
}

/// The outcome of a write guarded by a unique constraint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inserted<T> {
    /// The write went through.
    New(T),
    /// The expected constraint said the natural key exists already.
    Duplicate(DuplicateKey),
}

/// Turns a unique violation of `constraint` (see
/// [`DuplicateKey::constraint`] for what names it on each backend) into
/// [`Inserted::Duplicate`]; passes every other error through, unique
/// violations of other constraints included (those are real failures).
///
/// ```
/// use idem_sql::{insert_unique, Inserted};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE orders (order_ref TEXT UNIQUE)").execute(&pool).await?;
/// let insert = || sqlx::query("INSERT INTO orders (order_ref) VALUES ($1)").bind("ord-42").execute(&pool);
/// assert!(matches!(insert_unique(insert().await, "orders.order_ref")?, Inserted::New(_)));
/// assert!(matches!(insert_unique(insert().await, "orders.order_ref")?, Inserted::Duplicate(_)));
/// # Ok(()) }
/// ```
pub fn insert_unique<T>(
    result: Result<T, sqlx::Error>,
    constraint: &str,
) -> Result<Inserted<T>, sqlx::Error> {
    match result {
        Ok(v) => Ok(Inserted::New(v)),
        Err(e) => match DuplicateKey::of(&e) {
            Some(d) if d.constraint == constraint => Ok(Inserted::Duplicate(d)),
            _ => Err(e),
        },
    }
}

/// The result of a write fenced by a claim's token (complete, release):
/// `Ok` when it changed exactly the one row the claim holds, and
/// [`StoreError::ClaimLost`] when it changed none — the lease expired and
/// another holder took the key over, or the record is gone. A caller inside
/// a transaction must then roll it back, so its effect does not commit twice.
///
/// ```
/// use idem_core::StoreError;
/// assert!(idem_sql::fenced(Ok(1)).is_ok());
/// assert!(matches!(idem_sql::fenced(Ok(0)), Err(StoreError::ClaimLost)));
/// ```
pub fn fenced(rows_affected: Result<u64, sqlx::Error>) -> Result<(), StoreError> {
    match rows_affected.map_err(store_error)? {
        1 => Ok(()),
        _ => Err(StoreError::ClaimLost),
    }
}
