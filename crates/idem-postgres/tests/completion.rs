//! A completion sent again after it landed, against the real server, each
//! test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, Store, StoreError, StoredResponse};
use idem_postgres::{PostgresStore, TableName};
use idem_test_support::postgres::{database_url, TestSchema};

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(body),
    }
}

#[tokio::test]
async fn a_completion_whose_landing_cannot_be_read_is_not_called_lost() {
    let schema = TestSchema::create("idem_completion").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table.clone())
        .await
        .expect("connect");
    let request = idem_store_suite::request(
        "s",
        "k",
        "{}",
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let ClaimOutcome::Acquired(claim) = store.claim(&request).await.unwrap() else {
        panic!("a new key is claimed")
    };
    store
        .complete(&claim, &response(b"{\"id\":1}"))
        .await
        .unwrap();
    // Sent again (its first answer lost on the way back): it stands; with
    // another response it was not this completion that landed.
    store
        .complete(&claim, &response(b"{\"id\":1}"))
        .await
        .unwrap();
    assert!(matches!(
        store.complete(&claim, &response(b"{\"id\":2}")).await,
        Err(StoreError::ClaimLost)
    ));

    // Now the lookup that follows the completion's no-op fails: a trigger
    // on the completion's statement drops the session's privileges (a
    // role that cannot read the schema), as a connection that breaks
    // between the two statements would fail it.
    let s = schema.name();
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".lose_privileges() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM set_config('role', 'pg_monitor', false); RETURN NULL; END $$; \
         CREATE TRIGGER lose_privileges AFTER UPDATE ON {} FOR EACH STATEMENT \
         EXECUTE FUNCTION \"{s}\".lose_privileges();",
        table.qualified()
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let again = store.complete(&claim, &response(b"{\"id\":1}")).await;
    match again {
        Err(StoreError::ClaimLost) => {
            panic!("a lookup that failed was taken for a claim lost to a takeover")
        }
        Err(e) => assert!(format!("{e:?}").contains("permission denied"), "{e:?}"),
        Ok(()) => panic!("the lookup was to fail"),
    }
    // Its connections end with it (the privileges dropped on one of them).
    drop(store);
}
