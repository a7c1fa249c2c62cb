//! Completing a record in the caller's transaction, and beginning one.

use idem_core::{
    BeginTransaction, BoxFuture, Claim, StoreError, StoredResponse, TransactionalStore,
};

use super::{RecordDialect, SqlStore};
use crate::dialect::{Arg, Conn, Transaction};
use crate::{fenced, store_error};

impl<D: RecordDialect> SqlStore<D> {
    /// Completes `claim` with `response` on `conn`, usually the handler's
    /// open transaction, so that the record commits with the business
    /// write.
    ///
    /// Fenced by the claim's token: if the claim was taken over (or already
    /// completed), nothing is written and [`StoreError::ClaimLost`] is
    /// returned; the caller must then roll its transaction back, so its
    /// effect does not commit a second time.
    pub async fn complete_in(
        &self,
        conn: &mut Conn<D>,
        claim: &Claim,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let headers = response.encode_headers();
        let args = completion_args(claim, response, &headers);
        fenced(D::execute(conn, &self.sql.complete, &args).await)
    }

    /// Whether the record already stands completed under `claim`'s token
    /// with `response`: a completion that landed, sent again.
    pub(crate) async fn landed(
        &self,
        conn: &mut Conn<D>,
        claim: &Claim,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let headers = response.encode_headers();
        let args = completion_args(claim, response, &headers);
        let row = D::fetch_optional(conn, &self.sql.completed, &args)
            .await
            .map_err(store_error)?;
        Ok(row.is_some())
    }
}

/// A completion's arguments (`complete.sql`, `completed.sql`): $1 scope,
/// $2 key, $3 token, $4 status, $5 headers (`headers`, the response's
/// encoded), $6 body.
fn completion_args<'a>(
    claim: &'a Claim,
    response: &'a StoredResponse,
    headers: &'a [u8],
) -> [Arg<'a>; 6] {
    [
        Arg::Text(&claim.scope),
        Arg::Text(&claim.key),
        Arg::Int(claim.token.0),
        Arg::Int(i64::from(response.status)),
        Arg::Bytes(headers),
        Arg::Bytes(&response.body),
    ]
}

impl<D: RecordDialect> TransactionalStore<Conn<D>> for SqlStore<D> {
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut Conn<D>,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.complete_in(conn, claim, response))
    }
}

impl<D: RecordDialect> BeginTransaction for SqlStore<D> {
    type Transaction = Transaction<D>;
    type Connection = Conn<D>;

    /// A write transaction ([`Dialect::begin_write`](crate::Dialect::begin_write))
    /// on the store's [`writers`](SqlStore::writers).
    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        Box::pin(async move { D::begin_write(&self.writers).await.map_err(store_error) })
    }
    fn connection(tx: &mut Self::Transaction) -> &mut Conn<D> {
        tx
    }
    fn commit(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.commit().await.map_err(store_error) })
    }
    fn rollback(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.rollback().await.map_err(store_error) })
    }
}
