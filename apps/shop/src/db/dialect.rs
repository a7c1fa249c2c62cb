//! [`ShopDialect`]: what the shop needs of a database beyond
//! [`idem_sql::Dialect`] and [`idem_outbox::OutboxDialect`]: its idem
//! store, its tables, and the few statements whose SQL differs
//! ([`ShopSql`], typed fields).

use axum::response::{IntoResponse, Response};
use idem_axum::{DeferredClaim, Idempotency, Problem};
use idem_core::BoxFuture;
use idem_outbox::OutboxDialect;
use idem_sql::dialect::{Pool, Transaction};
use idem_sql::{RecordDialect, SqlStore};

/// The statements whose SQL differs between databases. Each inserts
/// nothing when its unique key exists already (`ON CONFLICT DO NOTHING`;
/// on MySQL a plain `INSERT` whose duplicate-key error names that key,
/// which [`super::create_once`] takes for "exists").
#[derive(Debug)]
pub(crate) struct ShopSql {
    /// The shop's tables (a script, run under a lock, re-runnable).
    pub(crate) schema: &'static str,
    /// $1 id, $2 operation id, $3 account, $4 amount, $5 currency, $6
    /// created at, $7 client, $8 reference; unique on the operation id.
    pub(crate) insert_charge: &'static str,
    /// $1 id … $9 created at; unique on the operation id.
    pub(crate) insert_payment: &'static str,
    /// $1 id, $2 client, $3 customer, $4 reference, $5 items, $6 created
    /// at; unique on the natural key.
    pub(crate) insert_order: &'static str,
    /// $1 order, $2 client, $3 operation id, $4 created at, $5 the
    /// Idempotency-Key, $6 what it pays with; unique on the order.
    pub(crate) insert_checkout: &'static str,
    /// $1 client, $2 the Idempotency-Key, $3 operation id, $4 what it
    /// pays with, $5 bound at; unique on client and key.
    pub(crate) insert_payment_key: &'static str,
    /// Deletes at most 500 key bindings bound before $1.
    pub(crate) sweep_payment_keys: &'static str,
    /// $1 sku, $2 name, $3 price; unique on the sku.
    pub(crate) insert_product: &'static str,
    /// $1 event id, $2 type, $3 payment, $4 received at; unique on the id.
    pub(crate) insert_bank_event: &'static str,
    /// Adds $2 units to SKU $1.
    pub(crate) reserve_stock: &'static str,
    /// The client's ($2) payments on account $1: `n` and their `total`.
    pub(crate) account_payments: &'static str,
}

/// The unique keys the inserts above may meet, by name.
pub(crate) const CHARGE_KEY: &str = "bank_charges_operation_id_key";
pub(crate) const PAYMENT_KEY: &str = "shop_payments_operation_id_key";
pub(crate) const ORDER_KEY: &str = "shop_orders_natural_key";
pub(crate) const PRODUCT_KEY: &str = "PRIMARY";
pub(crate) const CHECKOUT_KEY: &str = "PRIMARY";
pub(crate) const PAYMENT_KEY_BINDING: &str = "PRIMARY";
pub(crate) const BANK_EVENT_KEY: &str = "PRIMARY";

/// A database the shop runs on; idem's store of records on it is
/// `SqlStore<Self>`.
pub(crate) trait ShopDialect: OutboxDialect + RecordDialect {
    /// The statements that differ.
    const SQL: ShopSql;
    /// The bank's store: by default connections of its own to `url` (a
    /// remote system does not borrow the shop's).
    fn bank_store<'a>(
        store: &'a SqlStore<Self>,
        url: &'a str,
    ) -> BoxFuture<'a, Result<SqlStore<Self>, sqlx::Error>> {
        Box::pin(async move {
            let pool = <Self as RecordDialect>::open_pool(url).await?;
            SqlStore::new(pool, store.table().clone())
                .map_err(|e| sqlx::Error::Configuration(Box::new(e)))
        })
    }
    /// Creates the shop's tables (several instances may start at once).
    fn migrate_schema(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), sqlx::Error>>;
    /// Claims in the transaction that will hold the claim.
    fn begin_claimed<'a>(
        store: &'a SqlStore<Self>,
        deferred: &'a DeferredClaim,
    ) -> BoxFuture<'a, Result<(Transaction<Self>, Idempotency), Response>> {
        let _ = (store, deferred);
        Box::pin(async {
            // `Config::check` refuses the flag on other databases.
            Err(Problem::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "--claim-in-transaction needs PostgreSQL",
            )
            .into_response())
        })
    }
}

