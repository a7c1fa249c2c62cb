//! The one migration runner: records, outbox and inbox share one version
//! table; each migration applies once, also when runners race; SQLite's
//! old version table is upgraded in place.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use idem_sql::migrate::{migrate_postgres, migrate_sqlite, Migration};
use idem_test_support::postgres::TestSchema;

const STEPS: &[Migration] = &[
    Migration {
        version: 1,
        sql: "CREATE TABLE widgets (id TEXT PRIMARY KEY); INSERT INTO widgets VALUES ('a');",
    },
    Migration {
        version: 2,
        sql: "ALTER TABLE widgets ADD COLUMN n BIGINT; INSERT INTO widgets VALUES ('b', 2);",
    },
];

async fn versions_pg(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT table_name, version FROM idem_schema_migrations ORDER BY 1, 2")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn versions_sqlite(pool: &sqlx::SqlitePool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT table_name, version FROM idem_schema_migrations ORDER BY 1, 2")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_applies_each_step_once_even_when_runners_race() {
    let schema = TestSchema::create("idem_migrate").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&schema.url())
        .await
        .unwrap();
    let runs: Vec<_> = (0..6)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { migrate_postgres(&pool, None, "widgets", STEPS).await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM widgets")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "each step ran once");
    // The records', the outbox's and the inbox's versions share the table.
    idem_outbox_free_tables_pg(&pool).await;
    assert_eq!(
        versions_pg(&pool).await,
        vec![
            ("gadgets".to_owned(), 1),
            ("widgets".to_owned(), 1),
            ("widgets".to_owned(), 2)
        ]
    );
    pool.close().await;
    drop(schema);
}

/// First deployments racing into a schema that does not exist yet, each
/// migrating another table: the schema and the version table are made
/// once, and every table gets its version.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runners_of_different_tables_race_into_a_new_schema() {
    let schema = TestSchema::create("idem_migrate_new").await;
    let fresh = format!("{}_x", schema.name());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&schema.url())
        .await
        .unwrap();
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let (pool, fresh) = (pool.clone(), fresh.clone());
            tokio::spawn(async move {
                let steps = [Migration {
                    version: 1,
                    sql: "CREATE TABLE {table} (id TEXT PRIMARY KEY)",
                }];
                migrate_postgres(&pool, Some(&fresh), &format!("t{i}"), &steps).await
            })
        })
        .collect();
    let mut failed = Vec::new();
    for run in runs {
        if let Err(e) = run.await.unwrap() {
            failed.push(e.to_string());
        }
    }
    let versions: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{fresh}\".idem_schema_migrations"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    sqlx::query(&format!("DROP SCHEMA \"{fresh}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(versions, 6);
    pool.close().await;
    drop(schema);
}

/// A second table migrated with the same runner lands in the same version
/// table, under its own name.
async fn idem_outbox_free_tables_pg(pool: &sqlx::PgPool) {
    let gadgets = [Migration {
        version: 1,
        sql: "CREATE TABLE {table} (id TEXT PRIMARY KEY)",
    }];
    migrate_postgres(pool, None, "gadgets", &gadgets)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_applies_each_step_once_and_upgrades_the_old_version_table() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("m.db").display());
    let options = url
        .parse::<sqlx::sqlite::SqliteConnectOptions>()
        .unwrap()
        .create_if_missing(true)
        .busy_timeout(std::time::Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    // The layout idem used before: the records' versions alone.
    sqlx::raw_sql(
        "CREATE TABLE idem_schema_migrations (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);
         INSERT INTO idem_schema_migrations VALUES (1, 0);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { migrate_sqlite(&pool, "widgets", STEPS).await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM widgets")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "each step ran once");
    assert_eq!(
        versions_sqlite(&pool).await,
        vec![
            ("idem_records".to_owned(), 1),
            ("widgets".to_owned(), 1),
            ("widgets".to_owned(), 2)
        ]
    );
    // Running again changes nothing.
    migrate_sqlite(&pool, "widgets", STEPS).await.unwrap();
    assert_eq!(versions_sqlite(&pool).await.len(), 3);
}

/// A unique violation is recognised on both backends, by what each names.
#[tokio::test]
async fn duplicate_keys_on_both_backends() {
    let lite = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    sqlx::query("CREATE TABLE t (a TEXT, b TEXT, c TEXT, PRIMARY KEY (a, b), UNIQUE (c))")
        .execute(&lite)
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES ('1', '1', 'x')")
        .execute(&lite)
        .await
        .unwrap();
    let pk = sqlx::query("INSERT INTO t VALUES ('1', '1', 'y')")
        .execute(&lite)
        .await
        .unwrap_err();
    let d = idem_sql::DuplicateKey::of(&pk).unwrap();
    assert_eq!(
        (d.constraint.as_str(), d.table.as_deref()),
        ("t.a, t.b", Some("t"))
    );
    let unique = sqlx::query("INSERT INTO t VALUES ('2', '2', 'x')")
        .execute(&lite)
        .await
        .unwrap_err();
    assert_eq!(
        idem_sql::DuplicateKey::of(&unique).unwrap().constraint,
        "t.c"
    );
    let other = sqlx::query("INSERT INTO missing VALUES (1)")
        .execute(&lite)
        .await
        .unwrap_err();
    assert!(idem_sql::DuplicateKey::of(&other).is_none());
    assert!(!idem_sql::is_unavailable(&other));

    let schema = TestSchema::create("idem_dup").await;
    let pg = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    sqlx::query("CREATE TABLE t (c TEXT CONSTRAINT t_c_key UNIQUE)")
        .execute(&pg)
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES ('x')")
        .execute(&pg)
        .await
        .unwrap();
    let dup = sqlx::query("INSERT INTO t VALUES ('x')")
        .execute(&pg)
        .await
        .unwrap_err();
    let d = idem_sql::DuplicateKey::of(&dup).unwrap();
    assert_eq!(
        (d.constraint.as_str(), d.table.as_deref()),
        ("t_c_key", Some("t"))
    );
    pg.close().await;
    assert!(idem_sql::is_unavailable(
        &sqlx::query("SELECT 1").execute(&pg).await.unwrap_err()
    ));
    drop(schema);
}
