//! One migration runner, with one version table, for everything idem keeps
//! in a SQL database (the idempotency records, the outbox, the inbox), on
//! every [`Dialect`].
//!
//! Applied versions live in `idem_schema_migrations` (not sqlx's
//! `_sqlx_migrations`, so idem never collides with the application's own
//! migrations), one row per `(table_name, version)` with the SHA-256 of the
//! migration's text: each of idem's tables has its own list of versions,
//! and an applied migration whose text has changed since is refused
//! ([`MigrateError::Changed`]), as sqlx refuses one, rather than silently
//! leaving a table that is not what the code expects; so is a table with a
//! version applied that the code does not know ([`MigrateError::Newer`]: a
//! newer idem migrated it, and this one would not keep what it added).
//! Concurrent runners (several instances starting at once) wait for each
//! other.
//!
//! On SQLite and PostgreSQL every migration runs in a transaction with the
//! row that records it, so it is applied once or not at all. MySQL commits
//! each DDL statement by itself: a migration interrupted there runs again
//! next time, so idem's MySQL migrations are written to be re-run
//! (`CREATE TABLE IF NOT EXISTS`, indexes inside it), and a later one that
//! adds an index holds that one `CREATE INDEX`, whose duplicate-name error
//! on a re-run counts as applied (MySQL 8 has no `IF NOT EXISTS` there), and
//! one that adds a column holds that one `ALTER TABLE … ADD COLUMN`, whose
//! duplicate-column error counts likewise.
//!
//! On PostgreSQL and MySQL a migration's statement waits at most 10 s for
//! the transactions using its table (`lock_timeout`, once the runners'
//! lock is held; MySQL's `lock_wait_timeout`, a year by default), since
//! every later statement on the table would queue behind it: an upgrade
//! behind a long transaction fails, to be run again by the next start.

use sha2::{Digest, Sha256};

use crate::dialect::{Arg, Conn, Dialect, Statement};
use crate::TableName;

/// One versioned step of one table's schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Its version: applied in ascending order, once.
    pub version: i64,
    /// The statements, run as one script. Migrations may name `{table}`
    /// (the quoted, qualified table) and `{name}` (its bare name, to derive
    /// constraint and index names from: write `"{name}_pkey"`). The runner
    /// fills them in; the checksum is of the text as written here, so the
    /// same migration of two tables has one checksum.
    pub sql: &'static str,
}

impl Migration {
    /// The SHA-256 of [`sql`](Self::sql), as lowercase hex.
    pub fn checksum(&self) -> String {
        Sha256::digest(self.sql.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// How long a migration's DDL waits for the transactions using its table
/// (MySQL's `lock_wait_timeout`, PostgreSQL's `lock_timeout`), in seconds.
pub const MIGRATION_DDL_WAIT_SECS: i64 = 10;

/// The table that records applied versions.
pub const VERSION_TABLE: &str = "idem_schema_migrations";

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// A migration applied earlier has other text now: the table may not be
    /// what this code expects. Restore the migration's text (a change goes
    /// in a new version), or, knowing why, fix the recorded checksum.
    #[error(
        "migration {version} of table {table} was applied with checksum {applied}, \
         but its text now has checksum {now}: migrations must not change once applied \
         (add a new version instead)"
    )]
    Changed {
        /// The table.
        table: String,
        /// The version.
        version: i64,
        /// The checksum recorded when it was applied.
        applied: String,
        /// The checksum of its text now.
        now: String,
    },
    /// The table has versions applied that this code does not know: a
    /// newer idem migrated it. Nothing was changed. This code would not
    /// keep what those versions added (version 2 of the records, for one,
    /// adds the shortest retention run-once judges by, which version 1
    /// leaves as it is), so it refuses the table rather than use it
    /// quietly: run the newer version (or one newer still). A deliberate
    /// rollback that accepts the loss can match this error and go on when
    /// `missing` is empty: every version this code knows is applied.
    #[error(
        "table {table} has migration(s) {newer:?} applied, which this build of idem does not \
         know (it knows up to {known}): a newer idem migrated it, and this one would not keep \
         what those versions added; run that version or a newer one"
    )]
    Newer {
        /// The table.
        table: String,
        /// The applied versions this code does not know, ascending.
        newer: Vec<i64>,
        /// The highest version this code knows.
        known: i64,
        /// The versions this code knows that are not applied (none, unless
        /// the table's history was edited by hand), ascending.
        missing: Vec<i64>,
    },
    /// The table cannot live on this database (a schema on SQLite).
    #[error("table {table}: {reason}")]
    Misconfigured {
        /// The table.
        table: String,
        /// Why.
        reason: String,
    },
    /// The database failed.
    #[error("migrating {table}: {source}")]
    Database {
        /// The table.
        table: String,
        /// What the database said.
        #[source]
        source: sqlx::Error,
    },
}

