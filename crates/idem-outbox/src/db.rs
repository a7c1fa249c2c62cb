//! [`OutboxDialect`]: the outbox's and the inbox's statements on each
//! database idem runs on, as typed fields; everything else about the
//! database (transactions, table names, migrations, errors, the clock,
//! `SKIP LOCKED`) is [`idem_sql::Dialect`]'s.

use idem_core::BoxFuture;
use idem_sql::dialect::Pool;
use idem_sql::migrate::Migration;
use idem_sql::{Dialect, Driver, MigrateError, TableName};

use crate::relay::Wakeups;

mod sealed {
    pub trait Sealed {}
}

/// The outbox's statements, templates for [`idem_sql::Statement::prepare`].
#[derive(Debug)]
#[doc(hidden)]
pub struct OutboxSql {
    pub(crate) migrations: &'static [Migration],
    /// $1 message id, $2 destination, $3 ordering key, $4 payload, $5
    /// headers.
    pub(crate) enqueue: &'static str,
    /// Run after `enqueue` in the same transaction, where the database
    /// can wake relays on commit.
    pub(crate) notify: Option<&'static str>,
    /// The publishable rows (pending, due, not leased, the oldest of their
    /// ordering key), oldest first, locked: $1 batch.
    pub(crate) claimable: &'static str,
    /// Leases the rows `{seqs}` lists: $1 token, $2 lease (ms).
    pub(crate) lease: &'static str,
    /// How long the oldest pending row (by seq, so the pending index
    /// finds it at once) has waited, in ms; no row when none is pending.
    pub(crate) lag: &'static str,
    /// A row whose publish failed, back after $4 ms or dead: $1 seq, $2
    /// token, $3 last error, $4 backoff (ms), $5 state.
    pub(crate) mark_failed: &'static str,
    /// The rows `{seqs}` lists that are still leased under $1 token: sent
    /// (found by primary key, never by scanning for the token).
    pub(crate) mark_sent: &'static str,
    /// Deletes sent rows sent more than $1 ms ago (the database's clock),
    /// oldest first, at most $2.
    pub(crate) sweep_sent: &'static str,
    /// Counts `pending`, `sent`, `dead`.
    pub(crate) stats: &'static str,
    /// The dead rows, oldest first: $1 limit.
    pub(crate) dead: &'static str,
}

/// The inbox's statements.
#[derive(Debug)]
#[doc(hidden)]
pub struct InboxSql {
    pub(crate) migrations: &'static [Migration],
    /// $1 consumer, $2 message id, $3 now (ms).
    pub(crate) mark: &'static str,
    /// $1 cut-off (ms), $2 batch.
    pub(crate) sweep: &'static str,
}

/// A database the outbox and the inbox run on: SQLite, PostgreSQL or
/// MySQL (each behind this crate's feature of the same name). Sealed.
pub trait OutboxDialect: Dialect + sealed::Sealed {
    /// The outbox's statements.
    #[doc(hidden)]
    const OUTBOX: OutboxSql;
    /// The inbox's statements.
    #[doc(hidden)]
    const INBOX: InboxSql;

    /// Commit notifications, where the database has them (PostgreSQL's
    /// `LISTEN`).
    #[doc(hidden)]
    fn wakeups(pool: &Pool<Self>) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        let _ = pool;
        Box::pin(async { None })
    }
}

#[allow(unused_macros)] // without a database feature
macro_rules! claimable {
    ($clock:literal, $columns:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM {table} c WHERE ",
            "c.state = 'pending' AND c.next_attempt_at <= ",
            $clock,
            " AND (c.claimed_until IS NULL OR c.claimed_until < ",
            $clock,
            ") AND (c.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {table} p
                WHERE p.ordering_key = c.ordering_key AND p.state = 'pending' AND p.seq < c.seq))
             ORDER BY c.seq LIMIT $1 {skip_locked}"
        )
    };
}

/// The statements SQLite and MySQL share: times in milliseconds of the
/// database's clock (`{now}`), written once for both.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
mod millis {
    pub(super) const ENQUEUE: &str = "INSERT INTO {table}
                      (message_id, destination, ordering_key, payload, headers, created_at, next_attempt_at)
                  VALUES ($1, $2, $3, $4, $5, {now}, {now})";
    pub(super) const CLAIMABLE: &str = claimable!(
        "{now}",
        "c.seq, c.message_id, c.destination, c.ordering_key, c.payload, c.headers, c.attempts + 1 AS attempts"
    );
    pub(super) const LEASE: &str =
        "UPDATE {table} SET claimed_until = {now} + $2, claim_token = $1, attempts = attempts + 1
                WHERE seq IN ({seqs})";
    pub(super) const LAG: &str = "SELECT {now} - created_at AS lag FROM {table}
                WHERE state = 'pending' ORDER BY seq LIMIT 1";
    pub(super) const MARK_FAILED: &str =
        "UPDATE {table} SET claimed_until = NULL, claim_token = NULL, last_error = $3,
                          next_attempt_at = {now} + $4, state = $5, attempts = attempts - $6
                      WHERE seq = $1 AND claim_token = $2";
    pub(super) const MARK_SENT: &str =
        "UPDATE {table} SET state = 'sent', sent_at = {now}, claimed_until = NULL
                    WHERE seq IN ({seqs}) AND claim_token = $1 AND state = 'pending'";
}

