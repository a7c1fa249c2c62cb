//! The outbox on SQLite.

use std::time::Duration;

use idem_core::BoxFuture;
use sqlx::sqlite::SqlitePool;

use super::{claimed_row, millis, Claimed, OutboxBackend, Wakeups};
use crate::outbox::{now_ms, OutboxTable};

/// The outbox on SQLite: one writer at a time (so one relay per database
/// is enough), times from this process's clock, no notifications (the
/// application calls [`Relay::wake`] after its commit, or the relay polls).
pub(super) struct Sqlite {
    pool: SqlitePool,
    /// The statements rendered for the table, or why they cannot be (a
    /// schema-qualified table), reported by each call.
    sql: Result<Statements, String>,
}

struct Statements {
    claim: String,
    lag: String,
    mark_failed: String,
    mark_sent: String,
    check: String,
}

impl Sqlite {
    pub(super) fn new(pool: SqlitePool, table: &OutboxTable) -> Self {
        let sql = crate::db::sqlite_table(table.name())
            .map(|t| {
                let r = |sql: &str| sql.replace("{table}", &t);
                Statements {
                    claim: r(CLAIM),
                    lag: r("SELECT min(created_at) FROM {table} WHERE state = 'pending'"),
                    mark_failed: r("UPDATE {table} SET claimed_until = NULL, last_error = $3,
                         next_attempt_at = $4,
                         state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
                     WHERE seq = $1 AND claim_token = $2"),
                    mark_sent: r(
                        "UPDATE {table} SET state = 'sent', sent_at = $3, claimed_until = NULL
                     WHERE seq IN (SELECT value FROM json_each($1)) AND claim_token = $2",
                    ),
                    check: r("SELECT 1 FROM {table} LIMIT 0"),
                }
            })
            .map_err(|e| e.to_string());
        Self { pool, sql }
    }

    fn sql(&self) -> Result<&Statements, sqlx::Error> {
        self.sql
            .as_ref()
            .map_err(|e| sqlx::Error::Configuration(e.clone().into()))
    }
}

const CLAIM: &str = "UPDATE {table}
     SET claimed_until = $2 + $3, claim_token = $4, attempts = attempts + 1
     WHERE seq IN (
         SELECT c.seq FROM {table} c
         WHERE c.state = 'pending' AND c.next_attempt_at <= $2
           AND (c.claimed_until IS NULL OR c.claimed_until < $2)
           AND (c.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {table} p
                WHERE p.ordering_key = c.ordering_key AND p.state = 'pending' AND p.seq < c.seq))
         ORDER BY c.seq
         LIMIT $1)
     RETURNING seq, message_id, destination, ordering_key, payload, headers, attempts";

impl OutboxBackend for Sqlite {
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(&self.sql()?.claim)
                .bind(batch)
                .bind(now_ms())
                .bind(millis(lease))
                .bind(token)
                .fetch_all(&self.pool)
                .await?;
            let mut claimed = rows
                .iter()
                .map(claimed_row)
                .collect::<Result<Vec<_>, _>>()?;
            claimed.sort_by_key(|c| c.seq);
            Ok(claimed)
        })
    }

    fn lag(&self) -> BoxFuture<'_, Result<f64, sqlx::Error>> {
        Box::pin(async move {
            let oldest: Option<i64> = sqlx::query_scalar(&self.sql()?.lag)
                .fetch_one(&self.pool)
                .await?;
            Ok(oldest.map_or(0.0, |ms| (now_ms() - ms) as f64 / 1000.0))
        })
    }

    fn mark_failed<'a>(
        &'a self,
        seq: i64,
        token: i64,
        error: &'a str,
        backoff: Duration,
        dead: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&self.sql()?.mark_failed)
                .bind(seq)
                .bind(token)
                .bind(error)
                .bind(now_ms().saturating_add(millis(backoff)))
                .bind(dead)
                .execute(&self.pool)
                .await
                .map(drop)
        })
    }

    fn mark_sent<'a>(
        &'a self,
        seqs: &'a [i64],
        token: i64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            // SQLite has no arrays: the sequence numbers go as a JSON list.
            let list = format!(
                "[{}]",
                seqs.iter()
                    .map(i64::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            );
            sqlx::query(&self.sql()?.mark_sent)
                .bind(list)
                .bind(token)
                .bind(now_ms())
                .execute(&self.pool)
                .await
                .map(drop)
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&self.sql()?.check)
                .execute(&self.pool)
                .await
                .map(drop)
        })
    }

    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        Box::pin(async { None })
    }
}
