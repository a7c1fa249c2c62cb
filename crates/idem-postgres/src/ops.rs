//! What operators read: a record as it stands, and counts by state, with
//! the database's clock.

use idem_core::{Inspection, StoreError, StoreStats, UnixMillis};
use idem_sql::decode_record;
use sqlx::postgres::PgPool;
use sqlx::Row;

use crate::{corrupt, store_error, PostgresStore};

impl PostgresStore {
    /// Reads a record as an operator sees it: past its retention or not,
    /// with the database's clock.
    pub async fn inspect(&self, scope: &str, key: &str) -> Result<Option<Inspection>, StoreError> {
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
    pub async fn stats(&self) -> Result<StoreStats, StoreError> {
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        let count = |i: usize| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(i).map_err(|e| corrupt("stats", e))?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        Ok(StoreStats {
            in_progress: count(0)?,
            leases_expired: count(1)?,
            completed: count(2)?,
            past_retention: count(3)?,
            oldest_created_at: row
                .try_get::<Option<i64>, _>(4)
                .map_err(|e| corrupt("stats", e))?
                .map(UnixMillis),
            now: UnixMillis(row.try_get(5).map_err(|e| corrupt("stats", e))?),
        })
    }
}

async fn db_now(pool: &PgPool) -> Result<UnixMillis, StoreError> {
    let ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    Ok(UnixMillis(ms))
}
