//! The MySQL / MariaDB store for idem: durable, shared by every instance of
//! a service, with the record committed in the same transaction as the
//! business write, fenced by the claim's token. For MySQL 8 and MariaDB
//! 10.6+, on InnoDB.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store, StoredResponse};
//! use idem_mysql::{MySqlStore, TableName};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let table = TableName::new(Some("billing"), "idem_records")?; // database `billing`
//! let store = MySqlStore::connect_with("mysql://root@127.0.0.1:3306/test", table).await?;
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
//! # InnoDB, and what the store does about it
//!
//! - **No `RETURNING`.** A key never seen is claimed by one plain insert
//!   after the first look, whose lease is counted from the clock that look
//!   read, so nothing needs reading back: a new key costs two statements
//!   before the handler. Any other claim (a racing insert lost on the
//!   primary key, a record past its retention, a lease run out) is a write
//!   transaction of an upsert (`INSERT … ON DUPLICATE KEY UPDATE`, whose
//!   first assignment decides) and a locking read of the row back: the
//!   caller won when the token there is its own. See [`idem_sql::store`].
//!   The insert commits once sent, as PostgreSQL's first look does: a
//!   caller that stops waiting for it (a client gone, a store time-out)
//!   leaves a claim nobody holds, freed when its lease runs out.
//! - **Sessions must commit each statement by themselves** (`autocommit =
//!   1`, the server's default). In one that does not (a pool's hook, or a
//!   server whose default is 0) the store's one-statement writes (a new
//!   key's insert, a completion the layer stores after the handler, a
//!   release, a sweep) would stay open on their connection, and a
//!   completion never committed lets a retry run the request again once
//!   the lease is over: every claim there is refused with the reason.
//! - **Stale snapshots.** REPEATABLE READ (InnoDB's default) would let a
//!   plain `SELECT` after a wait read a snapshot from before it: the store's
//!   write transactions run under READ COMMITTED, and its reads after a
//!   write lock the row (`FOR UPDATE`).
//! - **Gap locks.** A `SELECT … FOR UPDATE` of a missing row locks the gap
//!   and deadlocks racing inserts: the claim inserts first.
//! - **Deadlocks** (1213) mean "retry the transaction": the claim does, a
//!   few times, then reports the store unavailable (`503` with
//!   `Retry-After`).
//! - **Lock waits.** A row another transaction holds (a handler past its
//!   lease that completed the record and has not committed) is waited for
//!   at most 2 s by the claim's transaction, or the session's
//!   `innodb_lock_wait_timeout` if lower, where InnoDB waits 50 s by
//!   default, with a connection taken. Past it (1205) the claim reports the
//!   store unavailable at once: the next turn would wait for the same
//!   transaction. The bound is the session's setting, set with the
//!   transaction's `START TRANSACTION` and put back with its `COMMIT`
//!   (kept meanwhile in the session variable `@idem_lock_wait`): neither
//!   MySQL's `SET_VAR` hint nor MariaDB's `SET STATEMENT` bounds one
//!   statement on both. A claim that stops half-way closes its connection
//!   rather than hand it on with the bound still set.
//! - **Collations and index limits.** Scope and key are kept as their
//!   UTF-8 bytes and compared byte for byte (no collation folds `Key` into
//!   `key` or pads `a ` to `a`: two keys, as on every other store), and fit
//!   InnoDB's 3072-byte index key together: a scope of more than 2048
//!   bytes is refused with an error that says so (hash long scopes), never
//!   truncated.
//! - **Time** is the database's clock (`UTC_TIMESTAMP(6)`, whatever the
//!   session's time zone), in milliseconds, so instances whose clocks drift
//!   apart still agree on when a lease ends.
//! - **DDL commits by itself**: migrations run under a named lock
//!   (`GET_LOCK`) and are written to be run again after an interruption.

pub use idem_sql::dialect::{
    mysql_pool as open_pool, MYSQL_ACQUIRE_TIMEOUT as DEFAULT_ACQUIRE_TIMEOUT,
};
pub use idem_sql::{is_unavailable, store_error, MySql, SqlRecords, TableName};

/// The MySQL / MariaDB store; see the crate-level docs.
pub type MySqlStore = idem_sql::SqlStore<MySql>;

/// Applies idem's migrations of the records' table to `table` on `pool`
/// (see [`idem_sql::migrate`]).
pub async fn migrate(
    pool: &sqlx::MySqlPool,
    table: &TableName,
) -> Result<(), idem_sql::MigrateError> {
    idem_sql::migrate::migrate::<MySql>(pool, table, MySqlStore::migrations()).await
}
