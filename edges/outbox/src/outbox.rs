//! The transactional outbox (PostgreSQL): messages enqueued inside the
//! business transaction, published by a relay after they commit, marked
//! sent only once the broker confirmed them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_sql::migrate::Migration;
use sqlx::postgres::{PgListener, PgPool};
use sqlx::sqlite::SqlitePool;
use sqlx::Row;
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// The channel `enqueue` notifies on commit, and relays listen to.
pub const NOTIFY_CHANNEL: &str = "idem_outbox";

/// The outbox table's migrations on PostgreSQL, in order.
pub const POSTGRES_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/postgres/0001_outbox.sql"),
}];

/// The outbox table's migrations on SQLite, in order.
pub const SQLITE_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/sqlite/0001_outbox.sql"),
}];

/// Creates or upgrades the outbox table on SQLite (see
/// [`idem_sql::migrate`]).
pub async fn migrate_sqlite(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_sqlite(pool, "idem_outbox", SQLITE_MIGRATIONS).await
}

/// Enqueues a message inside the caller's SQLite transaction; see
/// [`enqueue`]. SQLite has no `NOTIFY`: call [`Relay::wake`] after the
/// commit for prompt delivery (the relay polls otherwise).
pub async fn enqueue_sqlite(
    conn: &mut sqlx::SqliteConnection,
    message: &OutgoingMessage,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&message.message_id)
    .bind(&message.destination)
    .bind(&message.ordering_key)
    .bind(message.payload.as_ref())
    .bind(encode_headers(&message.headers))
    .bind(now_ms())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

fn now_ms() -> i64 {
    idem_core::UnixMillis::now().0
}

/// Creates or upgrades the outbox table on PostgreSQL, in the search
/// path's first schema (see [`idem_sql::migrate`]).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_postgres(pool, None, "idem_outbox", POSTGRES_MIGRATIONS).await
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The id consumers deduplicate on; sent to the broker as its message id.
    pub message_id: String,
    /// Where it goes (a RabbitMQ routing key, a NATS subject, a queue name).
    pub destination: String,
    /// Messages with the same key are published in enqueue order, one at a
    /// time; `None`: no ordering.
    pub ordering_key: Option<String>,
    /// The body.
    pub payload: Bytes,
    /// Headers carried to the broker.
    pub headers: Vec<(String, String)>,
}

fn encode_headers(headers: &[(String, String)]) -> Vec<u8> {
    idem_core::StoredResponse {
        status: 0,
        headers: headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect(),
        body: Bytes::new(),
    }
    .encode_headers()
}

fn decode_headers(bytes: &[u8]) -> Vec<(String, String)> {
    idem_core::StoredResponse::decode_headers(bytes)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect()
}

/// Enqueues a message inside the caller's transaction: it is published
/// only if, and after, the transaction commits. A `message_id` enqueued
/// twice is a unique violation (`idem_outbox_message_id_key`).
pub async fn enqueue(
    conn: &mut sqlx::PgConnection,
    message: &OutgoingMessage,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(&message.message_id)
    .bind(&message.destination)
    .bind(&message.ordering_key)
    .bind(message.payload.as_ref())
    .bind(encode_headers(&message.headers))
    .execute(&mut *conn)
    .await?;
    // Delivered to listening relays when (and only if) the transaction commits.
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(NOTIFY_CHANNEL)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Why a publish failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PublishError(pub String);

/// Sends messages to a broker. `publish` returns one result per message, in
/// order; `Ok` only once the broker confirmed the message (publisher
/// confirms, JetStream acks).
pub trait Publisher: Send + Sync + 'static {
    /// Publishes a batch.
    fn publish<'a>(
        &'a self,
        batch: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), PublishError>>>;
}

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

/// A relay over the outbox table. Several may run at once: each claims rows
/// with `FOR UPDATE SKIP LOCKED` under a lease, so in the normal case no row
/// is published twice; rows of a relay that died are claimed again after
/// the lease (consumers' inboxes absorb that duplicate). Rows are claimed by
/// lease, not past a moving offset, so a row that commits late behind a
/// higher sequence number is never skipped.
#[derive(Clone)]
pub struct Relay {
    db: Backend,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    wake: Arc<tokio::sync::Notify>,
}

