//! The relay: claims committed outbox rows under a lease, publishes them,
//! and marks what the broker confirmed. The table's backend is one
//! [`OutboxBackend`] implementation per database; the relay's logic is
//! written once above them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::BoxFuture;
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;
use sqlx::Row;
use tokio::sync::watch;
use tracing::{debug, info, warn};

mod postgres;
mod sqlite;

use postgres::Postgres;
use sqlite::Sqlite;

use crate::outbox::{decode_headers, OutgoingMessage, PublishError, Publisher};

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

pub(super) fn claimed_row<R>(r: &R) -> Result<Claimed, sqlx::Error>
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

pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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
