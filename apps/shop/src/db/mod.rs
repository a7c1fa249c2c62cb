//! The shop's database: its own tables, the fake bank's, idem's records,
//! the outbox and the inbox, on SQLite, PostgreSQL or MySQL/MariaDB.
//!
//! Everything is written once. Handlers hold a [`Database`] (a
//! [`ShopDb`]) and run statements written with `$n` parameters on it or on
//! its transactions ([`ShopTx`]); where the databases' SQL differs (their
//! tables, upserts, casts) the statement comes from [`ShopSql`], a struct
//! of typed fields, one per database. The one implementation of the
//! traits ([`generic::Db`]) is generic over [`dialect::ShopDialect`], on
//! top of [`idem_sql::Dialect`].

use std::borrow::Cow;
use std::sync::Arc;

use axum::response::Response;
use idem_axum::{CompleteError, DeferredClaim, Idempotency};
use idem_core::{BoxFuture, OperationId, Store};
use idem_outbox::{OutgoingMessage, Publisher, Relay, RelayConfig};
use idem_sql::dialect::Value;
use serde::Serialize;

pub(crate) mod dialect;
mod generic;
mod queries;

pub(crate) use dialect::ShopSql;
pub(crate) use queries::{account, bank_events, emails, reserved};

/// Opening the database failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("unsupported database URL {0:?}: use sqlite:FILE, postgres://… or mysql://…")]
    Unsupported(String),
    #[error("cannot open the idempotency store")]
    Store(#[from] idem_core::StoreError),
    #[error("cannot create the shop's tables")]
    Schema(#[from] sqlx::Error),
    #[error("cannot create the outbox or the inbox")]
    Messages(#[from] idem_sql::MigrateError),
}

/// The database, whichever it is.
pub(crate) type Database = Arc<dyn ShopDb>;

/// Opens (migrating) the database `url` names; each statement bounded by
/// `timeout`; a SQLite file synced as `synchronous` says.
pub(crate) async fn open(
    url: &str,
    timeout: std::time::Duration,
    connections: Option<u32>,
    synchronous: crate::config::SqliteSynchronous,
) -> Result<Database, OpenError> {
    use idem_sql::dialect::DialectKind;
    let driver_url = DialectKind::driver_url(url);
    match DialectKind::of_url(url) {
        Some(DialectKind::Sqlite) => {
            // `full` is idem's default (`idem_sql::dialect::sqlite::connect_options`).
            let relaxed = (synchronous == crate::config::SqliteSynchronous::Normal).then_some(
                |options: sqlx::sqlite::SqliteConnectOptions| {
                    options.synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                },
            );
            Ok(Arc::new(
                generic::Db::<idem_sql::Sqlite>::open(url, timeout, connections, relaxed).await?,
            ))
        }
        Some(DialectKind::Postgres) => Ok(Arc::new(
            generic::Db::<idem_sql::Postgres>::open(url, timeout, connections, None::<fn(_) -> _>)
                .await?,
        )),
        Some(DialectKind::MySql) => Ok(Arc::new(
            generic::Db::<idem_sql::MySql>::open(
                &driver_url,
                timeout,
                connections,
                None::<fn(_) -> _>,
            )
            .await?,
        )),
        _ => Err(OpenError::Unsupported(url.to_owned())),
    }
}

/// A row read back, owned: its columns by name.
#[derive(Debug, Clone, Default)]
pub(crate) struct Row(Vec<(String, Value<'static>)>);

impl Row {
    pub(crate) fn new(columns: Vec<(String, Value<'static>)>) -> Self {
        Self(columns)
    }

    fn value(&self, column: &str) -> Result<&Value<'static>, sqlx::Error> {
        self.0
            .iter()
            .find(|(name, _)| name == column)
            .map(|(_, v)| v)
            .ok_or_else(|| sqlx::Error::ColumnNotFound(column.to_owned()))
    }

    /// Column `column` as text.
    pub(crate) fn text(&self, column: &str) -> Result<String, sqlx::Error> {
        self.value(column)?.text(column)
    }

    /// Column `column` as an integer.
    pub(crate) fn int(&self, column: &str) -> Result<i64, sqlx::Error> {
        self.value(column)?.int(column)
    }
}

/// A value bound to a `$n` parameter.
#[derive(Debug, Clone)]
pub(crate) enum Param<'a> {
    Text(Cow<'a, str>),
    Int(i64),
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(s: &'a str) -> Self {
        Param::Text(Cow::Borrowed(s))
    }
}

impl<'a> From<&'a String> for Param<'a> {
    fn from(s: &'a String) -> Self {
        Param::Text(Cow::Borrowed(s))
    }
}

impl From<i64> for Param<'_> {
    fn from(i: i64) -> Self {
        Param::Int(i)
    }
}

/// Statements on a connection: the pool's, or a transaction's.
pub(crate) trait ShopExec: Send {
    /// Runs `sql` (`$n` parameters) with `params`; the rows it changed.
    fn execute<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;
    /// Runs `sql`; its rows.
    fn fetch_all<'a>(
        &'a mut self,
        sql: &'a str,
        params: &'a [Param<'a>],
    ) -> BoxFuture<'a, Result<Vec<Row>, sqlx::Error>>;
}

