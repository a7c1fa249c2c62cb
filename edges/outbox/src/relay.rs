//! The relay: claims committed outbox rows under a lease, publishes them,
//! and marks what the broker confirmed. The table's backend is one
//! [`OutboxBackend`] implementation per database; the relay's logic is
//! written once above them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::BoxFuture;
use sqlx::postgres::{PgListener, PgPool};
use sqlx::sqlite::SqlitePool;
use sqlx::Row;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::outbox::{decode_headers, now_ms, OutgoingMessage, PublishError, Publisher};

/// The channel `enqueue` notifies on commit, and relays listen to.
pub const NOTIFY_CHANNEL: &str = "idem_outbox";

/// How a relay behaves.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Rows claimed and published per round.
    pub batch: i64,
    /// How long a claim lasts before another relay may take the rows (a
    /// relay that died mid-batch).
    pub lease: Duration,
    /// How often to look for rows when no notification came.
    pub poll: Duration,
    /// Attempts before a row goes to the dead-letter state.
    pub max_attempts: i32,
    /// The first retry delay; it doubles with each attempt, up to a minute.
    pub backoff: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 500,
            lease: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            max_attempts: 10,
            backoff: Duration::from_millis(200),
        }
    }
}

/// What one round of the relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Rows published and marked sent.
    pub sent: usize,
    /// Rows whose publish failed (retried later, or dead-lettered).
    pub failed: usize,
}

/// A claimed row.
#[derive(Debug)]
pub(crate) struct Claimed {
    seq: i64,
    attempts: i32,
    message: OutgoingMessage,
}

fn claimed_row<R>(r: &R) -> Result<Claimed, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(Claimed {
        seq: r.try_get("seq")?,
        attempts: r.try_get("attempts")?,
        message: OutgoingMessage {
            message_id: r.try_get("message_id")?,
            destination: r.try_get("destination")?,
            ordering_key: r.try_get("ordering_key")?,
            payload: Bytes::from(r.try_get::<Vec<u8>, _>("payload")?),
            headers: decode_headers(&r.try_get::<Vec<u8>, _>("headers")?),
        },
    })
}

/// Wakes a relay when a transaction that enqueued rows commits.
pub(crate) trait Wakeups: Send {
    /// Resolves at the next notification (or when the source fails).
    fn next(&mut self) -> BoxFuture<'_, ()>;
}

impl Wakeups for PgListener {
    fn next(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.recv().await;
        })
    }
}

/// Where an outbox table lives: the statements a relay needs, one
/// implementation per database.
pub(crate) trait OutboxBackend: Send + Sync + 'static {
    /// Claims up to `batch` publishable rows (pending, due, not leased, the
    /// oldest of their ordering key) under `token` for `lease`, oldest first.
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>>;
    /// How long the oldest pending row has waited, in seconds.
    fn lag(&self) -> BoxFuture<'_, Result<f64, sqlx::Error>>;
    /// Puts a row whose publish failed back (after `backoff`), or in the
    /// dead-letter state; fenced by `token`.
    fn mark_failed<'a>(
        &'a self,
        seq: i64,
        token: i64,
        error: &'a str,
        backoff: Duration,
        dead: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Marks rows the broker confirmed as sent; fenced by `token`.
    fn mark_sent<'a>(
        &'a self,
        seqs: &'a [i64],
        token: i64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Commit notifications, where the database has them.
    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>>;
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The outbox on PostgreSQL: rows claimed with `FOR UPDATE SKIP LOCKED`,
/// times from the database's clock, `LISTEN` for wake-ups.
struct Postgres(PgPool);

