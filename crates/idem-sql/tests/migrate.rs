//! The one migration runner, on the three databases: records, outbox and
//! inbox share one version table; each migration applies once, also when
//! runners race; an applied migration whose text changed is refused, and
//! so is a table a newer idem migrated;
//! SQLite's old version table is upgraded in place. And what each
//! database's errors mean.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use idem_sql::migrate::{migrate, MigrateError, Migration};
use idem_sql::{ErrorClass, MySql, Postgres, Sqlite, TableName};
use idem_test_support::mysql::TestDatabase;
use idem_test_support::postgres::TestSchema;

fn table(schema: Option<&str>, name: &str) -> TableName {
    TableName::new(schema, name).unwrap()
}

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
            tokio::spawn(
                async move { migrate::<Postgres>(&pool, &table(None, "widgets"), STEPS).await },
            )
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
                migrate::<Postgres>(&pool, &table(Some(&fresh), &format!("t{i}")), &steps).await
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
    migrate::<Postgres>(pool, &table(None, "gadgets"), &gadgets)
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
            tokio::spawn(
                async move { migrate::<Sqlite>(&pool, &table(None, "widgets"), STEPS).await },
            )
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
    migrate::<Sqlite>(&pool, &table(None, "widgets"), STEPS)
        .await
        .unwrap();
    assert_eq!(versions_sqlite(&pool).await.len(), 3);
    // Versions applied before checksums adopted their text's.
    let unsummed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idem_schema_migrations WHERE checksum IS NULL AND table_name = 'widgets'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unsummed, 0);
    // A schema is refused, clearly.
    let err = migrate::<Sqlite>(&pool, &table(Some("app"), "widgets"), STEPS)
        .await
        .unwrap_err();
    assert!(matches!(err, MigrateError::Misconfigured { .. }), "{err}");
    assert!(err.to_string().contains("SQLite has no schemas"), "{err}");
}

const CHANGED: &[Migration] = &[
    Migration {
        version: 1,
        sql: "CREATE TABLE {table} (id VARCHAR(10) PRIMARY KEY)",
    },
    Migration {
        version: 2,
        sql: "CREATE TABLE {name}_more (id VARCHAR(10) PRIMARY KEY)",
    },
];
const CHANGED_AGAIN: &[Migration] = &[Migration {
    version: 1,
    sql: "CREATE TABLE {table} (id VARCHAR(20) PRIMARY KEY)",
}];

fn refused_as_changed(err: MigrateError) {
    let MigrateError::Changed {
        version,
        applied,
        now,
        ..
    } = &err
    else {
        panic!("expected Changed, got {err}");
    };
    assert_eq!(*version, 1);
    assert_ne!(applied, now);
    assert!(
        err.to_string().contains("must not change once applied"),
        "{err}"
    );
}

