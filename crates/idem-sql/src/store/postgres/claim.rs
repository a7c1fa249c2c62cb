//! What both claim paths share: the binds of a claim statement, and the
//! claim read back from what a statement returned.

use crate::decode_record;
use idem_core::{
    Claim, ClaimRequest, FencingToken, OperationId, Record, RecordState, StoreError, UnixMillis,
};
use sqlx::postgres::PgRow;
use sqlx::Row;

/// What every claim statement binds: $1 scope, $2 key, $3 fingerprint, $4
/// proposed operation id, $5 token, $6 lease (ms), $7 retention (ms).
pub(crate) struct ClaimBinds<'q> {
    req: &'q ClaimRequest,
    lease: i64,
    retention: i64,
}

impl<'q> ClaimBinds<'q> {
    pub(crate) fn new(req: &'q ClaimRequest) -> Self {
        Self {
            req,
            // Past a century, a century: `now() + interval` would be out
            // of range for some (every claim failing), as on the other
            // stores.
            lease: idem_core::capped_millis(req.lease),
            retention: idem_core::capped_millis(req.retention),
        }
    }

    /// The same binds with the lease run out at once: a claim that its
    /// holder's transaction will lock and lease (uncommitted).
    pub(crate) fn lease_held_by_transaction(mut self) -> Self {
        self.lease = 0;
        self
    }

    pub(crate) fn query<'s>(
        &'s self,
        sql: &'s str,
        proposed: OperationId,
        token: FencingToken,
    ) -> sqlx::query::Query<'s, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql)
            .bind(&self.req.scope)
            .bind(&self.req.key)
            .bind(self.req.fingerprint.as_bytes().as_slice())
            .bind(proposed.0.to_string())
            .bind(token.0)
            .bind(self.lease)
            .bind(self.retention)
    }
}

/// What the first look (`claim_first.sql`) found.
pub(crate) enum FirstLook {
    /// The key was never seen: this attempt inserted its claim.
    New(Claim),
    /// A record that answers the request without a claim (replay, 409, 422),
    /// read without a lock or a write.
    Existing(Record),
    /// Neither: the deciding claim must run.
    Undecided,
}

/// Reads the first look's row (or its absence).
pub(crate) fn first_look(
    req: &ClaimRequest,
    token: FencingToken,
    proposed: OperationId,
    row: Option<PgRow>,
) -> Result<FirstLook, StoreError> {
    let Some(row) = row else {
        return Ok(FirstLook::Undecided);
    };
    let outcome: String = row.try_get("outcome").map_err(|e| corrupt("outcome", e))?;
    match outcome.as_str() {
        "new" => Ok(FirstLook::New(fresh_claim(req, token, proposed, &row)?)),
        "existing" => Ok(FirstLook::Existing(decode_record(&row)?)),
        other => Err(StoreError::Corrupt(format!(
            "first look: outcome {other:?}"
        ))),
    }
}

/// The claim the first look inserted: a new record, this attempt's token
/// and proposed operation id, the lease the database computed.
fn fresh_claim(
    req: &ClaimRequest,
    token: FencingToken,
    operation_id: OperationId,
    row: &PgRow,
) -> Result<Claim, StoreError> {
    let locked_until: i64 = row
        .try_get("locked_until")
        .map_err(|e| corrupt("locked_until", e))?;
    Ok(super::super::inserted_claim(
        req,
        token,
        operation_id,
        UnixMillis(locked_until),
    ))
}

/// How many times a deciding claim runs when the row it lost to vanished
/// (swept) or was committed after the statement's snapshot: normally once.
pub(crate) const CLAIM_TURNS: usize = 5;

pub(crate) fn kept_racing() -> StoreError {
    StoreError::Backend(
        format!("the claim kept racing; giving up after {CLAIM_TURNS} tries").into(),
    )
}

/// The claim a deciding statement won, from the record it returned.
pub(crate) fn won_claim(
    record: Record,
    token: FencingToken,
    proposed: OperationId,
) -> Result<Claim, StoreError> {
    let RecordState::InProgress { locked_until, .. } = record.state else {
        return Err(StoreError::Corrupt(
            "a won claim returned a completed record".into(),
        ));
    };
    Ok(Claim {
        scope: record.scope,
        key: record.key,
        token,
        operation_id: record.operation_id,
        locked_until,
        takeover: record.operation_id != proposed,
    })
}

pub(crate) fn corrupt(what: &str, e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
}
