//! The first look: a repeat is answered by a read that writes and locks
//! nothing, against the real server, each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, ClaimRequest, RecordState, Store, StoredResponse};
use idem_postgres::{PostgresStore, TableName};
use idem_test_support::postgres::{database_url, TestSchema};

async fn fresh() -> (PostgresStore, TestSchema) {
    let schema = TestSchema::create("idem_first_look").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .expect("connect");
    (store, schema)
}

fn request(body: &str) -> ClaimRequest {
    idem_store_suite::request(
        "s",
        "k",
        body,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

/// The row's version and its lock word: a write makes a new version (xmin),
/// a row lock sets xmax.
async fn row_version(store: &PostgresStore) -> (String, String) {
    sqlx::query_as(&format!(
        "SELECT xmin::text, xmax::text FROM {} WHERE scope = 's' AND key = 'k'",
        store.table().qualified()
    ))
    .fetch_one(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn replays_in_flight_and_mismatches_neither_write_nor_lock_the_row() {
    let (store, _schema) = fresh().await;
    let ClaimOutcome::Acquired(claim) = store.claim(&request("{}")).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let claimed = row_version(&store).await;
    assert_eq!(claimed.1, "0", "a fresh claim's row is not locked");

    // In flight: the same request and another one are answered by a read.
    for body in ["{}", r#"{"other":1}"#] {
        match store.claim(&request(body)).await.unwrap() {
            ClaimOutcome::Existing(r) => {
                assert!(matches!(r.state, RecordState::InProgress { .. }), "{r:?}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        row_version(&store).await,
        claimed,
        "in flight: no write, no lock"
    );

    let response = StoredResponse {
        status: 201,
        headers: vec![("x-a".into(), b"1".to_vec())],
        body: Bytes::from_static(b"{\"id\":1}"),
    };
    store.complete(&claim, &response).await.unwrap();
    let completed = row_version(&store).await;
    assert_eq!(completed.1, "0");

    for body in ["{}", r#"{"other":1}"#] {
        match store.claim(&request(body)).await.unwrap() {
            ClaimOutcome::Existing(r) => match r.state {
                RecordState::Completed { response: got, .. } => assert_eq!(got, response),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        row_version(&store).await,
        completed,
        "a replay and a mismatch write nothing and lock nothing"
    );
}