/// An applied migration whose text changed is refused, on each database;
/// the same text again passes.
#[tokio::test]
async fn a_changed_migration_is_refused_on_every_database() {
    let lite = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    migrate::<Sqlite>(&lite, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    migrate::<Sqlite>(&lite, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    refused_as_changed(
        migrate::<Sqlite>(&lite, &table(None, "w"), CHANGED_AGAIN)
            .await
            .unwrap_err(),
    );

    let schema = TestSchema::create("idem_sum").await;
    let pg = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    migrate::<Postgres>(&pg, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    migrate::<Postgres>(&pg, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    refused_as_changed(
        migrate::<Postgres>(&pg, &table(None, "w"), CHANGED_AGAIN)
            .await
            .unwrap_err(),
    );
    pg.close().await;

    let db = TestDatabase::create("idem_sum").await;
    let my = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
    migrate::<MySql>(&my, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    migrate::<MySql>(&my, &table(None, "w"), CHANGED)
        .await
        .unwrap();
    refused_as_changed(
        migrate::<MySql>(&my, &table(None, "w"), CHANGED_AGAIN)
            .await
            .unwrap_err(),
    );
    my.close().await;
}

/// A table a newer idem migrated (a version this code does not know) is
/// refused, on `pool`, and nothing is applied: not even a version this
/// code knows that the table lacks. `t` must be new; `exists` says whether
/// a table of that name is there.
async fn a_newer_table_is_refused<DB: idem_sql::Driver>(
    pool: &sqlx::Pool<DB>,
    t: &TableName,
    exists: impl AsyncFn(&str) -> bool,
) {
    let v = |version, sql| Migration { version, sql };
    let newer: &[Migration] = &[
        v(1, "CREATE TABLE {table} (id VARCHAR(10) PRIMARY KEY)"),
        v(3, "CREATE TABLE {name}_three (id VARCHAR(10) PRIMARY KEY)"),
    ];
    migrate::<DB::Dialect>(pool, t, newer).await.unwrap();
    // An older build: it knows 1 and 2, not 3.
    let older: &[Migration] = &[
        newer[0],
        v(2, "CREATE TABLE {name}_two (id VARCHAR(10) PRIMARY KEY)"),
    ];
    let err = migrate::<DB::Dialect>(pool, t, older).await.unwrap_err();
    let MigrateError::Newer {
        newer: unknown,
        known,
        missing,
        ..
    } = &err
    else {
        panic!("expected Newer, got {err}");
    };
    assert_eq!(
        (unknown.as_slice(), *known, missing.as_slice()),
        (&[3][..], 2, &[2][..])
    );
    assert!(
        err.to_string()
            .contains("does not know (it knows up to 2): a newer idem migrated it"),
        "{err}"
    );
    assert!(
        !exists(&format!("{}_two", t.table())).await,
        "version 2 was applied"
    );
    // The newer build itself goes on as before, and so does one that knows
    // even more.
    migrate::<DB::Dialect>(pool, t, newer).await.unwrap();
    let newest: &[Migration] = &[
        newer[0],
        newer[1],
        v(4, "CREATE TABLE {name}_four (id VARCHAR(10) PRIMARY KEY)"),
    ];
    migrate::<DB::Dialect>(pool, t, newest).await.unwrap();
    assert!(exists(&format!("{}_four", t.table())).await);
    // One that knows every applied version but an older text of one is
    // told that first.
    let changed: &[Migration] = &[v(1, "CREATE TABLE {table} (id VARCHAR(20) PRIMARY KEY)")];
    let err = migrate::<DB::Dialect>(pool, t, changed).await.unwrap_err();
    assert!(
        matches!(err, MigrateError::Changed { version: 1, .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_a_newer_idem_migrated_is_refused_on_every_database() {
    let lite = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    let exists = async |name: &str| -> bool {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sqlite_master WHERE name = $1")
            .bind(name.to_owned())
            .fetch_one(&lite)
            .await
            .unwrap()
            > 0
    };
    a_newer_table_is_refused(&lite, &table(None, "n"), exists).await;
    lite.close().await;

    let schema = TestSchema::create("idem_newer").await;
    let pg = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    let exists = async |name: &str| -> bool {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2",
        )
        .bind(schema.name())
        .bind(name.to_owned())
        .fetch_one(&pg)
        .await
        .unwrap()
            > 0
    };
    a_newer_table_is_refused(&pg, &table(Some(schema.name()), "n"), exists).await;
    pg.close().await;

    let db = TestDatabase::create("idem_newer").await;
    let my = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
    let exists = async |name: &str| -> bool {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?",
        )
        .bind(db.name())
        .bind(name.to_owned())
        .fetch_one(&my)
        .await
        .unwrap()
            > 0
    };
    a_newer_table_is_refused(&my, &table(Some(db.name()), "n"), exists).await;
    my.close().await;
}

/// MySQL: runners racing on one database, of one table and of several,
/// apply each step once (a named lock; DDL commits by itself there).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_applies_each_step_once_even_when_runners_race() {
    let home = TestDatabase::create("idem_migrate").await;
    let fresh = TestDatabase::create("idem_migrate_x").await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .connect(&home.url())
        .await
        .unwrap();
    let steps: &'static [Migration] = &[
        Migration {
            version: 1,
            sql: "CREATE TABLE IF NOT EXISTS {table} (id VARCHAR(10) PRIMARY KEY);",
        },
        Migration {
            version: 2,
            sql: "INSERT INTO {table} VALUES ('a')",
        },
    ];
    let fresh_name = fresh.name().to_owned();
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let (pool, fresh_name) = (pool.clone(), fresh_name.clone());
            tokio::spawn(async move {
                let t = table(Some(&fresh_name), if i % 2 == 0 { "even" } else { "odd" });
                migrate::<MySql>(&pool, &t, steps).await
            })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    for t in ["even", "odd"] {
        let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM `{fresh_name}`.`{t}`"))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1, "{t}: each step ran once");
    }
    let versions: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM `{fresh_name}`.idem_schema_migrations"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(versions, 4);
    pool.close().await;
}

/// MySQL: a runner stopped while it holds the migration lock (its future
/// dropped, as a start-up time-out drops it) lets the lock go with its
/// connection. The pool used to get that connection back still holding the
/// lock, and every later runner waited a minute for it and failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_a_runner_stopped_midway_leaves_no_lock_behind() {
    use sqlx::Connection as _;
    let home = TestDatabase::create("idem_migrate_stop").await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&home.url())
        .await
        .unwrap();
    let t = table(Some(home.name()), "stopped");
    let steps: &'static [Migration] = &[Migration {
        version: 1,
        sql: "CREATE TABLE IF NOT EXISTS {table} (id VARCHAR(10) PRIMARY KEY)",
    }];
    migrate::<MySql>(&pool, &t, &[]).await.unwrap();
    // Another session holds the version table: the runner waits on it
    // while it holds the lock, and is stopped there.
    let mut blocker = sqlx::MySqlConnection::connect(&home.url()).await.unwrap();
    sqlx::query("LOCK TABLES idem_schema_migrations WRITE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let lock = format!("idem-migrate:{}", home.name());
    let stopped = tokio::time::timeout(
        std::time::Duration::from_millis(500),
        migrate::<MySql>(&pool, &t, steps),
    )
    .await;
    assert!(stopped.is_err(), "the runner was not held: {stopped:?}");
    sqlx::query("UNLOCK TABLES")
        .execute(&mut blocker)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let holder: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?)")
            .bind(&lock)
            .fetch_one(&mut blocker)
            .await
            .unwrap();
        let Some(holder) = holder else { break };
        assert!(
            std::time::Instant::now() < deadline,
            "connection {holder} still holds {lock:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    migrate::<MySql>(&pool, &t, steps).await.unwrap();
    blocker.close().await.unwrap();
    pool.close().await;
}

/// An upgrade whose DDL waits behind a transaction writing its table (a
/// lock the DDL needs, behind which every later statement on the table
/// would queue) gives up after a bounded wait, to be run again later,
/// instead of waiting for ever (MySQL's default `lock_wait_timeout` is a
/// year); once the transaction ended it goes through. `qualified` is the
/// table as a statement names it.
async fn an_upgrade_behind_an_open_transaction_gives_up<DB: idem_sql::Driver>(
    pool: &sqlx::Pool<DB>,
    t: &TableName,
    qualified: &str,
) {
    use idem_sql::dialect::{Dialect as _, Statement};
    let first: &[Migration] = &[Migration {
        version: 1,
        sql: "CREATE TABLE IF NOT EXISTS {table} (id VARCHAR(10) PRIMARY KEY)",
    }];
    migrate::<DB::Dialect>(pool, t, first).await.unwrap();
    let mut open = pool.begin().await.unwrap();
    let write = Statement::<DB::Dialect>::raw(&format!("INSERT INTO {qualified} VALUES ('a')"));
    DB::Dialect::execute(&mut open, &write, &[]).await.unwrap();
    let upgrade: &[Migration] = &[
        first[0],
        Migration {
            version: 2,
            sql: "CREATE INDEX waited_id2 ON {table} (id)",
        },
    ];
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_secs(40),
        migrate::<DB::Dialect>(pool, t, upgrade),
    )
    .await
    .expect("the upgrade waited for the open transaction past 40 s");
    assert!(gave_up.is_err(), "{gave_up:?}");
    open.rollback().await.unwrap();
    migrate::<DB::Dialect>(pool, t, upgrade).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_upgrade_behind_an_open_transaction_gives_up() {
    let home = TestDatabase::create("idem_migrate_wait").await;
    let pool = sqlx::MySqlPool::connect(&home.url()).await.unwrap();
    let t = table(Some(home.name()), "waited");
    let qualified = format!("`{}`.`waited`", home.name());
    an_upgrade_behind_an_open_transaction_gives_up(&pool, &t, &qualified).await;
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_upgrade_behind_an_open_transaction_gives_up() {
    let schema = TestSchema::create("idem_migrate_wait").await;
    let pool = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    let t = table(Some(schema.name()), "waited");
    let qualified = format!("\"{}\".waited", schema.name());
    an_upgrade_behind_an_open_transaction_gives_up(&pool, &t, &qualified).await;
    pool.close().await;
}

/// What each database's errors mean: a missing table, an unknown column
/// (fatal: never retried forever), a unique violation, a deadlock (retry
/// the transaction), an unreachable server.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn errors_are_classified_alike_on_every_database() {
    use idem_sql::{classify, Dialect};
    let lite = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    let e = sqlx::query("SELECT * FROM missing")
        .execute(&lite)
        .await
        .unwrap_err();
    assert_eq!(Sqlite::classify(&e), ErrorClass::MissingTable);
    sqlx::query("CREATE TABLE t (a TEXT)")
        .execute(&lite)
        .await
        .unwrap();
    let e = sqlx::query("SELECT nope FROM t")
        .execute(&lite)
        .await
        .unwrap_err();
    assert_eq!(classify(&e), ErrorClass::Fatal);
    // A database opened read-only refuses a write: fatal, by its primary
    // code (SQLITE_READONLY, whichever extended code comes with it).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ro.db");
    let rw = sqlx::SqlitePool::connect(&format!("sqlite:{}?mode=rwc", file.display()))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE t (a TEXT)")
        .execute(&rw)
        .await
        .unwrap();
    rw.close().await;
    let ro = sqlx::SqlitePool::connect(&format!("sqlite:{}?mode=ro", file.display()))
        .await
        .unwrap();
    let e = sqlx::query("INSERT INTO t VALUES ('x')")
        .execute(&ro)
        .await
        .unwrap_err();
    assert_eq!(Sqlite::classify(&e), ErrorClass::Fatal, "{e}");
    ro.close().await;

    let schema = TestSchema::create("idem_class").await;
    let pg = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    let e = sqlx::query("SELECT * FROM missing")
        .execute(&pg)
        .await
        .unwrap_err();
    assert_eq!(Postgres::classify(&e), ErrorClass::MissingTable);
    let e = sqlx::query("SELECT nope FROM pg_class")
        .execute(&pg)
        .await
        .unwrap_err();
    assert_eq!(classify(&e), ErrorClass::Fatal);
    assert!(!ErrorClass::Fatal.is_retryable());
    pg.close().await;

    let db = TestDatabase::create("idem_class").await;
    let my = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
    let e = sqlx::query("SELECT * FROM missing")
        .execute(&my)
        .await
        .unwrap_err();
    assert_eq!(MySql::classify(&e), ErrorClass::MissingTable);
    sqlx::query("CREATE TABLE t (id INT PRIMARY KEY, c VARCHAR(10), UNIQUE KEY t_c (c))")
        .execute(&my)
        .await
        .unwrap();
    let e = sqlx::query("SELECT nope FROM t")
        .execute(&my)
        .await
        .unwrap_err();
    assert_eq!(classify(&e), ErrorClass::Fatal);
    sqlx::query("INSERT INTO t VALUES (1, 'x'), (2, 'y')")
        .execute(&my)
        .await
        .unwrap();
    let e = sqlx::query("INSERT INTO t VALUES (3, 'x')")
        .execute(&my)
        .await
        .unwrap_err();
    assert_eq!(classify(&e), ErrorClass::UniqueViolation);
    let d = idem_sql::DuplicateKey::of(&e).unwrap();
    assert_eq!(d.constraint, "t_c");
    // A deadlock: two transactions lock rows 1 and 2 in opposite orders.
    let (mut a, mut b) = (my.begin().await.unwrap(), my.begin().await.unwrap());
    sqlx::query("UPDATE t SET c = 'a' WHERE id = 1")
        .execute(&mut *a)
        .await
        .unwrap();
    sqlx::query("UPDATE t SET c = 'b' WHERE id = 2")
        .execute(&mut *b)
        .await
        .unwrap();
    let second = tokio::spawn(async move {
        let r = sqlx::query("UPDATE t SET c = 'b1' WHERE id = 1")
            .execute(&mut *b)
            .await;
        (r.map(|_| ()), b)
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let first = sqlx::query("UPDATE t SET c = 'a2' WHERE id = 2")
        .execute(&mut *a)
        .await
        .map(|_| ());
    let (other, b) = second.await.unwrap();
    let deadlock = first
        .err()
        .or(other.err())
        .expect("one of the two is the deadlock victim");
    assert_eq!(classify(&deadlock), ErrorClass::RetryTransaction);
    assert!(ErrorClass::RetryTransaction.is_retryable());
    let _ = a.rollback().await;
    let _ = b.rollback().await;
    my.close().await;
    let closed = sqlx::query("SELECT 1").execute(&my).await.unwrap_err();
    assert_eq!(classify(&closed), ErrorClass::Unavailable);
}

/// A unique violation is recognised on SQLite and PostgreSQL, by what each
/// names (MySQL's: above).
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

/// What a failover, a time limit or a lock limit answers is worth a retry
/// (the standby promoted, the load gone), never a `500` for good: a
/// read-only transaction, a statement past its time limit, a lock not had
/// in time; on PostgreSQL and MySQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_and_time_limits_are_worth_a_retry() {
    use idem_sql::Dialect;
    let schema = TestSchema::create("idem_class_ro").await;
    let pg = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    sqlx::query("CREATE TABLE t (id INT PRIMARY KEY)")
        .execute(&pg)
        .await
        .unwrap();
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&pg)
        .await
        .unwrap();
    let mut ro = pg.begin().await.unwrap();
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *ro)
        .await
        .unwrap();
    let e = sqlx::query("INSERT INTO t VALUES (2)")
        .execute(&mut *ro)
        .await
        .unwrap_err();
    assert_eq!(Postgres::classify(&e), ErrorClass::Unavailable, "{e}");
    ro.rollback().await.unwrap();
    let mut slow = pg.begin().await.unwrap();
    sqlx::query("SET LOCAL statement_timeout = 50")
        .execute(&mut *slow)
        .await
        .unwrap();
    let e = sqlx::query("SELECT pg_sleep(5)")
        .execute(&mut *slow)
        .await
        .unwrap_err();
    assert_eq!(Postgres::classify(&e), ErrorClass::Unavailable, "{e}");
    slow.rollback().await.unwrap();
    let mut holder = pg.begin().await.unwrap();
    sqlx::query("SELECT id FROM t WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut waiter = pg.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = 50")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let e = sqlx::query("UPDATE t SET id = 1 WHERE id = 1")
        .execute(&mut *waiter)
        .await
        .unwrap_err();
    assert_eq!(Postgres::classify(&e), ErrorClass::RetryTransaction, "{e}");
    waiter.rollback().await.unwrap();
    holder.rollback().await.unwrap();
    pg.close().await;

    let db = TestDatabase::create("idem_class_ro").await;
    let my = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
    sqlx::query("CREATE TABLE t (id INT PRIMARY KEY)")
        .execute(&my)
        .await
        .unwrap();
    let mut ro = my.begin().await.unwrap();
    // A transaction begun read-only: end the one `begin` opened first.
    sqlx::query("COMMIT").execute(&mut *ro).await.unwrap();
    sqlx::query("START TRANSACTION READ ONLY")
        .execute(&mut *ro)
        .await
        .unwrap();
    let e = sqlx::query("INSERT INTO t VALUES (2)")
        .execute(&mut *ro)
        .await
        .unwrap_err();
    assert_eq!(MySql::classify(&e), ErrorClass::Unavailable, "{e}");
    ro.rollback().await.unwrap();
    let mut conn = my.acquire().await.unwrap();
    sqlx::query("SET SESSION max_statement_time = 0.05")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Over a row: MariaDB interrupts it at the limit (1969).
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&mut *conn)
        .await
        .unwrap();
    let e = sqlx::query("SELECT SLEEP(5) FROM t")
        .execute(&mut *conn)
        .await
        .unwrap_err();
    assert_eq!(MySql::classify(&e), ErrorClass::Unavailable, "{e}");
    drop(conn);
    my.close().await;
}

