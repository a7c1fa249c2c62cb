//! The relay's statements on one outbox table, for any [`OutboxDialect`].

use std::time::Duration;

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_sql::dialect::{Arg, Pool, Row, Statement, Value};
use idem_sql::{Dialect, ErrorClass};

use super::{RowState, Wakeups};
use crate::db::OutboxDialect;
use crate::message::decode_headers;
use crate::outbox::{OutboxTable, OutgoingMessage};

/// A claimed row.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) seq: i64,
    /// Counting this one.
    pub(crate) attempts: i64,
    pub(crate) message: OutgoingMessage,
}

/// What a relay does with its table, whichever the database: the dyn
/// face of [`SqlOutbox`], so that [`super::Relay`] names no database.
pub(crate) trait OutboxBackend: Send + Sync + 'static {
    /// Claims up to `batch` publishable rows (pending, due, not leased, the
    /// oldest of their ordering key) under `token` for `lease`, oldest
    /// first.
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>>;
    /// How long the oldest pending row has waited; `None` when no row is
    /// pending.
    fn lag(&self) -> BoxFuture<'_, Result<Option<Duration>, sqlx::Error>>;
    /// Lets a row whose publish failed go: back after `backoff`, or dead;
    /// fenced by `token`. A failure not `counted` does not use up one of
    /// the row's attempts.
    fn mark_failed<'a>(
        &'a self,
        seq: i64,
        token: i64,
        error: &'a str,
        backoff: Duration,
        state: RowState,
        counted: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Marks the rows `seqs` still leased under `token` as sent.
    fn mark_sent<'a>(
        &'a self,
        token: i64,
        seqs: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Reads the table (no rows), so a missing one shows at start.
    fn check(&self) -> BoxFuture<'_, Result<(), sqlx::Error>>;
    /// Commit notifications, where the database has them.
    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>>;
    /// What a failed statement means.
    fn classify(&self, e: &sqlx::Error) -> ErrorClass;
}

/// The statements made for the table once; or why they cannot be (a
/// schema-qualified table on SQLite), reported by each call.
struct Statements<D> {
    claimable: Statement<D>,
    lag: Statement<D>,
    mark_failed: Statement<D>,
    check: Statement<D>,
}

/// The outbox on database `D`.
pub(crate) struct SqlOutbox<D: OutboxDialect> {
    pool: Pool<D>,
    table: OutboxTable,
    sql: Result<Statements<D>, String>,
}

impl<D: OutboxDialect> SqlOutbox<D> {
    pub(crate) fn new(pool: Pool<D>, table: &OutboxTable) -> Self {
        let t = D::OUTBOX;
        let sql = (|| {
            Ok::<_, sqlx::Error>(Statements {
                claimable: table.statement(t.claimable)?,
                lag: table.statement(t.lag)?,
                mark_failed: table.statement(t.mark_failed)?,
                check: table.statement("SELECT 1 FROM {table} LIMIT 0")?,
            })
        })()
        .map_err(|e| e.to_string());
        Self {
            pool,
            table: table.clone(),
            sql,
        }
    }

    fn sql(&self) -> Result<&Statements<D>, sqlx::Error> {
        self.sql
            .as_ref()
            .map_err(|e| sqlx::Error::Configuration(e.clone().into()))
    }

    /// In one write transaction: the claimable rows, locked (skipping rows
    /// another relay holds), then leased to `token`.
    /// `template` for the rows `seqs`: the seqs are the database's own
    /// integers, written into the statement rather than bound, so one
    /// statement (finding its rows by primary key) serves the batch.
    fn for_rows(&self, template: &str, seqs: &[i64]) -> Result<Statement<D>, sqlx::Error> {
        let list: Vec<String> = seqs.iter().map(i64::to_string).collect();
        self.table
            .statement::<D>(&template.replace("{seqs}", &list.join(", ")))
    }

    async fn claim_batch(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let sql = self.sql()?;
        let mut tx = D::begin_write(&self.pool).await?;
        let staged = async {
            let rows = D::fetch_all(&mut tx, &sql.claimable, &[Arg::Int(batch)]).await?;
            let claimed = rows
                .iter()
                .map(claimed_row::<D>)
                .collect::<Result<Vec<_>, _>>()?;
            if claimed.is_empty() {
                return Ok(claimed);
            }
            let seqs: Vec<i64> = claimed.iter().map(|c| c.seq).collect();
            let lease_rows = self.for_rows(D::OUTBOX.lease, &seqs)?;
            D::execute(
                &mut tx,
                &lease_rows,
                &[Arg::Int(token), Arg::Int(millis(lease))],
            )
            .await?;
            Ok(claimed)
        }
        .await;
        idem_sql::finish(tx, staged).await
    }
}

fn claimed_row<D: Dialect>(row: &Row<D>) -> Result<Claimed, sqlx::Error> {
    let get = |c: &str| D::get(row, c);
    Ok(Claimed {
        seq: get("seq")?.int("seq")?,
        attempts: get("attempts")?.int("attempts")?,
        message: OutgoingMessage {
            message_id: get("message_id")?.text("message_id")?,
            destination: get("destination")?.text("destination")?,
            ordering_key: match get("ordering_key")? {
                Value::Null => None,
                v => Some(v.text("ordering_key")?),
            },
            payload: Bytes::from(get("payload")?.bytes("payload")?),
            headers: decode_headers(&get("headers")?.bytes("headers")?),
        },
    })
}

pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// How many times a statement or transaction the database aborted (a
/// deadlock, a lock wait time-out, a serialization failure) runs again at
/// once before its error is the round's.
const TURNS: usize = 5;

impl<D: OutboxDialect> SqlOutbox<D> {
    /// `Err` unless the database asked for the work to run again.
    fn again(e: sqlx::Error) -> Result<sqlx::Error, sqlx::Error> {
        if D::classify(&e) == ErrorClass::RetryTransaction {
            Ok(e)
        } else {
            Err(e)
        }
    }

    /// `statement` on a pooled connection, run again when the database
    /// aborted it (two relays' writes may deadlock on InnoDB).
    async fn write(&self, statement: &Statement<D>, args: &[Arg<'_>]) -> Result<(), sqlx::Error> {
        let mut last = None;
        for _ in 0..TURNS {
            let mut conn = self.pool.acquire().await?;
            match D::execute(&mut conn, statement, args).await {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(Self::again(e)?),
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }
}

impl<D: OutboxDialect> OutboxBackend for SqlOutbox<D> {
    fn claim(
        &self,
        batch: i64,
        lease: Duration,
        token: i64,
    ) -> BoxFuture<'_, Result<Vec<Claimed>, sqlx::Error>> {
        Box::pin(async move {
            let mut last = None;
            for _ in 0..TURNS {
                match self.claim_batch(batch, lease, token).await {
                    Ok(claimed) => return Ok(claimed),
                    Err(e) => last = Some(Self::again(e)?),
                }
            }
            Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
        })
    }

    fn lag(&self) -> BoxFuture<'_, Result<Option<Duration>, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = self.pool.acquire().await?;
            let row = D::fetch_optional(&mut conn, &self.sql()?.lag, &[]).await?;
            let ms = match row {
                Some(row) => D::get(&row, "lag")?.opt_int("lag")?,
                None => None,
            };
            // A clock that stepped back reads as no wait, never a negative.
            Ok(ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
        })
    }

    fn mark_failed<'a>(
        &'a self,
        seq: i64,
        token: i64,
        error: &'a str,
        backoff: Duration,
        state: RowState,
        counted: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let args = [
                Arg::Int(seq),
                Arg::Int(token),
                Arg::Text(error),
                Arg::Int(millis(backoff)),
                Arg::Text(state.as_str()),
                // The claim counted an attempt; one against a broker that
                // was down is given back.
                Arg::Int(i64::from(!counted)),
            ];
            self.write(&self.sql()?.mark_failed, &args).await
        })
    }

    fn mark_sent<'a>(
        &'a self,
        token: i64,
        seqs: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let statement = self.for_rows(D::OUTBOX.mark_sent, seqs)?;
            self.write(&statement, &[Arg::Int(token)]).await
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = self.pool.acquire().await?;
            D::execute(&mut conn, &self.sql()?.check, &[])
                .await
                .map(drop)
        })
    }

    fn wakeups(&self) -> BoxFuture<'_, Option<Box<dyn Wakeups>>> {
        D::wakeups(&self.pool)
    }

    fn classify(&self, e: &sqlx::Error) -> ErrorClass {
        D::classify(e)
    }
}

/// PostgreSQL's commit notifications: a listener on the outbox's channel.
///
/// The listener has a connection of its own, from a pool of one that
/// nothing else uses, never one of `pool`'s. The relay stops waiting for a
/// notification when its poll interval ends, which drops the listener's
/// `recv` wherever it is; dropped while it reconnects, after its `LISTEN`
/// ran, sqlx's listener gives the connection back to the pool it came
/// from, still listening. Had that been the shared pool, the next request
/// handed that connection would read a notification where it expects its
/// statement's answer, and fail (the network-fault runs found it as `500`s).
#[cfg(feature = "postgres")]
pub(crate) async fn listen(pool: &sqlx::PgPool) -> Option<Box<dyn Wakeups>> {
    use sqlx::postgres::{PgListener, PgPoolOptions};
    use tracing::warn;

    struct Listener(PgListener);
    impl Wakeups for Listener {
        fn next(&mut self) -> BoxFuture<'_, ()> {
            Box::pin(async move {
                // A listener that fails (it reconnects by itself on the
                // next call) ends no wait: the poll interval does, so a
                // database that fails fast does not turn rounds into a
                // loop.
                if self.0.recv().await.is_err() {
                    std::future::pending::<()>().await;
                }
            })
        }
    }

    let own = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(pool.options().get_acquire_timeout())
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = match PgListener::connect_with(&own).await {
        Ok(l) => l,
        Err(e) => {
            warn!(error = %e, "no listener connection; polling only");
            return None;
        }
    };
    match listener.listen(super::NOTIFY_CHANNEL).await {
        Ok(()) => Some(Box::new(Listener(listener))),
        Err(e) => {
            warn!(error = %e, "LISTEN failed; polling only");
            None
        }
    }
}
