//! PostgreSQL's records: [`SqlStore`] on the [`Postgres`] dialect, with
//! claims of its own (see `idem_postgres`'s docs for why each is correct
//! under READ COMMITTED):
//!
//! - a first look (`claim_first.sql`) that reads the key and, only if there
//!   is none, inserts the claim: a repeat writes and locks nothing, a new
//!   key costs one statement; the deciding upsert (`claim.sql`) runs only
//!   when it did not decide;
//! - claims run on a few of the pool's connections, kept checked out
//!   ([`conns`]);
//! - a claim held by the business transaction ([`held`]).

use idem_core::{BoxFuture, ClaimOutcome, ClaimRequest, FencingToken, OperationId, StoreError};
use sqlx::postgres::PgConnection;
use sqlx::Row;

use super::dialects::{RecordDialect, RecordTemplates};
use super::SqlStore;
use crate::migrate::Migration;
use crate::{decode_record, store_error, Postgres, TableName};

mod claim;
mod conns;
mod held;
mod pool;

use claim::{corrupt, first_look, kept_racing, won_claim, ClaimBinds, FirstLook, CLAIM_TURNS};
use conns::ClaimConnections;
pub use conns::CLAIM_CONNECTIONS;
pub use pool::{open_pool, DEFAULT_ACQUIRE_TIMEOUT, IDLE_CHECK_AFTER};

/// The statements PostgreSQL's own claims run, made for one table.
#[derive(Debug)]
pub(crate) struct PgSql {
    pub(crate) claim_first: String,
    pub(crate) claim: String,
    pub(crate) claim_held: String,
    pub(crate) hold: String,
}

/// What a PostgreSQL store keeps beside its pool: its claims' statements
/// and connections.
#[derive(Debug)]
pub struct PgExtra {
    sql: PgSql,
    claims: ClaimConnections,
}

const COLUMNS: &str = include_str!("../../../sql/postgres/columns.sql");
const EXPIRED: &str = include_str!("../../../sql/postgres/expired.sql");

/// A template of `sql/postgres/` made into the statement that runs on
/// `table`.
fn render(template: &str, table: &TableName) -> Result<String, sqlx::Error> {
    use crate::Dialect;
    Ok(template
        .replace("{columns}", COLUMNS.trim())
        .replace("{expired}", EXPIRED.trim())
        .replace("{table}", &Postgres::qualify(table)?))
}

impl RecordDialect for Postgres {
    const RECORDS: RecordTemplates = RecordTemplates {
        migrations: &[
            Migration {
                version: 1,
                sql: include_str!("../../../sql/postgres/records_0001.sql"),
            },
            Migration {
                version: 2,
                sql: include_str!("../../../sql/postgres/records_0002.sql"),
            },
        ],
        claim: include_str!("../../../sql/postgres/claim.sql"),
        select: include_str!("../../../sql/postgres/select.sql"),
        get: include_str!("../../../sql/postgres/get.sql"),
        complete: include_str!("../../../sql/postgres/complete.sql"),
        completed: include_str!("../../../sql/postgres/completed.sql"),
        release: include_str!("../../../sql/postgres/release.sql"),
        sweep: include_str!("../../../sql/postgres/sweep.sql"),
        stats: include_str!("../../../sql/postgres/stats.sql"),
        max_scope: None,
        max_key: None,
        new_key: None,
        claim_bound: None,
    };
    const COLUMNS: &'static str = COLUMNS;
    const EXPIRED: &'static str = EXPIRED;

    type Extra = PgExtra;

    fn extra(table: &TableName) -> Result<PgExtra, sqlx::Error> {
        Ok(PgExtra {
            sql: PgSql {
                claim_first: render(include_str!("../../../sql/postgres/claim_first.sql"), table)?,
                claim: render(include_str!("../../../sql/postgres/claim.sql"), table)?,
                claim_held: render(include_str!("../../../sql/postgres/claim_held.sql"), table)?,
                hold: render(include_str!("../../../sql/postgres/hold.sql"), table)?,
            },
            claims: ClaimConnections::new(),
        })
    }

    fn open_pool(url: &str) -> BoxFuture<'_, Result<sqlx::PgPool, sqlx::Error>> {
        Box::pin(open_pool(url))
    }

    fn claim<'a>(
        store: &'a SqlStore<Self>,
        req: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let extra = &store.extra;
            let mut checkout = extra
                .claims
                .checkout(&store.pool)
                .await
                .map_err(store_error)?;
            let outcome = claim_on(&extra.sql, checkout.conn(), req).await?;
            checkout.keep();
            Ok(outcome)
        })
    }
}

/// The first look, then (when it did not decide) the deciding claim.
async fn claim_on(
    sql: &PgSql,
    conn: &mut PgConnection,
    req: &ClaimRequest,
) -> Result<ClaimOutcome, StoreError> {
    let binds = ClaimBinds::new(req);
    let token = FencingToken::generate();
    let proposed = OperationId::generate();
    let first = binds
        .query(&sql.claim_first, proposed, token)
        .fetch_optional(&mut *conn)
        .await
        .map_err(store_error)?;
    match first_look(req, token, proposed, first)? {
        FirstLook::New(claim) => return Ok(ClaimOutcome::Acquired(claim)),
        FirstLook::Existing(record) => return Ok(ClaimOutcome::Existing(record)),
        FirstLook::Undecided => {}
    }
    // Normally one turn. A second only when the row we lost to was
    // committed after the statement's snapshot, or was swept in between.
    for _ in 0..CLAIM_TURNS {
        let token = FencingToken::generate();
        let proposed = OperationId::generate();
        let row = binds
            .query(&sql.claim, proposed, token)
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
