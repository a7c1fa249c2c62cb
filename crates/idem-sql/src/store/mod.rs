//! [`SqlStore`]: the idempotency records on SQLite or MySQL, written once.
//!
//! # How the claim stays atomic
//!
//! A repeat is answered by a first look, one plain read that writes and
//! locks nothing: a completed record, another request's record, or a claim
//! under a live lease (see `first_look`). A key it found no record of is
//! first claimed by one insert (below). Anything else is claimed by one
//! write transaction ([`Dialect::begin_write`]) of two
//! statements. The first (`sql/<dialect>/claim.sql`) is an upsert that
//! inserts a new record, replaces one past its retention, or takes over an
//! expired lease of the same request, and otherwise changes nothing. The
//! second reads the row back, holding its lock (SQLite's write
//! transaction holds the whole database; MySQL's upsert locked the row, and
//! the read is a locking read): the caller won exactly when the token there
//! is the one it proposed. So two racing claims cannot both win, and a
//! loser sees the winner's record as committed. A deadlock
//! ([`ErrorClass::RetryTransaction`]) runs the transaction again, a few
//! times; a lock wait timed out ([`Dialect::is_lock_timeout`]: a
//! transaction holds the row for long) ends the claim as unavailable. On
//! MySQL the transaction's lock waits are bounded (2 s; see
//! `idem_mysql`).
//!
//! A key the first look found no record of is first claimed by one plain
//! insert that commits by itself (`sql/<dialect>/insert.sql`): the primary
//! key lets one racing insert through, and any other (or a key whose
//! record is past its retention) fails on it and goes to the transaction
//! above. One statement where the transaction takes four (`BEGIN`, the
//! upsert, the read, `COMMIT`); on SQLite, where the whole file has one
//! writer, that statement is all every other writer waits for. Like
//! PostgreSQL's first look, the insert commits once sent: a caller that
//! stops waiting for it leaves a claim that is freed when its lease runs
//! out.
//!
//! - On SQLite the insert queues for the writers' connection
//!   ([`Dialect::writers`]), takes its times from the database's clock as
//!   it runs and returns the lease it stored (`RETURNING`). It is read to
//!   its end, so a failed commit (a full disk, an `fsync` that failed) is
//!   its error, and the claim is reported only once committed. It relies
//!   on that connection committing each statement by itself, as sqlx hands
//!   out every pooled connection (a transaction begun through sqlx is
//!   rolled back when its connection comes back); a `BEGIN` sent as a plain
//!   statement and left open there would take the claim into it.
//! - On MySQL, which cannot return what it inserted, the first look reports
//!   the database's clock even when it finds nothing, and the insert's
//!   lease is counted from it, so the claim knows its lease without reading
//!   it back: two statements for a new key instead of five. The insert runs
//!   on the first look's connection. A session that does not commit each
//!   statement by itself (the first look reads `@@autocommit`) is refused:
//!   there none of the store's one-statement writes would commit. A key
//!   longer than the table holds is refused
//!   before (never cut short to fit). A record past its retention goes to
//!   the transaction straight away (the first look marks it `stale`): an
//!   insert could only fail on it.

use std::sync::Arc;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, FencingToken, OperationId, Record, RecordState,
    Store, StoreError, StoredResponse, UnixMillis,
};

use crate::dialect::{Arg, Dialect, ErrorClass, Pool, Statement, Transaction, Value};
use crate::migrate::Migration;
use crate::{fenced, store_error, TableName};

mod dialects;
#[cfg(feature = "postgres")]
mod postgres;
mod records;
mod tx;

use dialects::NewKeyTemplates;
pub use dialects::RecordDialect;
#[doc(hidden)]
pub use dialects::RecordTemplates;
#[cfg(feature = "postgres")]
pub use postgres::{
    open_pool as postgres_pool, PgExtra, CLAIM_CONNECTIONS, DEFAULT_ACQUIRE_TIMEOUT,
    IDLE_CHECK_AFTER,
};
pub use records::SqlRecords;

