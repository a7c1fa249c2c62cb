//! Reading a stored idempotency record back from a SQL row, the same way
//! for every SQL store.

use idem_core::{Record, RecordRow, StoreError};
use sqlx::{ColumnIndex, Decode, Row, Type};

/// Decodes the record in `row`, selected with the columns `scope, key,
/// fingerprint, operation_id, state, token, locked_until, created_at,
/// expires_at, completed_at, status, headers, body` (times in Unix
/// milliseconds, `operation_id` as text, integers as 64-bit).
///
/// A row that does not decode, or decodes to an impossible record, is
/// [`StoreError::Corrupt`].
pub fn decode_record<'r, R>(row: &'r R) -> Result<Record, StoreError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let fields = || -> Result<RecordRow, sqlx::Error> {
        Ok(RecordRow {
            scope: row.try_get("scope")?,
            key: row.try_get("key")?,
            fingerprint: row.try_get("fingerprint")?,
            operation_id: row.try_get("operation_id")?,
            state: row.try_get("state")?,
            token: row.try_get("token")?,
            locked_until: row.try_get("locked_until")?,
            created_at: row.try_get("created_at")?,
            expires_at: row.try_get("expires_at")?,
            completed_at: row.try_get("completed_at")?,
            status: row.try_get("status")?,
            headers: row.try_get("headers")?,
            body: row.try_get("body")?,
        })
    };
    let fields = fields().map_err(|e| StoreError::Corrupt(e.to_string()))?;
    Ok(fields.into_record()?)
}