/// Its first row, if any.
pub(crate) async fn fetch_optional(
    exec: &mut dyn ShopExec,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Option<Row>, sqlx::Error> {
    Ok(exec.fetch_all(sql, params).await?.into_iter().next())
}

/// A write transaction on the shop's database.
pub(crate) trait ShopTx: ShopExec {
    /// Enqueues `message` in the outbox, committed with the transaction.
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Completes the idempotency record in this transaction (fenced).
    fn complete_in<'a>(
        &'a mut self,
        idem: &'a Idempotency,
        response: Response,
    ) -> BoxFuture<'a, Result<Response, CompleteError>>;
    /// Completes a claim on idem's records (a step's) with `stored`, in
    /// this transaction, fenced by the claim's token.
    fn complete_record<'a>(
        &'a mut self,
        claim: &'a idem_core::Claim,
        stored: &'a idem_core::StoredResponse,
    ) -> BoxFuture<'a, Result<(), idem_core::StoreError>>;
    /// Commits.
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), sqlx::Error>>;
    /// Rolls back.
    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), sqlx::Error>>;
}

/// A claim held by a transaction: the transaction, and the claim's handle.
pub(crate) type Claimed = (Box<dyn ShopTx>, Idempotency);

/// What a consumer does once per message, in the inbox's transaction.
#[derive(Debug)]
pub(crate) enum Work {
    /// `reserve-stock`: units per SKU.
    ReserveStock(Vec<(String, i64)>),
    /// `send-email`: one confirmation.
    SendEmail {
        payment_id: String,
        account_id: String,
        subject: String,
        now: i64,
    },
}

