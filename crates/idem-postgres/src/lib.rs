//! The PostgreSQL store for idem: durable, shared by every instance of a
//! service, with the record committed in the same transaction as the
//! business write.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store, StoredResponse};
//! use idem_postgres::{complete_in_tx, PostgresStore, TableName};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let table = TableName::new(Some("billing"), "idem_records")?;
//! let store = PostgresStore::connect_with("postgres://postgres@127.0.0.1/test", table).await?;
//! let request = ClaimRequest {
//!     scope: "client-1".into(),
//!     key: "key-1".into(),
//!     fingerprint: Fingerprint::of_request("POST", "/payments", None, b"{}"),
//!     lease: Duration::from_secs(30),
//!     retention: Duration::from_secs(86_400),
//! };
//! if let ClaimOutcome::Acquired(claim) = store.claim(&request).await? {
//!     let mut tx = store.pool().begin().await?;
//!     // ... the business write on `tx` ...
//!     let response = StoredResponse { status: 201, headers: vec![], body: "{}".into() };
//!     complete_in_tx(&mut tx, store.table(), &claim, &response).await?; // fenced by the token
//!     tx.commit().await?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Time
//!
//! Leases and retention are read against the **database's** clock (`now()`),
//! so instances whose clocks drift apart still agree on when a lease ends.
//!
//! # Why the claim is correct under READ COMMITTED
//!
//! A claim starts with a first look (`sql/claim_first.sql`): one statement
//! that reads the key's row and, only if there is none, inserts the claim
//! (`INSERT … SELECT … WHERE NOT EXISTS … ON CONFLICT DO NOTHING`). So the
//! two common cases cost one statement each, and a repeat writes and locks
//! nothing:
//!
//! - a key never seen is claimed by the insert;
//! - a record that answers the request without a claim is returned as it
//!   was read: a completed record (a replay, or `422` for another body),
//!   another request's record (`422`), a claim under a live lease (`409`).
//!   A completed record never changes until it is past its retention, and
//!   the in-flight answer is only ever "try again later", so a plain read
//!   answers these as surely as a locking one would.
//!
//! Anything else (a record past its retention, a lease run out, an insert
//! that met a row committed after the read's snapshot) runs one statement
//! that decides: `INSERT … ON CONFLICT (scope, key) DO UPDATE … WHERE
//! <claimable> RETURNING …`, with a fallback `SELECT` of the existing row
//! in the same statement.
//!
//! - Two callers inserting the same new key meet at the primary key: the
//!   second waits for the first to commit, then takes the deciding path.
//! - On conflict, PostgreSQL locks the row and evaluates the `WHERE` against
//!   its latest committed version, not the statement's snapshot. So two
//!   callers cannot both see an expired lease: the second waits for the
//!   first's row lock and then sees the new lease, and its `WHERE` is false.
//! - The fallback `SELECT` reads the statement's snapshot. If the row it lost
//!   to was committed after that snapshot was taken, the statement returns no
//!   row at all; the store then runs it again (a second round trip, only in
//!   that race).
//!
//! Completion and release are `UPDATE … WHERE token = $mine AND state =
//! 'in_progress'`, which READ COMMITTED re-checks against the latest row
//! version after any wait: a token replaced by a takeover matches nothing.
//!
//! # A claim held by the business transaction
//!
//! [`ClaimInTransaction::claim_and_begin`](idem_core::ClaimInTransaction::claim_and_begin) commits the claim first (the first
//! look's insert, or a deciding `UPDATE`), so the key is bound to the
//! request and its operation id before any effect; the committed claim's
//! lease has already run out, for the transaction is its lease. Then it
//! begins the caller's transaction and locks the claim's row in it (`FOR
//! UPDATE NOWAIT`, fenced by the token; a lock, not an update, so claimers'
//! unique checks never wait on it), setting the transaction's
//! `idle_in_transaction_session_timeout` to the lease. The deciding
//! statement looks for the row with `FOR UPDATE SKIP LOCKED`, so a duplicate
//! never waits on a holder:
//!
//! - locked by an open transaction: [`TxClaimOutcome::Busy`](idem_core::TxClaimOutcome::Busy) (`409`);
//! - unlocked, lease run out: its holder's transaction ended without
//!   completing it (rolled back, or died with its connection), so the same
//!   request takes it over at once, under the same operation id;
//! - unlocked with a live lease: a default-mode claim in flight: busy;
//! - another request's claim, or a completed record: its fingerprint is
//!   there to judge (`422`, or a replay).
//!
//! The handler must complete the record in its transaction: one that
//! commits without completing leaves the claim looking abandoned until the
//! layer completes it, and a duplicate arriving in that moment runs again
//! (under the same operation id).
//!
//! A takeover between the claim's commit and the lock is caught by the
//! token: the holder is told the key is busy before it ran anything. It
//! needs READ COMMITTED (PostgreSQL's default).

use idem_core::{
    BeginTransaction, BoxFuture, Claim, ClaimOutcome, ClaimRequest, FencingToken, OperationId,
    Record, Store, StoreError, StoredResponse, TransactionalStore,
};
use idem_sql::migrate::Migration;
use idem_sql::{decode_record, fenced};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::Row;

mod claim;
mod conns;
mod held;
mod ops;
mod pool;
mod sql;

pub use pool::{open_pool, DEFAULT_ACQUIRE_TIMEOUT, IDLE_CHECK_AFTER};

pub use idem_sql::{is_unavailable, store_error};
pub use idem_sql::{InvalidIdentifier, SqlRecords, TableName};

use claim::{corrupt, first_look, kept_racing, won_claim, ClaimBinds, FirstLook, CLAIM_TURNS};
use conns::ClaimConnections;
pub use conns::CLAIM_CONNECTIONS;
use sql::{complete_sql, Sql};

