//! [`Db`]: the one implementation of the shop's database traits, generic
//! over the dialect.

use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use idem_axum::{CompleteError, DeferredClaim, Idempotency};
use idem_core::{BoxFuture, Store};
use idem_outbox::{inbox, Handled, OutgoingMessage, Publisher, Relay, RelayConfig};
use idem_sql::dialect::{Arg, Conn, Row as DialectRow, Statement, Transaction};
use idem_sql::{Dialect, SqlStore};

use super::dialect::ShopDialect;
use super::{
    Claimed, Database, OpenError, Param, Row, ShopDb, ShopExec, ShopSql, ShopTx, Work, SWEEP_BATCH,
};

/// The connection options of dialect `D`'s driver.
pub(crate) type ConnectOptions<D> =
    <<<D as idem_sql::Dialect>::Database as sqlx::Database>::Connection as sqlx::Connection>::Options;

/// The shop's database on dialect `D`.
pub(crate) struct Db<D: ShopDialect> {
    store: SqlStore<D>,
    /// One connection of its own, for `/healthz`.
    health: idem_sql::dialect::Pool<D>,
    /// How long one statement (or connection, `BEGIN`, `COMMIT`) may take.
    timeout: Duration,
}

impl<D: ShopDialect> std::fmt::Debug for Db<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db").field("database", &D::NAME).finish()
    }
}

impl<D: ShopDialect> Db<D> {
    /// Opens idem's store at `url` and creates the shop's tables, the
    /// outbox and the inbox; `tune`, if any, adjusts the connections'
    /// options (SQLite's `synchronous`).
    pub(crate) async fn open<F>(
        url: &str,
        timeout: Duration,
        connections: Option<u32>,
        tune: Option<F>,
    ) -> Result<Self, OpenError>
    where
        F: FnOnce(ConnectOptions<D>) -> ConnectOptions<D>,
    {
        let mut store = SqlStore::<D>::connect(url).await?;
        if connections.is_some() || tune.is_some() {
            // The same pool's settings, sized and tuned: a pool's
            // connections cannot change, so it is opened anew (lazily) and
            // the first one closed before any request uses it. (Not for an
            // in-memory SQLite database, whose one connection is the
            // database: `Config::check` refuses both flags there.)
            let default = store.pool();
            let mut options = default.options().clone();
            if let Some(n) = connections {
                options = options.max_connections(n);
            }
            let mut connect = default.connect_options().as_ref().clone();
            if let Some(tune) = tune {
                connect = tune(connect);
            }
            let reopened = options.connect_lazy_with(connect);
            default.close().await;
            store = SqlStore::new(reopened, store.table().clone())?;
        }
        let pool = store.pool();
        D::migrate_schema(pool).await?;
        inbox::migrate(pool).await?;
        idem_outbox::outbox::migrate(pool).await?;
        let health = health_pool::<D>(pool);
        Ok(Self {
            store,
            health,
            timeout,
        })
    }
}

impl<D: ShopDialect> Db<D> {
    /// A connection of `pool`, taken and then used within the time-out.
    async fn pooled(
        &self,
        pool: &idem_sql::dialect::Pool<D>,
    ) -> Result<Box<dyn ShopExec>, sqlx::Error> {
        let conn = bounded(self.timeout, pool.acquire()).await?;
        Ok(Box::new(PooledConn::<D> {
            conn,
            timeout: self.timeout,
        }))
    }
}

/// The store error of a record's completion that got no answer within
/// `timeout`.
fn store_timed_out(timeout: Duration) -> idem_core::StoreError {
    idem_core::StoreError::Unavailable(Box::new(idem_once::StoreTimedOut(timeout)))
}

/// The error of a statement that got no answer within `timeout`: an I/O
/// time-out, which the dialects class as unavailable (503 with
/// `Retry-After`).
fn timed_out(timeout: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the database gave no answer within {} ms",
            timeout.as_millis()
        ),
    ))
}

/// `work`, or [`timed_out`] once `timeout` has passed: a statement behind a
/// network partition ends in bounded time, never holding the request until
/// the partition heals.
async fn bounded<T>(
    timeout: Duration,
    work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(timed_out(timeout)))
}

/// A pool of one connection to `pool`'s database, opened when first used.
fn health_pool<D: ShopDialect>(pool: &idem_sql::dialect::Pool<D>) -> idem_sql::dialect::Pool<D> {
    sqlx::pool::PoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy_with(pool.connect_options().as_ref().clone())
}

