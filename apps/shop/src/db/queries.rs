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

/// The newest 1,000 emails of client `$2`'s payments on account `$1`,
/// oldest first. Read from the client's own payments on the account (their
/// index), each payment's email then found by its id: what the query costs
/// grows with this client's payments there, not with the emails other
/// clients' payments sent to an account id they also use. (`CROSS JOIN`
/// fixes that order on SQLite, whose planner only knows averages; the
/// others find it from their statistics.)
const EMAILS: &str = "SELECT payment_id, account_id, subject FROM (
                          SELECT e.payment_id, e.account_id, e.subject, e.created_at, e.id
                          FROM shop_payments p CROSS JOIN shop_emails e
                          WHERE p.client_id = $2 AND p.account_id = $1
                            AND e.payment_id = p.id AND e.account_id = $1
                          ORDER BY e.created_at DESC, e.id DESC LIMIT 1000) newest
                      ORDER BY created_at, id";

/// The confirmation emails sent for the calling client's payments on an
/// account: the newest 1,000, oldest first (the list grows with every
/// payment; an answer must not).
pub(crate) async fn emails(
    db: &dyn ShopDb,
    client_id: &str,
    account_id: &str,
) -> Result<Vec<Email>, sqlx::Error> {
    query(db, EMAILS, &[account_id.into(), client_id.into()])
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use crate::config::SqliteSynchronous;
    use crate::db::{open, ShopDb, ShopExec};

    /// Which database a test runs on.
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Sqlite,
        Postgres,
        MySql,
    }

    /// 0 to 9,999 as a table `n (i)`, spelled the same on every database.
    fn numbers() -> String {
        let digit = (0..10)
            .map(|d| format!("SELECT {d} AS d"))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        format!(
            "(SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS i
              FROM ({digit}) a, ({digit}) b, ({digit}) c, ({digit}) e) n"
        )
    }

    /// `a` and `b` concatenated, in `kind`'s spelling.
    fn cat(kind: Kind, a: &str, b: &str) -> String {
        match kind {
            Kind::MySql => format!("CONCAT({a}, {b})"),
            _ => format!("({a} || {b})"),
        }
    }

    /// One client's `count` payments on `account`, each with its email
    /// (ids made from the client's name).
    async fn paid(db: &dyn ShopDb, kind: Kind, client: &str, account: &str, count: u32) {
        let id = cat(kind, &format!("'pay_{client}_'"), "CAST(n.i AS CHAR(8))");
        let id = if kind == Kind::MySql {
            id
        } else {
            id.replace("CHAR(8)", "TEXT")
        };
        let email = id.replacen("'pay_", "'em_", 1);
        let mut conn = db.conn().await.unwrap();
        let payments = format!(
            "INSERT INTO shop_payments
                 (id, client_id, account_id, amount, currency, status, bank_charge_id, operation_id, created_at)
             SELECT {id}, '{client}', '{account}', 100, 'EUR', 'captured', {id}, {id}, n.i
             FROM {n} WHERE n.i < {count}",
            n = numbers(),
        );
        conn.execute(&payments, &[]).await.unwrap();
        let emails = format!(
            "INSERT INTO shop_emails (id, payment_id, account_id, subject, created_at)
             SELECT {email}, {id}, '{account}', 'receipt', n.i
             FROM {n} WHERE n.i < {count}",
            n = numbers(),
        );
        conn.execute(&emails, &[]).await.unwrap();
    }

    /// Another client's 5,000 emails on an account id a quiet client also
    /// uses: the quiet client's list is read from its own three payments,
    /// through the index of emails by payment, whatever the other's volume.
    async fn emails_are_read_from_the_clients_own_payments(db: &dyn ShopDb, kind: Kind, url: &str) {
        paid(db, kind, "noisy", "acc_shared", 5000).await;
        paid(db, kind, "quiet", "acc_shared", 3).await;
        paid(db, kind, "other", "acc_other", 50).await;
        let mut conn = db.conn().await.unwrap();
        let analyze = match kind {
            Kind::Sqlite => "ANALYZE",
            Kind::Postgres => "ANALYZE shop_payments, shop_emails",
            Kind::MySql => "ANALYZE TABLE shop_payments, shop_emails",
        };
        conn.fetch_all(analyze, &[]).await.unwrap();

        let quiet = super::emails(db, "quiet", "acc_shared").await.unwrap();
        let ids: Vec<&str> = quiet.iter().map(|e| e.payment_id.as_str()).collect();
        assert_eq!(ids, ["pay_quiet_0", "pay_quiet_1", "pay_quiet_2"]);
        assert_eq!(
            super::emails(db, "quiet", "acc_other").await.unwrap().len(),
            0
        );
        assert_eq!(
            super::emails(db, "noisy", "acc_shared")
                .await
                .unwrap()
                .len(),
            1000
        );

        let sql = super::EMAILS
            .replace("$1", "'acc_shared'")
            .replace("$2", "'quiet'");
        let plan: Vec<String> = match kind {
            Kind::Sqlite => {
                explained(&mut *conn, format!("EXPLAIN QUERY PLAN {sql}"), "detail").await
            }
            Kind::Postgres => explained(&mut *conn, format!("EXPLAIN {sql}"), "QUERY PLAN").await,
            // Its plan's columns are of types the shop's rows do not read.
            Kind::MySql => {
                use sqlx::{Connection, Row};
                let mut raw = sqlx::MySqlConnection::connect(url).await.unwrap();
                let rows = sqlx::query(&format!("EXPLAIN {sql}"))
                    .fetch_all(&mut raw)
                    .await
                    .unwrap();
                raw.close().await.unwrap();
                rows.iter()
                    .map(|row| {
                        let table: String = row.try_get("table").unwrap();
                        let key: Option<String> = row.try_get("key").unwrap();
                        format!("{table}: {}", key.unwrap_or_default())
                    })
                    .collect()
            }
        };
        assert!(
            plan.iter().any(|line| line.contains("shop_emails_payment")),
            "the emails are found by payment: {plan:#?}"
        );
        assert!(
            !plan.iter().any(|line| line.contains("shop_emails_account")),
            "not by the account all clients share: {plan:#?}"
        );
    }

    /// The text of column `column` of each row `explain` gives.
    async fn explained(conn: &mut dyn ShopExec, explain: String, column: &str) -> Vec<String> {
        conn.fetch_all(&explain, &[])
            .await
            .unwrap()
            .iter()
            .map(|row| row.text(column).unwrap())
            .collect()
    }

    async fn opened(url: &str) -> crate::db::Database {
        open(
            url,
            Duration::from_secs(30),
            Some(2),
            SqliteSynchronous::Full,
        )
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn emails_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}/shop.db", dir.path().display());
        let db = opened(&url).await;
        emails_are_read_from_the_clients_own_payments(&*db, Kind::Sqlite, &url).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn emails_on_postgres() {
        let schema = idem_test_support::postgres::TestSchema::create("shop_emails").await;
        let db = opened(&schema.url()).await;
        emails_are_read_from_the_clients_own_payments(&*db, Kind::Postgres, &schema.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn emails_on_mysql() {
        let database = idem_test_support::mysql::TestDatabase::create("shop_emails").await;
        let db = opened(&database.url()).await;
        emails_are_read_from_the_clients_own_payments(&*db, Kind::MySql, &database.url()).await;
    }
}
