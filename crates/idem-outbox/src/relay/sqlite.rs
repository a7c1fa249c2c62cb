//! The outbox on SQLite.

use std::time::Duration;

use idem_core::BoxFuture;
use sqlx::sqlite::SqlitePool;

use super::{claimed_row, millis, Claimed, OutboxBackend, Wakeups};
use crate::outbox::now_ms;

/// The outbox on SQLite: one writer at a time (so one relay per database
/// is enough), times from this process's clock, no notifications (the
/// application calls [`Relay::wake`] after its commit, or the relay polls).
pub(super) struct Sqlite(pub(super) SqlitePool);

impl OutboxBackend for Sqlite {
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(
                "UPDATE idem_outbox
                 SET claimed_until = $2 + $3, claim_token = $4, attempts = attempts + 1
                 WHERE seq IN (
                     SELECT c.seq FROM idem_outbox c
                     WHERE c.state = 'pending' AND c.next_attempt_at <= $2
                       AND (c.claimed_until IS NULL OR c.claimed_until < $2)
                       AND (c.ordering_key IS NULL OR NOT EXISTS (
                            SELECT 1 FROM idem_outbox p
                            WHERE p.ordering_key = c.ordering_key AND p.state = 'pending' AND p.seq < c.seq))
                     ORDER BY c.seq
                     LIMIT $1)
                 RETURNING seq, message_id, destination, ordering_key, payload, headers, attempts",
            )
            .bind(batch)
            .bind(now_ms())
            .bind(millis(lease))
            .bind(token)
            .fetch_all(&self.0)
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
            let oldest: Option<i64> = sqlx::query_scalar(
                "SELECT min(created_at) FROM idem_outbox WHERE state = 'pending'",
            )
            .fetch_one(&self.0)
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
            sqlx::query(
                "UPDATE idem_outbox SET claimed_until = NULL, last_error = $3,
                     next_attempt_at = $4,
                     state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
                 WHERE seq = $1 AND claim_token = $2",
            )
            .bind(seq)
            .bind(token)
            .bind(error)
            .bind(now_ms().saturating_add(millis(backoff)))
            .bind(dead)
            .execute(&self.0)
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
            sqlx::query(
                "UPDATE idem_outbox SET state = 'sent', sent_at = $3, claimed_until = NULL
                 WHERE seq IN (SELECT value FROM json_each($1)) AND claim_token = $2",
            )
            .bind(list)
            .bind(token)
            .bind(now_ms())
            .execute(&self.0)
            .await
            .map(drop)
        })
    }

    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        Box::pin(async { None })
    }
}
