//! A fake bank standing for an external payment provider.
//!
//! It keeps its own ledger, commits on its own (outside the shop's
//! transaction, as a remote system would), and deduplicates on the operation
//! id the shop passes it: the same id always yields the same charge.

use idem_core::OperationId;

use crate::db::Database;

/// The bank could not charge.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BankError {
    #[error("the bank is unavailable (simulated)")]
    Simulated,
    #[error("the bank's ledger failed")]
    Ledger(#[from] sqlx::Error),
}

/// What to charge.
#[derive(Debug)]
pub(crate) struct ChargeRequest<'a> {
    /// The merchant: the shop's client the charge is made for.
    pub(crate) client_id: &'a str,
    pub(crate) operation_id: OperationId,
    pub(crate) account_id: &'a str,
    pub(crate) amount: i64,
    pub(crate) currency: &'a str,
    /// The merchant's own reference (an order id), or empty.
    pub(crate) reference: &'a str,
}

/// The bank's side of the wire: on PostgreSQL and MySQL, a pool of its own (a remote
/// system does not borrow the shop's connections, and a handler holding a
/// transaction open across the bank call must not wait on its own pool);
/// on SQLite, the shop's database (one writer anyway).
#[derive(Debug, Clone)]
pub(crate) struct Bank {
    db: Database,
}

impl Bank {
    /// Opens the bank's connections next to `db`'s, at `url`.
    pub(crate) async fn open(db: &Database, url: &str) -> Result<Self, sqlx::Error> {
        Ok(Self {
            db: db.bank(url).await?,
        })
    }

    /// Charges once per operation id (the caller's idempotency key);
    /// returns the charge id.
    pub(crate) async fn charge(&self, req: &ChargeRequest<'_>) -> Result<String, BankError> {
        let id = crate::db::bank_charge(
            &*self.db,
            req.client_id,
            req.operation_id,
            req.account_id,
            req.amount,
            req.currency,
            req.reference,
        )
        .await?;
        Ok(id)
    }
}
