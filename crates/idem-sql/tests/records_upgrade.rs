//! A records table made by an idem before version 2 (the shortest retention
//! any claim asked for), upgraded in place on each database: its rows read
//! as not knowing it, and keep not knowing it when taken over; new rows
//! know it. On MySQL, whose DDL commits by itself, a version 2 whose column
//! was added but whose row was never recorded (the runner stopped between
//! the two) is taken as applied.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store};
use idem_sql::migrate::migrate;
use idem_sql::{MySql, Postgres, RecordDialect, SqlStore, Sqlite, TableName};
use idem_test_support::mysql::TestDatabase;
use idem_test_support::postgres::TestSchema;

const OPERATION: &str = "5d1f8a2e-3b6c-4f7a-9e0d-1c2b3a4d5e6f";

fn fingerprint() -> Fingerprint {
    Fingerprint::of_request("POST", "/payments", Some("application/json"), b"{}")
}

fn request(key: &str, retention: Duration) -> ClaimRequest {
    ClaimRequest {
        scope: "s".into(),
        key: key.into(),
        fingerprint: fingerprint(),
        lease: Duration::from_secs(30),
        retention,
    }
}

fn now_ms() -> i64 {
    idem_core::UnixMillis::now().0
}

/// The insert of an old row as a version-1 idem wrote it on SQLite and
/// MySQL (times in ms): in progress, its lease over, no shortest retention.
/// Binds: fingerprint, operation id, locked_until, created_at, expires_at.
fn old_row(key_column: &str) -> String {
    format!(
        "INSERT INTO idem_records (scope, {key_column}, fingerprint, operation_id, token, state, \
         locked_until, created_at, expires_at) VALUES ('s', 'old', ?, ?, 7, 'in_progress', ?, ?, ?)"
    )
}

/// What an upgraded table must do, `store` on it holding the old row `old`
/// (in progress, its lease over, made without the column).
async fn upgraded<D: RecordDialect>(store: SqlStore<D>) {
    let old = store.get("s", "old").await.unwrap().expect("the old row");
    assert_eq!(old.shortest_retention, None, "a row made before the column");
    let ClaimOutcome::Acquired(taken) = store
        .claim(&request("old", Duration::from_secs(60)))
        .await
        .unwrap()
    else {
        panic!("the old row's lease is over: taken over")
    };
    assert!(taken.takeover);
    assert_eq!(taken.operation_id.to_string(), OPERATION);
    let old = store.get("s", "old").await.unwrap().unwrap();
    assert_eq!(
        old.shortest_retention, None,
        "a takeover cannot know what the claims before it asked for"
    );
    let ClaimOutcome::Acquired(_) = store
        .claim(&request("new", Duration::from_secs(60)))
        .await
        .unwrap()
    else {
        panic!("a new key")
    };
    let new = store.get("s", "new").await.unwrap().unwrap();
    assert_eq!(new.shortest_retention, Some(Duration::from_secs(60)));
}

#[tokio::test]
async fn sqlite_upgrades_a_table_made_before_the_shortest_retention() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}?mode=rwc", dir.path().join("r.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let table = TableName::default();
    migrate::<Sqlite>(&pool, &table, &SqlStore::<Sqlite>::migrations()[..1])
        .await
        .unwrap();
    let now = now_ms();
    sqlx::query(&old_row("key"))
        .bind(fingerprint().as_bytes().to_vec())
        .bind(OPERATION)
        .bind(now - 1000)
        .bind(now - 2000)
        .bind(now + 3_600_000)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let store = SqlStore::<Sqlite>::connect(&url).await.unwrap();
    upgraded(store).await;
}

#[tokio::test]
async fn postgres_upgrades_a_table_made_before_the_shortest_retention() {
    let schema = TestSchema::create("idem_upgrade").await;
    let pool = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    let table = TableName::new(Some(schema.name()), "idem_records").unwrap();
    migrate::<Postgres>(&pool, &table, &SqlStore::<Postgres>::migrations()[..1])
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (scope, key, fingerprint, operation_id, token, state, locked_until, \
         created_at, expires_at) VALUES ('s', 'old', $1, $2::uuid, 7, 'in_progress', \
         now() - interval '1 s', now() - interval '2 s', now() + interval '1 hour')",
        table.qualified()
    ))
    .bind(fingerprint().as_bytes().to_vec())
    .bind(OPERATION)
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let store = SqlStore::<Postgres>::connect_with(&schema.url(), table)
        .await
        .unwrap();
    upgraded(store).await;
}

#[tokio::test]
async fn mysql_upgrades_a_table_made_before_the_shortest_retention_also_after_a_stop_midway() {
    let db = TestDatabase::create("idem_upgrade").await;
    let pool = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
    let table = TableName::default();
    let migrations = SqlStore::<MySql>::migrations();
    migrate::<MySql>(&pool, &table, &migrations[..1])
        .await
        .unwrap();
    let now = now_ms();
    sqlx::query(&old_row("`key`"))
        .bind(fingerprint().as_bytes().to_vec())
        .bind(OPERATION)
        .bind(now - 1000)
        .bind(now - 2000)
        .bind(now + 3_600_000)
        .execute(&pool)
        .await
        .unwrap();
    // Version 2's change made, its row not recorded: a runner stopped
    // between the two (MySQL commits DDL by itself).
    let v2 = migrations
        .iter()
        .find(|m| m.version == 2)
        .expect("version 2");
    sqlx::raw_sql(&v2.sql.replace("{table}", "idem_records"))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let store = SqlStore::<MySql>::connect(&db.url()).await.unwrap();
    upgraded(store).await;
}