/// The embedded migrations of the records' table, in order. The SQL names the
/// table `{table}` and derives its index's name from `{name}`; see [`TableName`].
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/postgres/0001_records.sql"),
}];

/// The PostgreSQL store; see the crate-level docs.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    table: TableName,
    sql: std::sync::Arc<Sql>,
    claims: std::sync::Arc<ClaimConnections>,
}

impl PostgresStore {
    /// Connects to `url` and applies the migrations, with the default table
    /// (`idem_records` on the `search_path`).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, TableName::default()).await
    }

    /// Connects to `url` and applies the migrations to `table` (creating its
    /// schema if needed).
    pub async fn connect_with(url: &str, table: TableName) -> Result<Self, StoreError> {
        let pool = open_pool(url).await.map_err(store_error)?;
        let store = Self::new(pool, table);
        store.migrate().await?;
        Ok(store)
    }

    /// Uses an existing pool. Call [`PostgresStore::migrate`] once if the
    /// table may be missing.
    ///
    /// Claims run on up to [`CLAIM_CONNECTIONS`] of `pool`'s connections,
    /// which the store keeps checked out between claims (a claim is one
    /// statement, and sqlx checks every connection it takes back with a
    /// round trip of its own). They count in the pool's `max_connections`:
    /// give the pool a few more than the business work needs.
    pub fn new(pool: PgPool, table: TableName) -> Self {
        let sql = std::sync::Arc::new(Sql::new(&table));
        let claims = std::sync::Arc::new(ClaimConnections::new());
        Self {
            pool,
            table,
            sql,
            claims,
        }
    }

    /// The pool, for the application's own queries and transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table records live in.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    async fn claim_inner(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut checkout = self
            .claims
            .checkout(&self.pool)
            .await
            .map_err(store_error)?;
        let outcome = self.claim_on(checkout.conn(), req).await?;
        checkout.keep();
        Ok(outcome)
    }

    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let binds = ClaimBinds::new(req);
        let token = FencingToken::generate();
        let proposed = OperationId::generate();
        let first = binds
            .query(&self.sql.claim_first, proposed, token)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store_error)?;
        match first_look(req, token, proposed, first)? {
            FirstLook::New(claim) => return Ok(ClaimOutcome::Acquired(claim)),
            FirstLook::Existing(record) => return Ok(ClaimOutcome::Existing(record)),
            FirstLook::Undecided => {}
        }
        // Normally one turn. A second only when the row we lost to was
        // committed after the statement's snapshot (see the crate docs), or
        // was swept in between.
        for _ in 0..CLAIM_TURNS {
            let token = FencingToken::generate();
            let proposed = OperationId::generate();
            let row = binds
                .query(&self.sql.claim, proposed, token)
                .fetch_optional(&mut *conn)
                .await
                .map_err(store_error)?;
            let Some(row) = row else { continue };
            let won: bool = row.try_get("won").map_err(|e| corrupt("won", e))?;
            let record = decode_record(&row)?;
            if !won {
                return Ok(ClaimOutcome::Existing(record));
            }
            return Ok(ClaimOutcome::Acquired(won_claim(record, token, proposed)?));
        }
        Err(kept_racing())
    }
}

/// Applies idem's [`MIGRATIONS`] to `table`, under an advisory lock (see
/// [`idem_sql::migrate`]).
pub async fn migrate(pool: &PgPool, table: &TableName) -> Result<(), idem_sql::MigrateError> {
    idem_sql::migrate::migrate::<idem_sql::Postgres>(pool, table, MIGRATIONS).await
}

/// Completes `claim` with `response` on `conn`, usually the handler's open
/// transaction, so that the record commits with the business write.
///
/// Fenced by the claim's token: if the claim was taken over (or completed
/// already), nothing is written and [`StoreError::ClaimLost`] is returned.
/// The caller must then roll its transaction back (dropping it does): its
/// effect must not commit.
pub async fn complete_in_tx(
    conn: &mut PgConnection,
    table: &TableName,
    claim: &Claim,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    complete_with(conn, &complete_sql(table), claim, response).await
}

async fn complete_with(
    conn: &mut PgConnection,
    sql: &str,
    claim: &Claim,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    fenced(
        sqlx::query(sql)
            .bind(&claim.scope)
            .bind(&claim.key)
            .bind(claim.token.0)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(response.body.as_ref())
            .execute(&mut *conn)
            .await
            .map(|done| done.rows_affected()),
    )
}

impl TransactionalStore<PgConnection> for PostgresStore {
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(complete_with(conn, &self.sql.complete, claim, response))
    }
}

impl BeginTransaction for PostgresStore {
    type Transaction = sqlx::Transaction<'static, sqlx::Postgres>;
    type Connection = PgConnection;

    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        Box::pin(async move { self.pool.begin().await.map_err(idem_sql::store_error) })
    }
    fn connection(tx: &mut Self::Transaction) -> &mut PgConnection {
        tx
    }
    fn commit(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.commit().await.map_err(idem_sql::store_error) })
    }
    fn rollback(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.rollback().await.map_err(idem_sql::store_error) })
    }
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(self.claim_inner(request))
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            complete_with(&mut conn, &self.sql.complete, claim, response).await
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            fenced(
                sqlx::query(&self.sql.release)
                    .bind(&claim.scope)
                    .bind(&claim.key)
                    .bind(claim.token.0)
                    .execute(&self.pool)
                    .await
                    .map(|done| done.rows_affected()),
            )
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let row = sqlx::query(&self.sql.get)
                .bind(scope)
                .bind(key)
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            row.map(|r| decode_record(&r)).transpose()
        })
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query(&self.sql.sweep)
                .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}