/// Where the outbox lives.
#[derive(Clone, Debug)]
enum Backend {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A claimed row.
#[derive(Debug)]
struct Claimed {
    seq: i64,
    attempts: i32,
    message: OutgoingMessage,
}

impl Relay {
    /// A relay publishing a PostgreSQL outbox through `publisher`.
    pub fn new(pool: PgPool, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
        Self::with_backend(Backend::Postgres(pool), publisher, config)
    }

    /// A relay publishing a SQLite outbox through `publisher`. SQLite has
    /// one writer at a time, so one relay per database is enough.
    pub fn sqlite(pool: SqlitePool, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
        Self::with_backend(Backend::Sqlite(pool), publisher, config)
    }

    fn with_backend(db: Backend, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Self {
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

    async fn claim(&self, token: i64) -> Result<Vec<Claimed>, sqlx::Error> {
        let rows = match &self.db {
            Backend::Postgres(pool) => self.claim_postgres(pool, token).await?,
            Backend::Sqlite(pool) => self.claim_sqlite(pool, token).await?,
        };
        Ok(rows)
    }

    async fn claim_sqlite(
        &self,
        pool: &SqlitePool,
        token: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let now = now_ms();
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
        .bind(self.config.batch)
        .bind(now)
        .bind(i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX))
        .bind(token)
        .fetch_all(pool)
        .await?;
        let mut claimed = rows
            .iter()
            .map(|r| -> Result<Claimed, sqlx::Error> {
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
            })
            .collect::<Result<Vec<_>, _>>()?;
        claimed.sort_by_key(|c| c.seq);
        Ok(claimed)
    }

    async fn claim_postgres(&self, pool: &PgPool, token: i64) -> Result<Vec<Claimed>, sqlx::Error> {
        // Only the oldest pending row of each ordering key is claimable, so
        // a key's messages go out one after another, in order.
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
        .bind(self.config.batch)
        .bind(i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX))
        .bind(token)
        .fetch_all(pool)
        .await?;
        let mut claimed: Vec<Claimed> = rows
            .iter()
            .map(|r| -> Result<Claimed, sqlx::Error> {
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
            })
            .collect::<Result<_, _>>()?;
        claimed.sort_by_key(|c| c.seq);
        Ok(claimed)
    }

    /// Claims one batch, publishes it, and marks what the broker confirmed.
    pub async fn round(&self) -> Result<Round, sqlx::Error> {
        let token = idem_core::FencingToken::generate().0;
        let claimed = self.claim(token).await?;
        if claimed.is_empty() {
            metrics::gauge!("idem_outbox_lag_seconds").set(0.0);
            return Ok(Round::default());
        }
        metrics::gauge!("idem_outbox_lag_seconds").set(self.lag().await.unwrap_or(0.0));
        let batch: Vec<OutgoingMessage> = claimed.iter().map(|c| c.message.clone()).collect();
        let results = self.publisher.publish(&batch).await;
        let mut sent = Vec::new();
        let mut round = Round::default();
        for (c, result) in claimed
            .iter()
            .zip(results.into_iter().chain(std::iter::repeat_with(|| {
                Err(PublishError(
                    "the publisher returned fewer results than messages".into(),
                ))
            })))
        {
            match result {
                Ok(()) => sent.push(c.seq),
                Err(e) => {
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
                    self.mark_failed(c.seq, token, &e.0, backoff, dead).await?;
                }
            }
        }
        if !sent.is_empty() {
            self.mark_sent(&sent, token).await?;
            metrics::counter!("idem_outbox_published_total").increment(sent.len() as u64);
        }
        round.sent = sent.len();
        Ok(round)
    }

