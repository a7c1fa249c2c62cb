//! The shop's database: its own tables, the fake bank's, and idem's records,
//! on SQLite or PostgreSQL. Every statement is written once, with `$n`
//! parameters that both drivers understand, and runs on whichever backend
//! the URL names.

use std::sync::Arc;

use idem_core::{Store, UnixMillis};
use idem_postgres::PostgresStore;
use idem_sqlite::SqliteStore;
use serde::Serialize;

/// The shop's own schema, applied at start (idempotently), valid SQL for
/// both SQLite and PostgreSQL.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS shop_payments (
    id             TEXT   PRIMARY KEY,
    client_id      TEXT   NOT NULL,
    account_id     TEXT   NOT NULL,
    amount         BIGINT NOT NULL CHECK (amount > 0),
    currency       TEXT   NOT NULL,
    status         TEXT   NOT NULL,
    bank_charge_id TEXT   NOT NULL,
    -- the last safety net: one payment per operation, whatever the layers above do
    operation_id   TEXT   NOT NULL,
    created_at     BIGINT NOT NULL,
    CONSTRAINT shop_payments_operation_id_key UNIQUE (operation_id)
);
CREATE INDEX IF NOT EXISTS shop_payments_account ON shop_payments (client_id, account_id);

-- The fake bank's ledger. It stands for an external system: it commits on
-- its own and deduplicates on the operation id it is given.
CREATE TABLE IF NOT EXISTS bank_charges (
    id           TEXT   PRIMARY KEY,
    -- the merchant the charge was made for: the shop's client
    client_id    TEXT   NOT NULL,
    operation_id TEXT   NOT NULL UNIQUE,
    account_id   TEXT   NOT NULL,
    amount       BIGINT NOT NULL,
    currency     TEXT   NOT NULL,
    created_at   BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS bank_charges_account ON bank_charges (client_id, account_id);

-- Orders are created once per natural key, with or without an Idempotency-Key;
-- natural keys are per client: two clients may use the same reference.
CREATE TABLE IF NOT EXISTS shop_orders (
    id               TEXT   PRIMARY KEY,
    client_id        TEXT   NOT NULL,
    customer_id      TEXT   NOT NULL,
    client_reference TEXT   NOT NULL,
    items            TEXT   NOT NULL,
    status           TEXT   NOT NULL,
    created_at       BIGINT NOT NULL,
    CONSTRAINT shop_orders_natural_key UNIQUE (client_id, customer_id, client_reference)
);

-- Products are written with optimistic concurrency (ETag / If-Match).
CREATE TABLE IF NOT EXISTS shop_products (
    sku     TEXT   PRIMARY KEY,
    name    TEXT   NOT NULL,
    price   BIGINT NOT NULL,
    version BIGINT NOT NULL
);

-- The bank's webhook events, processed once per event id.
CREATE TABLE IF NOT EXISTS shop_bank_events (
    event_id    TEXT   PRIMARY KEY,
    type        TEXT   NOT NULL,
    payment_id  TEXT   NOT NULL,
    received_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_bank_events_payment ON shop_bank_events (payment_id);

-- What the reserve-stock consumer reserved, per SKU.
CREATE TABLE IF NOT EXISTS shop_stock (
    sku      TEXT   PRIMARY KEY,
    reserved BIGINT NOT NULL
);

-- What the send-email consumer sent: one confirmation per payment.
CREATE TABLE IF NOT EXISTS shop_emails (
    id         TEXT   PRIMARY KEY,
    payment_id TEXT   NOT NULL,
    account_id TEXT   NOT NULL,
    subject    TEXT   NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_emails_account ON shop_emails (account_id);
";

/// An open, migrated database on one of the two backends.
#[derive(Debug, Clone)]
pub(crate) enum Database {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

/// Runs `$body` with `$store` bound to the backend's idem store (which also
/// hands out its pool). Each arm type-checks against its own driver.
macro_rules! on_backend {
    ($db:expr, $store:ident => $body:expr) => {
        match $db {
            $crate::db::Database::Sqlite($store) => $body,
            $crate::db::Database::Postgres($store) => $body,
        }
    };
}
pub(crate) use on_backend;

/// Starting a transaction that will write.
///
/// On SQLite it is `BEGIN IMMEDIATE`: a deferred transaction that reads
/// before it writes fails at once with `SQLITE_BUSY` when another writer got
/// in between, instead of waiting for the busy timeout.
pub(crate) trait BeginWrite {
    type Db: sqlx::Database;

    fn begin_write(
        &self,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>>;

    /// Continues `open`, if given, or begins a write transaction.
    fn begin_in(
        &self,
        open: OpenTx,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>>;
}

/// A PostgreSQL transaction a handler already opened (and claimed in).
pub(crate) type OpenTx = Option<sqlx::Transaction<'static, sqlx::Postgres>>;

impl BeginWrite for sqlx::SqlitePool {
    type Db = sqlx::Sqlite;

    fn begin_in(
        &self,
        open: OpenTx,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error>>
    {
        match open {
            Some(_) => Box::pin(async {
                Err(sqlx::Error::Configuration(
                    "a PostgreSQL transaction cannot continue on SQLite".into(),
                ))
            }),
            None => self.begin_write(),
        }
    }

    fn begin_write(
        &self,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error>>
    {
        Box::pin(self.begin_with("BEGIN IMMEDIATE"))
    }
}

impl BeginWrite for sqlx::PgPool {
    type Db = sqlx::Postgres;

    fn begin_in(
        &self,
        open: OpenTx,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error>>
    {
        match open {
            Some(tx) => Box::pin(async { Ok(tx) }),
            None => self.begin_write(),
        }
    }

    fn begin_write(
        &self,
    ) -> idem_core::BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error>>
    {
        Box::pin(self.begin())
    }
}

/// Opening the database failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("unsupported database URL {0:?}: use sqlite:FILE or postgres://…")]
    Unsupported(String),
    #[error("cannot open the idempotency store")]
    Store(#[from] idem_core::StoreError),
    #[error("cannot create the shop's tables")]
    Schema(#[from] sqlx::Error),
    #[error("cannot create the outbox or the inbox")]
    Messages(#[from] idem_sql::MigrateError),
}

/// A payment as the API shows it, read from its row by column name.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
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

/// The columns a [`Payment`] is read from.
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
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub(crate) struct Email {
    /// The payment it confirms.
    pub(crate) payment_id: String,
    /// The account charged.
    pub(crate) account_id: String,
    /// Its subject line.
    pub(crate) subject: String,
}

/// A bank event processed for a payment.
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub(crate) struct BankEvent {
    /// The bank's event id.
    pub(crate) event_id: String,
    /// Its type, e.g. `charge.settled`.
    #[serde(rename = "type")]
    #[sqlx(rename = "type")]
    pub(crate) kind: String,
}

impl Database {
    pub(crate) async fn open(url: &str) -> Result<Self, OpenError> {
        if url.starts_with("sqlite:") {
            let store = SqliteStore::connect(url).await?;
            sqlx::raw_sql(SCHEMA).execute(store.pool()).await?;
            // A database made before charges named their merchant.
            let has_client: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pragma_table_info('bank_charges') WHERE name = 'client_id'",
            )
            .fetch_one(store.pool())
            .await?;
            if has_client == 0 {
                sqlx::query(
                    "ALTER TABLE bank_charges ADD COLUMN client_id TEXT NOT NULL DEFAULT ''",
                )
                .execute(store.pool())
                .await?;
            }
            idem_outbox::inbox::migrate(store.pool()).await?;
            idem_outbox::outbox::migrate(store.pool()).await?;
            Ok(Self::Sqlite(store))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let store = PostgresStore::connect(url).await?;
            // Several instances may start at once: serialise the DDL.
            let mut tx = store.pool().begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext('shop-schema'))")
                .execute(&mut *tx)
                .await?;
            sqlx::Executor::execute(&mut *tx, SCHEMA).await?;
            // A database made before charges named their merchant.
            sqlx::query(
                "ALTER TABLE bank_charges ADD COLUMN IF NOT EXISTS client_id TEXT NOT NULL DEFAULT ''",
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            idem_outbox::inbox::migrate(store.pool()).await?;
            idem_outbox::outbox::migrate(store.pool()).await?;
            Ok(Self::Postgres(store))
        } else {
            Err(OpenError::Unsupported(url.to_owned()))
        }
    }

    pub(crate) fn idem_store(&self) -> Arc<dyn Store> {
        on_backend!(self, store => Arc::new(store.clone()))
    }

    pub(crate) async fn ping(&self) -> Result<(), sqlx::Error> {
        on_backend!(self, store => sqlx::query("SELECT 1").execute(store.pool()).await.map(drop))
    }

    /// The calling client's payment `id`; another client's is `None`.
    pub(crate) async fn payment(
        &self,
        client_id: &str,
        id: &str,
    ) -> Result<Option<Payment>, sqlx::Error> {
        let sql =
            format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1 AND client_id = $2");
        on_backend!(self, store => sqlx::query_as(&sql).bind(id).bind(client_id).fetch_optional(store.pool()).await)
    }

    /// Units reserved so far for a SKU.
    pub(crate) async fn reserved(&self, sku: &str) -> Result<i64, sqlx::Error> {
        const SQL: &str = "SELECT reserved FROM shop_stock WHERE sku = $1";
        let found: Option<i64> = on_backend!(self, store => sqlx::query_scalar(SQL).bind(sku).fetch_optional(store.pool()).await?);
        Ok(found.unwrap_or(0))
    }

    /// The confirmation emails sent for the calling client's payments on an
    /// account, oldest first.
    pub(crate) async fn emails(
        &self,
        client_id: &str,
        account_id: &str,
    ) -> Result<Vec<Email>, sqlx::Error> {
        const SQL: &str = "SELECT e.payment_id, e.account_id, e.subject FROM shop_emails e
                           JOIN shop_payments p ON p.id = e.payment_id
                           WHERE e.account_id = $1 AND p.client_id = $2
                           ORDER BY e.created_at, e.id";
        on_backend!(self, store => sqlx::query_as(SQL).bind(account_id).bind(client_id).fetch_all(store.pool()).await)
    }

    /// The bank events processed for a payment, oldest first.
    pub(crate) async fn bank_events(
        &self,
        payment_id: &str,
    ) -> Result<Vec<BankEvent>, sqlx::Error> {
        const SQL: &str = "SELECT event_id, type FROM shop_bank_events WHERE payment_id = $1
                           ORDER BY received_at, event_id";
        on_backend!(self, store => sqlx::query_as(SQL).bind(payment_id).fetch_all(store.pool()).await)
    }

    /// What the calling client's payments charged an account.
    pub(crate) async fn account(
        &self,
        client_id: &str,
        account_id: &str,
    ) -> Result<Account, sqlx::Error> {
        // Amounts are at most 10^9: a sum overflows only past 9 * 10^9
        // payments on one account.
        const PAYMENTS: &str = "SELECT count(*), CAST(coalesce(sum(amount), 0) AS BIGINT)
                                FROM shop_payments WHERE account_id = $1 AND client_id = $2";
        const CHARGES: &str =
            "SELECT count(DISTINCT id) FROM bank_charges WHERE account_id = $1 AND client_id = $2";
        let ((payments, charged_total), bank_charges): ((i64, i64), i64) = on_backend!(self, store => (
            sqlx::query_as(PAYMENTS).bind(account_id).bind(client_id).fetch_one(store.pool()).await?,
            sqlx::query_scalar(CHARGES).bind(account_id).bind(client_id).fetch_one(store.pool()).await?,
        ));
        Ok(Account {
            account_id: account_id.to_owned(),
            payments,
            charged_total,
            bank_charges,
        })
    }

    /// The fake bank: charges once per operation id, committing on its own,
    /// and returns the charge id.
    pub(crate) async fn bank_charge(
        &self,
        client_id: &str,
        operation_id: &str,
        account_id: &str,
        amount: i64,
        currency: &str,
    ) -> Result<String, sqlx::Error> {
        const CHARGE: &str =
            "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id)
                              VALUES ($1, $2, $3, $4, $5, $6, $7)
                              ON CONFLICT (operation_id) DO NOTHING";
        const FIND: &str = "SELECT id FROM bank_charges WHERE operation_id = $1";
        let id = format!("ch_{}", uuid::Uuid::now_v7().simple());
        let now = UnixMillis::now().0;
        on_backend!(self, store => {
            sqlx::query(CHARGE)
                .bind(&id)
                .bind(operation_id)
                .bind(account_id)
                .bind(amount)
                .bind(currency)
                .bind(now)
                .bind(client_id)
                .execute(store.pool())
                .await?;
            sqlx::query_scalar(FIND).bind(operation_id).fetch_one(store.pool()).await
        })
    }
}
