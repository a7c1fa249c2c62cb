//! The relay: claims committed outbox rows under a lease, publishes them,
//! and marks what the broker confirmed. Written once, for every
//! [`OutboxDialect`]: what differs between databases is their statements
//! (`crate::db`) and [`idem_sql::Dialect`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::BoxFuture;
use idem_sql::{Driver, ErrorClass};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

mod sql;

#[cfg(feature = "postgres")]
pub(crate) use sql::listen;
use sql::{OutboxBackend, SqlOutbox};

use crate::db::OutboxDialect;
use crate::outbox::{
    OutboxTable, OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher,
};

/// The channel `enqueue` notifies on commit, and relays listen to.
pub const NOTIFY_CHANNEL: &str = "idem_outbox";

/// How a relay behaves.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The outbox table it publishes (default `idem_outbox`).
    pub table: OutboxTable,
    /// Rows claimed and published per round (at least one: a smaller
    /// figure is taken as one).
    pub batch: i64,
    /// How long a claim lasts before another relay may take the rows (a
    /// relay that died mid-batch).
    pub lease: Duration,
    /// How often to look for rows when no notification came.
    pub poll: Duration,
    /// Failed publishes before a row goes to the dead-letter state. A
    /// broker that is down ([`PublishErrorKind::BrokerDown`]: its connection
    /// lost or refused, no answer in time) uses up no attempt: the row
    /// waits for it, however long.
    pub max_attempts: i32,
    /// The first retry delay; it doubles with each attempt (while the
    /// broker is down: with each step of the outage, one per step's own
    /// wait), up to a minute.
    pub backoff: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            table: OutboxTable::default(),
            batch: 500,
            lease: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            max_attempts: 10,
            backoff: Duration::from_millis(200),
        }
    }
}

/// Why a relay stopped, or a round failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox table does not exist (not migrated, or migrated into
    /// another schema or database than the relay reads): nothing enqueued
    /// would ever be published, so [`Relay::run`] stops with this at once
    /// instead of polling forever.
    #[error("the outbox table {table} does not exist here: run outbox::migrate (or OutboxTable::migrate) against the database the relay reads")]
    MissingTable {
        /// The table the relay looked for.
        table: String,
        /// The database's words.
        #[source]
        source: sqlx::Error,
    },
    /// The relay cannot work as configured (a schema-qualified table on
    /// SQLite): [`Relay::run`] stops with this at once.
    #[error("the outbox relay is misconfigured")]
    Misconfigured(#[source] sqlx::Error),
    /// The database refused the relay's statements in a way waiting cannot
    /// mend (permission denied, an unknown column: a table of that name
    /// that is not an outbox): [`Relay::run`] stops with this, reported,
    /// instead of retrying forever.
    #[error("the outbox relay cannot use its table")]
    Fatal(#[source] sqlx::Error),
    /// The database failed (the relay retries it; [`Relay::round`] reports
    /// it).
    #[error("the outbox could not be read or written")]
    Database(#[source] sqlx::Error),
}

impl RelayError {
    /// Whether [`Relay::run`] stops on it rather than retry: waiting cannot
    /// mend it.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Self::MissingTable { .. } | Self::Misconfigured(_) | Self::Fatal(_)
        )
    }

    /// What kind of failure it is, as the metrics label it.
    pub fn kind(&self) -> RelayErrorKind {
        match self {
            Self::MissingTable { .. } => RelayErrorKind::MissingTable,
            Self::Misconfigured(_) => RelayErrorKind::Misconfigured,
            Self::Fatal(_) => RelayErrorKind::Fatal,
            Self::Database(_) => RelayErrorKind::Database,
        }
    }
}

/// The kinds of [`RelayError`], the `error` label of
/// `idem_outbox_relay_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelayErrorKind {
    /// [`RelayError::MissingTable`].
    MissingTable,
    /// [`RelayError::Misconfigured`].
    Misconfigured,
    /// [`RelayError::Fatal`].
    Fatal,
    /// [`RelayError::Database`].
    Database,
}

impl RelayErrorKind {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::MissingTable => "missing_table",
            Self::Misconfigured => "misconfigured",
            Self::Fatal => "fatal",
            Self::Database => "database",
        }
    }
}

