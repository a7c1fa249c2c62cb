//! Outboxes and inboxes in tables of their own (schema-qualified on
//! PostgreSQL), and a relay pointed at a table that is not there: it stops
//! with an error and counts it, rather than poll forever in silence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_outbox::inbox::{Handled, InboxTable};
use idem_outbox::outbox::{self, OutboxTable, OutgoingMessage, Relay, RelayConfig, RelayError};
use idem_outbox::transport::InProcess;
use idem_test_support::postgres::TestSchema;

/// Counts every counter increment by name and labels: enough to see the
/// relay's failure metric without a metrics backend.
#[derive(Default)]
struct Counters(Mutex<HashMap<String, Arc<Count>>>);

#[derive(Default)]
struct Count(AtomicU64);

impl metrics::CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

impl metrics::Recorder for &'static Counters {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let count = self.0.lock().unwrap().entry(name).or_default().clone();
        metrics::Counter::from_arc(count)
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

fn counters() -> &'static Counters {
    static COUNTERS: std::sync::OnceLock<&'static Counters> = std::sync::OnceLock::new();
    COUNTERS.get_or_init(|| {
        let c: &'static Counters = Box::leak(Box::default());
        metrics::set_global_recorder(c).unwrap();
        c
    })
}

fn missing_table_count() -> u64 {
    counters()
        .0
        .lock()
        .unwrap()
        .get("idem_outbox_relay_errors_total{error=missing_table}")
        .map_or(0, |c| c.0.load(Ordering::SeqCst))
}

async fn pg() -> (sqlx::PgPool, TestSchema) {
    let schema = TestSchema::create("idem_tables").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .connect(&schema.url())
        .await
        .unwrap();
    (pool, schema)
}

async fn sqlite() -> (sqlx::SqlitePool, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}?mode=rwc", dir.path().join("t.db").display());
    (sqlx::SqlitePool::connect(&url).await.unwrap(), dir)
}

fn event(id: &str) -> OutgoingMessage {
    OutgoingMessage::new(id, "orders", "{}").header("kind", "test")
}

async fn act(pool: &sqlx::PgPool, table: &InboxTable, id: &str) -> Handled<()> {
    table
        .process(pool, "c", id, async |_tx| Ok::<_, sqlx::Error>(()))
        .await
        .unwrap()
}

#[tokio::test]
async fn two_outboxes_and_two_inboxes_in_one_schema_stay_apart() {
    let (pool, schema) = pg().await;
    let a = OutboxTable::new(Some(schema.name()), "a_outbox").unwrap();
    let b = OutboxTable::new(Some(schema.name()), "b_outbox").unwrap();
    a.migrate(&pool).await.unwrap();
    b.migrate(&pool).await.unwrap();
    a.migrate(&pool).await.unwrap(); // again: nothing to do
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{}.a_outbox", schema.name()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(exists.is_some(), "the table is where it was named");

    // One message id in each: two tables, two unique keys.
    for t in [&a, &b] {
        let mut tx = pool.begin().await.unwrap();
        t.enqueue(&mut tx, &event("m1")).await.unwrap();
        tx.commit().await.unwrap();
    }
    // Enqueued twice in one table: its own key says so.
    let mut tx = pool.begin().await.unwrap();
    let err = a.enqueue(&mut tx, &event("m1")).await.unwrap_err();
    tx.rollback().await.unwrap();
    let dup = idem_sql::DuplicateKey::of(&err).expect("a unique violation");
    assert_eq!(dup.constraint, a.message_id_key());

    // A relay of `a` publishes `a`'s message and leaves `b`'s alone.
    let transport = Arc::new(InProcess::new());
    let mut rx = transport.subscribe("orders");
    let relay = Relay::new(
        &pool,
        transport,
        RelayConfig {
            table: a.clone(),
            ..RelayConfig::default()
        },
    );
    let round = tokio::spawn(async move { relay.round().await.unwrap() });
    let delivery = rx.recv().await.unwrap();
    assert_eq!(delivery.message.message_id, "m1");
    assert_eq!(
        delivery.message.headers,
        vec![("kind".to_owned(), "test".to_owned())]
    );
    delivery.ack();
    assert_eq!(round.await.unwrap().sent, 1);
    assert_eq!(a.stats(&pool).await.unwrap().sent, 1);
    assert_eq!(b.stats(&pool).await.unwrap().pending, 1);
    assert_eq!(b.stats(&pool).await.unwrap().sent, 0);

    let ia = InboxTable::new(Some(schema.name()), "a_inbox").unwrap();
    let ib = InboxTable::new(Some(schema.name()), "b_inbox").unwrap();
    ia.migrate(&pool).await.unwrap();
    ib.migrate(&pool).await.unwrap();
    assert_eq!(act(&pool, &ia, "m1").await, Handled::Processed(()));
    assert_eq!(
        act(&pool, &ib, "m1").await,
        Handled::Processed(()),
        "another inbox"
    );
    assert_eq!(act(&pool, &ia, "m1").await, Handled::Duplicate);
    assert_eq!(ia.sweep(&pool, Duration::ZERO, 10).await.unwrap(), 1);
    assert_eq!(act(&pool, &ia, "m1").await, Handled::Processed(()), "swept");
}