/// The longest name a records table may have, in bytes: its index is
/// `<name>_expires_at`, which must fit the 63 bytes of a PostgreSQL
/// identifier (MySQL's 64).
pub const MAX_RECORD_TABLE_NAME: usize = 52;

/// The record statements, made for one table.
#[derive(Debug)]
struct RecordSql<D> {
    claim: Statement<D>,
    select: Statement<D>,
    /// `select` without its lock (MySQL's is a locking read, for the
    /// claim's transaction): an operator's read.
    inspect: Statement<D>,
    get: Statement<D>,
    complete: Statement<D>,
    completed: Statement<D>,
    release: Statement<D>,
    sweep: Statement<D>,
    stats: Statement<D>,
    new_key: Option<NewKeySql<D>>,
}

/// A new key's claim in one insert (`dialects::NewKeyTemplates`).
#[derive(Debug)]
enum NewKeySql<D> {
    /// SQLite: the insert returns the lease it stored.
    Returning { insert: Statement<D> },
    /// MySQL: the first look reports the clock the insert's times are from.
    Clocked {
        first: Statement<D>,
        insert: Statement<D>,
    },
}

impl<D: RecordDialect> RecordSql<D> {
    fn new(table: &TableName) -> Result<Self, sqlx::Error> {
        let t = &D::RECORDS;
        let prepare = |template: &str| {
            let filled = template
                .replace("{columns}", D::COLUMNS.trim())
                .replace("{expired}", D::EXPIRED.trim());
            Statement::prepare(&filled, table)
        };
        Ok(Self {
            claim: prepare(t.claim)?,
            select: prepare(t.select)?,
            inspect: prepare(
                t.select
                    .trim_end()
                    .strip_suffix("FOR UPDATE")
                    .unwrap_or(t.select),
            )?,
            get: prepare(t.get)?,
            complete: prepare(t.complete)?,
            completed: prepare(t.completed)?,
            release: prepare(t.release)?,
            sweep: prepare(t.sweep)?,
            stats: prepare(t.stats)?,
            new_key: match &t.new_key {
                Some(NewKeyTemplates::Returning { insert }) => Some(NewKeySql::Returning {
                    insert: prepare(insert)?,
                }),
                Some(NewKeyTemplates::Clocked { first, insert }) => Some(NewKeySql::Clocked {
                    first: prepare(first)?,
                    insert: prepare(insert)?,
                }),
                None => None,
            },
        })
    }
}

/// How many times a claim's transaction runs when the database asks for a
/// retry (a deadlock, a lock wait time-out) or the row vanished (swept).
const CLAIM_TURNS: usize = 5;

/// The idempotency records in a SQL table, on SQLite
/// (`idem_sqlite::SqliteStore`) or MySQL (`idem_mysql::MySqlStore`); see
/// the [module docs](self) for why its claim is atomic.
#[derive(Debug)]
pub struct SqlStore<D: RecordDialect> {
    pool: Pool<D>,
    /// Where its writes take their connection ([`Dialect::writers`]).
    writers: Pool<D>,
    table: TableName,
    sql: Arc<RecordSql<D>>,
    extra: Arc<D::Extra>,
}

/// A handle: clones share the pool, the statements and the claims' state.
impl<D: RecordDialect> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            writers: self.writers.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            extra: self.extra.clone(),
        }
    }
}

