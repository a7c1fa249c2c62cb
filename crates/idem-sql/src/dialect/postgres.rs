//! PostgreSQL: schemas, advisory locks, SQLSTATEs.

use std::borrow::Cow;

use idem_core::BoxFuture;

use super::{binder, dialect_io, sealed, Dialect, ErrorClass};
use crate::migrate::{apply, MigrateError, Migration, VersionSql, VERSION_TABLE};
use crate::TableName;

/// PostgreSQL (feature `postgres`): durable, shared by every instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Postgres;

impl sealed::Sealed for Postgres {}

binder!(Postgres, sqlx::Postgres);

impl Dialect for Postgres {
    type Database = sqlx::Postgres;
    const NAME: &'static str = "postgres";
    const NOW_MILLIS: &'static str = "(extract(epoch FROM now()) * 1000)::bigint";
    const NUMBERED: bool = true;
    const SKIP_LOCKED: &'static str = "FOR UPDATE SKIP LOCKED";

    /// `"schema"."table"`, or `"table"` found through `search_path`.
    fn qualify(table: &TableName) -> Result<String, sqlx::Error> {
        Ok(match table.schema() {
            Some(s) => format!("\"{s}\".\"{}\"", table.table()),
            None => format!("\"{}\"", table.table()),
        })
    }

    /// By SQLSTATE: class `08` (connection exception), `57P01`–`57P03`
    /// (shutdown, crash, cannot connect now), `53300` (too many
    /// connections), `25006` (a read-only transaction: the server is a
    /// standby, as just after a failover, or read-only for now), `57014`
    /// (the statement ran past `statement_timeout`), `25P03` and `57P05`
    /// (a session cut for idling) are [`ErrorClass::Unavailable`];
    /// `55P03` (a lock not had within `lock_timeout`)
    /// [`ErrorClass::RetryTransaction`]; `23505` a unique
    /// violation; `42P01` a missing table; `40001` (serialization) and
    /// `40P01` (deadlock) [`ErrorClass::RetryTransaction`]; the rest of
    /// class `42` (permission, unknown column, syntax) and class `28`
    /// (authorization) [`ErrorClass::Fatal`].
    fn classify(e: &sqlx::Error) -> ErrorClass {
        let sqlx::Error::Database(d) = e else {
            return super::classify_io(e);
        };
        let Some(code) = d.code() else {
            return ErrorClass::Other;
        };
        match code.as_ref() {
            c if c.starts_with("08") => ErrorClass::Unavailable,
            "57P01" | "57P02" | "57P03" | "53300" | "25006" | "57014" | "25P03" | "57P05" => {
                ErrorClass::Unavailable
            }
            "55P03" => ErrorClass::RetryTransaction,
            "23505" => ErrorClass::UniqueViolation,
            "42P01" => ErrorClass::MissingTable,
            "40001" | "40P01" => ErrorClass::RetryTransaction,
            c if c.starts_with("42") || c.starts_with("28") => ErrorClass::Fatal,
            _ => ErrorClass::Other,
        }
    }

    /// `55P03`, `lock_timeout` run out.
    fn is_lock_timeout(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03"))
    }

    fn begin_write(
        pool: &sqlx::PgPool,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error>> {
        super::begin_detached(pool, None)
    }

    fn begin_write_bounded(
        pool: &sqlx::PgPool,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error>> {
        // At least a millisecond (0 would turn the bound off), at most what
        // the setting holds. (An integer: nothing else reaches the text.
        // Should the `SET` ever fail after the `BEGIN` succeeded, sqlx
        // would not count the transaction it left open; with a valid
        // integer it cannot fail.)
        match i32::try_from(timeout.as_millis().max(1)) {
            Ok(ms) => super::begin_detached(
                pool,
                Some(format!("BEGIN; SET LOCAL statement_timeout = {ms}").into()),
            ),
            Err(_) => super::begin_detached(pool, None),
        }
    }

    /// In one transaction, under an advisory lock per schema (creating the
    /// schema and the version table is shared by every table of it: two
    /// first deployments racing on them would otherwise meet a unique
    /// violation in the catalog).
    fn migrate<'a>(
        pool: &'a sqlx::PgPool,
        table: &'a TableName,
        migrations: &'a [Migration],
    ) -> BoxFuture<'a, Result<(), MigrateError>> {
        Box::pin(async move {
            let db = MigrateError::database(table);
            let versions =
                Self::qualify(&TableName::new(table.schema(), VERSION_TABLE).map_err(|e| {
                    MigrateError::Misconfigured {
                        table: table.to_string(),
                        reason: e.to_string(),
                    }
                })?)
                .map_err(&db)?;
            // Up to date (the common start): nothing to lock or run.
            if crate::migrate::is_current::<Self>(pool, &versions, table, migrations).await {
                return Ok(());
            }
            let mut tx = pool.begin().await.map_err(&db)?;
            let staged = async {
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                    .bind(format!(
                        "idem-migrate-schema:{}",
                        table.schema().unwrap_or("")
                    ))
                    .execute(&mut *tx)
                    .await
                    .map_err(&db)?;
                // Once the runners' lock is held: a DDL statement waits for
                // the transactions using its table, and every later
                // statement on the table waits behind it, so the wait is
                // bounded (an upgrade behind a long transaction fails, to
                // be run again by the next start).
                sqlx::query(&format!(
                    "SET LOCAL lock_timeout = '{}s'",
                    crate::migrate::MIGRATION_DDL_WAIT_SECS
                ))
                .execute(&mut *tx)
                .await
                .map_err(&db)?;
                let mut script = String::new();
                if let Some(s) = table.schema() {
                    script.push_str(&format!("CREATE SCHEMA IF NOT EXISTS \"{s}\";\n"));
                }
                script.push_str(&format!(
                    "CREATE TABLE IF NOT EXISTS {versions} (
                        table_name text        NOT NULL,
                        version    bigint      NOT NULL,
                        checksum   text,
                        applied_at timestamptz NOT NULL DEFAULT now(),
                        PRIMARY KEY (table_name, version)
                    );
                    ALTER TABLE {versions} ADD COLUMN IF NOT EXISTS checksum text;"
                ));
                Self::run_script(&mut tx, &script).await.map_err(&db)?;
                let sql = VersionSql::<Self>::new(&versions, "now()");
                apply::<Self>(&mut tx, &sql, table, migrations).await
            }
            .await;
            super::finish_migration(tx, staged, table).await
        })
    }

    dialect_io!(Postgres, sqlx::Postgres);

    fn placeholder(n: usize) -> Cow<'static, str> {
        Cow::Owned(format!("${n}"))
    }
}
