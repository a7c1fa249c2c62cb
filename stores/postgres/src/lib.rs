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
//! A claim first tries a plain `INSERT … ON CONFLICT DO NOTHING`: a key never
//! seen is claimed by the cheapest statement there is. On any conflict it
//! runs one statement that decides: `INSERT … ON CONFLICT (scope, key) DO
//! UPDATE … WHERE <claimable> RETURNING …`, with a fallback `SELECT` of the
//! existing row in the same statement.
//!
//! - Two callers inserting the same new key meet at the primary key: the
//!   second waits for the first to commit, then takes the conflict path.
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
//! [`ClaimInTransaction::claim_and_begin`] commits the claim first (the plain
//! insert, or on a conflict a deciding `UPDATE`), so the key is bound to the
//! request and its operation id before any effect; the committed claim's
//! lease has already run out, for the transaction is its lease. Then it
//! begins the caller's transaction and locks the claim's row in it (`FOR
//! UPDATE NOWAIT`, fenced by the token; a lock, not an update, so claimers'
//! unique checks never wait on it), setting the transaction's
//! `idle_in_transaction_session_timeout` to the lease. The deciding
//! statement looks for the row with `FOR UPDATE SKIP LOCKED`, so a duplicate
//! never waits on a holder:
//!
//! - locked by an open transaction: [`TxClaimOutcome::Busy`] (`409`);
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

use std::fmt;
use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimInTransaction, ClaimOutcome, ClaimRequest, FencingToken, Inspection,
    OperationId, Record, RecordState, Store, StoreError, StoreStats, StoredResponse,
    TransactionalStore, TxClaimOutcome, UnixMillis,
};
use idem_sql::decode_record;
use idem_sql::migrate::Migration;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::Row;

pub use idem_sql::{is_unavailable, store_error};

/// The embedded migrations of the records' table, in order. The SQL names the
/// table `{table}` and its index `{index}`; see [`TableName`].
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: include_str!("../migrations/postgres/0001_records.sql"),
}];

/// How long a request waits for a pooled connection before the store
/// answers [`StoreError::Unavailable`]: an outage becomes a prompt `503`,
/// never a hang.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// A (possibly schema-qualified) table name, validated and quoted, so that
/// two services can keep their records apart in one database.
///
/// ```
/// let t = idem_postgres::TableName::new(Some("billing"), "idem_records").unwrap();
/// assert_eq!(t.qualified(), r#""billing"."idem_records""#);
/// assert!(idem_postgres::TableName::new(None, "bad name; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a valid identifier: use 1 to 63 letters, digits or underscores, not starting with a digit")]
pub struct InvalidIdentifier(String);

fn valid_identifier(s: &str) -> Result<(), InvalidIdentifier> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !s.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(InvalidIdentifier(s.to_owned()))
    }
}

impl TableName {
    /// A table in `schema` (or, with `None`, wherever `search_path` finds it).
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, InvalidIdentifier> {
        if let Some(s) = schema {
            valid_identifier(s)?;
        }
        valid_identifier(table)?;
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// The quoted, qualified name for SQL.
    pub fn qualified(&self) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}\"", self.table),
            None => format!("\"{}\"", self.table),
        }
    }

    /// The schema, if one was given.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The bare table name.
    pub fn table(&self) -> &str {
        &self.table
    }
}

impl Default for TableName {
    /// `idem_records`, found through `search_path`.
    fn default() -> Self {
        Self {
            schema: None,
            table: "idem_records".to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualified())
    }
}

/// The statements, with the table name filled in once.
#[derive(Debug)]
struct Sql {
    claim_new: String,
    claim: String,
    claim_held: String,
    hold: String,
    select: String,
    get: String,
    complete: String,
    release: String,
    sweep: String,
    stats: String,
}

