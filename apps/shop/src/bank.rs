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
    pub(crate) operation_id: OperationId,
    pub(crate) account_id: &'a str,
    pub(crate) amount: i64,
    pub(crate) currency: &'a str,
}

/// Charges once per operation id; returns the charge id.
pub(crate) async fn charge(db: &Database, req: &ChargeRequest<'_>) -> Result<String, BankError> {
    let op = req.operation_id.to_string();
    let id = db
        .bank_charge(&op, req.account_id, req.amount, req.currency)
        .await?;
    Ok(id)
}