/// The shop's database: one implementation, generic over the dialect.
pub(crate) trait ShopDb: Send + Sync + std::fmt::Debug {
    /// The database's name (`sqlite`, `postgres`, `mysql`).
    fn kind(&self) -> &'static str;
    /// The statements that differ between databases.
    fn sql(&self) -> &'static ShopSql;
    /// idem's store of records, on this database.
    fn idem_store(&self) -> Arc<dyn Store>;
    /// A connection from the pool, for reads.
    fn conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>>;
    /// A connection for statements that write, each committing by itself:
    /// from the store's writers (`SqlStore::writers`), on SQLite the one
    /// connection this process's writers queue for. Not to be taken while
    /// a transaction of [`begin`](Self::begin) is open in the same task.
    fn write_conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>>;
    /// A connection outside the business pool (a pool of one of its own),
    /// for `/healthz`: it says whether the database answers, even while
    /// the business pool is busy.
    fn health_conn(&self) -> BoxFuture<'_, Result<Box<dyn ShopExec>, sqlx::Error>>;
    /// A write transaction.
    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn ShopTx>, sqlx::Error>>;
    /// Claims the request's key durably and begins the transaction that
    /// holds it (`--claim-in-transaction`; PostgreSQL only): the response
    /// when the claim answers instead (a replay, 409, 422, 503).
    fn begin_claimed<'a>(
        &'a self,
        deferred: &'a DeferredClaim,
    ) -> BoxFuture<'a, Result<Claimed, Response>>;
    /// Processes `message_id` for `consumer` once through the inbox.
    fn consume<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        work: Work,
    ) -> BoxFuture<'a, Result<idem_outbox::Handled<()>, String>>;
    /// Forgets processed message ids older than `retention`.
    fn sweep_inbox(
        &self,
        retention: std::time::Duration,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;
    /// Deletes at most 500 outbox rows sent more than `retention` ago.
    fn sweep_outbox(
        &self,
        retention: std::time::Duration,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;
    /// A relay over the outbox.
    fn relay(&self, publisher: Arc<dyn Publisher>, config: RelayConfig) -> Relay;
    /// The bank's side: its own connections to `url` (a remote system does
    /// not borrow the shop's), or on SQLite the shop's own (one writer).
    fn bank(&self, url: &str) -> BoxFuture<'_, Result<Database, sqlx::Error>>;
}

/// Runs `sql` on a pooled connection of `db`.
pub(crate) async fn query(
    db: &dyn ShopDb,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Vec<Row>, sqlx::Error> {
    db.conn().await?.fetch_all(sql, params).await
}

/// Runs `sql` on a pooled connection of `db`; its first row.
pub(crate) async fn query_one(
    db: &dyn ShopDb,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Option<Row>, sqlx::Error> {
    Ok(query(db, sql, params).await?.into_iter().next())
}

/// `written` with a duplicate of unique key `key` taken for "nothing
/// written": how MySQL's plain `INSERT` says the row exists (SQLite's and
/// PostgreSQL's `ON CONFLICT DO NOTHING` say it with 0 rows). A duplicate
/// of any other key stays an error.
pub(crate) fn unless_exists(
    written: Result<u64, sqlx::Error>,
    key: &str,
) -> Result<u64, sqlx::Error> {
    match written {
        Err(e) if idem_sql::DuplicateKey::of(&e).is_some_and(|d| d.constraint == key) => Ok(0),
        other => other,
    }
}

/// Creates a row once: `insert` (from [`ShopSql`]: it writes nothing when
/// unique key `key` exists) then `fetch` of the row by that key.
/// `Created` when this call wrote it.
pub(crate) async fn create_once(
    exec: &mut dyn ShopExec,
    (insert, key): (&str, &str),
    insert_params: &[Param<'_>],
    fetch: &str,
    fetch_params: &[Param<'_>],
) -> Result<idem_sql::Created<Row>, sqlx::Error> {
    let written = unless_exists(exec.execute(insert, insert_params).await, key)?;
    let row = fetch_optional(exec, fetch, fetch_params)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    Ok(if written == 1 {
        idem_sql::Created::Created(row)
    } else {
        idem_sql::Created::Existing(row)
    })
}

/// Moves a row to `target` once: `update` (`… WHERE <id> AND <state> =
/// <from>`), then `fetch` tells what became of it.
pub(crate) async fn transition(
    exec: &mut dyn ShopExec,
    target: &str,
    update: &str,
    fetch: &str,
    params: &[Param<'_>],
) -> Result<idem_sql::Transition<Row>, sqlx::Error> {
    use idem_sql::Transition;
    let moved = exec.execute(update, params).await?;
    let Some(row) = fetch_optional(exec, fetch, params).await? else {
        return Ok(Transition::NotFound);
    };
    let current = row.text("status")?;
    Ok(if moved == 1 {
        Transition::Applied(row)
    } else if current == target {
        Transition::AlreadyDone(row)
    } else {
        Transition::Conflict { current, row }
    })
}

/// A payment as the API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub(crate) struct Payment {
    /// The payment's id (`pay_…`).
    pub(crate) id: String,
    /// The account charged.
    pub(crate) account_id: String,
    /// In minor units (cents).
    pub(crate) amount: i64,
    /// Three letters, e.g. `EUR`.
    pub(crate) currency: String,
    /// `authorized`, `captured` or `settled`.
    pub(crate) status: String,
    /// The bank's charge (`ch_…`): one per payment, whatever the retries.
    pub(crate) bank_charge_id: String,
}

impl TryFrom<&Row> for Payment {
    type Error = sqlx::Error;
    fn try_from(r: &Row) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: r.text("id")?,
            account_id: r.text("account_id")?,
            amount: r.int("amount")?,
            currency: r.text("currency")?,
            status: r.text("status")?,
            bank_charge_id: r.text("bank_charge_id")?,
        })
    }
}

/// The columns a [`Payment`] is read from.
/// Rows deleted per statement by the sweeps of the inbox and the outbox.
pub(crate) const SWEEP_BATCH: i64 = 500;

/// Forgets payment keys bound (with Redis alone) more than `retention`
/// ago, when their records are gone too: at most [`SWEEP_BATCH`].
pub(crate) fn sweep_payment_keys(
    db: &dyn ShopDb,
    retention: std::time::Duration,
) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
    Box::pin(async move {
        let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let cutoff = idem_core::UnixMillis::now().0.saturating_sub(retention);
        db.write_conn()
            .await?
            .execute(db.sql().sweep_payment_keys, &[cutoff.into()])
            .await
    })
}

pub(crate) const PAYMENT_COLUMNS: &str = "id, account_id, amount, currency, status, bank_charge_id";

/// What an account has been charged.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Account {
    /// The account.
    pub(crate) account_id: String,
    /// The calling client's payments on it.
    pub(crate) payments: i64,
    /// Their sum, in minor units.
    pub(crate) charged_total: i64,
    /// The bank's charges for them: equal to `payments` when nothing ran twice.
    pub(crate) bank_charges: i64,
}