impl<D: RecordDialect> SqlStore<D> {
    /// Connects to `url` with idem's defaults for the database, and applies
    /// the migrations to the default table (`idem_records`).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, TableName::default()).await
    }

    /// Connects to `url` and applies the migrations to `table`.
    pub async fn connect_with(url: &str, table: TableName) -> Result<Self, StoreError> {
        let pool = D::open_pool(url).await.map_err(store_error)?;
        let store = Self::new(pool, table)?;
        store.migrate().await?;
        Ok(store)
    }

    /// The store on `pool`, in the default table (`idem_records`). Call
    /// [`migrate`](Self::migrate) once if the table may be missing.
    pub fn from_pool(pool: Pool<D>) -> Self {
        match Self::new(pool, TableName::default()) {
            Ok(store) => store,
            // The default table names no schema, which every database takes.
            Err(_) => unreachable!("the default table is valid on every database"),
        }
    }

    /// The store on `pool`, in `table`. Call [`migrate`](Self::migrate)
    /// once if the table may be missing. Fails when the table cannot live
    /// on this database (a schema on SQLite), or its name is longer than
    /// [`MAX_RECORD_TABLE_NAME`] bytes.
    pub fn new(pool: Pool<D>, table: TableName) -> Result<Self, StoreError> {
        let backend = |e: sqlx::Error| StoreError::Backend(Box::new(e));
        if table.table().len() > MAX_RECORD_TABLE_NAME {
            return Err(backend(sqlx::Error::Configuration(
                format!(
                    "the records table's name {:?} is longer than {MAX_RECORD_TABLE_NAME} bytes: the names made from it (its index, `<name>_expires_at`) would pass the 63 or 64 bytes a database takes (PostgreSQL cuts them short, and may find another table's index under the name cut)",
                    table.table()
                )
                .into(),
            )));
        }
        let sql = RecordSql::new(&table).map_err(backend)?;
        let extra = D::extra(&table).map_err(backend)?;
        Ok(Self {
            writers: D::writers(&pool),
            pool,
            table,
            sql: Arc::new(sql),
            extra: Arc::new(extra),
        })
    }

    /// The pool, for the application's own reads, and on PostgreSQL and
    /// MySQL its transactions too. On SQLite begin write transactions on
    /// [`writers`](Self::writers) (`BEGIN IMMEDIATE`): one begun here that
    /// reads, then writes while the writers' connection commits, fails at
    /// its write with `SQLITE_BUSY_SNAPSHOT` (its read went stale), which
    /// no busy timeout mends.
    pub fn pool(&self) -> &Pool<D> {
        &self.pool
    }

    /// The pool the store's own writes take their connection from, for the
    /// application's writes too ([`Dialect::writers`]): on SQLite one
    /// connection that this process's writers queue for, in order, instead
    /// of sleeping in SQLite's busy handler while the file is locked; on
    /// the other databases the same as [`pool`](Self::pool).
    ///
    /// Every writer of the file in this process belongs here (an outbox
    /// relay, an inbox too): a writer on another pool takes the file's lock
    /// between two turns, and the writer at the head of the queue then
    /// sleeps in the busy handler with every other writer behind it.
    /// Writers in other processes still meet the busy handler.
    ///
    /// A task that holds a connection of it (a write transaction open) must
    /// not wait for another: on SQLite that second write could never have
    /// run beside the first anyway (the file has one writer), but here it
    /// waits for the pool's acquire time-out rather than the busy timeout.
    pub fn writers(&self) -> &Pool<D> {
        &self.writers
    }

    /// The table records live in.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The migrations of the records' table, in order.
    pub fn migrations() -> &'static [Migration] {
        D::RECORDS.migrations
    }

    /// Refuses a scope or key longer than the table holds (MySQL's), so
    /// that neither is ever cut short to fit.
    fn check_sizes(&self, scope: &str, key: &str) -> Result<(), StoreError> {
        let t = &D::RECORDS;
        for (what, value, max, advice) in [
            (
                "scope",
                scope,
                t.max_scope,
                "hash long scopes before they reach idem",
            ),
            (
                "key",
                key,
                t.max_key,
                "keys are at most 255 bytes over HTTP",
            ),
        ] {
            if let Some(max) = max.filter(|max| value.len() > *max) {
                return Err(StoreError::Backend(
                    format!(
                        "a {what} of {} bytes does not fit {}'s records table \
                         (at most {max}): {advice}",
                        value.len(),
                        D::NAME
                    )
                    .into(),
                ));
            }
        }
        Ok(())
    }

    /// The claim of SQLite and MySQL: the first look, then (for a key it
    /// found no record of) one insert, then the claim's write transaction
    /// if neither decided.
    pub(crate) async fn claim_generic(
        &self,
        req: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        self.check_sizes(&req.scope, &req.key)?;
        // Past a century a lease or a retention means "for ever", and stays
        // far from overflowing the clock plus it in either path.
        let lease = idem_core::capped_millis(req.lease);
        let retention = idem_core::capped_millis(req.retention);
        {
            // One connection for the first look and (on MySQL) a new key's
            // insert, given back before the claim's transaction takes its
            // own; SQLite's insert queues for the writers' connection.
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            let inserted = match self.first_look(&mut conn, req).await? {
                Look::Answers(record) => return Ok(ClaimOutcome::Existing(record)),
                Look::Absent(clock) => match (&self.sql.new_key, clock) {
                    (Some(NewKeySql::Clocked { insert, .. }), Some(clock)) => {
                        self.insert_claim(&mut conn, insert, req, clock, lease, retention)
                            .await?
                    }
                    (Some(NewKeySql::Returning { insert }), _) => {
                        drop(conn);
                        self.insert_returning(insert, req, lease, retention).await?
                    }
                    _ => None,
                },
                Look::Undecided => None,
            };
            if let Some(claim) = inserted {
                return Ok(ClaimOutcome::Acquired(claim));
            }
        }
        let mut last = None;
        for _ in 0..CLAIM_TURNS {
            let proposal = Proposal::new();
            match self.claim_turn(&proposal.args(req, lease, retention)).await {
                Ok(Some(record)) => return decide(record, proposal.token, proposal.operation_id),
                Ok(None) => {}
                // A row held past the lock wait: held by a transaction that
                // is taking long, which the next turn would wait for again.
                Err(e) if D::is_lock_timeout(&e) => return Err(store_error(e)),
                Err(e) if D::classify(&e) == ErrorClass::RetryTransaction => last = Some(e),
                Err(e) => return Err(store_error(e)),
            }
        }
        Err(match last {
            Some(e) => store_error(e),
            None => StoreError::Backend("the record kept vanishing between claim and read".into()),
        })
    }

    /// A plain read, before any write or lock: the record when it answers
    /// the request without a claim. A completed record (a replay, or `422`
    /// for another body) never changes until it is past its retention,
    /// another request's record is `422` whatever happens to it, and a
    /// claim under a live lease is only ever "try again later": a read
    /// answers these as surely as the claim's transaction would, and a
    /// repeat costs one statement. Anything else (no record, or a lease run
    /// out) goes to the claim.
    async fn first_look(
        &self,
        conn: &mut crate::dialect::Conn<D>,
        req: &ClaimRequest,
    ) -> Result<Look, StoreError> {
        let args = [Arg::Text(&req.scope), Arg::Text(&req.key)];
        let (statement, clocked) = match &self.sql.new_key {
            Some(NewKeySql::Clocked { first, .. }) => (first, true),
            _ => (&self.sql.get, false),
        };
        let Some(row) = D::fetch_optional(conn, statement, &args)
            .await
            .map_err(store_error)?
        else {
            return Ok(Look::Absent(None));
        };
        let now = now_of::<D>(&row)?;
        let column = |name: &str| {
            D::get(&row, name)
                .map(Value::into_owned)
                .map_err(|e| StoreError::Corrupt(format!("the first look's {name}: {e}")))
        };
        // The first look with the clock (MySQL's) says whether the session
        // commits each statement by itself. One that does not would never
        // commit the store's one-statement writes (a new key's insert, a
        // completion the layer stores after the handler, a release): a
        // completion left open on its connection lets a retry run the
        // request again once the lease is over. Refused, with the reason.
        if clocked && !matches!(column("autocommit")?, Value::Int(1)) {
            return Err(StoreError::Backend(
                "this MySQL session does not commit each statement by itself \
                 (autocommit = 0, by a pool's hook or the server's default): \
                 idem's completions and releases would never commit; give \
                 the store a pool whose sessions run with autocommit = 1"
                    .into(),
            ));
        }
        if matches!(column("scope")?, Value::Null) {
            // Only the first look with the clock returns a row without a
            // record.
            return Ok(Look::Absent(Some(now)));
        }
        if clocked && matches!(column("stale")?, Value::Int(1)) {
            // Past its retention: replaced by the claim's transaction.
            return Ok(Look::Undecided);
        }
        let record = D::decode_record(&row)?;
        let answers = record.fingerprint != req.fingerprint
            || match &record.state {
                RecordState::Completed { .. } => true,
                RecordState::InProgress { locked_until, .. } => *locked_until > now,
            };
        Ok(if answers {
            Look::Answers(record)
        } else {
            Look::Undecided
        })
    }

    /// A new key's claim in one insert, its times from `clock` (the first
    /// look's): the claim, or `None` when a row holds the key (the claim's
    /// transaction decides then) or the database asked for a retry.
    async fn insert_claim(
        &self,
        conn: &mut crate::dialect::Conn<D>,
        insert: &Statement<D>,
        req: &ClaimRequest,
        clock: UnixMillis,
        lease: i64,
        retention: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let proposal = Proposal::new();
        let locked_until = clock.0.saturating_add(lease);
        let args = [
            Arg::Text(&req.scope),
            Arg::Text(&req.key),
            Arg::Bytes(req.fingerprint.as_bytes()),
            Arg::Text(&proposal.id),
            Arg::Int(proposal.token.0),
            Arg::Int(locked_until),
            Arg::Int(clock.0),
            Arg::Int(clock.0.saturating_add(retention)),
            Arg::Int(retention),
        ];
        match D::execute(conn, insert, &args).await {
            Ok(_) => Ok(Some(inserted_claim(
                req,
                proposal.token,
                proposal.operation_id,
                UnixMillis(locked_until),
            ))),
            Err(e) => lost_insert::<D>(e),
        }
    }

    /// A new key's claim in one insert that commits by itself on the
    /// writers' connection, its times the database's clock as it runs: the
    /// claim with the lease the insert returns, or `None` when a row holds
    /// the key (the claim's transaction decides then) or the database asked
    /// for a retry.
    async fn insert_returning(
        &self,
        insert: &Statement<D>,
        req: &ClaimRequest,
        lease: i64,
        retention: i64,
    ) -> Result<Option<Claim>, StoreError> {
        let proposal = Proposal::new();
        let args = proposal.args(req, lease, retention);
        let mut conn = self.writers.acquire().await.map_err(store_error)?;
        // Every row read, not the first alone: the statement then runs to
        // its end and commits there, so a failed commit is its error. Read
        // for one row, sqlx's SQLite worker resets the statement after that
        // row, which commits it too, but drops any error the reset returns:
        // a claim that never committed would be reported acquired.
        let rows = match D::fetch_all(&mut conn, insert, &args).await {
            Ok(rows) => rows,
            Err(e) => return lost_insert::<D>(e),
        };
        drop(conn);
        let [row] = rows.as_slice() else {
            return Err(StoreError::Corrupt(format!(
                "a new key's insert returned {} rows, not one",
                rows.len()
            )));
        };
        let locked_until = D::get(row, "locked_until")
            .and_then(|v| v.int("locked_until"))
            .map_err(|e| StoreError::Corrupt(format!("the inserted claim's lease: {e}")))?;
        Ok(Some(inserted_claim(
            req,
            proposal.token,
            proposal.operation_id,
            UnixMillis(locked_until),
        )))
    }

    /// One claim transaction: the upsert, then the row read back.
    async fn claim_turn(&self, args: &[Arg<'_>]) -> Result<Option<Record>, sqlx::Error> {
        if let Some(bound) = &D::RECORDS.claim_bound {
            return self.bounded_claim_turn(bound, args).await;
        }
        let mut tx: Transaction<D> = D::begin_write(&self.writers).await?;
        let staged = async {
            D::execute(&mut tx, &self.sql.claim, args).await?;
            D::fetch_optional(&mut tx, &self.sql.select, &args[..2]).await
        }
        .await;
        let row = crate::finish(tx, staged).await?;
        row.map(|r| D::decode_record(&r))
            .transpose()
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))
    }
}

