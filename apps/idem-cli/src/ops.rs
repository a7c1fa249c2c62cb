//! [`Ops`]: what the CLI's verbs need of a store, for every store at once.

use idem_core::{Inspection, StoreError, StoreStats};
use idem_outbox::{DeadLetter, OutboxDialect, OutboxStats};
use idem_sql::{ErrorClass, SqlRecords};

/// A store the CLI operates: the records' table and the outbox beside it.
pub(crate) trait Ops: SqlRecords {
    /// Creates or upgrades the records table.
    async fn migrate_records(&self) -> Result<(), StoreError>;
    /// One record, past its retention or not, with the database's clock.
    async fn inspect_record(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Inspection>, StoreError>;
    /// The records by state.
    async fn record_stats(&self) -> Result<StoreStats, StoreError>;
    /// Whether an open transaction holds the record (PostgreSQL's claim
    /// held by the transaction).
    async fn row_held(&self, scope: &str, key: &str) -> Result<bool, StoreError>;
    /// The outbox `table`'s counts and at most `limit` dead letters.
    async fn outbox(
        &self,
        table: &idem_outbox::OutboxTable,
        limit: i64,
    ) -> Result<(OutboxStats, Vec<DeadLetter>), sqlx::Error>;
}

/// Every SQL store, whichever its database, once.
impl<S> Ops for S
where
    S: SqlRecords,
    S::Dialect: OutboxDialect,
{
    async fn migrate_records(&self) -> Result<(), StoreError> {
        self.migrate().await
    }
    async fn inspect_record(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Inspection>, StoreError> {
        self.inspect(scope, key).await
    }
    async fn record_stats(&self) -> Result<StoreStats, StoreError> {
        self.stats().await
    }
    async fn row_held(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        SqlRecords::held_by_transaction(self, scope, key).await
    }
    async fn outbox(
        &self,
        table: &idem_outbox::OutboxTable,
        limit: i64,
    ) -> Result<(OutboxStats, Vec<DeadLetter>), sqlx::Error> {
        let pool = self.records_pool();
        Ok((
            table.stats(pool).await?,
            table.dead_letters(pool, limit).await?,
        ))
    }
}

/// Whether `e` comes from a table that does not exist, by what the
/// database's dialect says (never by its words).
pub(crate) fn is_missing_table(e: &StoreError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(sqlx) = s.downcast_ref::<sqlx::Error>() {
            return idem_sql::classify(sqlx) == ErrorClass::MissingTable;
        }
        source = s.source();
    }
    false
}
