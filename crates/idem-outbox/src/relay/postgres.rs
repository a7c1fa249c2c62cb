//! The outbox on PostgreSQL.

use std::time::Duration;

use idem_core::BoxFuture;
use sqlx::postgres::{PgListener, PgPool};
use tracing::warn;

use super::{claimed_row, millis, Claimed, OutboxBackend, Wakeups, NOTIFY_CHANNEL};
use crate::outbox::OutboxTable;

impl Wakeups for PgListener {
    fn next(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.recv().await;
        })
    }
}

/// The outbox on PostgreSQL: rows claimed with `FOR UPDATE SKIP LOCKED`,
/// times from the database's clock, `LISTEN` for wake-ups. The statements
/// are rendered for the table once.
pub(super) struct Postgres {
    pool: PgPool,
    claim: String,
    lag: String,
    mark_failed: String,
    mark_sent: String,
    check: String,
}

impl Postgres {
    pub(super) fn new(pool: PgPool, table: &OutboxTable) -> Self {
        let t = table.name().qualified();
        let r = |sql: &str| sql.replace("{table}", &t);
        Self {
            pool,
            claim: r(CLAIM),
            lag: r("SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {table} WHERE state = 'pending'"),
            mark_failed: r(MARK_FAILED),
            mark_sent: r("UPDATE {table} SET state = 'sent', sent_at = now(), claimed_until = NULL
                 WHERE seq = ANY($1) AND claim_token = $2"),
            check: r("SELECT 1 FROM {table} LIMIT 0"),
        }
    }
}

// Only the oldest pending row of each ordering key is claimable, so a key's
// messages go out one after another, in order.
const CLAIM: &str = "UPDATE {table} o
     SET claimed_until = now() + $2 * interval '1 millisecond', claim_token = $3, attempts = o.attempts + 1
     WHERE o.seq IN (
         SELECT c.seq FROM {table} c
         WHERE c.state = 'pending' AND c.next_attempt_at <= now()
           AND (c.claimed_until IS NULL OR c.claimed_until < now())
           AND (c.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {table} p
                WHERE p.ordering_key = c.ordering_key AND p.state = 'pending' AND p.seq < c.seq))
         ORDER BY c.seq
         LIMIT $1
         FOR UPDATE SKIP LOCKED)
     RETURNING o.seq, o.message_id, o.destination, o.ordering_key, o.payload, o.headers, o.attempts";

const MARK_FAILED: &str = "UPDATE {table} SET claimed_until = NULL, last_error = $3,
         next_attempt_at = now() + $4 * interval '1 millisecond',
         state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
     WHERE seq = $1 AND claim_token = $2";

impl OutboxBackend for Postgres {
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(&self.claim)
                .bind(batch)
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
            let lag: Option<f64> = sqlx::query_scalar(&self.lag).fetch_one(&self.pool).await?;
            Ok(lag.unwrap_or(0.0))
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
            sqlx::query(&self.mark_failed)
                .bind(seq)
                .bind(token)
                .bind(error)
                .bind(millis(backoff))
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
            sqlx::query(&self.mark_sent)
                .bind(seqs)
                .bind(token)
                .execute(&self.pool)
                .await
                .map(drop)
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move { sqlx::query(&self.check).execute(&self.pool).await.map(drop) })
    }

    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        Box::pin(async move {
            let mut listener = match PgListener::connect_with(&self.pool).await {
                Ok(l) => l,
                Err(e) => {
                    warn!(error = %e, "no listener connection; polling only");
                    return None;
                }
            };
            match listener.listen(NOTIFY_CHANNEL).await {
                Ok(()) => Some(Box::new(listener) as Box<dyn Wakeups>),
                Err(e) => {
                    warn!(error = %e, "LISTEN failed; polling only");
                    None
                }
            }
        })
    }
}