/// Where an outbox row stands after a failed publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowState {
    /// To be tried again after its backoff.
    Pending,
    /// Given up on: an operator must look.
    Dead,
}

impl RowState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Dead => "dead",
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

/// Wakes a relay when a transaction that enqueued rows commits.
#[doc(hidden)]
pub trait Wakeups: Send {
    /// Resolves at the next notification (or when the source fails).
    fn next(&mut self) -> BoxFuture<'_, ()>;
}

/// A relay over an outbox table (SQLite, PostgreSQL or MySQL). Several may
/// run at once: each claims rows with `FOR UPDATE SKIP LOCKED` under a
/// lease, so in the normal case no row
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
    looked: Arc<std::sync::Mutex<Looked>>,
    /// How long each destination has been unreachable, in backoff steps:
    /// the step grows at most once per its own backoff of wall time, so a
    /// batch after batch of failures in one blip does not jump to the
    /// longest wait. Per destination: one queue whose broker side is stuck
    /// (a quorum queue without its majority) backs off as its outage goes
    /// on while the others flow, where one outage for all was ended by any
    /// other row sent and kept the stuck one's rows at the first wait, in
    /// nearly every batch.
    outage: Arc<std::sync::Mutex<HashMap<String, Outage>>>,
}

/// A destination's outage not stepped for this long is forgotten (its
/// rows are no longer tried: sent, dead-lettered or deleted).
const FORGET_OUTAGE_AFTER: Duration = Duration::from_secs(3600);

/// How long the broker has been away (see [`Relay`]'s `outage`).
#[derive(Debug, Clone, Copy, Default)]
struct Outage {
    /// Backoff steps so far.
    steps: u32,
    /// When the last step was taken.
    since: Option<Instant>,
}

