//! The generic store suite and PostgreSQL-specific tests, against the real
//! server, each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, Store, StoreError, StoredResponse};
use idem_postgres::{PostgresStore, SqlRecords, TableName};
use idem_sql::{insert_unique, DuplicateKey, Inserted};
use idem_test_support::postgres::{database_url, TestSchema};

async fn fresh() -> (PostgresStore, TestSchema) {
    let schema = TestSchema::create("idem_suite").await;
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .expect("connect");
    (store, schema)
}

mod suite {
    idem_store_suite::store_suite!(|| super::fresh());
}

mod transactional {
    // Business transactions on a pool whose search path is the test's
    // schema, so that their tables are the test's own.
    idem_store_suite::transactional_suite!(|| async {
        let (store, schema) = super::fresh().await;
        let pool = sqlx::PgPool::connect(&schema.url()).await.expect("pool");
        (store, pool, schema)
    });
}

fn request() -> idem_core::ClaimRequest {
    idem_store_suite::request(
        "s",
        "k",
        "{}",
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tables_in_two_schemas_do_not_see_each_other() {
    let (a, _sa) = fresh().await;
    let (b, _sb) = fresh().await;
    let ClaimOutcome::Acquired(_) = a.claim(&request()).await.unwrap() else {
        panic!()
    };
    let ClaimOutcome::Acquired(_) = b.claim(&request()).await.unwrap() else {
        panic!()
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_idempotent_and_concurrent_starts_are_safe() {
    let schema = TestSchema::create("idem_migrate").await;
    let table = TableName::new(Some(schema.name()), "records").unwrap();
    let mut starts = Vec::new();
    for _ in 0..4 {
        let table = table.clone();
        starts.push(tokio::spawn(async move {
            PostgresStore::connect_with(&database_url(), table).await
        }));
    }
    for s in starts {
        s.await
            .unwrap()
            .expect("every concurrent start migrates or finds the table");
    }
    let store = PostgresStore::connect_with(&database_url(), table)
        .await
        .unwrap();
    let versions: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".idem_schema_migrations WHERE table_name = 'records'",
        schema.name()
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(versions, PostgresStore::migrations().len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_inspection_use_the_database_clock() {
    let (store, _schema) = fresh().await;
    let ClaimOutcome::Acquired(c) = store.claim(&request()).await.unwrap() else {
        panic!()
    };
    let mut other = request();
    other.key = "k2".into();
    other.lease = Duration::from_millis(50);
    store.claim(&other).await.unwrap();
    store.complete(&c, &response()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (
            stats.completed,
            stats.in_progress,
            stats.leases_expired,
            stats.past_retention
        ),
        (1, 1, 1, 0)
    );
    assert!(stats.oldest_created_at.unwrap() <= stats.now);
    let seen = store.inspect("s", "k").await.unwrap().unwrap();
    assert_eq!(seen.record.operation_id, c.operation_id);
    assert!(store.inspect("s", "nope").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violations_name_their_constraint() {
    let (store, schema) = fresh().await;
    let t = format!("\"{}\".orders", schema.name());
    sqlx::raw_sql(&format!(
        "CREATE TABLE {t} (id int PRIMARY KEY, order_ref text CONSTRAINT orders_ref_key UNIQUE)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let insert = |id: i32, r: &'static str| {
        let sql = format!("INSERT INTO {t} (id, order_ref) VALUES ($1, $2)");
        let pool = store.pool().clone();
        async move { sqlx::query(&sql).bind(id).bind(r).execute(&pool).await }
    };
    assert!(matches!(
        insert_unique(insert(1, "a").await, "orders_ref_key").unwrap(),
        Inserted::New(_)
    ));
    match insert_unique(insert(2, "a").await, "orders_ref_key").unwrap() {
        Inserted::Duplicate(d) => {
            assert_eq!(d.constraint, "orders_ref_key");
            assert_eq!(d.table.as_deref(), Some("orders"));
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    // a unique violation of another constraint is a real failure
    let err = insert_unique(insert(1, "b").await, "orders_ref_key").unwrap_err();
    assert_eq!(DuplicateKey::of(&err).unwrap().constraint, "orders_pkey");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_unavailable_not_a_panic() {
    let err = PostgresStore::connect("postgres://postgres@127.0.0.1:1/nothing")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(TableName::new(Some("x\"; drop"), "t").is_err());
}
