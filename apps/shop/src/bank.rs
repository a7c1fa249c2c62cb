//! A fake bank standing for an external payment provider.
//!
//! It keeps its own ledger, commits on its own (outside the shop's
//! transaction, as a remote system would), and deduplicates on the operation
//! id the shop passes it: the same id always yields the same charge.

use idem_core::{OperationId, UnixMillis};
use sqlx::SqlitePool;

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
pub(crate) async fn charge(
    pool: &SqlitePool,
    req: &ChargeRequest<'_>,
) -> Result<String, BankError> {
    let id = format!("ch_{}", uuid::Uuid::now_v7().simple());
    let op = req.operation_id.to_string();
    sqlx::query(
        "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT (operation_id) DO NOTHING",
    )
    .bind(&id)
    .bind(&op)
    .bind(req.account_id)
    .bind(req.amount)
    .bind(req.currency)
    .bind(UnixMillis::now().0)
    .execute(pool)
    .await?;
    let charged: String = sqlx::query_scalar("SELECT id FROM bank_charges WHERE operation_id = ?1")
        .bind(&op)
        .fetch_one(pool)
        .await?;
    if charged != id {
        tracing::info!(operation_id = %op, charge = %charged, "bank: operation seen before, returning its charge");
    }
    Ok(charged)
}