/// A confirmation email the send-email consumer sent.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Email {
    /// The payment it confirms.
    pub(crate) payment_id: String,
    /// The account charged.
    pub(crate) account_id: String,
    /// Its subject line.
    pub(crate) subject: String,
}

/// A bank event processed for a payment.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct BankEvent {
    /// The bank's event id.
    pub(crate) event_id: String,
    /// Its type, e.g. `charge.settled`.
    #[serde(rename = "type")]
    pub(crate) kind: String,
}

/// The calling client's payment `id`; another client's is `None`.
pub(crate) async fn payment(
    db: &dyn ShopDb,
    client_id: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let sql =
        format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1 AND client_id = $2");
    query_one(db, &sql, &[id.into(), client_id.into()])
        .await?
        .as_ref()
        .map(Payment::try_from)
        .transpose()
}

/// The fake bank: charges once per operation id, committing on its own,
/// and returns the charge id.
pub(crate) async fn bank_charge(
    db: &dyn ShopDb,
    client_id: &str,
    operation_id: OperationId,
    account_id: &str,
    amount: i64,
    currency: &str,
    reference: &str,
) -> Result<String, sqlx::Error> {
    let operation_id = operation_id.to_string();
    let id = format!("ch_{}", uuid::Uuid::now_v7().simple());
    let now = idem_core::UnixMillis::now().0;
    let mut conn = db.write_conn().await?;
    let written = conn
        .execute(
            db.sql().insert_charge,
            &[
                (&id).into(),
                (&operation_id).into(),
                account_id.into(),
                amount.into(),
                currency.into(),
                now.into(),
                client_id.into(),
                reference.into(),
            ],
        )
        .await;
    unless_exists(written, dialect::CHARGE_KEY)?;
    fetch_optional(
        &mut *conn,
        "SELECT id FROM bank_charges WHERE operation_id = $1",
        &[(&operation_id).into()],
    )
    .await?
    .ok_or(sqlx::Error::RowNotFound)?
    .text("id")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::SqliteSynchronous;

    /// `--sqlite-synchronous` reaches every connection of the pool (SQLite
    /// keeps the setting per connection): `PRAGMA synchronous` is 2 for
    /// FULL, 1 for NORMAL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_synchronous_reaches_every_connection() {
        let dir = tempfile::tempdir().unwrap();
        for (setting, expected) in [(SqliteSynchronous::Full, 2), (SqliteSynchronous::Normal, 1)] {
            let url = format!("sqlite:{}/{setting:?}.db", dir.path().display());
            let db = open(&url, std::time::Duration::from_secs(10), Some(4), setting)
                .await
                .unwrap();
            // Three at once: three connections of the pool.
            let mut conns = Vec::new();
            for _ in 0..3 {
                conns.push(db.conn().await.unwrap());
            }
            for conn in &mut conns {
                let row = fetch_optional(&mut **conn, "PRAGMA synchronous", &[])
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(row.int("synchronous").unwrap(), expected, "{setting:?}");
            }
            // The writers' own connection too (on SQLite, a pool of its own).
            drop(conns);
            let mut writer = db.write_conn().await.unwrap();
            let row = fetch_optional(&mut *writer, "PRAGMA synchronous", &[])
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                row.int("synchronous").unwrap(),
                expected,
                "writers, {setting:?}"
            );
        }
    }
}
