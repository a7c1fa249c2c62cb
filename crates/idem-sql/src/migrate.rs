//! One migration runner, with one version table, for everything idem keeps
//! in a SQL database: the idempotency records, the outbox, the inbox.
//!
//! Applied versions live in `idem_schema_migrations` (not sqlx's
//! `_sqlx_migrations`, so idem never collides with the application's own
//! migrations), one row per `(table_name, version)`: each of idem's tables
//! has its own list of versions. Every migration runs in a transaction with
//! the row that records it, so it is applied once or not at all; concurrent
//! runners (several instances starting at once) wait for each other.

/// One versioned step of one table's schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Its version: applied in ascending order, once.
    pub version: i64,
    /// The statements, run as one script. Migrations may name `{table}`
    /// (the quoted, on PostgreSQL schema-qualified, table) and `{name}` (its
    /// bare name, to derive constraint and index names from: write
    /// `"{name}_pkey"`); PostgreSQL ones also `{index}` (a name for the
    /// expiry index). The runner fills them in.
    pub sql: &'static str,
}

/// The table that records applied versions.
pub const VERSION_TABLE: &str = "idem_schema_migrations";

/// Applies `migrations` to the PostgreSQL table `table` in `schema` (or the
/// search path's first schema), creating the schema if missing, under a
/// transaction-scoped advisory lock per schema.
#[cfg(feature = "postgres")]
pub async fn migrate_postgres(
    pool: &sqlx::PgPool,
    schema: Option<&str>,
    table: &str,
    migrations: &[Migration],
) -> Result<(), sqlx::Error> {
    let quoted = |name: &str| match schema {
        Some(s) => format!("\"{s}\".\"{name}\""),
        None => format!("\"{name}\""),
    };
    let qualified = quoted(table);
    let versions = quoted(VERSION_TABLE);
    let index = format!("\"{table}_expires_at\"");
    let mut tx = pool.begin().await?;
    let staged = async {
        // One lock per schema, not per table: creating the schema and the
        // version table is shared by every table of it, and two first
        // deployments racing on them would otherwise meet a unique
        // violation in the catalog.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("idem-migrate-schema:{}", schema.unwrap_or("")))
            .execute(&mut *tx)
            .await?;
        // `Executor::execute` on a `&str` runs a script of several statements
        // (the simple query protocol), as a migration may hold.
        if let Some(s) = schema {
            let create = format!("CREATE SCHEMA IF NOT EXISTS \"{s}\"");
            sqlx::Executor::execute(&mut *tx, create.as_str()).await?;
        }
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {versions} (
            table_name text        NOT NULL,
            version    bigint      NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (table_name, version)
        )"
        );
        sqlx::Executor::execute(&mut *tx, create.as_str()).await?;
        let applied = format!("SELECT 1 FROM {versions} WHERE table_name = $1 AND version = $2");
        let record = format!("INSERT INTO {versions} (table_name, version) VALUES ($1, $2)");
        for m in migrations {
            let done = sqlx::query(&applied)
                .bind(table)
                .bind(m.version)
                .fetch_optional(&mut *tx)
                .await?
                .is_some();
            if done {
                continue;
            }
            let sql = m
                .sql
                .replace("{table}", &qualified)
                .replace("{index}", &index)
                .replace("{name}", table);
            sqlx::Executor::execute(&mut *tx, sql.as_str()).await?;
            sqlx::query(&record)
                .bind(table)
                .bind(m.version)
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }
    .await;
    crate::finish(tx, staged).await
}

/// Applies `migrations` to the SQLite table `table`, each in a write
/// transaction (`BEGIN IMMEDIATE`, so concurrent runners take turns).
///
/// A version table of the layout idem used before (one `version` column,
/// for the records alone) is upgraded in place.
#[cfg(feature = "sqlite")]
pub async fn migrate_sqlite(
    pool: &sqlx::SqlitePool,
    table: &str,
    migrations: &[Migration],
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let staged = async {
        let old_layout: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pragma_table_info('idem_schema_migrations')
         WHERE name = 'version' AND pk = 1",
        )
        .fetch_one(&mut *tx)
        .await?;
        if old_layout > 0 {
            // Before: (version PRIMARY KEY, applied_at), the records' versions.
            sqlx::Executor::execute(
                &mut *tx,
                "ALTER TABLE idem_schema_migrations RENAME TO idem_schema_migrations_v0;
             CREATE TABLE idem_schema_migrations (
                 table_name TEXT    NOT NULL,
                 version    INTEGER NOT NULL,
                 applied_at INTEGER NOT NULL,
                 PRIMARY KEY (table_name, version)
             );
             INSERT INTO idem_schema_migrations (table_name, version, applied_at)
                 SELECT 'idem_records', version, applied_at FROM idem_schema_migrations_v0;
             DROP TABLE idem_schema_migrations_v0;",
            )
            .await?;
        } else {
            sqlx::Executor::execute(
                &mut *tx,
                "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
                 table_name TEXT    NOT NULL,
                 version    INTEGER NOT NULL,
                 applied_at INTEGER NOT NULL,
                 PRIMARY KEY (table_name, version)
             )",
            )
            .await?;
        }
        Ok(())
    }
    .await;
    crate::finish(tx, staged).await?;
    for m in migrations {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let staged = async {
            let done = sqlx::query(
                "SELECT 1 FROM idem_schema_migrations WHERE table_name = ?1 AND version = ?2",
            )
            .bind(table)
            .bind(m.version)
            .fetch_optional(&mut *tx)
            .await?
            .is_some();
            if !done {
                let sql = m
                    .sql
                    .replace("{table}", &format!("\"{table}\""))
                    .replace("{name}", table);
                sqlx::Executor::execute(&mut *tx, sql.as_str()).await?;
                sqlx::query(
                    "INSERT INTO idem_schema_migrations (table_name, version, applied_at)
                 VALUES (?1, ?2, ?3)",
                )
                .bind(table)
                .bind(m.version)
                .bind(idem_core::UnixMillis::now().0)
                .execute(&mut *tx)
                .await?;
            }
            Ok(())
        }
        .await;
        crate::finish(tx, staged).await?;
    }
    Ok(())
}