/// Binds `params` as the dialect's arguments.
fn args<'a>(params: &'a [Param<'a>]) -> Vec<Arg<'a>> {
    params
        .iter()
        .map(|p| match p {
            Param::Text(s) => Arg::Text(s),
            Param::Int(i) => Arg::Int(*i),
        })
        .collect()
}

fn owned<D: Dialect>(row: &DialectRow<D>) -> Result<Row, sqlx::Error> {
    D::columns(row)
        .into_iter()
        .map(|name| {
            let value = D::get(row, &name)?.into_owned();
            Ok((name, value))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()
        .map(Row::new)
}

async fn execute<D: Dialect>(
    conn: &mut Conn<D>,
    sql: &str,
    params: &[Param<'_>],
) -> Result<u64, sqlx::Error> {
    D::execute(conn, &Statement::raw(sql), &args(params)).await
}

async fn fetch_all<D: Dialect>(
    conn: &mut Conn<D>,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Vec<Row>, sqlx::Error> {
    let rows = D::fetch_all(conn, &Statement::raw(sql), &args(params)).await?;
    rows.iter().map(owned::<D>).collect()
}

/// `end` (a commit or a rollback) on a task of its own, waited for at most
/// `timeout`: the caller is answered in bounded time, while the transaction
/// still ends by itself when the network lets it, never cut half-way.
async fn detached(
    timeout: Duration,
    end: impl std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'static,
) -> Result<(), sqlx::Error> {
    let ending = tokio::spawn(end);
    match tokio::time::timeout(timeout, ending).await {
        Ok(Ok(ended)) => ended,
        Ok(Err(e)) => Err(sqlx::Error::Io(std::io::Error::other(format!(
            "the task ending a transaction failed: {e}"
        )))),
        Err(_) => Err(timed_out(timeout)),
    }
}

/// A pooled connection, each statement bounded by the time-out.
struct PooledConn<D: ShopDialect> {
    conn: sqlx::pool::PoolConnection<D::Database>,
    timeout: Duration,
}

impl<D: ShopDialect> ShopExec for PooledConn<D> {
    fn execute<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(bounded(
            self.timeout,
            execute::<D>(&mut self.conn, sql, params),
        ))
    }
    fn fetch_all<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<Vec<Row>, sqlx::Error>> {
        Box::pin(bounded(
            self.timeout,
            fetch_all::<D>(&mut self.conn, sql, params),
        ))
    }
}

/// A write transaction, with the store its record completes in; each
/// statement, and its end, bounded by the time-out.
struct Tx<D: ShopDialect> {
    tx: Transaction<D>,
    store: SqlStore<D>,
    timeout: Duration,
}

impl<D: ShopDialect> ShopExec for Tx<D> {
    fn execute<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(bounded(
            self.timeout,
            execute::<D>(&mut self.tx, sql, params),
        ))
    }
    fn fetch_all<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<Vec<Row>, sqlx::Error>> {
        Box::pin(bounded(
            self.timeout,
            fetch_all::<D>(&mut self.tx, sql, params),
        ))
    }
}

impl<D: ShopDialect> ShopTx for Tx<D> {
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(bounded(
            self.timeout,
            idem_outbox::enqueue(&mut self.tx, message),
        ))
    }
    fn complete_in<'a>(
        &'a mut self,
        idem: &'a Idempotency,
        response: Response,
    ) -> BoxFuture<'a, Result<Response, CompleteError>> {
        let timeout = self.timeout;
        Box::pin(async move {
            tokio::time::timeout(
                timeout,
                idem.complete_in(&self.store, &mut *self.tx, response),
            )
            .await
            .unwrap_or_else(|_| Err(CompleteError::Store(store_timed_out(timeout))))
        })
    }
    fn complete_record<'a>(
        &'a mut self,
        claim: &'a idem_core::Claim,
        stored: &'a idem_core::StoredResponse,
    ) -> BoxFuture<'a, Result<(), idem_core::StoreError>> {
        use idem_core::TransactionalStore;
        let timeout = self.timeout;
        let completing = self.store.complete_in_tx(&mut *self.tx, claim, stored);
        Box::pin(async move {
            tokio::time::timeout(timeout, completing)
                .await
                .unwrap_or_else(|_| Err(store_timed_out(timeout)))
        })
    }
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), sqlx::Error>> {
        Box::pin(detached(self.timeout, self.tx.commit()))
    }
    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), sqlx::Error>> {
        Box::pin(detached(self.timeout, self.tx.rollback()))
    }
}

