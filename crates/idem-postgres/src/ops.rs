//! What operators read: a record as it stands, and counts by state, with
//! the database's clock.

use idem_core::{Inspection, StoreError, StoreStats, UnixMillis};
use idem_sql::{decode_record, decode_stats};
use sqlx::postgres::PgPool;
use sqlx::Row;

use crate::{corrupt, store_error, PostgresStore};

impl idem_sql::SqlRecords for PostgresStore {
    type Dialect = idem_sql::Postgres;

    fn records_pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations that have not run yet. Several
    /// instances starting at once serialise on an advisory lock.
    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(crate::migrate(&self.pool, &self.table).await?)
    }

    /// Reads a record as an operator sees it: past its retention or not,
    /// with the database's clock.
    async fn inspect(&self, scope: &str, key: &str) -> Result<Option<Inspection>, StoreError> {
        let row = sqlx::query(&self.sql.select)
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        let Some(row) = row else { return Ok(None) };
        let record = decode_record(&row)?;
        let now = db_now(&self.pool).await?;
        Ok(Some(Inspection { record, now }))
    }

    /// Counts records by state, for operators.
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        // The last column is the database's clock, the counts' own.
        let now = UnixMillis(row.try_get(5).map_err(|e| corrupt("stats", e))?);
        decode_stats(&row, now)
    }
}

async fn db_now(pool: &PgPool) -> Result<UnixMillis, StoreError> {
    let ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    Ok(UnixMillis(ms))
}
