//! The shop's database: its own tables, the fake bank's, and idem's records.

use std::sync::Arc;

use idem_core::Store;
use idem_sqlite::SqliteStore;
use sqlx::SqlitePool;

/// The shop's own schema, applied at start (idempotently).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS shop_payments (
    id             TEXT    PRIMARY KEY,
    client_id      TEXT    NOT NULL,
    account_id     TEXT    NOT NULL,
    amount         INTEGER NOT NULL CHECK (amount > 0),
    currency       TEXT    NOT NULL,
    status         TEXT    NOT NULL,
    bank_charge_id TEXT    NOT NULL,
    -- the last safety net: one payment per operation, whatever the layers above do
    operation_id   TEXT    NOT NULL UNIQUE,
    created_at     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_payments_account ON shop_payments (account_id);

-- The fake bank's ledger. It stands for an external system: it commits on
-- its own and deduplicates on the operation id it is given.
CREATE TABLE IF NOT EXISTS bank_charges (
    id           TEXT    PRIMARY KEY,
    operation_id TEXT    NOT NULL UNIQUE,
    account_id   TEXT    NOT NULL,
    amount       INTEGER NOT NULL,
    currency     TEXT    NOT NULL,
    created_at   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS bank_charges_account ON bank_charges (account_id);
";

/// An open, migrated database.
#[derive(Debug, Clone)]
pub(crate) struct Database {
    store: SqliteStore,
}

/// Opening the database failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("unsupported database URL {0:?}: shop runs on SQLite (sqlite:FILE)")]
    Unsupported(String),
    #[error("cannot open the idempotency store")]
    Store(#[from] idem_core::StoreError),
    #[error("cannot create the shop's tables")]
    Schema(#[from] sqlx::Error),
}

impl Database {
    pub(crate) async fn open(url: &str) -> Result<Self, OpenError> {
        if !url.starts_with("sqlite:") {
            return Err(OpenError::Unsupported(url.to_owned()));
        }
        let store = SqliteStore::connect(url).await?;
        sqlx::raw_sql(SCHEMA).execute(store.pool()).await?;
        Ok(Self { store })
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        self.store.pool()
    }

    pub(crate) fn idem_store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }
}
