//! The outbox, the relay and the inbox, written once and run on each
//! database idem supports: SQLite, PostgreSQL and MySQL/MariaDB (a file, a
//! schema, a database of each test's own).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_outbox::inbox::{self, Handled};
use idem_outbox::outbox::{self, OutgoingMessage, Relay, RelayConfig, RelayError};
use idem_outbox::{InboxTable, OutboxDialect, OutboxTable};
use idem_sql::dialect::{Arg, Statement};
use idem_sql::{Dialect, Driver};
use idem_test_support::messaging::Recording;
use idem_test_support::mysql::TestDatabase;
use idem_test_support::postgres::TestSchema;

/// Runs a statement without arguments, on any database.
async fn exec<DB: Driver>(pool: &sqlx::Pool<DB>, sql: &str) {
    let mut conn = pool.acquire().await.unwrap();
    DB::Dialect::execute(&mut conn, &Statement::raw(sql), &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn count<DB: Driver>(pool: &sqlx::Pool<DB>, sql: &str) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    let row = DB::Dialect::fetch_optional(&mut conn, &Statement::raw(sql), &[])
        .await
        .unwrap()
        .unwrap();
    DB::Dialect::get(&row, "n").unwrap().int("n").unwrap()
}

fn message(id: &str, destination: &str, key: Option<&str>) -> OutgoingMessage {
    let mut m = OutgoingMessage::new(id, destination, Bytes::from(format!("{{\"id\":\"{id}\"}}")))
        .header("type", "Test");
    if let Some(k) = key {
        m = m.ordering_key(k);
    }
    m
}

/// What every database must do, once per database.
async fn conformance<DB>(pool: sqlx::Pool<DB>)
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    inbox::migrate(&pool).await.unwrap();
    outbox::migrate(&pool).await.unwrap();
    outbox::migrate(&pool).await.unwrap(); // again: nothing to do
    exec(
        &pool,
        "CREATE TABLE effects (message_id VARCHAR(200) NOT NULL)",
    )
    .await;

    // The inbox: a redelivery acts once; a failing handler rolls back.
    let consume = |consumer: &'static str, id: &'static str| {
        let pool = pool.clone();
        async move {
            inbox::process(&pool, consumer, id, async move |tx| {
                DB::Dialect::execute(
                    tx,
                    &Statement::raw("INSERT INTO effects (message_id) VALUES ($1)"),
                    &[Arg::Text(id)],
                )
                .await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap()
        }
    };
    assert_eq!(consume("c", "m1").await, Handled::Processed(()));
    assert_eq!(consume("c", "m1").await, Handled::Duplicate);
    assert_eq!(consume("other", "m1").await, Handled::Processed(()));
    let failed = inbox::process(&pool, "c", "m2", async |tx| {
        DB::Dialect::execute(
            tx,
            &Statement::raw("INSERT INTO effects (message_id) VALUES ('m2')"),
            &[],
        )
        .await
        .unwrap();
        Err::<(), _>("boom")
    })
    .await;
    assert!(matches!(
        failed,
        Err(idem_outbox::InboxError::Handler("boom"))
    ));
    assert_eq!(count(&pool, "SELECT count(*) AS n FROM effects").await, 2);

    // Racing consumers of one message: one effect.
    let racing: Vec<_> = (0..12)
        .map(|_| tokio::spawn(consume("c", "same")))
        .collect();
    let mut processed = 0;
    for t in racing {
        processed += usize::from(t.await.unwrap() == Handled::Processed(()));
    }
    assert_eq!(processed, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) AS n FROM effects WHERE message_id = 'same'"
        )
        .await,
        1
    );

    // The outbox: a rolled-back enqueue is never published.
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("never", "orders", None))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("a", "orders", Some("k")))
        .await
        .unwrap();
    outbox::enqueue(&mut tx, &message("b", "orders", Some("k")))
        .await
        .unwrap();
    outbox::enqueue(&mut tx, &message("bad", "poison", None))
        .await
        .unwrap();
    outbox::enqueue(&mut *tx, &message("quiet", "silent", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The same id twice: the message id's key.
    let mut tx = pool.begin().await.unwrap();
    let twice = outbox::enqueue(&mut tx, &message("a", "orders", None))
        .await
        .unwrap_err();
    assert_eq!(
        idem_sql::classify(&twice),
        idem_sql::ErrorClass::UniqueViolation
    );
    tx.rollback().await.unwrap();

    let publisher = Arc::new(Recording::default());
    let relay = Relay::new(
        &pool,
        publisher.clone(),
        RelayConfig {
            max_attempts: 2,
            backoff: Duration::from_millis(10),
            ..RelayConfig::default()
        },
    );
    // One ordering key: `b` waits for `a`.
    let first = relay.round().await.unwrap();
    assert_eq!(
        (first.sent, first.failed),
        (1, 2),
        "a sent; bad refused; quiet unsaid"
    );
    let second = relay.round().await.unwrap();
    assert_eq!(second.sent, 1, "b after a");
    assert_eq!(*publisher.published.lock().unwrap(), vec!["a", "b"]);
    for _ in 0..20 {
        relay.round().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.dead, s.pending), (2, 2, 0));
    let dead = outbox::dead_letters(&pool, 10).await.unwrap();
    let names: Vec<_> = dead.iter().map(|d| d.message_id.as_str()).collect();
    assert_eq!(names, vec!["bad", "quiet"]);
    assert_eq!(dead[0].attempts, 2);
    assert_eq!(dead[0].destination, "poison");
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("not published: the broker refused it")
    );
    assert!(!publisher
        .published
        .lock()
        .unwrap()
        .contains(&"never".to_owned()));

    // Two relays racing over 600 rows: each published once.
    for chunk in 0..3 {
        let mut tx = pool.begin().await.unwrap();
        for i in 0..200 {
            let id = format!("m-{chunk}-{i}");
            outbox::enqueue(&mut tx, &message(&id, "orders", None))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let racing = Arc::new(Recording::default());
    let config = RelayConfig {
        batch: 50,
        ..RelayConfig::default()
    };
    let (a, b) = (
        Relay::new(&pool, racing.clone(), config.clone()),
        Relay::new(&pool, racing.clone(), config),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while outbox::stats(&pool).await.unwrap().sent < 602 {
        let (ra, rb) = tokio::join!(a.round(), b.round());
        ra.unwrap();
        rb.unwrap();
        assert!(std::time::Instant::now() < deadline, "not all sent");
    }
    let published = racing.published.lock().unwrap().clone();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for id in &published {
        *seen.entry(id).or_default() += 1;
    }
    assert_eq!(seen.len(), 600);
    assert_eq!(published.len(), 600, "no row published twice");

    // Sent rows stay until swept, oldest first in batches; pending and
    // dead rows are never swept.
    assert_eq!(
        outbox::sweep_sent(&pool, Duration::from_secs(3600), 1000)
            .await
            .unwrap(),
        0,
        "every row was sent within the hour"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        outbox::sweep_sent(&pool, Duration::ZERO, 500)
            .await
            .unwrap(),
        500,
        "a batch"
    );
    assert_eq!(
        outbox::sweep_sent(&pool, Duration::ZERO, 500)
            .await
            .unwrap(),
        102
    );
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.dead, s.pending), (0, 2, 0));

    // Sweeping the inbox keeps what is young.
    assert_eq!(
        inbox::sweep(&pool, Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        inbox::sweep(&pool, Duration::ZERO, 2).await.unwrap(),
        2,
        "a batch"
    );
    assert_eq!(inbox::sweep(&pool, Duration::ZERO, 100).await.unwrap(), 1);
}

/// A relay pointed at a database without its table stops at once.
async fn a_missing_table_stops_the_relay<DB>(pool: sqlx::Pool<DB>)
where
    DB: Driver,
    DB::Dialect: OutboxDialect,
{
    let relay = Relay::new(
        &pool,
        Arc::new(Recording::default()),
        RelayConfig::default(),
    );
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let err = tokio::time::timeout(Duration::from_secs(60), relay.run(stopped))
        .await
        .expect("run returned instead of polling")
        .unwrap_err();
    assert!(matches!(err, RelayError::MissingTable { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("o.db").display());
    let pool = idem_sqlite::open_pool(&url).await.unwrap();
    a_missing_table_stops_the_relay(pool.clone()).await;
    conformance(pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres() {
    let schema = TestSchema::create("idem_dialects").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&schema.url())
        .await
        .unwrap();
    a_missing_table_stops_the_relay(pool.clone()).await;
    conformance(pool.clone()).await;
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql() {
    let db = TestDatabase::create("idem_dialects").await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(20)
        .connect(&db.url())
        .await
        .unwrap();
    a_missing_table_stops_the_relay(pool.clone()).await;
    conformance(pool.clone()).await;
    pool.close().await;
}

/// MySQL: tables of their own, in a database of their own, created there.
#[tokio::test]
async fn mysql_tables_in_another_database() {
    let home = TestDatabase::create("idem_home").await;
    let other = TestDatabase::create("idem_other").await;
    let pool = sqlx::MySqlPool::connect(&home.url()).await.unwrap();
    let o = OutboxTable::new(Some(other.name()), "billing_outbox").unwrap();
    let i = InboxTable::new(Some(other.name()), "billing_inbox").unwrap();
    o.migrate(&pool).await.unwrap();
    i.migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    o.enqueue(&mut tx, &message("x", "orders", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(o.stats(&pool).await.unwrap().pending, 1);
    assert_eq!(
        outbox::stats(&pool).await.map(|s| s.pending).ok(),
        None,
        "not in the home database"
    );
    let handled = i
        .process(&pool, "c", "x", async |_tx| Ok::<_, sqlx::Error>(()))
        .await
        .unwrap();
    assert_eq!(handled, Handled::Processed(()));
    let n = count(
        &pool,
        &format!("SELECT count(*) AS n FROM `{}`.billing_inbox", other.name()),
    )
    .await;
    assert_eq!(n, 1);
    pool.close().await;
}