/// The index of the bank's charges by reference (SQLite, PostgreSQL),
/// made after the column is (a database made before it has none).
const REFERENCE_INDEX: &str =
    "CREATE INDEX IF NOT EXISTS bank_charges_reference ON bank_charges (reference)";

/// The tables on SQLite and PostgreSQL, whose SQL agrees.
const SCHEMA: &str = include_str!("schema.sql");

const ANSI: ShopSql = ShopSql {
    schema: SCHEMA,
    insert_charge: "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id, reference)
                    VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (operation_id) DO NOTHING",
    insert_payment: "INSERT INTO shop_payments
                     (id, client_id, account_id, amount, currency, status, bank_charge_id, operation_id, created_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (operation_id) DO NOTHING",
    insert_order: "INSERT INTO shop_orders (id, client_id, customer_id, client_reference, items, status, created_at)
                   VALUES ($1, $2, $3, $4, $5, 'placed', $6)
                   ON CONFLICT (client_id, customer_id, client_reference) DO NOTHING",
    insert_checkout: "INSERT INTO shop_checkouts (order_id, client_id, operation_id, created_at, idempotency_key, intent)
                      VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (order_id) DO NOTHING",
    insert_payment_key: "INSERT INTO shop_payment_keys (client_id, idempotency_key, operation_id, intent, bound_at)
                         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (client_id, idempotency_key) DO NOTHING",
    // The outer `bound_at < $1` too: a row bound afresh after the inner
    // SELECT read it (a DELETE that waited re-checks only its own WHERE)
    // is kept.
    sweep_payment_keys: "DELETE FROM shop_payment_keys
                         WHERE (client_id, idempotency_key) IN
                               (SELECT client_id, idempotency_key FROM shop_payment_keys
                                WHERE bound_at < $1 ORDER BY bound_at LIMIT 500)
                           AND bound_at < $1",
    insert_product: "INSERT INTO shop_products (sku, name, price, version) VALUES ($1, $2, $3, 1)
                     ON CONFLICT (sku) DO NOTHING",
    insert_bank_event: "INSERT INTO shop_bank_events (event_id, type, payment_id, received_at)
                        VALUES ($1, $2, $3, $4) ON CONFLICT (event_id) DO NOTHING",
    reserve_stock: "INSERT INTO shop_stock (sku, reserved) VALUES ($1, $2)
                    ON CONFLICT (sku) DO UPDATE SET reserved = shop_stock.reserved + excluded.reserved",
    account_payments: "SELECT count(*) AS n, CAST(coalesce(sum(amount), 0) AS BIGINT) AS total
                       FROM shop_payments WHERE account_id = $1 AND client_id = $2",
};

impl ShopDialect for idem_sql::Sqlite {
    const SQL: ShopSql = ANSI;

    /// SQLite has one writer: the bank shares the shop's file.
    fn bank_store<'a>(
        store: &'a SqlStore<Self>,
        _: &'a str,
    ) -> BoxFuture<'a, Result<SqlStore<Self>, sqlx::Error>> {
        Box::pin(async move { Ok(store.clone()) })
    }
    /// In one write transaction (SQLite's DDL is transactional): two
    /// shops starting at once on one file take turns, and the second finds
    /// the columns the first added, rather than adding them again and
    /// failing.
    fn migrate_schema(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut tx = <Self as idem_sql::Dialect>::begin_write(pool).await?;
            let staged = async {
                // Before the schema, whose indexes may name the columns.
                for added in ADDED_COLUMNS {
                    let missing: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)
                            AND NOT EXISTS (SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2)",
                    )
                    .bind(added.table)
                    .bind(added.column)
                    .fetch_one(&mut *tx)
                    .await?;
                    if missing {
                        sqlx::query(&format!(
                            "ALTER TABLE {} ADD COLUMN {} TEXT NOT NULL DEFAULT ''",
                            added.table, added.column
                        ))
                        .execute(&mut *tx)
                        .await?;
                    }
                }
                sqlx::Executor::execute(&mut *tx, SCHEMA).await?;
                sqlx::query(REFERENCE_INDEX).execute(&mut *tx).await?;
                Ok(())
            }
            .await;
            idem_sql::finish(tx, staged).await
        })
    }
}