impl MigrateError {
    pub(crate) fn database(table: &TableName) -> impl Fn(sqlx::Error) -> Self + '_ {
        move |source| Self::Database {
            table: table.to_string(),
            source,
        }
    }

    /// The database's error, when that is what failed.
    pub fn as_database(&self) -> Option<&sqlx::Error> {
        match self {
            Self::Database { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<MigrateError> for idem_core::StoreError {
    /// The database's failure as the store's (unavailable when a retry may
    /// get past it); anything else (a changed migration, a misconfigured
    /// table) as a backend error that says so.
    fn from(e: MigrateError) -> Self {
        match e {
            MigrateError::Database { source, .. } => crate::store_error(source),
            other => idem_core::StoreError::Backend(Box::new(other)),
        }
    }
}

/// Applies `migrations` to `table` on `pool`: the entry point, the same for
/// every database. The table's schema (PostgreSQL) or database (MySQL) is
/// created if missing.
pub async fn migrate<D: Dialect>(
    pool: &sqlx::Pool<D::Database>,
    table: &TableName,
    migrations: &[Migration],
) -> Result<(), MigrateError> {
    D::migrate(pool, table, migrations).await
}

/// The statements the runner needs on the version table, made for `D`.
pub(crate) struct VersionSql<D> {
    applied: Statement<D>,
    record: Statement<D>,
    adopt: Statement<D>,
}

impl<D: Dialect> VersionSql<D> {
    /// `versions` is the qualified version table, `applied_at` what its
    /// column of that name is set to.
    pub(crate) fn new(versions: &str, applied_at: &str) -> Self {
        Self {
            applied: Statement::raw(&format!(
                "SELECT version, checksum FROM {versions} WHERE table_name = $1"
            )),
            record: Statement::raw(&format!(
                "INSERT INTO {versions} (table_name, version, checksum, applied_at) \
                 VALUES ($1, $2, $3, {applied_at})"
            )),
            adopt: Statement::raw(&format!(
                "UPDATE {versions} SET checksum = $3 WHERE table_name = $1 AND version = $2"
            )),
        }
    }
}

/// Whether `table` has every one of `migrations` recorded in `versions`
/// (the qualified version table) with its text's checksum, and no other:
/// read on a pooled connection, with no lock and no DDL, so that a process
/// starting against a database that is up to date needs only the right to
/// read the version table (not to own it, as `ALTER TABLE` would), and
/// queues behind no transaction. Any error (no version table yet, no
/// checksum column, no privilege) is "not current": the full run decides,
/// and says what is wrong.
pub(crate) async fn is_current<D: Dialect>(
    pool: &crate::dialect::Pool<D>,
    versions: &str,
    table: &TableName,
    migrations: &[Migration],
) -> bool {
    let Ok(mut conn) = pool.acquire().await else {
        return false;
    };
    let sql = VersionSql::<D>::new(versions, "NULL");
    let Ok(applied) = applied::<D>(&mut conn, &sql, table.table()).await else {
        return false;
    };
    applied.len() == migrations.len()
        && migrations.iter().all(|m| {
            applied
                .iter()
                .any(|(v, c)| *v == m.version && c.as_deref() == Some(m.checksum().as_str()))
        })
}

/// The versions applied to the table `name`, each with its checksum (none:
/// recorded by idem before checksums).
async fn applied<D: Dialect>(
    conn: &mut Conn<D>,
    sql: &VersionSql<D>,
    name: &str,
) -> Result<Vec<(i64, Option<String>)>, sqlx::Error> {
    let rows = D::fetch_all(conn, &sql.applied, &[Arg::Text(name)]).await?;
    let mut applied = Vec::with_capacity(rows.len());
    for row in &rows {
        let version = D::get(row, "version").and_then(|v| v.int("version"))?;
        let checksum = D::get(row, "checksum").and_then(|v| match v {
            crate::dialect::Value::Null => Ok(None),
            v => v.text("checksum").map(Some),
        })?;
        applied.push((version, checksum));
    }
    Ok(applied)
}

/// Applies what is missing of `migrations` to `table` on `conn`, which
/// holds the migrations' lock (and, where DDL is transactional, a
/// transaction). An applied version recorded without a checksum (by idem
/// before checksums) adopts its current text's. Every applied version's
/// text is checked first, then that no applied version is unknown here
/// ([`MigrateError::Newer`]); only then is anything applied.
pub(crate) async fn apply<D: Dialect>(
    conn: &mut Conn<D>,
    sql: &VersionSql<D>,
    table: &TableName,
    migrations: &[Migration],
) -> Result<(), MigrateError> {
    let db = MigrateError::database(table);
    let name = table.table();
    let applied = applied::<D>(conn, sql, name).await.map_err(&db)?;
    let mut ordered: Vec<&Migration> = migrations.iter().collect();
    ordered.sort_by_key(|m| m.version);
    for m in &ordered {
        if let Some((_, Some(was))) = applied.iter().find(|(v, _)| *v == m.version) {
            let now = m.checksum();
            if *was != now {
                return Err(MigrateError::Changed {
                    table: table.to_string(),
                    version: m.version,
                    applied: was.clone(),
                    now,
                });
            }
        }
    }
    let mut newer: Vec<i64> = applied
        .iter()
        .map(|(v, _)| *v)
        .filter(|v| !ordered.iter().any(|m| m.version == *v))
        .collect();
    if !newer.is_empty() {
        newer.sort_unstable();
        return Err(MigrateError::Newer {
            table: table.to_string(),
            newer,
            known: ordered.last().map_or(0, |m| m.version),
            missing: ordered
                .iter()
                .map(|m| m.version)
                .filter(|k| !applied.iter().any(|(v, _)| v == k))
                .collect(),
        });
    }
    for m in ordered {
        let now = m.checksum();
        match applied.iter().find(|(v, _)| *v == m.version) {
            Some((_, Some(_))) => {}
            Some((_, None)) => {
                let args = [Arg::Text(name), Arg::Int(m.version), Arg::Text(&now)];
                D::execute(conn, &sql.adopt, &args).await.map_err(&db)?;
            }
            None => {
                let script =
                    Statement::<D>::prepare(m.sql, table).map_err(|e| misconfigured(table, e))?;
                match D::run_script(conn, script.sql()).await {
                    Ok(()) => {}
                    // Only a migration of that one statement: of several,
                    // those after it would never run.
                    Err(e) if is_one_rerunnable_ddl(m.sql) && D::already_applied(&e) => {}
                    Err(e) => return Err(db(e)),
                }
                let args = [Arg::Text(name), Arg::Int(m.version), Arg::Text(&now)];
                D::execute(conn, &sql.record, &args).await.map_err(&db)?;
            }
        }
    }
    Ok(())
}

/// Whether `sql` is one `CREATE INDEX` or one `ALTER TABLE … ADD COLUMN`
/// statement (comment lines aside, one `;` at most, at its end): one change
/// whose duplicate error on a re-run means it was made.
fn is_one_rerunnable_ddl(sql: &str) -> bool {
    let code: String = sql
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    let code = code.trim();
    let code = code.strip_suffix(';').unwrap_or(code);
    if code.contains(';') {
        return false;
    }
    let words: Vec<&str> = code.split_whitespace().take(5).collect();
    let said = |at: usize, word: &str| words.get(at).is_some_and(|w| w.eq_ignore_ascii_case(word));
    (said(0, "CREATE") && said(1, "INDEX"))
        || (said(0, "ALTER") && said(1, "TABLE") && said(3, "ADD") && said(4, "COLUMN")
            // the table, then one change: no second clause after a comma
            && !code.contains(','))
}

pub(crate) fn misconfigured(table: &TableName, e: sqlx::Error) -> MigrateError {
    match e {
        sqlx::Error::Configuration(reason) => MigrateError::Misconfigured {
            table: table.to_string(),
            reason: reason.to_string(),
        },
        source => MigrateError::Database {
            table: table.to_string(),
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::is_one_rerunnable_ddl;

    #[test]
    fn only_a_lone_create_index_or_add_column_counts_as_one() {
        assert!(is_one_rerunnable_ddl(
            "-- why\nCREATE INDEX `t_x` ON {table} (x)"
        ));
        assert!(is_one_rerunnable_ddl("create index t_x on t (x);\n"));
        assert!(!is_one_rerunnable_ddl(
            "CREATE INDEX t_x ON t (x); ALTER TABLE t ADD y INT"
        ));
        assert!(!is_one_rerunnable_ddl(
            "CREATE TABLE IF NOT EXISTS t (x INT, INDEX t_x (x))"
        ));
        assert!(!is_one_rerunnable_ddl("CREATE UNIQUE INDEX t_x ON t (x)"));
        assert!(is_one_rerunnable_ddl(
            "-- why\nALTER TABLE {table} ADD COLUMN y BIGINT\n"
        ));
        assert!(is_one_rerunnable_ddl("alter table t add column y int;"));
        assert!(!is_one_rerunnable_ddl(
            "ALTER TABLE t ADD COLUMN y INT, ADD COLUMN z INT"
        ));
        assert!(!is_one_rerunnable_ddl(
            "ALTER TABLE t ADD COLUMN y INT; DROP TABLE u"
        ));
        assert!(!is_one_rerunnable_ddl("ALTER TABLE t DROP COLUMN y"));
        assert!(!is_one_rerunnable_ddl("ALTER TABLE t ADD INDEX t_y (y)"));
    }
}
