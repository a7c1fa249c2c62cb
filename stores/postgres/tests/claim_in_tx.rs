//! Claims made inside the caller's transaction, against the real server,
//! each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    decide, ClaimInTransaction, ClaimOutcome, ClaimRequest, Decision, OperationId, Policy,
    RecordState, Situation, Store, StoredResponse, TransactionalStore, TxClaimOutcome, UnixMillis,
};
use idem_postgres::{PostgresStore, TableName};
use idem_store_suite::postgres::{database_url, TestSchema};

async fn fresh() -> (PostgresStore, TestSchema, String) {
    let schema = TestSchema::create("idem_in_tx").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .expect("connect");
    let effects = format!("\"{}\".effects", schema.name());
    sqlx::query(&format!(
        "CREATE TABLE {effects} (key text NOT NULL, operation_id text NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    (store, schema, effects)
}

fn request(lease: Duration) -> ClaimRequest {
    idem_store_suite::request("s", "k", "{}", lease, Duration::from_secs(3600))
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{\"id\":1}"),
    }
}

async fn count(store: &PostgresStore, effects: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {effects}"))
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_commits_with_the_transaction_and_duplicates_see_busy_meanwhile() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(claim) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!("a new key is acquired")
    };
    assert!(!claim.takeover);
    assert_eq!(
        claim.operation_id,
        OperationId::derive("s", "k", &req.fingerprint)
    );

    // Nothing is visible outside the transaction, and a duplicate neither
    // acquires nor waits: it is told the key is busy at once.
    assert!(store.get("s", "k").await.unwrap().is_none());
    let mut dup = store.pool().begin().await.unwrap();
    let busy = tokio::time::timeout(Duration::from_secs(5), store.claim_in_tx(&mut dup, &req))
        .await
        .expect("a duplicate does not wait on the holder's row")
        .unwrap();
    assert_eq!(busy, TxClaimOutcome::Busy);
    dup.rollback().await.unwrap();

    sqlx::query(&format!("INSERT INTO {effects} VALUES ('k', $1)"))
        .bind(claim.operation_id.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // After the commit a duplicate finds the completed record: a replay.
    let mut dup = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Existing(record) = store.claim_in_tx(&mut dup, &req).await.unwrap() else {
        panic!("the committed record is found")
    };
    dup.rollback().await.unwrap();
    assert!(
        matches!(record.state, RecordState::Completed { response: ref stored, .. } if stored.body == response().body)
    );
    let decision = decide(
        &Policy::default(),
        Situation::Arrived {
            stored: Some(&record),
            fingerprint: &req.fingerprint,
            now: UnixMillis::now(),
        },
    );
    assert_eq!(decision, Decision::Replay);
    assert_eq!(count(&store, &effects).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_takes_the_claim_with_it_and_the_retry_keeps_the_operation_id() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(first) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!()
    };
    sqlx::query(&format!("INSERT INTO {effects} VALUES ('k', $1)"))
        .bind(first.operation_id.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(count(&store, &effects).await, 0);
    assert!(store.get("s", "k").await.unwrap().is_none());

    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(retry) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!("the key is free again")
    };
    assert!(!retry.takeover, "nothing was left to take over");
    assert_eq!(retry.operation_id, first.operation_id);
    assert_ne!(retry.token, first.token);
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_record_is_taken_over_under_its_own_operation_id() {
    let (store, _schema, _effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    // A claim made the default way, then released (its handler answered 5xx).
    let ClaimOutcome::Acquired(old) = store.claim(&req).await.unwrap() else {
        panic!()
    };
    store.release(&old).await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(claim) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!("a released record can be taken over")
    };
    assert!(claim.takeover);
    assert_eq!(claim.operation_id, old.operation_id);
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The released holder's completion is refused: its token is gone.
    assert!(store.complete(&old, &response()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_default_claim_is_in_flight_for_a_transactional_one() {
    let (store, _schema, _effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let ClaimOutcome::Acquired(_) = store.claim(&req).await.unwrap() else {
        panic!()
    };
    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Existing(record) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!("the committed in-flight record is found")
    };
    assert!(matches!(record.state, RecordState::InProgress { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_transactions_on_one_key_commit_one_effect() {
    let (store, _schema, effects) = fresh().await;
    let store = Arc::new(store);
    let start = Arc::new(tokio::sync::Barrier::new(12));
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let store = store.clone();
        let effects = effects.clone();
        let start = start.clone();
        tasks.push(tokio::spawn(async move {
            let req = request(Duration::from_secs(30));
            let mut tx = store.pool().begin().await.unwrap();
            start.wait().await;
            match store.claim_in_tx(&mut tx, &req).await.unwrap() {
                TxClaimOutcome::Acquired(claim) => {
                    sqlx::query(&format!("INSERT INTO {effects} VALUES ('k', $1)"))
                        .bind(claim.operation_id.to_string())
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    // Hold the claim a moment, as a handler would.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    store
                        .complete_in_tx(&mut tx, &claim, &response())
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    "acquired"
                }
                TxClaimOutcome::Busy => "busy",
                TxClaimOutcome::Existing(r) => match r.state {
                    RecordState::Completed { .. } => "replay",
                    RecordState::InProgress { .. } => "in-progress",
                },
            }
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    assert_eq!(
        outcomes.iter().filter(|o| **o == "acquired").count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(*o, "acquired" | "busy" | "replay")),
        "{outcomes:?}"
    );
    assert_eq!(count(&store, &effects).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_idle_past_its_lease_loses_its_connection_and_the_key() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_millis(300));
    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(claim) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!()
    };
    sqlx::query(&format!("INSERT INTO {effects} VALUES ('k', $1)"))
        .bind(claim.operation_id.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    // Stalled (waiting on something slow) for longer than the lease: the
    // server ends the session, and the claim and the effect with it.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let late = store.complete_in_tx(&mut tx, &claim, &response()).await;
    let committed = match late {
        Ok(()) => tx.commit().await.is_ok(),
        Err(_) => false,
    };
    assert!(!committed, "a holder past its lease cannot commit");
    assert_eq!(count(&store, &effects).await, 0);

    let mut tx = store.pool().begin().await.unwrap();
    let TxClaimOutcome::Acquired(retry) = store.claim_in_tx(&mut tx, &req).await.unwrap() else {
        panic!("the key is free once the stalled session is gone")
    };
    assert_eq!(retry.operation_id, claim.operation_id);
    // Within the lease, the same transaction is not cut off.
    tokio::time::sleep(Duration::from_millis(100)).await;
    store
        .complete_in_tx(&mut tx, &retry, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_keys_do_not_block_each_other() {
    let (store, _schema, _effects) = fresh().await;
    let mut a = store.pool().begin().await.unwrap();
    let mut b = store.pool().begin().await.unwrap();
    let mut other = request(Duration::from_secs(30));
    other.key = "k2".into();
    assert!(matches!(
        store
            .claim_in_tx(&mut a, &request(Duration::from_secs(30)))
            .await
            .unwrap(),
        TxClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim_in_tx(&mut b, &other).await.unwrap(),
        TxClaimOutcome::Acquired(_)
    ));
}