/// What every database's outbox and inbox say alike.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
const DEAD: &str = "SELECT message_id, destination, attempts, last_error FROM {table}
               WHERE state = 'dead' ORDER BY seq LIMIT $1";
const MARK: &str = "INSERT INTO {table} (consumer, message_id, processed_at) VALUES ($1, $2, $3)";

#[cfg(feature = "postgres")]
impl sealed::Sealed for idem_sql::Postgres {}

#[cfg(feature = "postgres")]
impl OutboxDialect for idem_sql::Postgres {
    const OUTBOX: OutboxSql = OutboxSql {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../migrations/postgres/outbox_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../migrations/postgres/outbox_0002.sql"),
            },
        ],
        enqueue: "INSERT INTO {table} (message_id, destination, ordering_key, payload, headers)
                  VALUES ($1, $2, $3, $4, $5)",
        notify: Some("SELECT pg_notify('idem_outbox', '')"),
        claimable: claimable!(
            "now()",
            "c.seq, c.message_id, c.destination, c.ordering_key, c.payload, c.headers, c.attempts::int8 + 1 AS attempts"
        ),
        lease: "UPDATE {table} SET claimed_until = now() + $2 * interval '1 millisecond',
                    claim_token = $1, attempts = attempts + 1
                WHERE seq IN ({seqs})",
        lag: "SELECT (extract(epoch FROM now() - created_at) * 1000)::int8 AS lag
              FROM {table} WHERE state = 'pending' ORDER BY seq LIMIT 1",
        mark_failed: "UPDATE {table} SET claimed_until = NULL, claim_token = NULL, last_error = $3,
                          next_attempt_at = now() + $4 * interval '1 millisecond', state = $5,
                          attempts = attempts - $6
                      WHERE seq = $1 AND claim_token = $2",
        mark_sent: "UPDATE {table} SET state = 'sent', sent_at = now(), claimed_until = NULL
                    WHERE seq IN ({seqs}) AND claim_token = $1 AND state = 'pending'",
        sweep_sent: "DELETE FROM {table} WHERE seq IN (
                         SELECT seq FROM {table}
                         WHERE state = 'sent' AND sent_at < now() - $1 * interval '1 millisecond'
                         ORDER BY sent_at LIMIT $2)",
        stats: "SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
                       count(*) FILTER (WHERE state = 'sent') AS sent,
                       count(*) FILTER (WHERE state = 'dead') AS dead FROM {table}",
        dead: "SELECT message_id, destination, attempts::int8 AS attempts, last_error FROM {table}
               WHERE state = 'dead' ORDER BY seq LIMIT $1",
    };
    const INBOX: InboxSql = InboxSql {
        migrations: &[Migration {
            version: 1,
            sql: include_str!("../migrations/inbox_0001.sql"),
        }],
        mark: MARK,
        sweep: "DELETE FROM {table} WHERE (consumer, message_id) IN (
                    SELECT consumer, message_id FROM {table}
                    WHERE processed_at <= $1 ORDER BY processed_at LIMIT $2)",
    };

    fn wakeups(pool: &Pool<Self>) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        Box::pin(crate::relay::listen(pool))
    }
}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for idem_sql::Sqlite {}

#[cfg(feature = "sqlite")]
impl OutboxDialect for idem_sql::Sqlite {
    const OUTBOX: OutboxSql = OutboxSql {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../migrations/sqlite/outbox_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../migrations/sqlite/outbox_0002.sql"),
            },
            Migration {
                version: 3,
                sql: include_str!("../migrations/sqlite/outbox_0003.sql"),
            },
        ],
        enqueue: millis::ENQUEUE,
        notify: None,
        claimable: millis::CLAIMABLE,
        lease: millis::LEASE,
        lag: millis::LAG,
        mark_failed: millis::MARK_FAILED,
        mark_sent: millis::MARK_SENT,
        sweep_sent: "DELETE FROM {table} WHERE seq IN (
                         SELECT seq FROM {table} WHERE state = 'sent' AND sent_at < {now} - $1
                         ORDER BY sent_at LIMIT $2)",
        stats: "SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
                       count(*) FILTER (WHERE state = 'sent') AS sent,
                       count(*) FILTER (WHERE state = 'dead') AS dead FROM {table}",
        dead: DEAD,
    };
    const INBOX: InboxSql = InboxSql {
        migrations: &[Migration {
            version: 1,
            sql: include_str!("../migrations/inbox_0001.sql"),
        }],
        mark: MARK,
        sweep: "DELETE FROM {table} WHERE rowid IN (
                    SELECT rowid FROM {table}
                    WHERE processed_at <= $1 ORDER BY processed_at LIMIT $2)",
    };
}

