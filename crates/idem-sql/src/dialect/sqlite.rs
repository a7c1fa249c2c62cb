//! SQLite: one file, one writer at a time, no schemas.

use std::borrow::Cow;

use idem_core::BoxFuture;

use super::{binder, dialect_io, sealed, Dialect, ErrorClass};
use crate::migrate::{apply, misconfigured, MigrateError, Migration, VersionSql, VERSION_TABLE};
use crate::TableName;

/// SQLite (feature `sqlite`): the embedded default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sqlite;

impl sealed::Sealed for Sqlite {}

binder!(Sqlite, sqlx::Sqlite);

impl Dialect for Sqlite {
    type Database = sqlx::Sqlite;
    const NAME: &'static str = "sqlite";
    // `'now'` is read once per statement.
    const NOW_MILLIS: &'static str =
        "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";
    const NUMBERED: bool = true;
    const SKIP_LOCKED: &'static str = "";

    /// The bare, quoted name: SQLite keeps no schemas (its "schemas" are
    /// attached database files), so a qualified table is refused rather
    /// than silently put somewhere else.
    fn qualify(table: &TableName) -> Result<String, sqlx::Error> {
        match table.schema() {
            None => Ok(format!("\"{}\"", table.table())),
            Some(schema) => Err(sqlx::Error::Configuration(
                format!(
                    "table {table}: SQLite has no schemas (schema {schema:?} given); \
                     name the table alone (TableName::new(None, …))"
                )
                .into(),
            )),
        }
    }

    /// `SQLITE_BUSY`, `SQLITE_LOCKED` and every extended code of theirs
    /// (`SQLITE_BUSY_SNAPSHOT`, `SQLITE_BUSY_TIMEOUT`, …) after the busy
    /// timeout are [`ErrorClass::Unavailable`]; read-only, permission,
    /// corruption and "not a database", in every extended code, are fatal.
    /// SQLite gives a missing table no code of its own (it is
    /// `SQLITE_ERROR`): here alone, its message tells.
    fn classify(e: &sqlx::Error) -> ErrorClass {
        let sqlx::Error::Database(d) = e else {
            return super::classify_io(e);
        };
        let code = d.code();
        let code = code.as_deref();
        // The primary result code is the extended one's low byte.
        let primary = code.and_then(|c| c.parse::<u32>().ok()).map(|c| c & 0xff);
        if matches!(code, Some("2067" | "1555")) {
            return ErrorClass::UniqueViolation;
        }
        match primary {
            // BUSY, LOCKED
            Some(5 | 6) => return ErrorClass::Unavailable,
            // READONLY, PERM, CORRUPT, AUTH, NOTADB
            Some(8 | 3 | 11 | 23 | 26) => return ErrorClass::Fatal,
            _ => {}
        }
        match code {
            Some("1") if d.message().starts_with("no such table") => ErrorClass::MissingTable,
            Some("1")
                if d.message().starts_with("no such column")
                    || d.message().contains("syntax error") =>
            {
                ErrorClass::Fatal
            }
            _ => ErrorClass::Other,
        }
    }

    /// A pool of one connection made from `pool`'s options, its hooks
    /// (`after_connect` and the rest) included. Outside a Tokio runtime
    /// (a store made in a synchronous `main` from a pool opened in a
    /// runtime), where sqlx could not start the new pool's upkeep, `pool`
    /// itself: writers then meet SQLite's busy handler as other processes'
    /// do.
    fn writers(pool: &sqlx::SqlitePool) -> sqlx::SqlitePool {
        let options = pool.options();
        if options.get_max_connections() <= 1 || tokio::runtime::Handle::try_current().is_err() {
            return pool.clone();
        }
        options
            .clone()
            .max_connections(1)
            .min_connections(0)
            // Every write waits its turn for this connection: a ping
            // before each would lengthen every turn. A broken connection
            // still fails its statement, and is replaced.
            .test_before_acquire(false)
            .connect_lazy_with(pool.connect_options().as_ref().clone())
    }

