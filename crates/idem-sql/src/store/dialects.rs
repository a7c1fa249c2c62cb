//! [`RecordDialect`]: the databases [`SqlStore`](super::SqlStore) keeps
//! records on, and their statements (`sql/<dialect>/`).

use idem_core::{BoxFuture, ClaimOutcome, ClaimRequest, StoreError};

use super::SqlStore;
use crate::dialect::{sealed, Dialect, Pool};
use crate::migrate::Migration;
use crate::TableName;

/// What a dialect's record statements are made from (`sql/<dialect>/`).
#[derive(Debug)]
#[doc(hidden)]
pub struct RecordTemplates {
    pub(super) migrations: &'static [Migration],
    pub(super) claim: &'static str,
    pub(super) select: &'static str,
    pub(super) get: &'static str,
    pub(super) complete: &'static str,
    pub(super) completed: &'static str,
    pub(super) release: &'static str,
    pub(super) sweep: &'static str,
    pub(super) stats: &'static str,
    /// The longest scope the table holds, in bytes.
    pub(super) max_scope: Option<usize>,
    /// The longest key the table holds, in bytes.
    pub(super) max_key: Option<usize>,
    /// A new key claimed by one plain insert (SQLite, MySQL), or `None`:
    /// every claim the first look did not answer runs the claim's
    /// transaction.
    pub(super) new_key: Option<NewKeyTemplates>,
    /// The claim's transaction begun and ended by these scripts instead of
    /// [`Dialect::begin_write`] and a plain `COMMIT`/`ROLLBACK`, or `None`.
    pub(super) claim_bound: Option<BoundedClaim>,
}

/// A claim transaction whose lock waits a session setting bounds: set by
/// the script that begins it, put back by the one that ends it, each sent
/// as one text, so the bound costs no round trip. A connection that does
/// not reach its end cleanly (an error there, a caller who stopped
/// waiting) is closed, never handed back with the bound still set.
#[derive(Debug)]
#[doc(hidden)]
pub(super) struct BoundedClaim {
    pub(super) begin: &'static str,
    pub(super) commit: &'static str,
    pub(super) rollback: &'static str,
}

/// MySQL's claim transaction. A record's row held by another transaction
/// (a handler past its lease that completed the record, not yet
/// committed) is waited for at most 2 s (`innodb_lock_wait_timeout`, or
/// the session's own if lower), where InnoDB's default waits 50 s with a
/// connection taken. Neither MySQL 8's `SET_VAR` hint (InnoDB's variables
/// are not among those it sets) nor MariaDB's `SET STATEMENT` (MariaDB's
/// alone) bounds one statement on both, hence the session's setting, kept
/// in `@idem_lock_wait` meanwhile.
#[cfg(feature = "mysql")]
const MYSQL_BOUNDED_CLAIM: BoundedClaim = BoundedClaim {
    begin: "SET @idem_lock_wait = @@SESSION.innodb_lock_wait_timeout; \
            SET SESSION innodb_lock_wait_timeout = LEAST(@idem_lock_wait, 2); \
            SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
            START TRANSACTION",
    commit: "COMMIT; SET SESSION innodb_lock_wait_timeout = @idem_lock_wait",
    rollback: "ROLLBACK; SET SESSION innodb_lock_wait_timeout = @idem_lock_wait",
};

/// A new key's claim in one statement that commits by itself, tried when
/// the first look found no record; a row holding the key (a claim that
/// raced it, or a record past its retention) makes it fail on the primary
/// key, and the claim's transaction decides then.
#[derive(Debug)]
#[doc(hidden)]
pub(super) enum NewKeyTemplates {
    /// The database returns what it inserted (SQLite): the insert takes its
    /// times from the database's clock as it runs, on the writers' pool
    /// ([`Dialect::writers`]), and returns `locked_until`. The first look
    /// stays the plain read `get`.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Returning {
        /// The insert; `$1` scope, `$2` key, `$3` fingerprint, `$4`
        /// operation id, `$5` token, `$6` lease (ms), `$7` retention (ms).
        insert: &'static str,
    },
    /// It cannot (MySQL): a first look that always reports the database's
    /// clock, and an insert, on the same connection, whose times are taken
    /// from it.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    Clocked {
        /// The first look, one row even when there is no record (its
        /// columns `NULL`), with the clock in `now` and whether the session
        /// commits each statement by itself in `autocommit`; `$1` scope,
        /// `$2` key.
        first: &'static str,
        /// The insert; `$6` locked_until, `$7` created_at, `$8` expires_at,
        /// `$9` the retention (ms).
        insert: &'static str,
    },
}

