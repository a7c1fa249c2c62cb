//! The claim held by the business transaction ([`ClaimInTransaction`]):
//! committed first, then locked by the transaction that does the work.

use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimInTransaction, ClaimRequest, FencingToken, OperationId, RecordState,
    StoreError, TxClaimOutcome,
};
use sqlx::Row;

use super::claim::{
    corrupt, first_look, kept_racing, won_claim, ClaimBinds, FirstLook, CLAIM_TURNS,
};
use crate::store::SqlStore;
use crate::{decode_record, store_error, Postgres};

impl SqlStore<Postgres> {
    /// The durable half of a transaction-held claim: the first look, then
    /// (when it did not decide) the deciding statement that respects row locks.
    async fn claim_held_inner(&self, req: &ClaimRequest) -> Result<TxClaimOutcome<()>, StoreError> {
        let mut checkout = self
            .extra
            .claims
            .checkout(&self.pool)
            .await
            .map_err(store_error)?;
        let outcome = self.claim_held_on(checkout.conn(), req).await?;
        checkout.keep();
        Ok(outcome)
    }

    async fn claim_held_on(
        &self,
        conn: &mut sqlx::PgConnection,
        req: &ClaimRequest,
    ) -> Result<TxClaimOutcome<()>, StoreError> {
        let binds = ClaimBinds::new(req).lease_held_by_transaction();
        // A row swept, or committed after a statement's snapshot, between
        // the two statements: try again (see the crate docs).
        for _ in 0..CLAIM_TURNS {
            let token = FencingToken::generate();
            let proposed = OperationId::generate();
            let first = binds
                .query(&self.extra.sql.claim_first, proposed, token)
                .fetch_optional(&mut *conn)
                .await
                .map_err(store_error)?;
            match first_look(req, token, proposed, first)? {
                FirstLook::New(claim) => {
                    return Ok(TxClaimOutcome::Acquired {
                        claim,
                        transaction: (),
                    })
                }
                // A live default-mode claim of the same request: busy, as
                // the deciding statement would say.
                FirstLook::Existing(record)
                    if record.fingerprint == req.fingerprint
                        && matches!(record.state, RecordState::InProgress { .. }) =>
                {
                    return Ok(TxClaimOutcome::Busy)
                }
                FirstLook::Existing(record) => return Ok(TxClaimOutcome::Existing(record)),
                FirstLook::Undecided => {}
            }
            let token = FencingToken::generate();
            let row = binds
                .query(&self.extra.sql.claim_held, proposed, token)
                .fetch_optional(&mut *conn)
                .await
                .map_err(store_error)?;
            let Some(row) = row else { continue };
            let outcome: String = row.try_get("outcome").map_err(|e| corrupt("outcome", e))?;
            match outcome.as_str() {
                "busy" => return Ok(TxClaimOutcome::Busy),
                "existing" => return Ok(TxClaimOutcome::Existing(decode_record(&row)?)),
                _ => {}
            }
            return Ok(TxClaimOutcome::Acquired {
                claim: won_claim(decode_record(&row)?, token, proposed)?,
                transaction: (),
            });
        }
        Err(kept_racing())
    }

    /// Begins the holder's transaction and locks the claimed row in it,
    /// bounding the transaction's idle time and each of its statements by
    /// the lease (`hold.sql`). `None`: another attempt took the claim over in between.
    async fn hold(
        &self,
        claim: &Claim,
        lease: Duration,
    ) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>, StoreError> {
        let mut tx = crate::dialect::begin_detached(&self.pool, None)
            .await
            .map_err(store_error)?;
        // The idle and statement timeouts are ints of milliseconds; 0
        // would mean "none".
        let lease_ms = i64::try_from(lease.as_millis())
            .unwrap_or(i64::MAX)
            .clamp(1, i64::from(i32::MAX));
        let held = sqlx::query(&self.extra.sql.hold)
            .bind(&claim.scope)
            .bind(&claim.key)
            .bind(claim.token.0)
            .bind(lease_ms.to_string())
            .fetch_optional(&mut *tx)
            .await;
        match held {
            Ok(Some(_)) => Ok(Some(tx)),
            Ok(None) => {
                tx.rollback().await.map_err(store_error)?;
                Ok(None)
            }
            // Locked by another transaction (NOWAIT): a takeover got in
            // between and holds it; the key is busy.
            Err(e) if <Postgres as crate::Dialect>::is_lock_timeout(&e) => {
                tx.rollback().await.map_err(store_error)?;
                Ok(None)
            }
            Err(e) => {
                // Best effort: the error may have broken the connection.
                let _ = tx.rollback().await;
                Err(store_error(e))
            }
        }
    }
}

impl ClaimInTransaction for SqlStore<Postgres> {
    type Transaction = sqlx::Transaction<'static, sqlx::Postgres>;

    fn claim_and_begin<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<TxClaimOutcome<Self::Transaction>, StoreError>> {
        Box::pin(async move {
            let claim = match self.claim_held_inner(request).await? {
                TxClaimOutcome::Acquired { claim, .. } => claim,
                TxClaimOutcome::Existing(record) => return Ok(TxClaimOutcome::Existing(record)),
                TxClaimOutcome::Busy => return Ok(TxClaimOutcome::Busy),
            };
            match self.hold(&claim, request.lease).await? {
                Some(transaction) => Ok(TxClaimOutcome::Acquired { claim, transaction }),
                None => Ok(TxClaimOutcome::Busy),
            }
        })
    }
}
