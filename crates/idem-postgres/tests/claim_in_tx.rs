//! Claims held by the business transaction ([`ClaimInTransaction`]),
//! against the real server, each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    on_arrival, Arrival, Claim, ClaimInTransaction, ClaimRequest, Policy, Record, RecordState,
    Store, StoredResponse, TransactionalStore, TxClaimOutcome, UnixMillis,
};
use idem_postgres::{PostgresStore, TableName};
use idem_test_support::postgres::{database_url, TestSchema};
use sqlx::{Postgres, Transaction};

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

fn request_with(body: &str, lease: Duration, retention: Duration) -> ClaimRequest {
    idem_store_suite::request("s", "k", body, lease, retention)
}

fn request(lease: Duration) -> ClaimRequest {
    request_with("{}", lease, Duration::from_secs(3600))
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

type Tx = Transaction<'static, Postgres>;

async fn acquire(store: &PostgresStore, req: &ClaimRequest) -> (Claim, Tx) {
    match store.claim_and_begin(req).await.unwrap() {
        TxClaimOutcome::Acquired { claim, transaction } => (claim, transaction),
        other => panic!("expected the claim, got {other:?}"),
    }
}

async fn existing(store: &PostgresStore, req: &ClaimRequest) -> Record {
    match store.claim_and_begin(req).await.unwrap() {
        TxClaimOutcome::Existing(record) => record,
        other => panic!("expected a record, got {other:?}"),
    }
}

fn decision(record: &Record, req: &ClaimRequest) -> Arrival {
    on_arrival(
        &Policy::default(),
        Some(record),
        &req.fingerprint,
        UnixMillis::now(),
    )
}

async fn effect(tx: &mut Tx, effects: &str, claim: &Claim) {
    effect_result(tx, effects, claim).await.unwrap();
}

async fn effect_result(tx: &mut Tx, effects: &str, claim: &Claim) -> Result<(), sqlx::Error> {
    sqlx::query(&format!("INSERT INTO {effects} VALUES ('k', $1)"))
        .bind(claim.operation_id.to_string())
        .execute(&mut **tx)
        .await
        .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_is_durable_before_the_handler_runs_and_busy_while_its_transaction_is_open() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let (claim, mut tx) = acquire(&store, &req).await;
    assert!(!claim.takeover);

    // The binding of key, request and operation id is committed already:
    // visible outside the transaction, before any effect.
    let seen = store.get("s", "k").await.unwrap().expect("committed claim");
    assert_eq!(seen.operation_id, claim.operation_id);
    assert_eq!(seen.fingerprint, req.fingerprint);
    // A duplicate neither acquires nor waits: busy, at once.
    let busy = tokio::time::timeout(Duration::from_secs(5), store.claim_and_begin(&req))
        .await
        .expect("a duplicate does not wait on the holder")
        .unwrap();
    assert!(matches!(busy, TxClaimOutcome::Busy), "{busy:?}");

    effect(&mut tx, &effects, &claim).await;
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // After the commit a duplicate finds the completed record: a replay.
    let record = existing(&store, &req).await;
    assert!(
        matches!(record.state, RecordState::Completed { response: ref stored, .. } if stored.body == response().body)
    );
    assert_eq!(decision(&record, &req), Arrival::Replay);
    assert_eq!(count(&store, &effects).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_frees_the_claim_at_once_for_the_same_request_only() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let (first, mut tx) = acquire(&store, &req).await;
    effect(&mut tx, &effects, &first).await;
    tx.rollback().await.unwrap();
    assert_eq!(count(&store, &effects).await, 0);

    // Another request under the same key: 422, though nothing committed
    // but the claim (its operation id may have reached the outside world).
    let other = request_with(
        r#"{"amount":500}"#,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let record = existing(&store, &other).await;
    assert_eq!(decision(&record, &other), Arrival::Mismatch);

    // The same request takes it over at once (no lease to wait out), under
    // the same operation id, with a new token.
    let (retry, tx) = acquire(&store, &req).await;
    assert!(retry.takeover);
    assert_eq!(retry.operation_id, first.operation_id);
    assert_ne!(retry.token, first.token);
    tx.rollback().await.unwrap();
    // The first holder's completion is fenced off.
    assert!(store.complete(&first, &response()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_connection_dies_frees_the_key_and_binds_it_to_its_request() {
    let (store, _schema, effects) = fresh().await;
    let req = request(Duration::from_secs(60));
    let (claim, mut tx) = acquire(&store, &req).await;
    effect(&mut tx, &effects, &claim).await;
    // The process dies: the server sees its connection close.
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(killed);
    assert!(tx.commit().await.is_err());
    assert_eq!(count(&store, &effects).await, 0);

    let other = request_with(
        r#"{"amount":500}"#,
        Duration::from_secs(60),
        Duration::from_secs(3600),
    );
    // Wait for the server to finish ending the session (its locks go last).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let record = loop {
        match store.claim_and_begin(&other).await.unwrap() {
            TxClaimOutcome::Existing(record) => break record,
            TxClaimOutcome::Busy if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            o => panic!("{o:?}"),
        }
    };
    assert_eq!(decision(&record, &other), Arrival::Mismatch);
    let (retry, mut tx) = acquire(&store, &req).await;
    assert!(retry.takeover);
    assert_eq!(retry.operation_id, claim.operation_id);
    store
        .complete_in_tx(&mut tx, &retry, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_past_its_retention_is_new_with_a_new_operation_id() {
    let (store, _schema, _effects) = fresh().await;
    let req = request_with("{}", Duration::from_millis(100), Duration::from_millis(400));
    let (first, mut tx) = acquire(&store, &req).await;
    store
        .complete_in_tx(&mut tx, &first, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    for body in ["{}", r#"{"amount":500}"#] {
        let later = request_with(body, Duration::from_millis(100), Duration::from_millis(400));
        let (claim, tx) = acquire(&store, &later).await;
        assert!(!claim.takeover);
        assert_ne!(
            claim.operation_id, first.operation_id,
            "a new request, a new id"
        );
        tx.rollback().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_holds_nothing_so_the_next_request_is_never_busy() {
    let (store, _schema, _effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let (claim, mut tx) = acquire(&store, &req).await;
    store
        .complete_in_tx(&mut tx, &claim, &response())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let other = request_with(
        r#"{"amount":500}"#,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    // A strictly sequential client: each answer before the next request.
    for _ in 0..50 {
        let r = existing(&store, &req).await;
        assert_eq!(decision(&r, &req), Arrival::Replay);
        let r = existing(&store, &other).await;
        assert_eq!(decision(&r, &other), Arrival::Mismatch);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_on_one_key_commit_one_effect() {
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
            start.wait().await;
            match store.claim_and_begin(&req).await.unwrap() {
                TxClaimOutcome::Acquired {
                    claim,
                    mut transaction,
                } => {
                    effect(&mut transaction, &effects, &claim).await;
                    // Hold the claim a moment, as a handler would.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    store
                        .complete_in_tx(&mut transaction, &claim, &response())
                        .await
                        .unwrap();
                    transaction.commit().await.unwrap();
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
    let req = request(Duration::from_millis(1000));
    let (claim, mut tx) = acquire(&store, &req).await;
    effect(&mut tx, &effects, &claim).await;
    // Stalled (waiting on something slow) for longer than the lease: the
    // server ends the session, and the effect with it.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let late = store.complete_in_tx(&mut tx, &claim, &response()).await;
    let committed = match late {
        Ok(()) => tx.commit().await.is_ok(),
        Err(_) => false,
    };
    assert!(!committed, "a holder past its lease cannot commit");
    assert_eq!(count(&store, &effects).await, 0);

    let (retry, mut tx) = acquire(&store, &req).await;
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
async fn a_holder_statement_waiting_past_its_lease_is_cancelled_and_frees_the_key() {
    let (store, _schema, effects) = fresh().await;
    let lease = Duration::from_millis(1000);
    let req = request(lease);
    let (claim, mut tx) = acquire(&store, &req).await;
    // Another session holds the table the handler writes to, for longer
    // than the test waits: the handler's statement waits on its lock.
    let mut blocker = store.pool().begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {effects} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *blocker)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let waited = tokio::time::timeout(
        Duration::from_secs(30),
        effect_result(&mut tx, &effects, &claim),
    )
    .await;
    let took = started.elapsed();
    let Ok(result) = waited else {
        panic!("the holder's statement still waited after 30 s: nothing bounds it by the lease");
    };
    let Err(sqlx::Error::Database(e)) = result else {
        panic!("expected the statement cancelled, got {result:?}");
    };
    assert_eq!(e.code().as_deref(), Some("57014"), "{e}");
    assert!(
        took >= lease - Duration::from_millis(50),
        "cancelled after {took:?}, before the lease"
    );
    tx.rollback().await.unwrap();

    // The key is free at once, for the same request under the same
    // operation id, while the table is still locked.
    let (retry, mut tx) = acquire(&store, &req).await;
    assert_eq!(retry.operation_id, claim.operation_id);
    let bound: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(bound, "1s");
    tx.rollback().await.unwrap();
    blocker.rollback().await.unwrap();
    assert_eq!(count(&store, &effects).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_statement_timeout_shorter_than_the_lease_is_kept() {
    let schema = TestSchema::create("idem_in_tx").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    // (session's statement_timeout, lease) -> the bound inside the holder's transaction
    let cases = [
        ("200ms", 30_000, "200ms"),
        ("1min", 1_000, "1s"),
        ("0", 1_500, "1500ms"),
    ];
    for (i, (session, lease_ms, want)) in cases.into_iter().enumerate() {
        let url = format!(
            "{}?options=-c%20statement_timeout%3D{session}",
            database_url()
        );
        let store = PostgresStore::connect_with(&url, table.clone())
            .await
            .expect("connect");
        let mut req = request(Duration::from_millis(lease_ms));
        req.key = format!("k{i}");
        let (_, mut tx) = acquire(&store, &req).await;
        let bound: String = sqlx::query_scalar("SHOW statement_timeout")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        assert_eq!(bound, want, "session {session}, lease {lease_ms} ms");
        // The session's own setting is back once the transaction ended.
        let after: String = sqlx::query_scalar("SHOW statement_timeout")
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(after, session, "after the transaction");
        // Dropped, not closed: a close waits for every connection, the one
        // the store keeps for its claims too.
        drop(store);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_keeps_the_shortest_retention_any_claim_asked_for() {
    let (store, _schema, _effects) = fresh().await;
    let minute = Duration::from_secs(60);
    let lease = Duration::from_secs(30);
    let kept = async || {
        store
            .get("s", "k")
            .await
            .unwrap()
            .expect("the record")
            .shortest_retention
    };
    let (first, tx) = acquire(&store, &request_with("{}", lease, minute)).await;
    tx.rollback().await.unwrap();
    assert_eq!(kept().await, Some(minute));
    let (longer, tx) = acquire(&store, &request_with("{}", lease, minute * 60)).await;
    tx.rollback().await.unwrap();
    assert_eq!(longer.operation_id, first.operation_id);
    assert_eq!(kept().await, Some(minute), "raised by a longer retention");
    let (_, tx) = acquire(&store, &request_with("{}", lease, minute / 2)).await;
    tx.rollback().await.unwrap();
    assert_eq!(kept().await, Some(minute / 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_keys_do_not_block_each_other() {
    let (store, _schema, _effects) = fresh().await;
    let mut other = request(Duration::from_secs(30));
    other.key = "k2".into();
    let (_, a) = acquire(&store, &request(Duration::from_secs(30))).await;
    let (_, b) = acquire(&store, &other).await;
    a.rollback().await.unwrap();
    b.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_default_claim_is_busy_for_a_transaction_held_one() {
    let (store, _schema, _effects) = fresh().await;
    let req = request(Duration::from_secs(30));
    let idem_core::ClaimOutcome::Acquired(_) = store.claim(&req).await.unwrap() else {
        panic!()
    };
    let outcome = store.claim_and_begin(&req).await.unwrap();
    assert!(matches!(outcome, TxClaimOutcome::Busy), "{outcome:?}");
    // Another request is told why at once.
    let other = request_with(
        r#"{"amount":500}"#,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let record = existing(&store, &other).await;
    assert_eq!(decision(&record, &other), Arrival::Mismatch);
}
