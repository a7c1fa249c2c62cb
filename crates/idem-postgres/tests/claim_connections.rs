//! The connections claims run on, kept outside the pool: one that died while
//! idle is found out and replaced, never kept; against the real server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Store, StoreError};
use idem_postgres::{PostgresStore, TableName, IDLE_CHECK_AFTER};
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