/// A [`Dialect`] whose records [`SqlStore`] keeps: SQLite, PostgreSQL and
/// MySQL. Each may claim its own way (PostgreSQL: a first look that
/// inserts, claim connections kept between claims, claims held by the
/// business transaction); the rest of the store is written once.
pub trait RecordDialect: Dialect + sealed::Sealed {
    /// The statements.
    #[doc(hidden)]
    const RECORDS: RecordTemplates;

    /// What `{columns}` becomes in the statements: a record's columns, as
    /// [`decode_record`](crate::decode_record) reads them.
    #[doc(hidden)]
    const COLUMNS: &'static str = "";

    /// What `{expired}` becomes: a record past its retention and not held
    /// under a live lease.
    #[doc(hidden)]
    const EXPIRED: &'static str = "";

    /// What a store keeps beside its pool and statements for its claims.
    #[doc(hidden)]
    type Extra: std::fmt::Debug + Send + Sync + 'static;

    /// Makes the [`Extra`](Self::Extra) of a store of `table`.
    #[doc(hidden)]
    fn extra(table: &TableName) -> Result<Self::Extra, sqlx::Error>;

    /// Opens a pool on `url` with idem's defaults for this database.
    #[doc(hidden)]
    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>>;

    /// Claims `req`: by default the first look, then (for a key it found
    /// no record of) one insert, then the claim's write transaction (see
    /// [`crate::store`]).
    #[doc(hidden)]
    fn claim<'a>(
        store: &'a SqlStore<Self>,
        req: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>>
    where
        Self: Sized,
    {
        Box::pin(store.claim_generic(req))
    }
}

#[cfg(feature = "sqlite")]
impl RecordDialect for crate::Sqlite {
    const RECORDS: RecordTemplates = RecordTemplates {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../../sql/sqlite/records_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../../sql/sqlite/records_0002.sql"),
            },
        ],
        claim: include_str!("../../sql/sqlite/claim.sql"),
        select: include_str!("../../sql/sqlite/select.sql"),
        get: include_str!("../../sql/sqlite/get.sql"),
        complete: include_str!("../../sql/sqlite/complete.sql"),
        completed: include_str!("../../sql/sqlite/completed.sql"),
        release: include_str!("../../sql/sqlite/release.sql"),
        sweep: include_str!("../../sql/sqlite/sweep.sql"),
        stats: include_str!("../../sql/sqlite/stats.sql"),
        max_scope: None,
        max_key: None,
        new_key: Some(NewKeyTemplates::Returning {
            insert: include_str!("../../sql/sqlite/insert.sql"),
        }),
        claim_bound: None,
    };
    type Extra = ();

    fn extra(_: &TableName) -> Result<(), sqlx::Error> {
        Ok(())
    }

    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(crate::dialect::sqlite_pool(url))
    }
}

#[cfg(feature = "mysql")]
impl RecordDialect for crate::MySql {
    const RECORDS: RecordTemplates = RecordTemplates {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../../sql/mysql/records_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../../sql/mysql/records_0002.sql"),
            },
        ],
        claim: include_str!("../../sql/mysql/claim.sql"),
        select: include_str!("../../sql/mysql/select.sql"),
        get: include_str!("../../sql/mysql/get.sql"),
        complete: include_str!("../../sql/mysql/complete.sql"),
        completed: include_str!("../../sql/mysql/completed.sql"),
        release: include_str!("../../sql/mysql/release.sql"),
        sweep: include_str!("../../sql/mysql/sweep.sql"),
        stats: include_str!("../../sql/mysql/stats.sql"),
        max_scope: Some(2048),
        max_key: Some(1020),
        new_key: Some(NewKeyTemplates::Clocked {
            first: include_str!("../../sql/mysql/first.sql"),
            insert: include_str!("../../sql/mysql/insert.sql"),
        }),
        claim_bound: Some(MYSQL_BOUNDED_CLAIM),
    };
    type Extra = ();

    fn extra(_: &TableName) -> Result<(), sqlx::Error> {
        Ok(())
    }

    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(crate::dialect::mysql_pool(url))
    }
}
