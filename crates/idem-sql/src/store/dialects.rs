//! [`RecordDialect`]: the databases [`SqlStore`](super::SqlStore) keeps
//! records on, and their statements (`sql/<dialect>/`).

use idem_core::BoxFuture;

use crate::dialect::{sealed, Dialect, Pool};
use crate::migrate::Migration;

/// What a dialect's record statements are made from (`sql/<dialect>/`).
#[derive(Debug)]
#[doc(hidden)]
pub struct RecordTemplates {
    pub(super) migrations: &'static [Migration],
    pub(super) claim: &'static str,
    pub(super) select: &'static str,
    pub(super) get: &'static str,
    pub(super) complete: &'static str,
    pub(super) release: &'static str,
    pub(super) sweep: &'static str,
    pub(super) stats: &'static str,
    /// The longest scope the table holds, in bytes.
    pub(super) max_scope: Option<usize>,
}

/// A [`Dialect`] whose records [`SqlStore`](super::SqlStore) keeps (SQLite and MySQL;
/// PostgreSQL has a store of its own, `idem-postgres`, with a first look
/// and claims held by the business transaction).
pub trait RecordDialect: Dialect + sealed::Sealed {
    /// The statements.
    #[doc(hidden)]
    const RECORDS: RecordTemplates;

    /// Opens a pool on `url` with idem's defaults for this database.
    #[doc(hidden)]
    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>>;
}

#[cfg(feature = "sqlite")]
impl RecordDialect for crate::Sqlite {
    const RECORDS: RecordTemplates = RecordTemplates {
        migrations: &[Migration {
            version: 1,
            sql: include_str!("../../sql/sqlite/records_0001.sql"),
        }],
        claim: include_str!("../../sql/sqlite/claim.sql"),
        select: include_str!("../../sql/sqlite/select.sql"),
        get: include_str!("../../sql/sqlite/get.sql"),
        complete: include_str!("../../sql/sqlite/complete.sql"),
        release: include_str!("../../sql/sqlite/release.sql"),
        sweep: include_str!("../../sql/sqlite/sweep.sql"),
        stats: include_str!("../../sql/sqlite/stats.sql"),
        max_scope: None,
    };

    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(crate::dialect::sqlite_pool(url))
    }
}

#[cfg(feature = "mysql")]
impl RecordDialect for crate::MySql {
    const RECORDS: RecordTemplates = RecordTemplates {
        migrations: &[Migration {
            version: 1,
            sql: include_str!("../../sql/mysql/records_0001.sql"),
        }],
        claim: include_str!("../../sql/mysql/claim.sql"),
        select: include_str!("../../sql/mysql/select.sql"),
        get: include_str!("../../sql/mysql/get.sql"),
        complete: include_str!("../../sql/mysql/complete.sql"),
        release: include_str!("../../sql/mysql/release.sql"),
        sweep: include_str!("../../sql/mysql/sweep.sql"),
        stats: include_str!("../../sql/mysql/stats.sql"),
        max_scope: Some(2048),
    };

    fn open_pool(url: &str) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(crate::dialect::mysql_pool(url))
    }
}
