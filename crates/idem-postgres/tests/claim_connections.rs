//! The connections claims run on, kept outside the pool: one that died while
//! idle is found out and replaced, never kept; against the real server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Store, StoreError};
use idem_postgres::{PostgresStore, SqlRecords, TableName, IDLE_CHECK_AFTER};
use idem_test_support::postgres::{database_url, TestSchema};

fn request(key: &str) -> ClaimRequest {
    idem_store_suite::request(
        "s",
        key,
        "{}",
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

/// Ends every server session that last ran a claim on this schema's table.
async fn kill_claim_sessions(store: &PostgresStore) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE pid <> pg_backend_pid() AND query LIKE '%WITH seen AS%' AND query LIKE $1",
    )
    .bind(format!("%{}%", store.table().qualified()))
    .fetch_one(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_claim_connection_that_died_is_replaced_not_kept() {
    let schema = TestSchema::create("idem_claim_conns").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .expect("connect");
    assert!(matches!(
        store.claim(&request("a")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(kill_claim_sessions(&store).await >= 1);

    // Used again at once, the dead connection fails its statement (an
    // outage, so a 503 with Retry-After), and is dropped: the next claim
    // runs on a new one. Past the idle check it is found out first.
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        match store.claim(&request("b")).await {
            Ok(outcome) => {
                outcomes.push(outcome);
                break;
            }
            Err(e) => assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}"),
        }
    }
    assert!(
        matches!(outcomes.as_slice(), [ClaimOutcome::Acquired(_)]),
        "{outcomes:?}"
    );

    assert!(kill_claim_sessions(&store).await >= 1);
    tokio::time::sleep(IDLE_CHECK_AFTER + Duration::from_millis(100)).await;
    let outcome = store
        .claim(&request("c"))
        .await
        .expect("checked, then replaced");
    assert!(matches!(outcome, ClaimOutcome::Acquired(_)), "{outcome:?}");
}

/// A store on `pool`, its table migrated in a schema of its own.
async fn store_on(pool: sqlx::PgPool, schema: &TestSchema) -> PostgresStore {
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::new(pool, table).expect("store");
    store.migrate().await.expect("migrate");
    store
}

/// A pool of `n` connections that waits at most five seconds for one.
async fn small_pool(n: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(n)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&database_url())
        .await
        .expect("pool")
}

/// On a pool of one connection no claim keeps it: the application's
/// transaction after a claim gets the connection at once.
#[tokio::test]
async fn a_pool_of_one_keeps_no_claim_connection() {
    let schema = TestSchema::create("idem_claim_pool1").await;
    let store = store_on(small_pool(1).await, &schema).await;
    for key in ["a", "b"] {
        assert!(matches!(
            store.claim(&request(key)).await.unwrap(),
            ClaimOutcome::Acquired(_)
        ));
        let conn = store.pool().acquire().await;
        assert!(conn.is_ok(), "after claiming {key}: {conn:?}");
    }
}

/// On a pool of two, two claims running at once (one held up by a row
/// another session inserted and has not committed) leave one connection
/// kept and the other to the application.
#[tokio::test]
async fn a_small_pool_keeps_a_connection_for_the_application() {
    use sqlx::Connection;

    let schema = TestSchema::create("idem_claim_pool2").await;
    let store = store_on(small_pool(2).await, &schema).await;
    let table = store.table().qualified();
    let mut blocker = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {table} (scope, key, fingerprint, operation_id, token, state,
                              locked_until, created_at, expires_at)
         VALUES ('s', 'held', sha256('x'::bytea), gen_random_uuid(), 1, 'in_progress',
                 now(), now(), now() + interval '1 hour')"
    ))
    .execute(&mut blocker)
    .await
    .unwrap();

    let store = std::sync::Arc::new(store);
    let held = tokio::spawn({
        let store = store.clone();
        async move { store.claim(&request("held")).await }
    });
    // The held claim waits on the uncommitted row, on a connection of its
    // own. Watched from a session outside any transaction: inside one,
    // PostgreSQL shows the sessions' statements as they were at its first
    // look, for the rest of it.
    let mut watcher = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    let waiting = async {
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%WITH seen AS%' AND query LIKE $1",
            )
            .bind(format!("%{table}%"))
            .fetch_one(&mut watcher)
            .await
            .unwrap();
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the claim of `held` waits on the uncommitted row");
    // The other claim runs on the pool's second connection.
    assert!(matches!(
        store.claim(&request("free")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    blocker.close().await.unwrap();
    watcher.close().await.unwrap();
    assert!(matches!(
        held.await.unwrap().unwrap(),
        ClaimOutcome::Acquired(_)
    ));

    let conn = store.pool().acquire().await;
    assert!(
        conn.is_ok(),
        "both claim connections kept, none for the application: {conn:?}"
    );
}

/// A pool's `close` waits for every connection checked out; the ones the
/// store keeps for its claims are handed back when it is called, so a
/// shutdown that closes the pool ends. A claim after the close fails as
/// an outage, never running on a kept connection.
#[tokio::test]
async fn closing_the_pool_hands_the_claim_connections_back() {
    let schema = TestSchema::create("idem_claim_close").await;
    let store = std::sync::Arc::new(store_on(small_pool(8).await, &schema).await);
    // Claims at once, so that several connections are kept.
    let claims: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request(&format!("k{i}"))).await })
        })
        .collect();
    for claim in claims {
        assert!(matches!(
            claim.await.unwrap().unwrap(),
            ClaimOutcome::Acquired(_)
        ));
    }
    assert!(
        store.pool().size() > store.pool().num_idle() as u32,
        "connections are kept for claims"
    );

    // Claims keep running while the pool closes: each either ran before
    // the close or fails, and none keeps its connection past it.
    let racing: Vec<_> = (0..4)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for j in 0..50 {
                    outcomes.push(store.claim(&request(&format!("r{i}-{j}"))).await);
                }
                outcomes
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    tokio::time::timeout(Duration::from_secs(30), store.pool().close())
        .await
        .expect("the pool's close ends although claims kept connections");
    for racing in racing {
        for outcome in racing.await.unwrap() {
            if let Err(e) = outcome {
                assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
            }
        }
    }
    // (sqlx's close may return while a claim that was running still had
    // its connection; that one is closed as it comes back.) Nothing is
    // kept: every connection of the pool ends.
    let ended = async {
        while store.pool().size() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended)
        .await
        .expect("no connection is kept past the close");
    let after = store.claim(&request("after")).await;
    assert!(
        matches!(after, Err(StoreError::Unavailable(_))),
        "a claim after the close: {after:?}"
    );
}