const COLUMNS: &str = "scope, key, fingerprint, operation_id::text AS operation_id, token, state,
    (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until,
    (extract(epoch FROM created_at) * 1000)::bigint AS created_at,
    (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at,
    (extract(epoch FROM completed_at) * 1000)::bigint AS completed_at,
    status::int8 AS status, headers, body";

/// How many columns [`COLUMNS`] selects.
const COLUMN_COUNT: usize = 13;

/// The claim's new row: $1 scope, $2 key, $3 fingerprint, $4 proposed
/// operation id, $5 new token, $6 lease (ms), $7 retention (ms).
const VALUES: &str = "VALUES ($1, $2, $3, $4::uuid, $5, 'in_progress',
            now() + $6 * interval '1 millisecond', now(), now() + $7 * interval '1 millisecond')";

/// The claim itself: insert the row, or take over an expired or released
/// one (see the crate docs for why this is safe under READ COMMITTED).
fn upsert(table: &str, values: &str) -> String {
    format!(
        "INSERT INTO {table} AS r
        (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at)
    {values}
    ON CONFLICT (scope, key) DO UPDATE SET
        token        = excluded.token,
        locked_until = excluded.locked_until,
        state        = 'in_progress',
        -- past its retention the record is replaced whole; a takeover keeps it
        fingerprint  = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint  ELSE r.fingerprint  END,
        operation_id = CASE WHEN r.expires_at <= now() THEN excluded.operation_id ELSE r.operation_id END,
        created_at   = CASE WHEN r.expires_at <= now() THEN excluded.created_at   ELSE r.created_at   END,
        expires_at   = CASE WHEN r.expires_at <= now() THEN excluded.expires_at   ELSE r.expires_at   END,
        completed_at = NULL,
        status       = NULL,
        headers      = NULL,
        body         = NULL
    WHERE
        -- past its retention, and not held under a live lease
        (r.expires_at <= now() AND (r.state = 'completed' OR r.locked_until <= now()))
        -- or an expired or released lease of the same request: take it over
        OR (r.state = 'in_progress' AND r.locked_until <= now() AND r.fingerprint = excluded.fingerprint)"
    )
}

/// A record past its retention and not held under a live lease.
const EXPIRED: &str = "(expires_at <= now() AND (state = 'completed' OR locked_until <= now()))";

impl Sql {
    fn new(t: &TableName) -> Self {
        let table = t.qualified();
        Self {
            // $1 scope, $2 key, $3 fingerprint, $4 proposed operation id,
            // $5 new token, $6 lease (ms), $7 retention (ms).
            // The common case, a key never seen: a plain insert. It returns
            // no row on any conflict, and `claim` then decides.
            claim_new: format!(
                "INSERT INTO {table}
        (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at)
    {VALUES}
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until"
            ),
            claim: format!(
                "WITH claimed AS (
    {upsert}
    RETURNING {COLUMNS}
)
SELECT true AS won, * FROM claimed
UNION ALL
SELECT false AS won, {COLUMNS} FROM {table}
WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)",
                upsert = upsert(&table, VALUES),
            ),
            // The deciding claim of a transaction-held claim (autocommit,
            // after the plain insert met a row). Such a claim commits with
            // its lease already run out (bound $6 = 0): the holder's
            // transaction, which locks the row, is its lease. So a row is
            // free to the same request only if no transaction holds its lock
            // (SKIP LOCKED) and its lease has run out: its holder's
            // transaction ended without completing it (rolled back, or died
            // with its connection), or it is a default-mode claim whose
            // lease ended (a live one is busy). Another request's live claim or a
            // live completed record is `existing` (422 or a replay); past
            // its retention and abandoned, a record is replaced whole. A
            // takeover keeps the record for at least another retention.
            // Same binds as `claim`.
            claim_held: format!(
                "WITH free AS MATERIALIZED (
    SELECT scope AS free_scope, key AS free_key FROM {table}
    WHERE scope = $1 AND key = $2
      AND ((state = 'in_progress' AND locked_until <= now() AND fingerprint = $3)
           OR {EXPIRED})
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {table} AS r SET
        token        = $5,
        state        = 'in_progress',
        locked_until = now() + $6 * interval '1 millisecond',
        -- past its retention the record is replaced whole; a takeover keeps it
        fingerprint  = CASE WHEN r.expires_at <= now() THEN $3          ELSE r.fingerprint  END,
        operation_id = CASE WHEN r.expires_at <= now() THEN $4::uuid    ELSE r.operation_id END,
        created_at   = CASE WHEN r.expires_at <= now() THEN now()       ELSE r.created_at   END,
        expires_at   = greatest(r.expires_at, now() + $7 * interval '1 millisecond'),
        completed_at = NULL,
        status       = NULL,
        headers      = NULL,
        body         = NULL
    FROM free
    WHERE r.scope = free.free_scope AND r.key = free.free_key
    RETURNING {COLUMNS}
),
live_other AS (
    -- a live completed record, or another request's claim
    SELECT {COLUMNS} FROM {table}
    WHERE scope = $1 AND key = $2 AND expires_at > now()
      AND (state = 'completed' OR fingerprint <> $3)
)
SELECT 'won' AS outcome, * FROM claimed
UNION ALL
SELECT 'existing', * FROM live_other WHERE NOT EXISTS (SELECT 1 FROM claimed)
UNION ALL
SELECT 'busy', {nulls} FROM {table}
WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)
  AND NOT EXISTS (SELECT 1 FROM live_other)",
                nulls = vec!["NULL"; COLUMN_COUNT].join(", "),
            ),
            // The first statement of the holder's transaction: lock the
            // claimed row for as long as the transaction lasts (NOWAIT:
            // another transaction holding it means the key is busy, never a
            // wait; a lock, not an update, so that claimers' unique checks
            // never wait on it), and end the session if the transaction sits
            // idle longer than the lease. $1 scope, $2 key, $3 token, $4 the
            // idle timeout (ms, text). No row: another attempt took the
            // claim over in between.
            hold: format!(
                "SELECT set_config('idle_in_transaction_session_timeout', $4, true) AS lease
FROM {table}
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
FOR UPDATE NOWAIT"
            ),
            select: format!("SELECT {COLUMNS} FROM {table} WHERE scope = $1 AND key = $2"),
            get: format!(
                "SELECT {COLUMNS} FROM {table} WHERE scope = $1 AND key = $2 AND NOT {EXPIRED}"
            ),
            complete: complete_sql(t),
            release: format!(
                "UPDATE {table} SET locked_until = least(locked_until, now())
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'"
            ),
            // Bounded: at most $1 rows, skipping rows another sweeper holds.
            sweep: format!(
                "DELETE FROM {table} WHERE (scope, key) IN (
    SELECT scope, key FROM {table} WHERE {EXPIRED}
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            stats: format!(
                "SELECT
    count(*) FILTER (WHERE state = 'in_progress'),
    count(*) FILTER (WHERE state = 'in_progress' AND locked_until <= now()),
    count(*) FILTER (WHERE state = 'completed'),
    count(*) FILTER (WHERE {EXPIRED}),
    (extract(epoch FROM min(created_at)) * 1000)::bigint,
    (extract(epoch FROM now()) * 1000)::bigint
FROM {table}"
            ),
        }
    }
}

