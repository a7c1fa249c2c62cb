//! [`SqlRecords`]: a SQL store as operators and tools use it.

use std::future::Future;

use idem_core::{Inspection, Store, StoreError, StoreStats};

use super::{now_of, RecordDialect, SqlStore};
use crate::dialect::{Arg, Dialect, Pool};
use crate::store_error;

/// What operators and tools do with a SQL store of idempotency records,
/// whichever the database: [`SqlStore`] on SQLite and MySQL, and
/// `idem_postgres::PostgresStore`. Code written once over it (the `idem`
/// CLI's verbs) serves every one.
pub trait SqlRecords: Store {
    /// The database.
    type Dialect: Dialect;

    /// The pool, for the application's own reads (and, on PostgreSQL and
    /// MySQL, transactions; on SQLite begin write transactions on the
    /// store's writers' pool, [`SqlStore::writers`]).
    fn records_pool(&self) -> &Pool<Self::Dialect>;

    /// Applies the migrations of the records' table that have not run yet
    /// (see [`crate::migrate`]); safe from several processes at once.
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads a record as an operator sees it, past its retention or not,
    /// with the database's clock.
    fn inspect(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<Inspection>, StoreError>> + Send;

    /// Counts records by state, for operators.
    fn stats(&self) -> impl Future<Output = Result<StoreStats, StoreError>> + Send;

    /// Whether an open transaction holds the record's row now (PostgreSQL's
    /// claim held by the transaction, or a default-mode statement caught in
    /// its moment): probed with `FOR UPDATE NOWAIT` in a transaction rolled
    /// back at once, so the probe never waits and writes nothing. For that
    /// moment it holds the row itself: a claim in a transaction arriving
    /// just then is told the key is busy (`409`) and retries. A held
    /// record's lease says nothing: its holder is working until its
    /// transaction ends. Always `false` on the other databases, where no
    /// claim is held so. For operators (`idem inspect`), not hot paths.
    fn held_by_transaction(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

impl<D: RecordDialect> SqlRecords for SqlStore<D> {
    type Dialect = D;

    fn records_pool(&self) -> &Pool<D> {
        &self.pool
    }

    /// Applies the migrations that have not run yet (see
    /// [`crate::migrate`]); safe from several processes at once.
    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(D::migrate(&self.pool, &self.table, D::RECORDS.migrations).await?)
    }

    /// Reads a record as an operator sees it, past its retention or not,
    /// with the database's clock.
    async fn inspect(&self, scope: &str, key: &str) -> Result<Option<Inspection>, StoreError> {
        // A read, outside any transaction: it takes no lock (SQLite's write
        // lock included) and needs no privilege beyond reading.
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let row = D::fetch_optional(
            &mut conn,
            &self.sql.inspect,
            &[Arg::Text(scope), Arg::Text(key)],
        )
        .await
        .map_err(store_error)?;
        let Some(row) = row else { return Ok(None) };
        let now = now_of::<D>(&row)?;
        Ok(Some(Inspection {
            record: D::decode_record(&row)?,
            now,
        }))
    }

    async fn held_by_transaction(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        if D::NAME != "postgres" {
            return Ok(false);
        }
        let sql = format!(
            "SELECT 1 AS held FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE NOWAIT",
            self.table.qualified()
        );
        let mut tx = D::begin_write(&self.writers).await.map_err(store_error)?;
        let probed = D::fetch_optional(
            &mut tx,
            &crate::Statement::raw(&sql),
            &[Arg::Text(scope), Arg::Text(key)],
        )
        .await;
        tx.rollback().await.map_err(store_error)?;
        match probed {
            Ok(_) => Ok(false),
            // lock_not_available: a transaction holds the row.
            Err(e) if D::is_lock_timeout(&e) => Ok(true),
            Err(e) => Err(store_error(e)),
        }
    }

    /// Counts records by state, for operators.
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let row = D::fetch_optional(&mut conn, &self.sql.stats, &[])
            .await
            .map_err(store_error)?
            .ok_or_else(|| StoreError::Corrupt("stats: no row".into()))?;
        let now = now_of::<D>(&row)?;
        D::decode_stats(&row, now)
    }
}