#[cfg(feature = "mysql")]
impl sealed::Sealed for idem_sql::MySql {}

#[cfg(feature = "mysql")]
impl OutboxDialect for idem_sql::MySql {
    const OUTBOX: OutboxSql = OutboxSql {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../migrations/mysql/outbox_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../migrations/mysql/outbox_0002.sql"),
            },
        ],
        enqueue: millis::ENQUEUE,
        notify: None,
        claimable: millis::CLAIMABLE,
        lease: millis::LEASE,
        lag: millis::LAG,
        mark_failed: millis::MARK_FAILED,
        mark_sent: millis::MARK_SENT,
        sweep_sent: "DELETE FROM {table} WHERE state = 'sent' AND sent_at < {now} - $1
                     ORDER BY sent_at LIMIT $2",
        stats: "SELECT CAST(COALESCE(SUM(state = 'pending'), 0) AS SIGNED) AS pending,
                       CAST(COALESCE(SUM(state = 'sent'), 0) AS SIGNED) AS sent,
                       CAST(COALESCE(SUM(state = 'dead'), 0) AS SIGNED) AS dead FROM {table}",
        dead: DEAD,
    };
    const INBOX: InboxSql = InboxSql {
        migrations: &[Migration {
            version: 1,
            sql: include_str!("../migrations/mysql/inbox_0001.sql"),
        }],
        mark: MARK,
        sweep: "DELETE FROM {table} WHERE processed_at <= $1 ORDER BY processed_at LIMIT $2",
    };
}

/// Applies `migrations` to `name` on `pool` (see [`idem_sql::migrate`]).
pub(crate) async fn migrate<DB: Driver>(
    pool: &sqlx::Pool<DB>,
    name: &TableName,
    migrations: &[Migration],
) -> Result<(), MigrateError> {
    idem_sql::migrate::migrate::<DB::Dialect>(pool, name, migrations).await
}

#[cfg(all(test, feature = "sqlite"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use idem_sql::Dialect;

    use super::OutboxDialect;

    /// SQLite's plan for each of the relay's statements, on the default
    /// table: what it searches and by which index.
    async fn plan(pool: &sqlx::SqlitePool, template: &str) -> String {
        let sql = template
            .replace("{table}", "\"idem_outbox\"")
            .replace("{now}", idem_sql::Sqlite::NOW_MILLIS)
            .replace("{skip_locked}", idem_sql::Sqlite::SKIP_LOCKED)
            .replace("{seqs}", "1, 2, 3");
        let rows: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(&format!("EXPLAIN QUERY PLAN {sql}"))
                .fetch_all(pool)
                .await
                .unwrap();
        rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("\n")
    }

    /// The relay's statements cost what their rows cost, not what the
    /// table holds: a backlog of pending rows, or years of sent ones, must
    /// not slow each round (a relay that falls behind must not fall
    /// further behind).
    #[tokio::test]
    async fn the_relays_statements_on_sqlite_search_by_index_never_scan() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        crate::outbox::migrate(&pool).await.unwrap();
        let sql = <idem_sql::Sqlite as OutboxDialect>::OUTBOX;
        for (what, template) in [
            ("claimable", sql.claimable),
            ("lease", sql.lease),
            ("lag", sql.lag),
            ("mark_sent", sql.mark_sent),
            ("sweep_sent", sql.sweep_sent),
        ] {
            let plan = plan(&pool, template).await;
            assert!(
                !plan.lines().any(|l| l.starts_with("SCAN")),
                "{what} scans the table:\n{plan}"
            );
            assert!(!plan.contains("TEMP B-TREE"), "{what} sorts:\n{plan}");
        }
        // An older pending row of the same ordering key is found by the
        // key, not by walking every older pending row.
        let claimable = plan(&pool, sql.claimable).await;
        assert!(
            claimable.contains("idem_outbox_ordering (ordering_key=? AND seq<?)"),
            "{claimable}"
        );
        // The sweep reads only the rows sent before its cut-off, in order.
        let sweep = plan(&pool, sql.sweep_sent).await;
        assert!(
            sweep.contains("idem_outbox_sent (state=? AND sent_at<?)"),
            "{sweep}"
        );
        pool.close().await;
    }
}