impl<D: RecordDialect> SqlStore<D> {
    /// [`claim_turn`](Self::claim_turn) in a transaction begun and ended by
    /// `bound`'s scripts (see [`dialects::BoundedClaim`]). The connection
    /// goes back to the pool only once an end script ran; anything else
    /// (an error there, a caller who stopped waiting) closes it, so no
    /// session is handed on inside the transaction or with the bound set.
    async fn bounded_claim_turn(
        &self,
        bound: &dialects::BoundedClaim,
        args: &[Arg<'_>],
    ) -> Result<Option<Record>, sqlx::Error> {
        let mut conn = ClosedUnlessKept::new(self.writers.acquire().await?);
        D::run_script(conn.get(), bound.begin).await?;
        let staged = async {
            D::execute(conn.get(), &self.sql.claim, args).await?;
            D::fetch_optional(conn.get(), &self.sql.select, &args[..2]).await
        }
        .await;
        let row = match staged {
            Ok(row) => {
                D::run_script(conn.get(), bound.commit).await?;
                row
            }
            Err(e) => {
                // A failed rollback leaves the connection to be closed; the
                // error that matters is `e`.
                if D::run_script(conn.get(), bound.rollback).await.is_ok() {
                    conn.keep();
                }
                return Err(e);
            }
        };
        conn.keep();
        row.map(|r| D::decode_record(&r))
            .transpose()
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))
    }
}

