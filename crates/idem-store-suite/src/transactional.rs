//! The suite's second level, for stores that complete a record inside the
//! caller's own transaction ([`TransactionalStore`]): the SQLite and the
//! PostgreSQL store pass the same cases, written once here.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, RecordState, Store, StoreError, StoredResponse, TransactionalStore};

/// Instantiates every transactional case as a `#[tokio::test]`, each with
/// a fresh store from `$make`: a closure returning a future of `(store,
/// pool, guard)`, where `pool` opens the business transactions (on the
/// store's database; its unqualified tables must be the test's own) and
/// the guard lives until the case ends.
#[macro_export]
macro_rules! transactional_suite {
    ($make:expr) => {
        $crate::transactional_suite!(@cases $make;
            completion_commits_and_rolls_back_with_the_business_transaction,
            a_zombie_completion_in_its_transaction_is_refused
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let make = $make;
                let (store, pool, guard) = make().await;
                $crate::transactional::$case(store, pool).await;
                drop(guard);
            }
        )*
    };
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    }
}

fn request(lease: Duration) -> idem_core::ClaimRequest {
    crate::request("s", "k", "{}", lease, Duration::from_secs(3600))
}

async fn effects<DB>(pool: &sqlx::Pool<DB>) -> i64
where
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("count effects: {e}"))
}

/// The record commits with the business write, and rolls back with it.
pub async fn completion_commits_and_rolls_back_with_the_business_transaction<S, DB>(
    store: S,
    pool: sqlx::Pool<DB>,
) where
    S: Store + TransactionalStore<DB::Connection>,
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    sqlx::query("CREATE TABLE effects (id BIGINT PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("create effects: {e}"));
    let Ok(ClaimOutcome::Acquired(claim)) = store.claim(&request(super::LONG)).await else {
        panic!("expected to acquire")
    };
    // Rolled back: neither the effect nor the completion is there.
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("begin: {e}"));
    sqlx::query("INSERT INTO effects (id) VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("insert: {e}"));
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap_or_else(|e| panic!("complete: {e}"));
    tx.rollback()
        .await
        .unwrap_or_else(|e| panic!("rollback: {e}"));
    assert_eq!(effects(&pool).await, 0);
    assert!(matches!(
        store.get("s", "k").await.ok().flatten().map(|r| r.state),
        Some(RecordState::InProgress { .. })
    ));
    // Committed: both are there.
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("begin: {e}"));
    sqlx::query("INSERT INTO effects (id) VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("insert: {e}"));
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap_or_else(|e| panic!("complete: {e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("commit: {e}"));
    assert_eq!(effects(&pool).await, 1);
    assert!(matches!(
        store.get("s", "k").await.ok().flatten().map(|r| r.state),
        Some(RecordState::Completed { .. })
    ));
}

/// A holder that ran past its lease and was taken over cannot complete in
/// its transaction: `ClaimLost`, for the caller to roll back.
pub async fn a_zombie_completion_in_its_transaction_is_refused<S, DB>(
    store: S,
    pool: sqlx::Pool<DB>,
) where
    S: Store + TransactionalStore<DB::Connection>,
    DB: sqlx::Database,
{
    let Ok(ClaimOutcome::Acquired(zombie)) = store.claim(&request(super::SHORT)).await else {
        panic!("expected to acquire")
    };
    tokio::time::sleep(super::SHORT + Duration::from_millis(100)).await;
    let Ok(ClaimOutcome::Acquired(fresh)) = store.claim(&request(super::LONG)).await else {
        panic!("expected a takeover")
    };
    assert!(fresh.takeover);
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("begin: {e}"));
    let err = store.complete_in_tx(&mut tx, &zombie, &response()).await;
    assert!(matches!(err, Err(StoreError::ClaimLost)), "{err:?}");
    tx.rollback()
        .await
        .unwrap_or_else(|e| panic!("rollback: {e}"));
}