#[tokio::test]
async fn sqlite_tables_of_their_own_and_no_schemas() {
    let (pool, _dir) = sqlite().await;
    let t = OutboxTable::new(None, "billing_outbox").unwrap();
    t.migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    t.enqueue(&mut tx, &event("m1")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(t.stats(&pool).await.unwrap().pending, 1);
    assert_eq!(
        outbox::stats(&pool).await.map(|s| s.pending).ok(),
        None,
        "the default table was never created"
    );
    let i = InboxTable::new(None, "billing_inbox").unwrap();
    i.migrate(&pool).await.unwrap();
    let once = |id: &'static str| {
        let i = i.clone();
        let pool = pool.clone();
        async move {
            i.process(&pool, "c", id, async |_tx| Ok::<_, sqlx::Error>(()))
                .await
                .unwrap()
        }
    };
    assert_eq!(once("m1").await, Handled::Processed(()));
    assert_eq!(once("m1").await, Handled::Duplicate);

    // SQLite has no schemas: refused, never put somewhere else.
    let qualified = OutboxTable::new(Some("billing"), "outbox").unwrap();
    let err = qualified.migrate(&pool).await.unwrap_err();
    assert!(err.to_string().contains("SQLite has no schemas"), "{err}");
    let mut tx = pool.begin().await.unwrap();
    assert!(qualified.enqueue(&mut tx, &event("m2")).await.is_err());
    tx.rollback().await.unwrap();
    let err = InboxTable::new(Some("billing"), "inbox")
        .unwrap()
        .migrate(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("SQLite has no schemas"), "{err}");
    let relay = Relay::new(
        &pool,
        Arc::new(InProcess::new()),
        RelayConfig {
            table: qualified,
            ..RelayConfig::default()
        },
    );
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let err = relay.run(stopped).await.unwrap_err();
    assert!(matches!(err, RelayError::Misconfigured(_)), "{err:?}");
}

/// A relay whose table is missing must not poll forever: `run` ends with
/// the error at once, and the failure is counted.
#[tokio::test]
async fn a_relay_without_its_table_fails_loudly_on_both_databases() {
    let before = missing_table_count();
    let (pool, _schema) = pg().await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let relay = Relay::new(&pool, Arc::new(InProcess::new()), RelayConfig::default());
    let err = tokio::time::timeout(Duration::from_secs(60), relay.run(stopped.clone()))
        .await
        .expect("run returned instead of polling")
        .unwrap_err();
    match &err {
        RelayError::MissingTable { table, .. } => assert_eq!(table, "\"idem_outbox\""),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("outbox::migrate"), "{err}");
    assert!(err.is_fatal());

    let (lite, _dir) = sqlite().await;
    let relay = Relay::new(&lite, Arc::new(InProcess::new()), RelayConfig::default());
    let err = tokio::time::timeout(Duration::from_secs(60), relay.run(stopped))
        .await
        .expect("run returned instead of polling")
        .unwrap_err();
    assert!(matches!(err, RelayError::MissingTable { .. }), "{err:?}");
    assert_eq!(missing_table_count() - before, 2, "each failure counted");

    // A round meets it the same way (the table dropped under a running relay).
    outbox::migrate(&lite).await.unwrap();
    let relay = Relay::new(&lite, Arc::new(InProcess::new()), RelayConfig::default());
    assert_eq!(relay.round().await.unwrap().sent, 0);
    sqlx::query("DROP TABLE idem_outbox")
        .execute(&lite)
        .await
        .unwrap();
    assert!(matches!(
        relay.round().await,
        Err(RelayError::MissingTable { .. })
    ));
    drop(stop);
}