/// A pooled connection that is closed when dropped, unless [`keep`]
/// (Self::keep) hands it back to the pool: for a session left in a state
/// the pool's next user must not inherit until a statement puts it back.
struct ClosedUnlessKept<DB: sqlx::Database> {
    conn: sqlx::pool::PoolConnection<DB>,
    kept: bool,
}

impl<DB: sqlx::Database> ClosedUnlessKept<DB> {
    fn new(conn: sqlx::pool::PoolConnection<DB>) -> Self {
        Self { conn, kept: false }
    }

    /// The connection.
    fn get(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }

    /// Hands the connection back to the pool: its session is clean.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl<DB: sqlx::Database> Drop for ClosedUnlessKept<DB> {
    fn drop(&mut self) {
        if !self.kept {
            self.conn.close_on_drop();
        }
    }
}

/// A claim's fresh token and operation id, proposed to the database.
struct Proposal {
    token: FencingToken,
    operation_id: OperationId,
    /// The operation id as the statements bind it.
    id: String,
}

impl Proposal {
    fn new() -> Self {
        let operation_id = OperationId::generate();
        Self {
            token: FencingToken::generate(),
            id: operation_id.0.to_string(),
            operation_id,
        }
    }

    /// The arguments of `claim.sql` and of SQLite's `insert.sql`: `$1`
    /// scope, `$2` key, `$3` fingerprint, `$4` operation id, `$5` token,
    /// `$6` lease and `$7` retention (ms).
    fn args<'a>(&'a self, req: &'a ClaimRequest, lease: i64, retention: i64) -> [Arg<'a>; 7] {
        [
            Arg::Text(&req.scope),
            Arg::Text(&req.key),
            Arg::Bytes(req.fingerprint.as_bytes()),
            Arg::Text(&self.id),
            Arg::Int(self.token.0),
            Arg::Int(lease),
            Arg::Int(retention),
        ]
    }
}