/// What the relay last saw of its table: when it looked, and how long the
/// oldest pending row had waited then (`None`: no row was pending).
#[derive(Debug, Clone, Copy)]
struct Looked {
    at: Instant,
    oldest: Option<Duration>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay publishing the outbox `config.table` of `pool` (SQLite,
    /// PostgreSQL or MySQL) through `publisher`. On SQLite, which has one
    /// writer at a time, one relay per database is enough.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use idem_outbox::outbox::{Relay, RelayConfig};
    /// use idem_outbox::transport::InProcess;
    /// # async fn f(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    /// let (stop, stopped) = tokio::sync::watch::channel(false);
    /// let relay = Relay::new(&pool, Arc::new(InProcess::new()), RelayConfig::default());
    /// let running = tokio::spawn(relay.clone().run(stopped));
    /// // … enqueue in your transactions, relay.wake() after each commit …
    /// stop.send(true)?;
    /// running.await??; // a missing outbox table ends run() with an error
    /// # Ok(()) }
    /// ```
    pub fn new<DB>(
        pool: &sqlx::Pool<DB>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Self
    where
        DB: Driver,
        DB::Dialect: OutboxDialect,
    {
        // A batch of none would loop with nothing to wait on (`0 >= 0`);
        // a negative one is no limit on SQLite.
        let config = RelayConfig {
            batch: config.batch.max(1),
            ..config
        };
        let backend = SqlOutbox::<DB::Dialect>::new(pool.clone(), &config.table);
        Self {
            db: Arc::new(backend),
            publisher,
            config,
            wake: Arc::new(tokio::sync::Notify::new()),
            outage: Arc::default(),
            looked: Arc::new(std::sync::Mutex::new(Looked {
                at: Instant::now(),
                oldest: None,
            })),
        }
    }

    /// How far behind the relay may be: how long the oldest message still
    /// waiting in the outbox has waited, as of now. Read from what the
    /// relay saw at the start of its last round, plus the time since, so it
    /// keeps growing while a round hangs or no round runs: when the last
    /// look found nothing pending, it is the time since that look (what a
    /// message enqueued just after it has waited at most). A relay that has
    /// never run a round reports the time since it was made. Clones share
    /// it. Also the gauge `idem_outbox_lag_seconds`, set at each round.
    pub fn lag(&self) -> Duration {
        let looked = *self.looked.lock().unwrap_or_else(|e| e.into_inner());
        looked.oldest.unwrap_or_default() + looked.at.elapsed()
    }

    /// `destination`'s absence so far.
    fn outage(&self, destination: &str) -> Outage {
        self.outage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(destination)
            .copied()
            .unwrap_or_default()
    }

    /// Wakes the running relay at once (after a commit that enqueued
    /// messages), instead of at its next poll. PostgreSQL relays are also
    /// woken by `NOTIFY`.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// The error for `e`, by what the database says it is.
    fn error(&self, e: sqlx::Error) -> RelayError {
        if matches!(e, sqlx::Error::Configuration(_)) {
            return RelayError::Misconfigured(e);
        }
        match self.db.classify(&e) {
            ErrorClass::MissingTable => RelayError::MissingTable {
                table: self.config.table.name().to_string(),
                source: e,
            },
            ErrorClass::Fatal => RelayError::Fatal(e),
            _ => RelayError::Database(e),
        }
    }

    /// Claims one batch, publishes it, and marks what the broker confirmed.
    pub async fn round(&self) -> Result<Round, RelayError> {
        self.round_inner().await.map_err(|e| self.error(e))
    }

    async fn round_inner(&self) -> Result<Round, sqlx::Error> {
        let token = idem_core::FencingToken::generate().0;
        // Every round looks at the oldest pending row first, whether or not
        // it can claim it: rows backing off after failed publishes, or
        // leased by another relay, are waiting too.
        let at = Instant::now();
        let oldest = self.db.lag().await?;
        *self.looked.lock().unwrap_or_else(|e| e.into_inner()) = Looked { at, oldest };
        metrics::gauge!("idem_outbox_lag_seconds").set(oldest.unwrap_or_default().as_secs_f64());
        let claimed = self
            .db
            .claim(self.config.batch, self.config.lease, token)
            .await?;
        if claimed.is_empty() {
            return Ok(Round::default());
        }
        let batch: Vec<OutgoingMessage> = claimed.iter().map(|c| c.message.clone()).collect();
        // A broker that takes the messages but never confirms (a memory or
        // disk alarm blocks its connection) must not hold the round past
        // its lease, nor a shutdown: what is unconfirmed by half the lease
        // is let go, to be sent again (the inboxes absorb a copy).
        let wait = self.config.lease / 2;
        let published = match tokio::time::timeout(wait, self.publisher.publish(&batch)).await {
            Ok(published) => published,
            Err(_) => {
                let mut none = Published::default();
                for m in &batch {
                    none.record(
                        &m.message_id,
                        Err(PublishError::new(
                            PublishErrorKind::BrokerDown,
                            format!("no confirmation within {} ms", wait.as_millis()),
                        )),
                    );
                }
                none
            }
        };
        let mut sent = Vec::new();
        let mut round = Round::default();
        // The destinations a row reached, and those only the broker's
        // absence kept rows from.
        let mut reached: HashSet<&str> = HashSet::new();
        let mut unreachable: HashSet<&str> = HashSet::new();
        for c in &claimed {
            let outcome = published
                .get(&c.message.message_id)
                .cloned()
                .unwrap_or_else(|| {
                    Err(PublishError::other(
                        "the publisher said nothing of this message",
                    ))
                });
            let destination = c.message.destination.as_str();
            let Err(e) = outcome else {
                sent.push(c.seq);
                reached.insert(destination);
                continue;
            };
            round.failed += 1;
            // A broker that is down is waited for however long it takes
            // (backing off as the outage goes on): otherwise a restart of a
            // few minutes would turn every row into a dead letter. Every
            // other failure uses up an attempt.
            let counted = e.kind() != PublishErrorKind::BrokerDown;
            let dead = counted && c.attempts >= i64::from(self.config.max_attempts);
            let streak = if counted {
                c.attempts
            } else {
                unreachable.insert(destination);
                i64::from(self.outage(destination).steps) + 1
            };
            let backoff = self
                .config
                .backoff
                .saturating_mul(1u32 << (streak.clamp(1, 16) - 1) as u32)
                .min(Duration::from_secs(60));
            if dead {
                metrics::counter!("idem_outbox_dead_lettered_total").increment(1);
                warn!(message_id = %c.message.message_id, attempts = c.attempts, error = %e, "outbox row dead-lettered");
            } else {
                debug!(message_id = %c.message.message_id, error = %e, ?backoff, "publish failed; backing off");
            }
            let state = if dead {
                RowState::Dead
            } else {
                RowState::Pending
            };
            self.db
                .mark_failed(c.seq, token, &e.to_string(), backoff, state, counted)
                .await?;
        }
        // A destination the round could not reach: the backoff of its rows
        // grows with the outage's length in time (one step per step's own
        // wait), not with the number of batches that failed. One it reached
        // is back.
        {
            let mut outages = self.outage.lock().unwrap_or_else(|e| e.into_inner());
            for destination in &reached {
                outages.remove(*destination);
            }
            // One not tried for an hour (its rows sent elsewhere, dead,
            // deleted) is forgotten: the map holds what is failing now.
            outages.retain(|_, o| o.since.is_some_and(|at| at.elapsed() < FORGET_OUTAGE_AFTER));
            for destination in unreachable.difference(&reached) {
                let outage = outages.entry((*destination).to_owned()).or_default();
                let step = self
                    .config
                    .backoff
                    .saturating_mul(1u32 << outage.steps.min(16))
                    .min(Duration::from_secs(60));
                if outage.since.is_none_or(|at| at.elapsed() >= step) {
                    outage.steps = outage.steps.saturating_add(1);
                    outage.since = Some(Instant::now());
                }
            }
        }
        if !sent.is_empty() {
            // The rows whose publish failed were let go above: what is
            // still leased under the token is what the broker confirmed.
            self.db.mark_sent(token, &sent).await?;
            metrics::counter!("idem_outbox_published_total").increment(sent.len() as u64);
        }
        round.sent = sent.len();
        Ok(round)
    }

    /// Runs until `stop` turns true: woken by `LISTEN` on commit, polling as
    /// a fallback; a full batch that sent something is followed at once by
    /// the next round (one whose every row failed waits for the poll, or a
    /// wake: a broker that is down is not walked through the whole backlog
    /// back to back). The round in progress when `stop` flips finishes
    /// first.
    ///
    /// A round that fails is retried after the poll interval (logged, and counted
    /// in `idem_outbox_relay_errors_total`). A missing outbox table is not
    /// waited out: `run` returns [`RelayError::MissingTable`] at once, at
    /// start or whenever a round meets it, so a relay pointed at the wrong
    /// database fails loudly even without a tracing subscriber.
    pub async fn run(self, mut stop: watch::Receiver<bool>) -> Result<(), RelayError> {
        if let Err(e) = self.db.check().await {
            let e = self.error(e);
            if e.is_fatal() {
                metrics::counter!("idem_outbox_relay_errors_total", "error" => e.kind().label())
                    .increment(1);
                error!(error = %e, "outbox relay cannot start");
                return Err(e);
            }
            // Anything else (the database is down) is waited out below.
        }
        let mut wakeups = self.db.wakeups().await;
        info!(table = %self.config.table.name(), "outbox relay started");
        loop {
            if *stop.borrow() {
                info!("outbox relay stopped");
                return Ok(());
            }
            let mut failed_round = false;
            let round = match self.round().await {
                Ok(r) => r,
                Err(e) if e.is_fatal() => {
                    metrics::counter!("idem_outbox_relay_errors_total", "error" => e.kind().label())
                        .increment(1);
                    error!(error = %e, "outbox relay stopped");
                    return Err(e);
                }
                Err(e) => {
                    metrics::counter!("idem_outbox_relay_errors_total", "error" => e.kind().label())
                        .increment(1);
                    warn!(error = %e, "relay round failed; retrying");
                    failed_round = true;
                    Round::default()
                }
            };
            if round.sent > 0 && round.sent + round.failed >= self.config.batch as usize {
                continue;
            }
            let wait = async {
                match wakeups.as_mut() {
                    // After a failed round, the whole interval: a
                    // listener failing as fast (the database away) would
                    // end the wait at once.
                    Some(w) if !failed_round => {
                        let _ = tokio::time::timeout(self.config.poll, w.next()).await;
                    }
                    _ => tokio::time::sleep(self.config.poll).await,
                }
            };
            tokio::select! {
                () = wait => {}
                () = self.wake.notified() => {}
                changed = stop.changed() => if changed.is_err() {
                    // The sender is gone: nobody can ask for a stop any
                    // more, and `changed` would answer at once from now on
                    // (rounds back to back). A dropped sender is a stop.
                    info!("outbox relay stopped: its stop signal was dropped");
                    return Ok(());
                }
            }
        }
    }
}