/// A column the schema gained after databases were made without it: added
/// (empty) where it is missing.
struct AddedColumn {
    table: &'static str,
    column: &'static str,
}

/// Charges that name their merchant and carry a reference; checkouts that
/// keep their `Idempotency-Key` and what they pay with.
const ADDED_COLUMNS: [AddedColumn; 4] = [
    AddedColumn {
        table: "bank_charges",
        column: "client_id",
    },
    AddedColumn {
        table: "bank_charges",
        column: "reference",
    },
    AddedColumn {
        table: "shop_checkouts",
        column: "idempotency_key",
    },
    AddedColumn {
        table: "shop_checkouts",
        column: "intent",
    },
];

/// The tables and indexes `schema` creates (`CREATE TABLE|INDEX IF NOT
/// EXISTS name`), by name.
fn schema_objects(schema: &str) -> Vec<&str> {
    schema
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            line.strip_prefix("CREATE TABLE IF NOT EXISTS ")
                .or_else(|| line.strip_prefix("CREATE INDEX IF NOT EXISTS "))
        })
        .filter_map(|rest| rest.split([' ', '(']).next())
        .filter(|name| !name.is_empty())
        .collect()
}

impl ShopDialect for idem_sql::Postgres {
    const SQL: ShopSql = ANSI;

    fn migrate_schema(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            // Done already (every table and index the schema names is
            // there, and the columns added later): nothing to run.
            // `ALTER TABLE … ADD COLUMN IF NOT EXISTS` and `CREATE INDEX IF
            // NOT EXISTS` lock the table before they find there is nothing
            // to do (ACCESS EXCLUSIVE, SHARE): an instance starting beside
            // running ones would queue behind their open transactions, and
            // every query of the table behind it.
            let mut objects = schema_objects(SCHEMA);
            objects.push("bank_charges_reference");
            let added: Vec<String> = ADDED_COLUMNS
                .iter()
                .map(|a| format!("{}.{}", a.table, a.column))
                .collect();
            let done: bool = sqlx::query_scalar(
                "SELECT bool_and(to_regclass(o) IS NOT NULL)
                        AND (SELECT count(*) FROM information_schema.columns
                             WHERE table_schema = current_schema()
                               AND table_name || '.' || column_name = ANY($2)) = cardinality($2)
                 FROM unnest($1::text[]) AS o",
            )
            .bind(&objects)
            .bind(&added)
            .fetch_one(pool)
            .await?;
            if done {
                return Ok(());
            }
            // Several instances may start at once: serialise the DDL.
            let mut tx = pool.begin().await?;
            let staged = async {
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext('shop-schema'))")
                    .execute(&mut *tx)
                    .await?;
                // Its DDL waits at most 10 s for the transactions using a
                // table (every later statement on it would queue behind).
                sqlx::query(&format!(
                    "SET LOCAL lock_timeout = '{}s'",
                    idem_sql::migrate::MIGRATION_DDL_WAIT_SECS
                ))
                .execute(&mut *tx)
                .await?;
                // Before the schema, whose indexes may name the columns.
                // Only where one is missing: `ADD COLUMN IF NOT EXISTS`
                // takes ACCESS EXCLUSIVE on its table before it finds the
                // column there, so an upgrade that adds one column to
                // `shop_checkouts` would otherwise also wait for (and
                // stop) every transaction on `bank_charges`.
                for added in ADDED_COLUMNS {
                    let missing: bool = sqlx::query_scalar(
                        "SELECT to_regclass($1) IS NOT NULL
                            AND NOT EXISTS (SELECT 1 FROM information_schema.columns
                                            WHERE table_schema = current_schema()
                                              AND table_name = $1 AND column_name = $2)",
                    )
                    .bind(added.table)
                    .bind(added.column)
                    .fetch_one(&mut *tx)
                    .await?;
                    if missing {
                        sqlx::query(&format!(
                            "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} TEXT NOT NULL DEFAULT ''",
                            added.table, added.column
                        ))
                        .execute(&mut *tx)
                        .await?;
                    }
                }
                // The schema's tables and indexes only when one is missing:
                // `CREATE INDEX IF NOT EXISTS` takes SHARE on its table
                // before it finds the index, which waits for (and stops)
                // every writer of the table, so an upgrade that only added
                // columns runs none of it.
                let all: bool = sqlx::query_scalar(
                    "SELECT bool_and(to_regclass(o) IS NOT NULL) FROM unnest($1::text[]) AS o",
                )
                .bind(&objects)
                .fetch_one(&mut *tx)
                .await?;
                if !all {
                    sqlx::Executor::execute(&mut *tx, SCHEMA).await?;
                    // Last: its index says the whole step is done (above).
                    sqlx::query(REFERENCE_INDEX).execute(&mut *tx).await?;
                }
                Ok(())
            }
            .await;
            idem_sql::finish(tx, staged).await
        })
    }
    fn begin_claimed<'a>(
        store: &'a SqlStore<Self>,
        deferred: &'a DeferredClaim,
    ) -> BoxFuture<'a, Result<(Transaction<Self>, Idempotency), Response>> {
        Box::pin(async move {
            deferred
                .begin(store)
                .await
                .map_err(IntoResponse::into_response)
        })
    }
}

