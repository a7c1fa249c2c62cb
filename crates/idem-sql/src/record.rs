//! Reading a stored idempotency record back from a SQL row, the same way
//! for every SQL store.

use bytes::Bytes;
use idem_core::{Record, RecordParts, StoreError, StoreStats, UnixMillis};
use sqlx::{ColumnIndex, Decode, Row, Type};

/// Decodes the record in `row`, selected with the columns `scope, key,
/// fingerprint, operation_id, state, token, locked_until, created_at,
/// expires_at, completed_at, status, headers, body` and
/// `shortest_retention_ms` (times and lengths in Unix milliseconds,
/// `operation_id` as text, integers as 64-bit). A row selected without
/// `shortest_retention_ms` (a query written before the column) decodes
/// with it not known (`None`), which run-once's steps then judge by the
/// attempt's own retention: select it.
///
/// A row that does not decode, or decodes to an impossible record, is
/// [`StoreError::Corrupt`].
pub fn decode_record<'r, R>(row: &'r R) -> Result<Record, StoreError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    &'r str: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    &'r [u8]: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    // The fingerprint, operation id, state and headers are read in place
    // (the record keeps none of them as they are); the body is taken as
    // the row decoded it.
    let fields = || -> Result<RecordParts<'r>, sqlx::Error> {
        Ok(RecordParts {
            scope: row.try_get("scope")?,
            key: row.try_get("key")?,
            fingerprint: row.try_get("fingerprint")?,
            operation_id: row.try_get("operation_id")?,
            state: row.try_get("state")?,
            token: row.try_get("token")?,
            locked_until: row.try_get("locked_until")?,
            created_at: row.try_get("created_at")?,
            expires_at: row.try_get("expires_at")?,
            // Absent from a row selected without it (a query written
            // before the column): not known.
            shortest_retention: match row.try_get("shortest_retention_ms") {
                Err(sqlx::Error::ColumnNotFound(_)) => None,
                other => other?,
            },
            completed_at: row.try_get("completed_at")?,
            status: row.try_get("status")?,
            headers: row.try_get("headers")?,
            body: row.try_get::<Option<Vec<u8>>, _>("body")?.map(Bytes::from),
        })
    };
    let fields = fields().map_err(|e| StoreError::Corrupt(e.to_string()))?;
    Ok(fields.into_record()?)
}

/// Decodes what `idem stats` shows from a row of `count(*)`s selected in
/// this order: in progress, of which past their lease, completed, past
/// retention; then the oldest `created_at` (Unix milliseconds, or `NULL`).
/// `now` is the clock the counts were taken against.
pub fn decode_stats<'r, R>(row: &'r R, now: UnixMillis) -> Result<StoreStats, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let corrupt = |e: sqlx::Error| StoreError::Corrupt(format!("stats: {e}"));
    let count = |i: usize| -> Result<u64, StoreError> {
        let n: i64 = row.try_get(i).map_err(corrupt)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    Ok(StoreStats {
        in_progress: count(0)?,
        leases_expired: count(1)?,
        completed: count(2)?,
        past_retention: count(3)?,
        oldest_created_at: row
            .try_get::<Option<i64>, _>(4)
            .map_err(corrupt)?
            .map(UnixMillis),
        now,
    })
}