fn complete_sql(t: &TableName) -> String {
    format!(
        "UPDATE {}
SET state = 'completed', locked_until = NULL, completed_at = now(),
    status = $4, headers = $5, body = $6
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'",
        t.qualified()
    )
}

/// The PostgreSQL store; see the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    table: TableName,
    sql: std::sync::Arc<Sql>,
}

/// Opens a pool with idem's defaults: a bounded acquire time-out, and every
/// connection checked before use (so a restarted server is picked up).
pub async fn open_pool(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
        .test_before_acquire(true)
        .connect(url)
        .await
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
    pub fn new(pool: PgPool, table: TableName) -> Self {
        let sql = std::sync::Arc::new(Sql::new(&table));
        Self { pool, table, sql }
    }

    /// The pool, for the application's own queries and transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table records live in.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Applies the embedded migrations that have not run yet. Several
    /// instances starting at once serialise on an advisory lock.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool, &self.table).await.map_err(store_error)
    }

    async fn claim_inner(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let binds = ClaimBinds::new(req);
        // One connection for both statements: one checkout, one health check.
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let token = FencingToken::generate();
        let proposed = OperationId::generate();
        let fresh = binds
            .query(&self.sql.claim_new, proposed, token)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store_error)?;
        if let Some(row) = fresh {
            return Ok(ClaimOutcome::Acquired(fresh_claim(
                req, token, proposed, &row,
            )?));
        }
        // Normally one turn. A second only when the row we lost to was
        // committed after the statement's snapshot (see the crate docs), or
        // was swept in between.
        for _ in 0..5 {
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
            let locked_until = match record.state {
                RecordState::InProgress { locked_until, .. } => locked_until,
                RecordState::Completed { .. } => {
                    return Err(StoreError::Corrupt(
                        "a won claim returned a completed record".into(),
                    ))
                }
            };
            return Ok(ClaimOutcome::Acquired(Claim {
                scope: record.scope,
                key: record.key,
                token,
                operation_id: record.operation_id,
                locked_until,
                takeover: record.operation_id != proposed,
            }));
        }
        Err(StoreError::Backend(
            "the claim kept racing; giving up after 5 tries".into(),
        ))
    }

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

/// Applies idem's [`MIGRATIONS`] to `table`, under an advisory lock (see
/// [`idem_sql::migrate`]).
pub async fn migrate(pool: &PgPool, table: &TableName) -> Result<(), sqlx::Error> {
    idem_sql::migrate::migrate_postgres(pool, table.schema(), table.table(), MIGRATIONS).await
}