/// What a new key's failed insert means: a row holds the key, or the
/// database asked for a retry (`None`: the claim's transaction decides),
/// or the error itself.
fn lost_insert<D: Dialect>(e: sqlx::Error) -> Result<Option<Claim>, StoreError> {
    match D::classify(&e) {
        ErrorClass::UniqueViolation | ErrorClass::RetryTransaction => Ok(None),
        _ => Err(store_error(e)),
    }
}

/// The claim on a record this attempt inserted: its own token and
/// operation id, no takeover.
fn inserted_claim(
    req: &ClaimRequest,
    token: FencingToken,
    operation_id: OperationId,
    locked_until: UnixMillis,
) -> Claim {
    Claim {
        scope: req.scope.clone(),
        key: req.key.clone(),
        token,
        operation_id,
        locked_until,
        takeover: false,
    }
}

/// What the first look found.
enum Look {
    /// A record that answers the request without a claim.
    Answers(Record),
    /// No record, at the database's clock where the first look reports it
    /// (MySQL's).
    Absent(Option<UnixMillis>),
    /// A record that does not answer it (a lease run out), or a session
    /// whose insert would not commit by itself: the claim's transaction.
    Undecided,
}

/// The claim's outcome from the record read back after the upsert.
fn decide(
    record: Record,
    token: FencingToken,
    proposed: OperationId,
) -> Result<ClaimOutcome, StoreError> {
    match record.state {
        RecordState::InProgress {
            token: held,
            locked_until,
        } if held == token => Ok(ClaimOutcome::Acquired(Claim {
            takeover: record.operation_id != proposed,
            scope: record.scope,
            key: record.key,
            token,
            operation_id: record.operation_id,
            locked_until,
        })),
        _ => Ok(ClaimOutcome::Existing(record)),
    }
}