    fn begin_write(
        pool: &sqlx::SqlitePool,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error>> {
        super::begin_detached(pool, Some("BEGIN IMMEDIATE".into()))
    }

    /// Under the write lock (`BEGIN IMMEDIATE`), in one transaction: the
    /// version table, then every missing migration. A version table of the
    /// layouts idem used before (one `version` column for the records; no
    /// checksum) is upgraded in place.
    fn migrate<'a>(
        pool: &'a sqlx::SqlitePool,
        table: &'a TableName,
        migrations: &'a [Migration],
    ) -> BoxFuture<'a, Result<(), MigrateError>> {
        Box::pin(async move {
            Self::qualify(table).map_err(|e| misconfigured(table, e))?;
            let db = MigrateError::database(table);
            let mut tx = Self::begin_write(pool).await.map_err(&db)?;
            let staged = async {
                let layout: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT name, pk FROM pragma_table_info('idem_schema_migrations')",
                )
                .fetch_all(&mut *tx)
                .await
                .map_err(&db)?;
                let script = if layout.iter().any(|(n, pk)| n == "version" && *pk == 1) {
                    UPGRADE_V0
                } else if layout.is_empty() {
                    CREATE
                } else if !layout.iter().any(|(n, _)| n == "checksum") {
                    ADD_CHECKSUM
                } else {
                    ""
                };
                if !script.is_empty() {
                    Self::run_script(&mut tx, script).await.map_err(&db)?;
                }
                let sql = VersionSql::<Self>::new(VERSION_TABLE, Self::NOW_MILLIS);
                apply::<Self>(&mut tx, &sql, table, migrations).await
            }
            .await;
            super::finish_migration(tx, staged, table).await
        })
    }

    dialect_io!(Sqlite, sqlx::Sqlite);

    fn placeholder(n: usize) -> Cow<'static, str> {
        Cow::Owned(format!("?{n}"))
    }
}

/// How long a connection waits for SQLite's write lock before failing.
pub const DEFAULT_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Connection options idem uses for a SQLite URL: the file created if
/// missing, WAL journal, `synchronous = FULL` (a committed record survives a
/// power cut, not only a crash), foreign keys on, and a busy timeout.
pub fn connect_options(url: &str) -> Result<sqlx::sqlite::SqliteConnectOptions, sqlx::Error> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    use std::str::FromStr;
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true)
        .busy_timeout(DEFAULT_BUSY_TIMEOUT))
}

/// Opens a pool on `url` with [`connect_options`]. An in-memory database gets
/// a single connection, since each SQLite connection to `:memory:` would
/// otherwise see a database of its own.
///
/// A connection is not checked before it is handed out (sqlx's
/// `test_before_acquire`): a SQLite connection is a thread of this process
/// with the file open, which no server restart or network can break while
/// it idles, and sqlx already checks each connection as it goes back to the
/// pool. The check would be one more round trip to that thread (two context
/// switches) on every checkout: a third of a replay's. A connection that
/// fails anyway fails its statement, and sqlx discards it when it comes
/// back.
pub async fn open_pool(url: &str) -> Result<sqlx::SqlitePool, sqlx::Error> {
    let options = connect_options(url)?;
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut pool = sqlx::sqlite::SqlitePoolOptions::new()
        .acquire_timeout(DEFAULT_BUSY_TIMEOUT)
        .test_before_acquire(false);
    if in_memory {
        pool = pool
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    }
    pool.connect_with(options).await
}

const CREATE: &str = "CREATE TABLE idem_schema_migrations (
    table_name TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    checksum   TEXT,
    applied_at INTEGER NOT NULL,
    PRIMARY KEY (table_name, version)
)";

const ADD_CHECKSUM: &str = "ALTER TABLE idem_schema_migrations ADD COLUMN checksum TEXT";

// Before: (version PRIMARY KEY, applied_at), the records' versions.
const UPGRADE_V0: &str = "ALTER TABLE idem_schema_migrations RENAME TO idem_schema_migrations_v0;
CREATE TABLE idem_schema_migrations (
    table_name TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    checksum   TEXT,
    applied_at INTEGER NOT NULL,
    PRIMARY KEY (table_name, version)
);
INSERT INTO idem_schema_migrations (table_name, version, applied_at)
    SELECT 'idem_records', version, applied_at FROM idem_schema_migrations_v0;
DROP TABLE idem_schema_migrations_v0;";