/// The sweep on the servers: by the index of sent rows, never a walk of
/// every sent row kept (which, once a tick, cost what the table holds when
/// nothing was due yet); and MySQL's migration of that index runs again
/// after a cut before its version row was written.
#[cfg(all(test, feature = "postgres", feature = "mysql"))]
#[allow(clippy::unwrap_used)]
mod server_tests {
    use idem_sql::dialect::Statement;
    use idem_sql::{Dialect, TableName};
    use idem_test_support::mysql::TestDatabase;
    use idem_test_support::postgres::TestSchema;
    use sqlx::Row;

    use super::OutboxDialect;

    fn sweep<D: OutboxDialect>() -> String {
        let table = TableName::new(None, "idem_outbox").unwrap();
        Statement::<D>::prepare(D::OUTBOX.sweep_sent, &table)
            .unwrap()
            .sql()
            .to_owned()
    }

    #[tokio::test]
    async fn the_sweep_on_postgres_reads_the_sent_index() {
        let schema = TestSchema::create("idem_outbox_plan").await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&schema.url())
            .await
            .unwrap();
        crate::outbox::migrate(&pool).await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        // An empty table is read whole whatever its indexes: the planner
        // is told to prefer them, as it does once the table is large.
        sqlx::query("SET enable_seqscan = off")
            .execute(&mut *conn)
            .await
            .unwrap();
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN {}", sweep::<idem_sql::Postgres>()))
                .bind(1000_i64)
                .bind(500_i64)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("idem_outbox_sent"), "{plan}");
        assert!(!plan.contains("Sort"), "{plan}");
        drop(conn);
        pool.close().await;
    }

    #[tokio::test]
    async fn the_sweep_on_mysql_reads_the_sent_index_and_its_migration_runs_again() {
        let db = TestDatabase::create("idem_outbox_plan").await;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&db.url())
            .await
            .unwrap();
        crate::outbox::migrate(&pool).await.unwrap();
        // Rows sent a moment ago (none due), as a busy outbox holds; the
        // statistics then tell the plans apart.
        for batch in 0..20 {
            let values: Vec<String> = (0..200)
                .map(|n| {
                    format!(
                        "('m-{batch}-{n}', 'd', x'7b7d', x'', 'sent', 0, {now}, {now})",
                        now = idem_sql::MySql::NOW_MILLIS
                    )
                })
                .collect();
            sqlx::query(&format!(
                "INSERT INTO idem_outbox (message_id, destination, payload, headers, state, \
                 next_attempt_at, created_at, sent_at) VALUES {}",
                values.join(", ")
            ))
            .execute(&pool)
            .await
            .unwrap();
        }
        sqlx::query("ANALYZE TABLE idem_outbox")
            .execute(&pool)
            .await
            .unwrap();
        let rows = sqlx::query(&format!("EXPLAIN {}", sweep::<idem_sql::MySql>()))
            .bind(1000_i64)
            .bind(500_i64)
            .fetch_all(&pool)
            .await
            .unwrap();
        let keys: Vec<Option<String>> = rows
            .iter()
            .map(|r| r.try_get::<Option<String>, _>("key").unwrap())
            .collect();
        assert_eq!(keys, [Some("idem_outbox_sent".to_owned())]);
        // Cut off after the index, before its version row: the next run
        // finds the index there and records the version.
        sqlx::query(
            "DELETE FROM idem_schema_migrations WHERE table_name = 'idem_outbox' AND version = 2",
        )
        .execute(&pool)
        .await
        .unwrap();
        crate::outbox::migrate(&pool).await.unwrap();
        let versions: Vec<i64> = sqlx::query_scalar(
            "SELECT version FROM idem_schema_migrations WHERE table_name = 'idem_outbox' ORDER BY version",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(versions, [1, 2]);
        pool.close().await;
    }
}

/// Runs one writing `statement` in a transaction of its own, begun as the
/// dialect begins writes (MySQL: READ COMMITTED, so a sweep's scan locks
/// only the rows it deletes, not every row and gap it reads past, which
/// under the server's default REPEATABLE READ held the relay's marks and
/// the business's enqueues), and commits it; how many rows it changed.
pub(crate) async fn write_once<DB>(
    pool: &sqlx::Pool<DB>,
    statement: &idem_sql::dialect::Statement<DB::Dialect>,
    args: &[idem_sql::dialect::Arg<'_>],
) -> Result<u64, sqlx::Error>
where
    DB: idem_sql::Driver,
    DB::Dialect: OutboxDialect,
{
    use idem_sql::Dialect;
    let mut tx = DB::Dialect::begin_write(pool).await?;
    match DB::Dialect::execute(&mut tx, statement, args).await {
        Ok(n) => {
            tx.commit().await?;
            Ok(n)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}
