//! The embedded SQLite store for idem.
//!
//! One process, no server: the database file is created if missing, put in
//! WAL mode with a busy timeout, and migrated on [`SqliteStore::connect`].
//! Handlers that write to the same database can complete the idempotency
//! record **in their own transaction** with [`complete_in_tx`], so that the
//! business write and the record commit together or not at all.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store, StoredResponse};
//! use idem_sqlite::{complete_in_tx, SqliteStore};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! let request = ClaimRequest {
//!     scope: "client-1".into(),
//!     key: "key-1".into(),
//!     fingerprint: Fingerprint::of_request("POST", "/payments", None, b"{}"),
//!     lease: Duration::from_secs(30),
//!     retention: Duration::from_secs(86_400),
//! };
//! let ClaimOutcome::Acquired(claim) = store.claim(&request).await? else { unreachable!() };
//!
//! let mut tx = store.pool().begin().await?;
//! // ... the business write on `tx` ...
//! let response = StoredResponse { status: 201, headers: vec![], body: "{}".into() };
//! complete_in_tx(&mut tx, &claim, &response).await?; // fenced by the claim's token
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # How the claim stays atomic
//!
//! The claim is one `INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING`
//! statement: it inserts a new record, replaces one past its retention, or
//! takes over an expired lease of the same request, and returns no row when
//! none of these apply. SQLite runs each statement under its database write
//! lock, so two racing claims cannot both get a row back. Only when the claim
//! did not win is the existing record read, for the caller to decide on.

use std::str::FromStr;
use std::time::Duration;

use idem_core::{
    BeginTransaction, BoxFuture, Claim, ClaimOutcome, ClaimRequest, FencingToken, Inspection,
    OperationId, Record, Store, StoreError, StoreStats, StoredResponse, TransactionalStore,
    UnixMillis,
};
use idem_sql::migrate::Migration;
use idem_sql::{decode_record, decode_stats, fenced};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::Row;

/// The embedded migrations of the records' table, in order.
///
/// idem keeps its own version table (`idem_schema_migrations`) rather than
/// sqlx's `_sqlx_migrations`, so that it never collides with the
/// application's own sqlx migrations in the same database.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/sqlite/0001_records.sql"),
}];

/// How long a connection waits for SQLite's write lock before failing.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The SQLite store; see the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

pub use idem_sql::{is_unavailable, store_error};

/// Connection options idem uses for a SQLite URL: the file created if
/// missing, WAL journal, `synchronous = FULL` (a committed record survives a
/// power cut, not only a crash), foreign keys on, and a busy timeout.
pub fn connect_options(url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true)
        .busy_timeout(DEFAULT_BUSY_TIMEOUT))
}