/// Does `work` in the inbox's transaction on `conn`.
async fn act<D: ShopDialect>(conn: &mut Conn<D>, work: Work) -> Result<(), sqlx::Error> {
    match work {
        Work::ReserveStock(lines) => {
            for (sku, qty) in &lines {
                execute::<D>(conn, D::SQL.reserve_stock, &[sku.into(), (*qty).into()]).await?;
            }
        }
        Work::SendEmail {
            payment_id,
            account_id,
            subject,
            now,
        } => {
            let id = format!("em_{}", uuid::Uuid::now_v7().simple());
            execute::<D>(
                conn,
                "INSERT INTO shop_emails (id, payment_id, account_id, subject, created_at)
                 VALUES ($1, $2, $3, $4, $5)",
                &[
                    (&id).into(),
                    (&payment_id).into(),
                    (&account_id).into(),
                    (&subject).into(),
                    now.into(),
                ],
            )
            .await?;
        }
    }
    Ok(())
}

impl<D: ShopDialect> ShopDb for Db<D> {
    fn kind(&self) -> &'static str {
        D::NAME
    }

    fn sql(&self) -> &'static ShopSql {
        &D::SQL
    }

    fn idem_store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    fn conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>> {
        Box::pin(self.pooled(self.store.pool()))
    }

    fn write_conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>> {
        Box::pin(self.pooled(self.store.writers()))
    }

    fn health_conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>> {
        Box::pin(self.pooled(&self.health))
    }

    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn ShopTx>, sqlx::Error>> {
        Box::pin(async move {
            // Bounded on the server too where it can be (PostgreSQL): a
            // statement cut here is cancelled there, its locks and
            // connection freed, not left waiting.
            let tx = bounded(
                self.timeout,
                D::begin_write_bounded(self.store.writers(), self.timeout),
            )
            .await?;
            Ok(Box::new(Tx::<D> {
                tx,
                store: self.store.clone(),
                timeout: self.timeout,
            }) as Box<dyn ShopTx>)
        })
    }

    fn begin_claimed<'a>(
        &'a self,
        deferred: &'a DeferredClaim,
    ) -> BoxFuture<'a, Result<Claimed, Response>> {
        Box::pin(async move {
            // Bounded like every statement: the transaction is begun on a
            // task of its own, and one cut here rolls back as it drops.
            let begun = tokio::time::timeout(self.timeout, D::begin_claimed(&self.store, deferred))
                .await
                .unwrap_or_else(|_| {
                    tracing::warn!(
                        timeout_ms = self.timeout.as_millis(),
                        "the claim in the transaction got no answer in time"
                    );
                    Err(idem_axum::IdempotencyRejection::StoreUnavailable.into_response())
                });
            let (tx, idem) = begun?;
            let tx = Box::new(Tx::<D> {
                tx,
                store: self.store.clone(),
                timeout: self.timeout,
            }) as Box<dyn ShopTx>;
            Ok((tx, idem))
        })
    }

    fn consume<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        work: Work,
    ) -> BoxFuture<'a, Result<Handled<()>, String>> {
        Box::pin(async move {
            // Bounded like every statement: a database that stops
            // answering fails the message in time (it comes again) instead
            // of holding it, unacknowledged, for as long as it is away.
            inbox::InboxTable::default()
                .statement_timeout(self.timeout)
                .process(
                    self.store.writers(),
                    consumer,
                    message_id,
                    async move |conn| act::<D>(conn, work).await,
                )
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn sweep_inbox(&self, retention: Duration) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(inbox::sweep(self.store.writers(), retention, SWEEP_BATCH))
    }

    fn sweep_outbox(&self, retention: Duration) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(idem_outbox::outbox::sweep_sent(
            self.store.writers(),
            retention,
            SWEEP_BATCH,
        ))
    }

    fn relay(&self, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Relay {
        Relay::new(self.store.writers(), publisher, config)
    }

    fn bank(&self, url: &str) -> BoxFuture<'_, Result<Database, sqlx::Error>> {
        let url = url.to_owned();
        Box::pin(async move {
            let store = D::bank_store(&self.store, &url).await?;
            let health = health_pool::<D>(store.pool());
            Ok(Arc::new(Db::<D> {
                store,
                health,
                timeout: self.timeout,
            }) as Database)
        })
    }
}