impl ShopDialect for idem_sql::MySql {
    const SQL: ShopSql = ShopSql {
        schema: include_str!("schema_mysql.sql"),
        insert_charge: "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id, reference)
                        VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        insert_payment: "INSERT INTO shop_payments
                         (id, client_id, account_id, amount, currency, status, bank_charge_id, operation_id, created_at)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        insert_order: "INSERT INTO shop_orders (id, client_id, customer_id, client_reference, items, status, created_at)
                       VALUES ($1, $2, $3, $4, $5, 'placed', $6)",
        insert_checkout: "INSERT INTO shop_checkouts (order_id, client_id, operation_id, created_at, idempotency_key, intent)
                          VALUES ($1, $2, $3, $4, $5, $6)",
        insert_payment_key: "INSERT INTO shop_payment_keys (client_id, idempotency_key, operation_id, intent, bound_at)
                             VALUES ($1, $2, $3, $4, $5)",
        sweep_payment_keys: "DELETE FROM shop_payment_keys WHERE bound_at < $1 ORDER BY bound_at LIMIT 500",
        insert_product: "INSERT INTO shop_products (sku, name, price, version) VALUES ($1, $2, $3, 1)",
        insert_bank_event: "INSERT INTO shop_bank_events (event_id, type, payment_id, received_at)
                            VALUES ($1, $2, $3, $4)",
        reserve_stock: "INSERT INTO shop_stock (sku, reserved) VALUES ($1, $2)
                        ON DUPLICATE KEY UPDATE reserved = reserved + VALUES(reserved)",
        account_payments: "SELECT count(*) AS n, CAST(COALESCE(SUM(amount), 0) AS SIGNED) AS total
                           FROM shop_payments WHERE account_id = $1 AND client_id = $2",
    };
    /// Under a named lock; each statement commits by itself (MySQL's DDL),
    /// and each is written to be run again.
    fn migrate_schema(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            // The lock is the session's: stopped before it let go, the
            // connection closes (and the lock with it) rather than go back
            // to the pool holding it.
            conn.close_on_drop();
            // Its DDL waits at most 10 s for transactions open on a table
            // (every later statement on the table would queue behind it),
            // as idem's own migrations do; the connection goes with it.
            sqlx::query("SET SESSION lock_wait_timeout = ?")
                .bind(idem_sql::migrate::MIGRATION_DDL_WAIT_SECS)
                .execute(&mut *conn)
                .await?;
            let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK('shop-schema', 60)")
                .fetch_one(&mut *conn)
                .await?;
            if got != Some(1) {
                return Err(sqlx::Error::Protocol(
                    "another shop held the schema lock for 60 s".into(),
                ));
            }
            let created = async {
                sqlx::Executor::execute(&mut *conn, Self::SQL.schema).await?;
                for upgrade in MYSQL_UPGRADES {
                    let present: i64 = sqlx::query_scalar(upgrade.present)
                        .fetch_one(&mut *conn)
                        .await?;
                    if present == 0 {
                        sqlx::query(upgrade.add).execute(&mut *conn).await?;
                    }
                }
                Ok::<_, sqlx::Error>(())
            }
            .await;
            let released = sqlx::query("SELECT RELEASE_LOCK('shop-schema')")
                .execute(&mut *conn)
                .await;
            created?;
            released.map(drop)
        })
    }
}