/// Opens a pool on `url` with [`connect_options`]. An in-memory database gets
/// a single connection, since each SQLite connection to `:memory:` would
/// otherwise see a database of its own.
pub async fn open_pool(url: &str) -> Result<SqlitePool, sqlx::Error> {
    let options = connect_options(url)?;
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut pool = SqlitePoolOptions::new().acquire_timeout(DEFAULT_BUSY_TIMEOUT);
    if in_memory {
        pool = pool
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    }
    pool.connect_with(options).await
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` (`sqlite:idem.db`,
    /// `sqlite::memory:`, …) and applies idem's migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = open_pool(url).await.map_err(store_error)?;
        let store = Self { pool };
        store.migrate().await?;
        Ok(store)
    }

    /// Uses an existing pool. Call [`SqliteStore::migrate`] once before use
    /// if the tables may be missing.
    pub fn from_pool(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// The pool, for the application's own queries and transactions.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Applies the embedded migrations that have not run yet. Safe to call
    /// from several processes at once: each migration runs in an immediate
    /// transaction that also records its version.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool).await.map_err(store_error)
    }

    /// Reads a record as an operator sees it, past its retention or not.
    pub async fn inspect(&self, scope: &str, key: &str) -> Result<Option<Inspection>, StoreError> {
        let now = UnixMillis::now();
        Ok(self
            .fetch(scope, key)
            .await?
            .map(|record| Inspection { record, now }))
    }

    /// Counts records by state, for operators.
    pub async fn stats(&self) -> Result<StoreStats, StoreError> {
        let now = UnixMillis::now();
        let row = sqlx::query(STATS_SQL)
            .bind(now.0)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        decode_stats(&row, now)
    }

    async fn claim_inner(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        // A claim that loses reads the winner's record; if that record is
        // swept between the two statements, claim again (bounded).
        for _ in 0..5 {
            let now = UnixMillis::now();
            let token = FencingToken::generate();
            let operation_id = OperationId::generate();
            let locked_until = now.plus(req.lease);
            let won = sqlx::query(CLAIM_SQL)
                .bind(&req.scope)
                .bind(&req.key)
                .bind(req.fingerprint.as_bytes().as_slice())
                .bind(operation_id.0.to_string())
                .bind(token.0)
                .bind(locked_until.0)
                .bind(now.0)
                .bind(now.plus(req.retention).0)
                .fetch_optional(&self.pool)
                .await
                .map_err(store_error)?;
            if let Some(row) = won {
                let stored_op =
                    parse_operation_id(&row.try_get::<String, _>(0).map_err(store_error)?)?;
                return Ok(ClaimOutcome::Acquired(Claim {
                    scope: req.scope.clone(),
                    key: req.key.clone(),
                    token,
                    operation_id: stored_op,
                    locked_until,
                    takeover: stored_op != operation_id,
                }));
            }
            if let Some(record) = self.fetch(&req.scope, &req.key).await? {
                return Ok(ClaimOutcome::Existing(record));
            }
        }
        Err(StoreError::Backend(
            "the record kept vanishing between claim and read".into(),
        ))
    }

    async fn fetch(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(SELECT_SQL)
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
        row.map(|r| decode_record(&r)).transpose()
    }
}

/// Applies idem's [`MIGRATIONS`] on `pool` (see [`idem_sql::migrate`]).
pub async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_sqlite(pool, "idem_records", MIGRATIONS).await
}

// The statements, as they run, from `sql/` (each file says its parameters).
const CLAIM_SQL: &str = include_str!("../sql/claim.sql");
const SELECT_SQL: &str = include_str!("../sql/select.sql");
const COMPLETE_SQL: &str = include_str!("../sql/complete.sql");
const RELEASE_SQL: &str = include_str!("../sql/release.sql");
const SWEEP_SQL: &str = include_str!("../sql/sweep.sql");
const STATS_SQL: &str = include_str!("../sql/stats.sql");

fn parse_operation_id(s: &str) -> Result<OperationId, StoreError> {
    uuid::Uuid::parse_str(s)
        .map(OperationId)
        .map_err(|e| StoreError::Corrupt(format!("operation id {s:?}: {e}")))
}

/// Completes `claim` with `response` on `conn`, usually the handler's open
/// transaction, so that the record commits with the business write.
///
/// Fenced by the claim's token: if the claim was taken over (or already
/// completed), nothing is written and [`StoreError::ClaimLost`] is returned.
/// The caller must then roll its transaction back (dropping it does), so that
/// its effect does not commit a second time.
pub async fn complete_in_tx(
    conn: &mut SqliteConnection,
    claim: &Claim,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    fenced(
        sqlx::query(COMPLETE_SQL)
            .bind(&claim.scope)
            .bind(&claim.key)
            .bind(claim.token.0)
            .bind(UnixMillis::now().0)
            .bind(i64::from(response.status))
            .bind(response.encode_headers())
            .bind(response.body.as_ref())
            .execute(&mut *conn)
            .await
            .map(|done| done.rows_affected()),
    )
}

impl TransactionalStore<SqliteConnection> for SqliteStore {
    fn complete_in_tx<'a>(
        &'a self,
        conn: &'a mut SqliteConnection,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(complete_in_tx(conn, claim, response))
    }
}

impl BeginTransaction for SqliteStore {
    type Transaction = sqlx::Transaction<'static, sqlx::Sqlite>;
    type Connection = SqliteConnection;

    /// An immediate transaction: the write lock first, so two writers wait
    /// for each other instead of failing at their first write.
    fn begin_transaction(&self) -> BoxFuture<'_, Result<Self::Transaction, StoreError>> {
        Box::pin(async move {
            self.pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(idem_sql::store_error)
        })
    }
    fn connection(tx: &mut Self::Transaction) -> &mut SqliteConnection {
        tx
    }
    fn commit(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.commit().await.map_err(idem_sql::store_error) })
    }
    fn rollback(tx: Self::Transaction) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move { tx.rollback().await.map_err(idem_sql::store_error) })
    }
}

impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
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
            complete_in_tx(&mut conn, claim, response).await
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            fenced(
                sqlx::query(RELEASE_SQL)
                    .bind(&claim.scope)
                    .bind(&claim.key)
                    .bind(claim.token.0)
                    .bind(UnixMillis::now().0)
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
            let now = UnixMillis::now();
            Ok(self.fetch(scope, key).await?.filter(|r| !r.is_expired(now)))
        })
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query(SWEEP_SQL)
                .bind(UnixMillis::now().0)
                .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(done.rows_affected())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn fresh() -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        (SqliteStore::connect(&url).await.expect("connect"), dir)
    }

    mod suite {
        // Each case gets its own database file, removed when the case ends.
        idem_store_suite::store_suite!(|| super::fresh());
    }

    mod transactional {
        idem_store_suite::transactional_suite!(|| async {
            let (store, dir) = super::fresh().await;
            let pool = store.pool().clone();
            (store, pool, dir)
        });
    }

    #[tokio::test]
    async fn migrations_are_idempotent_and_the_file_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested.db");
        let url = format!("sqlite:{}", path.display());
        let a = SqliteStore::connect(&url).await.unwrap();
        assert!(path.exists());
        a.migrate().await.unwrap();
        let b = SqliteStore::connect(&url).await.unwrap();
        let v: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_schema_migrations")
            .fetch_one(b.pool())
            .await
            .unwrap();
        assert_eq!(v, MIGRATIONS.len() as i64);
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(b.pool())
            .await
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[tokio::test]
    async fn a_bad_url_is_an_error_not_a_panic() {
        assert!(SqliteStore::connect("sqlite:/nonexistent-dir/x/y.db")
            .await
            .is_err());
        assert!(SqliteStore::connect("postgres://nope").await.is_err());
    }
}
