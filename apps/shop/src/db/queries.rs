//! The shop's reads, written once with `$n` parameters for every database.

use super::{query, query_one, Account, BankEvent, Email, ShopDb};

/// What the calling client's payments charged an account.
pub(crate) async fn account(
    db: &dyn ShopDb,
    client_id: &str,
    account_id: &str,
) -> Result<Account, sqlx::Error> {
    // Amounts are at most 10^9: a sum overflows only past 9 * 10^9
    // payments on one account.
    const CHARGES: &str = "SELECT count(DISTINCT id) AS n FROM bank_charges
                           WHERE account_id = $1 AND client_id = $2";
    let params = [account_id.into(), client_id.into()];
    let paid = query_one(db, db.sql().account_payments, &params)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    let charged = query_one(db, CHARGES, &params)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    Ok(Account {
        account_id: account_id.to_owned(),
        payments: paid.int("n")?,
        charged_total: paid.int("total")?,
        bank_charges: charged.int("n")?,
    })
}

/// The confirmation emails sent for the calling client's payments on an
/// account: the newest 1,000, oldest first (the list grows with every
/// payment; an answer must not).
pub(crate) async fn emails(
    db: &dyn ShopDb,
    client_id: &str,
    account_id: &str,
) -> Result<Vec<Email>, sqlx::Error> {
    const SQL: &str = "SELECT payment_id, account_id, subject FROM (
                           SELECT e.payment_id, e.account_id, e.subject, e.created_at, e.id
                           FROM shop_emails e JOIN shop_payments p ON p.id = e.payment_id
                           WHERE e.account_id = $1 AND p.client_id = $2
                           ORDER BY e.created_at DESC, e.id DESC LIMIT 1000) newest
                       ORDER BY created_at, id";
    query(db, SQL, &[account_id.into(), client_id.into()])
        .await?
        .iter()
        .map(|r| {
            Ok(Email {
                payment_id: r.text("payment_id")?,
                account_id: r.text("account_id")?,
                subject: r.text("subject")?,
            })
        })
        .collect()
}

/// The bank events processed for a payment: the newest 1,000, oldest
/// first.
pub(crate) async fn bank_events(
    db: &dyn ShopDb,
    payment_id: &str,
) -> Result<Vec<BankEvent>, sqlx::Error> {
    const SQL: &str = "SELECT event_id, type FROM (
                           SELECT event_id, type, received_at FROM shop_bank_events
                           WHERE payment_id = $1
                           ORDER BY received_at DESC, event_id DESC LIMIT 1000) newest
                       ORDER BY received_at, event_id";
    query(db, SQL, &[payment_id.into()])
        .await?
        .iter()
        .map(|r| {
            Ok(BankEvent {
                event_id: r.text("event_id")?,
                kind: r.text("type")?,
            })
        })
        .collect()
}

/// Units reserved so far for a SKU.
pub(crate) async fn reserved(db: &dyn ShopDb, sku: &str) -> Result<i64, sqlx::Error> {
    const SQL: &str = "SELECT reserved FROM shop_stock WHERE sku = $1";
    match query_one(db, SQL, &[sku.into()]).await? {
        Some(row) => row.int("reserved"),
        None => Ok(0),
    }
}