/// What every claim statement binds: $1 scope, $2 key, $3 fingerprint, $4
/// proposed operation id, $5 token, $6 lease (ms), $7 retention (ms).
struct ClaimBinds<'q> {
    req: &'q ClaimRequest,
    lease: i64,
    retention: i64,
}

impl<'q> ClaimBinds<'q> {
    fn new(req: &'q ClaimRequest) -> Self {
        Self {
            req,
            lease: i64::try_from(req.lease.as_millis()).unwrap_or(i64::MAX),
            retention: i64::try_from(req.retention.as_millis()).unwrap_or(i64::MAX),
        }
    }

    /// The same binds with the lease run out at once: a claim that its
    /// holder's transaction will lock and lease (uncommitted).
    fn lease_held_by_transaction(mut self) -> Self {
        self.lease = 0;
        self
    }

    fn query<'s>(
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

/// The claim a plain insert made: a new record, this attempt's token and
/// proposed operation id, the lease the database computed.
fn fresh_claim(
    req: &ClaimRequest,
    token: FencingToken,
    operation_id: OperationId,
    row: &PgRow,
) -> Result<Claim, StoreError> {
    let locked_until: i64 = row
        .try_get("locked_until")
        .map_err(|e| corrupt("locked_until", e))?;
    Ok(Claim {
        scope: req.scope.clone(),
        key: req.key.clone(),
        token,
        operation_id,
        locked_until: UnixMillis(locked_until),
        takeover: false,
    })
}

fn corrupt(what: &str, e: sqlx::Error) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
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
    let done = sqlx::query(sql)
        .bind(&claim.scope)
        .bind(&claim.key)
        .bind(claim.token.0)
        .bind(i32::from(response.status))
        .bind(response.encode_headers())
        .bind(response.body.as_ref())
        .execute(&mut *conn)
        .await
        .map_err(store_error)?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(StoreError::ClaimLost)
    }
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

impl PostgresStore {
    /// The durable half of a transaction-held claim: the plain insert, then
    /// (on a conflict) the deciding statement that respects row locks.
    async fn claim_held_inner(&self, req: &ClaimRequest) -> Result<TxClaimOutcome<()>, StoreError> {
        let binds = ClaimBinds::new(req).lease_held_by_transaction();
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        // A row swept, or committed after a statement's snapshot, between
        // the two statements: try again (see the crate docs).
        for _ in 0..5 {
            let token = FencingToken::generate();
            let proposed = OperationId::generate();
            let fresh = binds
                .query(&self.sql.claim_new, proposed, token)
                .fetch_optional(&mut *conn)
                .await
                .map_err(store_error)?;
            if let Some(row) = fresh {
                return Ok(TxClaimOutcome::Acquired {
                    claim: fresh_claim(req, token, proposed, &row)?,
                    transaction: (),
                });
            }
            let token = FencingToken::generate();
            let row = binds
                .query(&self.sql.claim_held, proposed, token)
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
            let record = decode_record(&row)?;
            let RecordState::InProgress { locked_until, .. } = record.state else {
                return Err(StoreError::Corrupt(
                    "a won claim returned a completed record".into(),
                ));
            };
            let claim = Claim {
                scope: record.scope,
                key: record.key,
                token,
                operation_id: record.operation_id,
                locked_until,
                takeover: record.operation_id != proposed,
            };
            return Ok(TxClaimOutcome::Acquired {
                claim,
                transaction: (),
            });
        }
        Err(StoreError::Backend(
            "the claim kept racing; giving up after 5 tries".into(),
        ))
    }

    /// Begins the holder's transaction and locks the claimed row in it.
    /// `None`: another attempt took the claim over in between.
    async fn hold(
        &self,
        claim: &Claim,
        lease: Duration,
    ) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>, StoreError> {
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        // The idle timeout is an int of milliseconds; 0 would mean "none".
        let idle_ms = i64::try_from(lease.as_millis())
            .unwrap_or(i64::MAX)
            .clamp(1, i64::from(i32::MAX));
        let held = sqlx::query(&self.sql.hold)
            .bind(&claim.scope)
            .bind(&claim.key)
            .bind(claim.token.0)
            .bind(idle_ms.to_string())
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
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
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

impl ClaimInTransaction for PostgresStore {
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
            let done = sqlx::query(&self.sql.release)
                .bind(&claim.scope)
                .bind(&claim.key)
                .bind(claim.token.0)
                .execute(&self.pool)
                .await
                .map_err(store_error)?;
            if done.rows_affected() == 1 {
                Ok(())
            } else {
                Err(StoreError::ClaimLost)
            }
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