/// A records table whose index name would not fit an identifier is
/// refused when the store is made, saying why: PostgreSQL cut the index's
/// name short (and `CREATE INDEX IF NOT EXISTS` could then find another
/// table's index under it, leaving this one without), MySQL refused the
/// migration with a bare 1059.
#[tokio::test]
async fn a_records_table_whose_index_name_cannot_fit_is_refused() {
    let pool = sqlx::PgPool::connect_lazy("postgres://postgres@127.0.0.1:5432/test").unwrap();
    let longest = "t".repeat(idem_sql::MAX_RECORD_TABLE_NAME);
    assert!(idem_sql::SqlStore::<Postgres>::new(pool.clone(), table(None, &longest)).is_ok());
    let longer = "t".repeat(idem_sql::MAX_RECORD_TABLE_NAME + 1);
    let refused = idem_sql::SqlStore::<Postgres>::new(pool, table(None, &longer))
        .map(|_| ())
        .unwrap_err();
    let said = format!("{:?}", refused);
    assert!(said.contains("longer than 52 bytes"), "{said}");
}

/// A role that may use the records but does not own their tables (a
/// least-privilege service account; `idem once` run from cron) starts
/// against a database already migrated: the runner reads the version
/// table and finds nothing to do, where it ran `ALTER TABLE … ADD COLUMN
/// IF NOT EXISTS` on it at every start, which needs ownership (refused,
/// so the process never started).
#[tokio::test]
async fn an_up_to_date_database_needs_no_ownership_to_start() {
    let schema = TestSchema::create("idem_least").await;
    let records = table(Some(schema.name()), "idem_records");
    drop(
        idem_sql::SqlStore::<Postgres>::connect_with(&schema.url(), records.clone())
            .await
            .unwrap(),
    );
    let role = format!("{}_role", schema.name());
    let admin = sqlx::PgPool::connect(&schema.url()).await.unwrap();
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA \"{}\" TO {role}", schema.name()),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{}\" TO {role}",
            schema.name()
        ),
    ] {
        sqlx::query(&sql).execute(&admin).await.unwrap();
    }
    let as_role = schema
        .url()
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let started = idem_sql::SqlStore::<Postgres>::connect_with(&as_role, records).await;
    let ok = started.as_ref().map(|_| ()).map_err(|e| format!("{e:?}"));
    if let Ok(store) = started {
        store.pool().close().await;
    }
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(&sql).execute(&admin).await.unwrap();
    }
    admin.close().await;
    ok.unwrap();
}