/// The database's clock, from `row`'s column `now`.
fn now_of<D: Dialect>(row: &crate::dialect::Row<D>) -> Result<UnixMillis, StoreError> {
    let corrupt = |e: sqlx::Error| StoreError::Corrupt(format!("the database's clock: {e}"));
    let value = D::get(row, "now").map_err(corrupt)?;
    Ok(UnixMillis(value.int("now").map_err(corrupt)?))
}

impl<D: RecordDialect> Store for SqlStore<D> {
    fn kind(&self) -> &'static str {
        D::NAME
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        D::claim(self, request)
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.writers.acquire().await.map_err(store_error)?;
            match self.complete_in(&mut conn, claim, response).await {
                // Sent again after it landed (the commit's answer was lost,
                // and the caller tried again): it stands. A lookup that
                // fails says so: whether the claim was lost is not known,
                // and a caller retrying an unavailable store finds out.
                Err(StoreError::ClaimLost) => match self.landed(&mut conn, claim, response).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(StoreError::ClaimLost),
                    Err(e) => Err(e),
                },
                done => done,
            }
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.writers.acquire().await.map_err(store_error)?;
            let args = [
                Arg::Text(&claim.scope),
                Arg::Text(&claim.key),
                Arg::Int(claim.token.0),
            ];
            fenced(D::execute(&mut conn, &self.sql.release, &args).await)
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.pool.acquire().await.map_err(store_error)?;
            let row = D::fetch_optional(
                &mut conn,
                &self.sql.get,
                &[Arg::Text(scope), Arg::Text(key)],
            )
            .await
            .map_err(store_error)?;
            row.map(|r| D::decode_record(&r)).transpose()
        })
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let mut conn = self.writers.acquire().await.map_err(store_error)?;
            let batch = i64::try_from(batch).unwrap_or(i64::MAX);
            D::execute(&mut conn, &self.sql.sweep, &[Arg::Int(batch)])
                .await
                .map_err(store_error)
        })
    }
}
