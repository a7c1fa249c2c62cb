//! The deciding claim against the real server when another claimant
//! replaces the row under it: the loser's answer is the row as the winner
//! left it, never the version it replaced.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::{ClaimOutcome, RecordState, Store, StoredResponse};
use idem_postgres::{PostgresStore, TableName};
use idem_test_support::postgres::{database_url, TestSchema};

/// A store in a schema of the test's own.
async fn fresh() -> (PostgresStore, TestSchema) {
    let schema = TestSchema::create("idem_deciding").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .expect("connect");
    (store, schema)
}

fn request(body: &str) -> idem_core::ClaimRequest {
    idem_store_suite::request(
        "s",
        "k",
        body,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

/// A completed record past its retention is replaced by another request's
/// claim (uncommitted while this one's deciding claim waits on the row):
/// the loser is told of that live claim (`409`), not handed the expired
/// record it replaced, whose body is another's (`422`) or whose answer
/// counts no more (a stale replay). Before, the fallback read the version
/// of its snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loser_is_never_answered_with_the_version_its_winner_replaced() {
    let (store, _schema) = fresh().await;
    let qualified = store.table().qualified();
    let ClaimOutcome::Acquired(claim) = store.claim(&request(r#"{"n":1}"#)).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let done = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"first"),
    };
    store.complete(&claim, &done).await.unwrap();
    sqlx::query(&format!(
        "UPDATE {qualified} SET created_at = now() - interval '3 hours',
             completed_at = now() - interval '3 hours', expires_at = now() - interval '1 hour'"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    // Another request claims the expired key, as the deciding claim would;
    // not committed yet.
    let second = request(r#"{"n":2}"#);
    let mut winner = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE {qualified} SET fingerprint = $1, token = 42,
             state = 'in_progress', locked_until = now() + interval '1 hour',
             created_at = now(), expires_at = now() + interval '1 day',
             operation_id = gen_random_uuid(), completed_at = NULL, status = NULL,
             headers = NULL, body = NULL"
    ))
    .bind(second.fingerprint.as_bytes().as_slice())
    .execute(&mut *winner)
    .await
    .unwrap();
    let loser = {
        let store = store.clone();
        let second = second.clone();
        tokio::spawn(async move { store.claim(&second).await })
    };
    // Until the loser's deciding claim waits on the winner's row lock.
    let like = format!("%{qualified}%");
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE NOT l.granted AND a.query LIKE $1",
        )
        .bind(&like)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < until, "the loser never waited on the row");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    winner.commit().await.unwrap();
    // The loser waits for the row at most 2 s (the claim's own lock
    // timeout); a machine too slow to commit within it has it fail for
    // now, and the same claim, sent again, must then find the winner's.
    let outcome = match loser.await.unwrap() {
        Err(idem_core::StoreError::Unavailable(_)) => store.claim(&second).await.unwrap(),
        other => other.unwrap(),
    };
    match outcome {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, second.fingerprint, "{r:?}");
            assert!(matches!(r.state, RecordState::InProgress { .. }), "{r:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// A retry past the lease meets the row locked by its holder's business
/// transaction, still open (a handler past its lease that completed the
/// record in it): the deciding claim gives up on the lock after 2 s
/// (`503` for now) instead of waiting, with its connection, for as long as
/// that transaction lasts. Before, it waited for the transaction's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_on_a_held_row_a_bounded_time() {
    let (store, _schema) = fresh().await;
    let qualified = store.table().qualified();
    let short = idem_store_suite::request(
        "s",
        "k",
        "{}",
        Duration::from_millis(200),
        Duration::from_secs(3600),
    );
    let ClaimOutcome::Acquired(_claim) = store.claim(&short).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!("SELECT 1 FROM {qualified} FOR UPDATE"))
        .execute(&mut *holder)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let started = Instant::now();
    let retry = tokio::time::timeout(Duration::from_secs(15), store.claim(&short))
        .await
        .expect("the claim gave up on the lock within 15 s");
    assert!(
        matches!(retry, Err(idem_core::StoreError::Unavailable(_))),
        "{retry:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "it waited for the lock first: {:?}",
        started.elapsed()
    );
    holder.rollback().await.unwrap();
    // Once the row is free, the retry takes the lease over.
    let again = store.claim(&short).await.unwrap();
    assert!(
        matches!(&again, ClaimOutcome::Acquired(c) if c.takeover),
        "{again:?}"
    );
}
