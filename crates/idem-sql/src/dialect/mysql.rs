//! MySQL and MariaDB: databases for schemas, named locks, error numbers.

use std::borrow::Cow;

use idem_core::BoxFuture;
use sha2::Digest as _;
use sqlx::mysql::MySqlDatabaseError;

use super::{binder, dialect_io, sealed, Dialect, ErrorClass};
use crate::migrate::{apply, MigrateError, Migration, VersionSql, VERSION_TABLE};
use crate::TableName;

/// MySQL 8 and MariaDB 10.6+ (feature `mysql`), on InnoDB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MySql;

impl sealed::Sealed for MySql {}

binder!(MySql, sqlx::MySql);

/// How long a request waits for a pooled connection before failing as
/// unavailable: an outage becomes a prompt `503`, never a hang.
pub const DEFAULT_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Opens a pool on `url` (`mysql://user:password@host:3306/database`) with
/// idem's defaults: a bounded acquire time-out, 16 connections, and
/// sqlx's session settings (UTC, `utf8mb4`, strict SQL mode as the server
/// has it). A database the URL names that does not exist yet is created
/// (as a SQLite file is), when its name is a plain identifier.
pub async fn open_pool(url: &str) -> Result<sqlx::MySqlPool, sqlx::Error> {
    use std::str::FromStr;
    let options = sqlx::mysql::MySqlConnectOptions::from_str(url)?;
    let open = || {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
            .connect_with(options.clone())
    };
    match open().await {
        Err(sqlx::Error::Database(e))
            if e.try_downcast_ref::<MySqlDatabaseError>()
                .is_some_and(|my| my.number() == 1049) =>
        {
            let Some(name) = options.get_database().filter(|n| {
                !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            }) else {
                return Err(sqlx::Error::Database(e));
            };
            create_database(&options, name).await?;
            open().await
        }
        other => other,
    }
}

/// Creates database `name` (a plain identifier) on the server `options`
/// names.
async fn create_database(
    options: &sqlx::mysql::MySqlConnectOptions,
    name: &str,
) -> Result<(), sqlx::Error> {
    use sqlx::{ConnectOptions, Connection, Executor};
    let mut conn = options
        .clone()
        .database("information_schema")
        .connect()
        .await?;
    let created = conn
        .execute(format!("CREATE DATABASE IF NOT EXISTS `{name}`").as_str())
        .await;
    let _ = conn.close().await;
    created.map(drop)
}

/// How long a migration waits for another runner's lock, in seconds.
const MIGRATION_LOCK_SECS: i64 = 60;

/// The name of the migration lock of database `schema` (the connection's
/// own when `None`): at most the 64 characters MySQL 8 allows a lock name
/// (MariaDB has no limit). A name that would be longer holds a hash of the
/// database's name instead.
fn lock_name(schema: Option<&str>) -> String {
    let plain = format!("idem-migrate:{}", schema.unwrap_or(""));
    if plain.chars().count() <= 64 {
        return plain;
    }
    let digest = sha2::Sha256::digest(schema.unwrap_or("").as_bytes());
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("idem-migrate:{hex}")
}

impl Dialect for MySql {
    type Database = sqlx::MySql;
    const NAME: &'static str = "mysql";
    // UTC whatever the session's time zone; read once per statement.
    const NOW_MILLIS: &'static str =
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";
    const NUMBERED: bool = false;
    const SKIP_LOCKED: &'static str = "FOR UPDATE SKIP LOCKED";

    /// `` `database`.`table` ``, or `` `table` `` in the connection's
    /// database. (MySQL's schemas are its databases.)
    fn qualify(table: &TableName) -> Result<String, sqlx::Error> {
        Ok(match table.schema() {
            Some(s) => format!("`{s}`.`{}`", table.table()),
            None => format!("`{}`", table.table()),
        })
    }

    /// By error number: 1040 (too many connections), 1053 (shutdown), 1927
    /// (connection killed), 1290 and 1836 (read-only: a replica, as just
    /// after a failover), 1792 (a read-only transaction), 4031 (a session
    /// cut for idling), 1969 and 3024 (a statement past its time limit)
    /// are [`ErrorClass::Unavailable`]; 1062, 1022 and
    /// 1586 a unique violation; 1146 a missing table; 1213 (deadlock) and
    /// 1205 (lock wait timeout) [`ErrorClass::RetryTransaction`]; access
    /// denied (1044, 1045, 1142, 1143), an unknown column (1054) or
    /// database (1049) and a syntax error (1064) [`ErrorClass::Fatal`].
    fn classify(e: &sqlx::Error) -> ErrorClass {
        let sqlx::Error::Database(d) = e else {
            return super::classify_io(e);
        };
        let Some(my) = d.try_downcast_ref::<MySqlDatabaseError>() else {
            return ErrorClass::Other;
        };
        match my.number() {
            1040 | 1053 | 1927 | 2002 | 2003 | 2006 | 2013 | 1290 | 1836 | 1792 | 4031 | 1969
            | 3024 => ErrorClass::Unavailable,
            1062 | 1022 | 1586 => ErrorClass::UniqueViolation,
            1146 => ErrorClass::MissingTable,
            1213 | 1205 => ErrorClass::RetryTransaction,
            1044 | 1045 | 1142 | 1143 | 1054 | 1049 | 1064 | 1227 => ErrorClass::Fatal,
            _ => ErrorClass::Other,
        }
    }