    /// How long the oldest pending row has waited, in seconds.
    async fn lag(&self) -> Result<f64, sqlx::Error> {
        let lag: Option<f64> = match &self.db {
            Backend::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM idem_outbox WHERE state = 'pending'",
                )
                .fetch_one(pool)
                .await?
            }
            Backend::Sqlite(pool) => {
                let oldest: Option<i64> =
                    sqlx::query_scalar("SELECT min(created_at) FROM idem_outbox WHERE state = 'pending'")
                        .fetch_one(pool)
                        .await?;
                oldest.map(|ms| (now_ms() - ms) as f64 / 1000.0)
            }
        };
        Ok(lag.unwrap_or(0.0).max(0.0))
    }

    async fn mark_failed(
        &self,
        seq: i64,
        token: i64,
        error: &str,
        backoff: Duration,
        dead: bool,
    ) -> Result<(), sqlx::Error> {
        let backoff = i64::try_from(backoff.as_millis()).unwrap_or(60_000);
        match &self.db {
            Backend::Postgres(pool) => {
                sqlx::query(
                    "UPDATE idem_outbox SET claimed_until = NULL, last_error = $3,
                         next_attempt_at = now() + $4 * interval '1 millisecond',
                         state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
                     WHERE seq = $1 AND claim_token = $2",
                )
                .bind(seq)
                .bind(token)
                .bind(error)
                .bind(backoff)
                .bind(dead)
                .execute(pool)
                .await?;
            }
            Backend::Sqlite(pool) => {
                sqlx::query(
                    "UPDATE idem_outbox SET claimed_until = NULL, last_error = $3,
                         next_attempt_at = $4,
                         state = CASE WHEN $5 THEN 'dead' ELSE 'pending' END
                     WHERE seq = $1 AND claim_token = $2",
                )
                .bind(seq)
                .bind(token)
                .bind(error)
                .bind(now_ms() + backoff)
                .bind(dead)
                .execute(pool)
                .await?;
            }
        }
        Ok(())
    }

    async fn mark_sent(&self, seqs: &[i64], token: i64) -> Result<(), sqlx::Error> {
        match &self.db {
            Backend::Postgres(pool) => {
                sqlx::query(
                    "UPDATE idem_outbox SET state = 'sent', sent_at = now(), claimed_until = NULL
                     WHERE seq = ANY($1) AND claim_token = $2",
                )
                .bind(seqs)
                .bind(token)
                .execute(pool)
                .await?;
            }
            Backend::Sqlite(pool) => {
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
                .execute(pool)
                .await?;
            }
        }
        Ok(())
    }

    /// Runs until `stop` turns true: woken by `LISTEN` on commit, polling as
    /// a fallback; a full batch is followed at once by the next round. The
    /// round in progress when `stop` flips finishes first.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> Result<(), sqlx::Error> {
        let mut listener = match &self.db {
            Backend::Postgres(pool) => match PgListener::connect_with(pool).await {
                Ok(mut l) => match l.listen(NOTIFY_CHANNEL).await {
                    Ok(()) => Some(l),
                    Err(e) => {
                        warn!(error = %e, "LISTEN failed; polling only");
                        None
                    }
                },
                Err(e) => {
                    warn!(error = %e, "no listener connection; polling only");
                    None
                }
            },
            Backend::Sqlite(_) => None,
        };
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
                match listener.as_mut() {
                    Some(l) => {
                        let _ = tokio::time::timeout(self.config.poll, l.recv()).await;
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

/// Counts of the outbox by state, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxStats {
    /// Waiting to be published (or retried).
    pub pending: i64,
    /// Published and confirmed.
    pub sent: i64,
    /// Failed too often; an operator must look.
    pub dead: i64,
}

const STATS: &str =
    "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'sent'),
        count(*) FILTER (WHERE state = 'dead') FROM idem_outbox";

/// Counts rows by state (PostgreSQL).
pub async fn stats(pool: &PgPool) -> Result<OutboxStats, sqlx::Error> {
    let (pending, sent, dead): (i64, i64, i64) = sqlx::query_as(STATS).fetch_one(pool).await?;
    Ok(OutboxStats {
        pending,
        sent,
        dead,
    })
}

/// Counts rows by state (SQLite).
pub async fn stats_sqlite(pool: &SqlitePool) -> Result<OutboxStats, sqlx::Error> {
    let (pending, sent, dead): (i64, i64, i64) = sqlx::query_as(STATS).fetch_one(pool).await?;
    Ok(OutboxStats {
        pending,
        sent,
        dead,
    })
}

const DEAD: &str = "SELECT message_id, destination, attempts, last_error FROM idem_outbox
     WHERE state = 'dead' ORDER BY seq LIMIT $1";

/// A dead-lettered row: (message id, destination, attempts, last error).
pub type DeadLetter = (String, String, i32, Option<String>);

/// The dead-lettered rows (PostgreSQL).
pub async fn dead_letters(pool: &PgPool, limit: i64) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(DEAD).bind(limit).fetch_all(pool).await
}

/// The dead-lettered rows (SQLite).
pub async fn dead_letters_sqlite(
    pool: &SqlitePool,
    limit: i64,
) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(DEAD).bind(limit).fetch_all(pool).await
}
