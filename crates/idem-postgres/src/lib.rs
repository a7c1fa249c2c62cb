//! The PostgreSQL store for idem: durable, shared by every instance of a
//! service, with the record committed in the same transaction as the
//! business write.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store, StoredResponse};
//! use idem_postgres::{PostgresStore, TableName};
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
//!     store.complete_in(&mut tx, &claim, &response).await?; // fenced by the token
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
//!   row at all: a new row is not in the snapshot, and a row the winner
//!   replaced (a record past its retention, a lease run out) is refused by
//!   the fallback's own test of the `WHERE`'s condition, rather than
//!   answered as it was before (an old record's replay, or a `422` for the
//!   request that won). The store then runs it again (a second round trip,
//!   only in that race).
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
//! `idle_in_transaction_session_timeout` to the lease, and its
//! `statement_timeout` too unless the session's own is shorter: a holder
//! idle, or stuck in one statement, longer than the lease loses the
//! transaction and with it the key. The deciding
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

pub use idem_sql::store::{
    postgres_pool as open_pool, PgExtra, CLAIM_CONNECTIONS, DEFAULT_ACQUIRE_TIMEOUT,
    IDLE_CHECK_AFTER,
};
pub use idem_sql::{
    is_unavailable, store_error, InvalidIdentifier, Postgres, SqlRecords, TableName,
};

/// The PostgreSQL store; see the crate-level docs. It is
/// [`idem_sql::SqlStore`] on the [`Postgres`] dialect, whose claims are
/// its own (a first look, claim connections, claims held by the business
/// transaction).
pub type PostgresStore = idem_sql::SqlStore<Postgres>;

/// Applies idem's migrations of the records' table to `table`, under an
/// advisory lock (see [`idem_sql::migrate`]).
pub async fn migrate(pool: &sqlx::PgPool, table: &TableName) -> Result<(), idem_sql::MigrateError> {
    idem_sql::migrate::migrate::<Postgres>(pool, table, PostgresStore::migrations()).await
}