    /// 1205, `innodb_lock_wait_timeout` run out.
    fn is_lock_timeout(e: &sqlx::Error) -> bool {
        let sqlx::Error::Database(d) = e else {
            return false;
        };
        d.try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|my| my.number() == 1205)
    }

    /// 1061, a duplicate index name, or 1060, a duplicate column name: a
    /// migration of one `CREATE INDEX`, or of one `ALTER TABLE … ADD
    /// COLUMN`, that ran before.
    fn already_applied(e: &sqlx::Error) -> bool {
        let sqlx::Error::Database(d) = e else {
            return false;
        };
        d.try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|my| matches!(my.number(), 1060 | 1061))
    }

    /// Under READ COMMITTED: a statement after a lock wait reads what
    /// committed meanwhile, not InnoDB's default REPEATABLE READ snapshot
    /// taken before it.
    fn begin_write(
        pool: &sqlx::MySqlPool,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::MySql>, sqlx::Error>> {
        super::begin_detached(
            pool,
            Some("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION".into()),
        )
    }

    /// Under a named lock (`GET_LOCK`) per database, on one connection,
    /// without a transaction: MySQL commits each DDL statement by itself,
    /// so a migration interrupted half-way runs again next time (idem's are
    /// written to), and its version is recorded after it.
    fn migrate<'a>(
        pool: &'a sqlx::MySqlPool,
        table: &'a TableName,
        migrations: &'a [Migration],
    ) -> BoxFuture<'a, Result<(), MigrateError>> {
        Box::pin(async move {
            let db = MigrateError::database(table);
            let versions_table = TableName::new(table.schema(), VERSION_TABLE).map_err(|e| {
                MigrateError::Misconfigured {
                    table: table.to_string(),
                    reason: e.to_string(),
                }
            })?;
            let versions = Self::qualify(&versions_table).map_err(&db)?;
            // Up to date (the common start): nothing to lock or run.
            if crate::migrate::is_current::<Self>(pool, &versions, table, migrations).await {
                return Ok(());
            }
            let mut conn = pool.acquire().await.map_err(&db)?;
            // The lock is the session's: a runner stopped before it let go
            // (its future dropped) must not give the pool back a
            // connection that still holds it, which every later runner
            // would wait for in vain. Closed instead, the lock goes with it.
            conn.close_on_drop();
            // A DDL statement waits for every transaction open on its table
            // (a metadata lock), and every new statement on the table then
            // waits behind it: bounded here (the server's default is a
            // year), so that an upgrade behind a long transaction fails
            // and is run again later, rather than stall the table's users
            // and hold the migration lock meanwhile.
            sqlx::query("SET SESSION lock_wait_timeout = ?")
                .bind(crate::migrate::MIGRATION_DDL_WAIT_SECS)
                .execute(&mut *conn)
                .await
                .map_err(&db)?;
            let lock = lock_name(table.schema());
            let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
                .bind(&lock)
                .bind(MIGRATION_LOCK_SECS)
                .fetch_one(&mut *conn)
                .await
                .map_err(&db)?;
            if got != Some(1) {
                return Err(db(sqlx::Error::Protocol(format!(
                    "another runner held the migration lock {lock:?} for {MIGRATION_LOCK_SECS} s"
                ))));
            }
            let staged = async {
                let mut script = String::new();
                if let Some(s) = table.schema() {
                    script.push_str(&format!("CREATE DATABASE IF NOT EXISTS `{s}`;\n"));
                }
                script.push_str(&format!(
                    "CREATE TABLE IF NOT EXISTS {versions} (
                        table_name VARCHAR(64) CHARACTER SET ascii NOT NULL,
                        version    BIGINT      NOT NULL,
                        checksum   CHAR(64)    CHARACTER SET ascii,
                        applied_at BIGINT      NOT NULL,
                        PRIMARY KEY (table_name, version)
                    ) ENGINE = InnoDB"
                ));
                Self::run_script(&mut conn, &script).await.map_err(&db)?;
                let sql = VersionSql::<Self>::new(&versions, Self::NOW_MILLIS);
                apply::<Self>(&mut conn, &sql, table, migrations).await
            }
            .await;
            let released = sqlx::query("SELECT RELEASE_LOCK(?)")
                .bind(&lock)
                .execute(&mut *conn)
                .await;
            staged?;
            released.map_err(&db)?;
            Ok(())
        })
    }

    dialect_io!(MySql, sqlx::MySql);

    fn placeholder(_: usize) -> Cow<'static, str> {
        Cow::Borrowed("?")
    }
}

#[cfg(test)]
mod tests {
    use super::lock_name;

    #[test]
    fn migration_lock_names_fit_mysqls_64_characters() {
        assert_eq!(lock_name(None), "idem-migrate:");
        assert_eq!(lock_name(Some("billing")), "idem-migrate:billing");
        // 51 characters still fit as they are.
        let fits = "d".repeat(51);
        assert_eq!(lock_name(Some(&fits)), format!("idem-migrate:{fits}"));
        // Longer: a hash, the same every time, one per name.
        let long = "d".repeat(64);
        let hashed = lock_name(Some(&long));
        assert_eq!(hashed.chars().count(), 53, "{hashed}");
        assert_eq!(hashed, lock_name(Some(&long)));
        assert_ne!(hashed, lock_name(Some(&"e".repeat(64))));
        // Characters, not bytes, count.
        let wide = "é".repeat(51);
        assert_eq!(lock_name(Some(&wide)), format!("idem-migrate:{wide}"));
    }
}