/// What a MySQL database made by an earlier shop lacks: found missing by
/// `present` (a count of 0), added by `add`.
struct MysqlUpgrade {
    present: &'static str,
    add: &'static str,
}

/// In order: charges that carry a reference, emails read from payments,
/// checkouts that keep their key.
const MYSQL_UPGRADES: [MysqlUpgrade; 4] = [
    MysqlUpgrade {
        present: "SELECT count(*) FROM information_schema.columns
                  WHERE table_schema = DATABASE() AND table_name = 'bank_charges'
                    AND column_name = 'reference'",
        add: "ALTER TABLE bank_charges ADD COLUMN reference VARBINARY(255) NOT NULL DEFAULT '',
              ADD INDEX bank_charges_reference (reference)",
    },
    MysqlUpgrade {
        present: "SELECT count(*) FROM information_schema.statistics
                  WHERE table_schema = DATABASE() AND table_name = 'shop_emails'
                    AND index_name = 'shop_emails_payment'",
        add: "ALTER TABLE shop_emails ADD INDEX shop_emails_payment (payment_id)",
    },
    MysqlUpgrade {
        present: "SELECT count(*) FROM information_schema.columns
                  WHERE table_schema = DATABASE() AND table_name = 'shop_checkouts'
                    AND column_name = 'idempotency_key'",
        add: "ALTER TABLE shop_checkouts ADD COLUMN idempotency_key VARBINARY(255) NOT NULL DEFAULT ''",
    },
    MysqlUpgrade {
        present: "SELECT count(*) FROM information_schema.columns
                  WHERE table_schema = DATABASE() AND table_name = 'shop_checkouts'
                    AND column_name = 'intent'",
        add: "ALTER TABLE shop_checkouts ADD COLUMN intent VARBINARY(255) NOT NULL DEFAULT ''",
    },
];

#[cfg(test)]
mod tests {
    /// Every table and index of the schema is named, so that an instance
    /// runs the schema step while any one is missing.
    #[test]
    fn the_schema_objects_are_all_named() {
        let names = super::schema_objects(super::SCHEMA);
        for name in [
            "shop_payments",
            "shop_payments_account",
            "bank_charges",
            "bank_charges_account",
            "shop_orders",
            "shop_checkouts",
            "shop_payment_keys",
            "shop_payment_keys_bound_at",
            "shop_products",
            "shop_bank_events",
            "shop_bank_events_payment",
            "shop_stock",
            "shop_emails",
            "shop_emails_account",
            "shop_emails_payment",
        ] {
            assert!(names.contains(&name), "{name}: {names:?}");
        }
        assert_eq!(
            names.len(),
            super::SCHEMA.matches("IF NOT EXISTS").count(),
            "{names:?}"
        );
    }
}