impl OutboxBackend for Postgres {
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(async move {
            // Only the oldest pending row of each ordering key is claimable,
            // so a key's messages go out one after another, in order.
            let rows = sqlx::query(
                "UPDATE idem_outbox o
                 SET claimed_until = now() + $2 * interval '1 millisecond', claim_token = $3, attempts = o.attempts + 1
                 WHERE o.seq IN (
                     SELECT c.seq FROM idem_outbox c
                     WHERE c.state = 'pending' AND c.next_attempt_at <= now()
                       AND (c.claimed_until IS NULL OR c.claimed_until < now())
                       AND (c.ordering_key IS NULL OR NOT EXISTS (
                            SELECT 1 FROM idem_outbox p
                            WHERE p.ordering_key = c.ordering_key AND p.state = 'pending' AND p.seq < c.seq))
                     ORDER BY c.seq
                     LIMIT $1
                     FOR UPDATE SKIP LOCKED)
                 RETURNING o.seq, o.message_id, o.destination, o.ordering_key, o.payload, o.headers, o.attempts",
            )
            .bind(batch)
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
            let lag: Option<f64> = sqlx::query_scalar(
                "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM idem_outbox WHERE state = 'pending'",
            )
            .fetch_one(&self.0)
            .await?;
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
            sqlx::query(
                "UPDATE idem_outbox SET claimed_until = NULL, last_error = $3,
                     next_attempt_at = now() + $4 * interval '1 millisecond',
                     state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
                 WHERE seq = $1 AND claim_token = $2",
            )
            .bind(seq)
            .bind(token)
            .bind(error)
            .bind(millis(backoff))
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
            sqlx::query(
                "UPDATE idem_outbox SET state = 'sent', sent_at = now(), claimed_until = NULL
                 WHERE seq = ANY($1) AND claim_token = $2",
            )
            .bind(seqs)
            .bind(token)
            .execute(&self.0)
            .await
            .map(drop)
        })
    }

    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        Box::pin(async move {
            let mut listener = match PgListener::connect_with(&self.0).await {
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

/// The outbox on SQLite: one writer at a time (so one relay per database
/// is enough), times from this process's clock, no notifications (the
/// application calls [`Relay::wake`] after its commit, or the relay polls).
struct Sqlite(SqlitePool);

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

/// A relay over the outbox table. Several may run at once: each claims rows
/// with `FOR UPDATE SKIP LOCKED` under a lease, so in the normal case no row
/// is published twice; rows of a relay that died are claimed again after
/// the lease (consumers' inboxes absorb that duplicate). Rows are claimed by
/// lease, not past a moving offset, so a row that commits late behind a
/// higher sequence number is never skipped.
#[derive(Clone)]
pub struct Relay {
    db: Arc<dyn OutboxBackend>,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    wake: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay publishing a PostgreSQL outbox through `publisher`.
    pub fn new(pool: PgPool, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
        Self::with_backend(Arc::new(Postgres(pool)), publisher, config)
    }

    /// A relay publishing a SQLite outbox through `publisher`. SQLite has
    /// one writer at a time, so one relay per database is enough.
    pub fn sqlite(pool: SqlitePool, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
        Self::with_backend(Arc::new(Sqlite(pool)), publisher, config)
    }

    fn with_backend(
        db: Arc<dyn OutboxBackend>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Self {
        Self {
            db,
            publisher,
            config,
            wake: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Wakes the running relay at once (after a commit that enqueued
    /// messages), instead of at its next poll. PostgreSQL relays are also
    /// woken by `NOTIFY`.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Claims one batch, publishes it, and marks what the broker confirmed.
    pub async fn round(&self) -> Result<Round, sqlx::Error> {
        let token = idem_core::FencingToken::generate().0;
        let claimed = self
            .db
            .claim(self.config.batch, self.config.lease, token)
            .await?;
        if claimed.is_empty() {
            metrics::gauge!("idem_outbox_lag_seconds").set(0.0);
            return Ok(Round::default());
        }
        let lag = self.db.lag().await.unwrap_or(0.0).max(0.0);
        metrics::gauge!("idem_outbox_lag_seconds").set(lag);
        let batch: Vec<OutgoingMessage> = claimed.iter().map(|c| c.message.clone()).collect();
        let published = self.publisher.publish(&batch).await;
        let mut sent = Vec::new();
        let mut round = Round::default();
        for c in &claimed {
            let outcome = published
                .get(&c.message.message_id)
                .cloned()
                .unwrap_or_else(|| {
                    Err(PublishError(
                        "the publisher said nothing of this message".into(),
                    ))
                });
            let Err(e) = outcome else {
                sent.push(c.seq);
                continue;
            };
            round.failed += 1;
            let dead = c.attempts >= self.config.max_attempts;
            let backoff = self
                .config
                .backoff
                .saturating_mul(1u32 << (c.attempts.clamp(1, 16) - 1) as u32)
                .min(Duration::from_secs(60));
            if dead {
                metrics::counter!("idem_outbox_dead_lettered_total").increment(1);
                warn!(message_id = %c.message.message_id, attempts = c.attempts, error = %e, "outbox row dead-lettered");
            } else {
                debug!(message_id = %c.message.message_id, error = %e, ?backoff, "publish failed; backing off");
            }
            self.db
                .mark_failed(c.seq, token, &e.0, backoff, dead)
                .await?;
        }
        if !sent.is_empty() {
            self.db.mark_sent(&sent, token).await?;
            metrics::counter!("idem_outbox_published_total").increment(sent.len() as u64);
        }
        round.sent = sent.len();
        Ok(round)
    }

    /// Runs until `stop` turns true: woken by `LISTEN` on commit, polling as
    /// a fallback; a full batch is followed at once by the next round. The
    /// round in progress when `stop` flips finishes first.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> Result<(), sqlx::Error> {
        let mut wakeups = self.db.wakeups().await;
        info!("outbox relay started");
        loop {
            if *stop.borrow() {
                info!("outbox relay stopped");
                return Ok(());
            }
            let round = match self.round().await {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %e, "relay round failed; retrying");
                    Round::default()
                }
            };
            if round.sent + round.failed >= self.config.batch as usize {
                continue;
            }
            let wait = async {
                match wakeups.as_mut() {
                    Some(w) => {
                        let _ = tokio::time::timeout(self.config.poll, w.next()).await;
                    }
                    None => tokio::time::sleep(self.config.poll).await,
                }
            };
            tokio::select! {
                () = wait => {}
                () = self.wake.notified() => {}
                _ = stop.changed() => {}
            }
        }
    }
}
