//! The inbox and the outbox against real PostgreSQL (and SQLite for the
//! inbox), each test in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_outbox::inbox::{self, Handled};
use idem_outbox::outbox::{self, OutgoingMessage, Published, Publisher, Relay, RelayConfig};
use idem_test_support::messaging::Recording;
use idem_test_support::postgres::TestSchema;

async fn pg() -> (sqlx::PgPool, TestSchema) {
    let schema = TestSchema::create("idem_outbox").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&schema.url())
        .await
        .unwrap();
    inbox::migrate(&pool).await.unwrap();
    outbox::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    (pool, schema)
}

/// An outbox on a SQLite file of the test's own (the directory goes with
/// the guard).
async fn lite() -> (sqlx::SqlitePool, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let pool = sqlx::SqlitePool::connect(&format!(
        "sqlite:{}?mode=rwc",
        dir.path().join("o.db").display()
    ))
    .await
    .unwrap();
    outbox::migrate(&pool).await.unwrap();
    (pool, dir)
}

async fn effects(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn consume(pool: &sqlx::PgPool, consumer: &str, message_id: &str) -> Handled<()> {
    let id = message_id.to_owned();
    inbox::process(pool, consumer, message_id, async move |tx| {
        sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok::<_, sqlx::Error>(())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivered_message_acts_once() {
    let (pool, _s) = pg().await;
    assert_eq!(consume(&pool, "c", "m1").await, Handled::Processed(()));
    assert_eq!(consume(&pool, "c", "m1").await, Handled::Duplicate);
    // another consumer of the same message is another effect
    assert_eq!(consume(&pool, "other", "m1").await, Handled::Processed(()));
    assert_eq!(effects(&pool).await, 2);
    // a failing handler rolls back, and the redelivery processes it
    let failed = inbox::process(&pool, "c", "m2", async |tx| {
        sqlx::query("INSERT INTO effects (message_id) VALUES ('m2')")
            .execute(&mut *tx)
            .await
            .unwrap();
        Err::<(), _>("boom")
    })
    .await;
    assert!(matches!(
        failed,
        Err(idem_outbox::InboxError::Handler("boom"))
    ));
    assert_eq!(effects(&pool).await, 2);
    assert_eq!(consume(&pool, "c", "m2").await, Handled::Processed(()));
    assert_eq!(effects(&pool).await, 3);
}

/// With a statement timeout, an inbox step the database does not answer
/// (the mark waiting on a lock another transaction holds, a handler that
/// hangs) fails in time, leaving nothing: the message is processed once
/// it comes again. Without one, the consumer would wait as long as the
/// database does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_inbox_step_past_its_statement_timeout_fails_in_time_and_leaves_nothing() {
    let (pool, schema) = pg().await;
    // The bounded consumer's connections, told apart by their name.
    let name = format!("inbox-{}", uuid::Uuid::new_v4().simple());
    let own = sqlx::postgres::PgPoolOptions::new()
        .connect_with(
            schema
                .url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .application_name(&name),
        )
        .await
        .unwrap();
    let bounded = inbox::InboxTable::default().statement_timeout(Duration::from_millis(300));
    // Another transaction holds the message's mark, uncommitted.
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (held, holding) = tokio::sync::oneshot::channel::<()>();
    let blocker = {
        let pool = pool.clone();
        tokio::spawn(async move {
            inbox::process(&pool, "c", "m-held", async move |_tx| {
                let _ = held.send(());
                let _ = released.await;
                Err::<(), _>("let go")
            })
            .await
        })
    };
    holding.await.unwrap();
    let waited = tokio::time::timeout(
        Duration::from_secs(20),
        bounded.process(&own, "c", "m-held", async |_tx| Ok::<_, sqlx::Error>(())),
    )
    .await
    .expect("the mark's wait is cut by the statement timeout");
    assert!(
        matches!(waited, Err(inbox::InboxError::Database(_))),
        "{waited:?}"
    );
    // The server cancelled the mark too: no connection of the bounded
    // consumer still waits on the lock (it would, cut on this side only).
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(&name)
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "a cut statement still waits on the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    release.send(()).unwrap();
    assert!(matches!(
        blocker.await.unwrap(),
        Err(inbox::InboxError::Handler("let go"))
    ));
    // A handler that hangs.
    let hung = tokio::time::timeout(
        Duration::from_secs(20),
        bounded.process(&own, "c", "m-hung", async |_tx| {
            std::future::pending::<()>().await;
            Ok::<_, sqlx::Error>(())
        }),
    )
    .await
    .expect("the handler is cut by the statement timeout");
    assert!(
        matches!(hung, Err(inbox::InboxError::Database(_))),
        "{hung:?}"
    );
    // Nothing was kept of either: both are processed when they come again.
    for id in ["m-held", "m-hung"] {
        let again = bounded
            .process(&pool, "c", id, async move |tx| {
                sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map(drop)
            })
            .await
            .unwrap();
        assert_eq!(again, Handled::Processed(()), "{id}");
    }
    assert_eq!(effects(&pool).await, 2);
    // The bound is the transaction's alone: the connection goes back to
    // the pool with the server's own setting, for whatever runs on it next.
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&schema.url())
        .await
        .unwrap();
    let before: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    let seen = bounded
        .process(&one, "c", "m-after", async |tx| {
            sqlx::query_scalar::<_, String>("SHOW statement_timeout")
                .fetch_one(&mut *tx)
                .await
        })
        .await
        .unwrap();
    assert_eq!(seen, Handled::Processed("300ms".to_owned()));
    let after: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    assert_eq!(after, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_consumers_act_once() {
    let (pool, _s) = pg().await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(
            async move { consume(&pool, "c", "same").await },
        ));
    }
    let mut processed = 0;
    for t in tasks {
        processed += usize::from(t.await.unwrap() == Handled::Processed(()));
    }
    assert_eq!(processed, 1);
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_consumers_act_once_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("inbox.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    inbox::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (message_id TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            inbox::process(&pool, "c", "same", async |tx| {
                sqlx::query("INSERT INTO effects VALUES ('same')")
                    .execute(&mut *tx)
                    .await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap()
        }));
    }
    let mut processed = 0;
    for t in tasks {
        processed += usize::from(t.await.unwrap() == Handled::Processed(()));
    }
    assert_eq!(processed, 1);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(inbox::sweep(&pool, Duration::ZERO, 100).await.unwrap(), 1);
}

fn message(id: &str, destination: &str, key: Option<&str>) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.to_owned(),
        destination: destination.to_owned(),
        ordering_key: key.map(str::to_owned),
        payload: Bytes::from(format!("{{\"id\":\"{id}\"}}")),
        headers: vec![("type".into(), "Test".into())],
    }
}

async fn enqueue_many(pool: &sqlx::PgPool, n: usize, prefix: &str) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = pool.begin().await.unwrap();
        for i in chunk {
            outbox::enqueue(&mut tx, &message(&format!("{prefix}-{i}"), "orders", None))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_publish_ten_thousand_messages_none_lost() {
    let (pool, _s) = pg().await;
    enqueue_many(&pool, 10_000, "m").await;
    let publisher = Arc::new(Recording::default());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let config = RelayConfig {
        poll: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let a = tokio::spawn(Relay::new(&pool, publisher.clone(), config.clone()).run(stop.clone()));
    let b = tokio::spawn(Relay::new(&pool, publisher.clone(), config).run(stop));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = outbox::stats(&pool).await.unwrap();
        if s.sent == 10_000 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not all sent: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(true).unwrap();
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    let published = publisher.published.lock().unwrap().clone();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for id in &published {
        *counts.entry(id).or_default() += 1;
    }
    assert_eq!(counts.len(), 10_000, "every message published");
    let duplicates = published.len() - counts.len();
    assert_eq!(
        duplicates, 0,
        "SKIP LOCKED: no row published twice in the normal case"
    );
    assert!(
        publisher.calls.load(Ordering::SeqCst) < 100,
        "published in batches"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_dies_before_marking_republishes_and_the_inbox_absorbs_it() {
    let (pool, _s) = pg().await;
    enqueue_many(&pool, 50, "crash").await;
    /// Publishes (the broker confirms), then the relay dies before marking.
    struct DiesAfterPublish(Arc<Recording>);
    impl Publisher for DiesAfterPublish {
        fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
            let inner = self.0.publish(batch);
            Box::pin(async move {
                let _ = inner.await;
                panic!("the relay process died after the broker confirmed");
            })
        }
    }
    let recording = Arc::new(Recording::default());
    // The lease is the margin: the healthy relay's first round must come
    // before it runs out, however slow the machine.
    let short = RelayConfig {
        lease: Duration::from_millis(3000),
        ..RelayConfig::default()
    };
    let dying = Relay::new(
        &pool,
        Arc::new(DiesAfterPublish(recording.clone())),
        short.clone(),
    );
    assert!(tokio::spawn(async move { dying.round().await })
        .await
        .unwrap_err()
        .is_panic());
    assert_eq!(
        outbox::stats(&pool).await.unwrap().sent,
        0,
        "nothing was marked"
    );
    // before the lease runs out, another relay finds nothing to take
    let healthy = Relay::new(&pool, recording.clone(), short);
    assert_eq!(healthy.round().await.unwrap().sent, 0);
    tokio::time::sleep(Duration::from_millis(3200)).await;
    assert_eq!(healthy.round().await.unwrap().sent, 50);
    let published = recording.published.lock().unwrap().clone();
    assert_eq!(published.len(), 100, "every message went out twice");
    // the consumer's inbox makes each act once
    for id in &published {
        consume(&pool, "orders-consumer", id).await;
    }
    assert_eq!(effects(&pool).await, 50);
}

/// Results go by message id: a message the publisher says nothing of is
/// not marked sent (it is retried), whatever its place in the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_publisher_says_nothing_of_is_not_marked_sent() {
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    for (id, destination) in [("a", "orders"), ("b", "silent"), ("c", "orders")] {
        outbox::enqueue(&mut tx, &message(id, destination, None))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = Arc::new(Recording::default());
    let relay = Relay::new(&pool, publisher.clone(), RelayConfig::default());
    let round = relay.round().await.unwrap();
    assert_eq!((round.sent, round.failed), (2, 1));
    assert_eq!(*publisher.published.lock().unwrap(), vec!["a", "c"]);
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.pending), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_without_blocking_the_rest() {
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("bad", "poison", None))
        .await
        .unwrap();
    for i in 0..5 {
        outbox::enqueue(&mut tx, &message(&format!("good-{i}"), "orders", None))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = Arc::new(Recording::default());
    let relay = Relay::new(
        &pool,
        publisher.clone(),
        RelayConfig {
            max_attempts: 3,
            backoff: Duration::from_millis(20),
            ..RelayConfig::default()
        },
    );
    let first = relay.round().await.unwrap();
    assert_eq!(
        (first.sent, first.failed),
        (5, 1),
        "the rest went out at once"
    );
    for _ in 0..20 {
        relay.round().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.dead, s.pending), (5, 1, 0));
    let dead = outbox::dead_letters(&pool, 10).await.unwrap();
    assert_eq!(dead[0].message_id, "bad");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("not published: the broker refused it"),
        "the kind, then the broker's words"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_with_one_ordering_key_go_out_in_order() {
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    for i in 0..5 {
        outbox::enqueue(
            &mut tx,
            &message(&format!("a-{i}"), "orders", Some("order-a")),
        )
        .await
        .unwrap();
        outbox::enqueue(
            &mut tx,
            &message(&format!("b-{i}"), "orders", Some("order-b")),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = Arc::new(Recording::default());
    let relay = Relay::new(&pool, publisher.clone(), RelayConfig::default());
    let mut rounds = 0;
    while outbox::stats(&pool).await.unwrap().pending > 0 {
        relay.round().await.unwrap();
        rounds += 1;
        assert!(rounds < 20);
    }
    let published = publisher.published.lock().unwrap().clone();
    let a: Vec<_> = published
        .iter()
        .filter(|m| m.starts_with("a-"))
        .cloned()
        .collect();
    let b: Vec<_> = published
        .iter()
        .filter(|m| m.starts_with("b-"))
        .cloned()
        .collect();
    assert_eq!(a, (0..5).map(|i| format!("a-{i}")).collect::<Vec<_>>());
    assert_eq!(b, (0..5).map(|i| format!("b-{i}")).collect::<Vec<_>>());
    assert_eq!(
        rounds, 5,
        "one message per key per round, keys side by side"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_row_wakes_the_relay_promptly_and_an_uncommitted_one_is_never_sent() {
    let (pool, _s) = pg().await;
    let publisher = Arc::new(Recording::default());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let config = RelayConfig {
        poll: Duration::from_secs(30),
        ..RelayConfig::default()
    };
    let relay = tokio::spawn(Relay::new(&pool, publisher.clone(), config).run(stop));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut rolled_back = pool.begin().await.unwrap();
    outbox::enqueue(&mut rolled_back, &message("never", "orders", None))
        .await
        .unwrap();
    rolled_back.rollback().await.unwrap();
    let started = std::time::Instant::now();
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("soon", "orders", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    while publisher.published.lock().unwrap().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "NOTIFY did not wake the relay"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        *publisher.published.lock().unwrap(),
        vec!["soon".to_owned()]
    );
    stop_tx.send(true).unwrap();
    relay.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_listener_neither_takes_nor_poisons_a_connection_of_the_shared_pool() {
    // A pool of one: were the listener's connection one of the pool's,
    // nothing else could ever get a connection while the relay waits.
    let (setup, s) = pg().await;
    setup.close().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&s.url())
        .await
        .unwrap();
    let admin = sqlx::PgPool::connect(&s.url()).await.unwrap();
    let publisher = Arc::new(Recording::default());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    // A short poll: the relay stops waiting for a notification (dropping
    // the listener's receive wherever it is) every few milliseconds.
    let config = RelayConfig {
        poll: Duration::from_millis(3),
        ..RelayConfig::default()
    };
    let relay = tokio::spawn(Relay::new(&pool, publisher.clone(), config).run(stop));
    for i in 0..60 {
        let mut tx = pool.begin().await.unwrap();
        outbox::enqueue(&mut tx, &message(&format!("m-{i}"), "orders", None))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        if i % 10 == 0 {
            // The listener's connection broken under it: it reconnects,
            // while the relay keeps cutting its waits short.
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND query LIKE 'LISTEN%'",
            )
            .execute(&admin)
            .await
            .unwrap();
        }
        // The shared pool's connection listens to nothing: a notification
        // never lands where a statement expects its answer.
        let listening: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_listening_channels()")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(listening, 0, "a pooled connection is listening");
    }
    let started = std::time::Instant::now();
    while publisher.published.lock().unwrap().len() < 60 {
        assert!(started.elapsed() < Duration::from_secs(30), "not all sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    relay.await.unwrap().unwrap();
    pool.close().await;
    admin.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_embedded_default_sqlite_outbox_through_the_in_process_transport() {
    use idem_outbox::transport::InProcess;
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("outbox.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    outbox::migrate(&pool).await.unwrap();
    inbox::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (message_id TEXT)")
        .execute(&pool)
        .await
        .unwrap();

    let transport = Arc::new(InProcess::new());
    let mut deliveries = transport.subscribe("orders");
    let relay = Relay::new(
        &pool,
        transport.clone(),
        RelayConfig {
            poll: Duration::from_secs(30),
            ..RelayConfig::default()
        },
    );
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(relay.clone().run(stop));
    // a rolled-back transaction's message never goes out
    let mut rolled_back = pool.begin().await.unwrap();
    outbox::enqueue(&mut rolled_back, &message("never", "orders", None))
        .await
        .unwrap();
    rolled_back.rollback().await.unwrap();
    for chunk in 0..10 {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        for i in 0..100 {
            outbox::enqueue(
                &mut tx,
                &message(&format!("s-{}", chunk * 100 + i), "orders", None),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
        relay.wake();
    }
    let mut consumed = 0;
    while consumed < 1000 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .unwrap()
            .unwrap();
        let m = delivery.message.clone();
        assert_ne!(m.message_id, "never");
        let id = m.message_id.clone();
        let handled = inbox::process(&pool, "c", &m.message_id, async move |tx| {
            sqlx::query("INSERT INTO effects VALUES ($1)")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            Ok::<_, sqlx::Error>(())
        })
        .await
        .unwrap();
        assert_eq!(handled, Handled::Processed(()));
        delivery.ack();
        consumed += 1;
    }
    // the relay marks the last batch once its acknowledgements are in
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let s = loop {
        let s = outbox::stats(&pool).await.unwrap();
        if s.sent == 1000 || std::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((s.sent, s.pending, s.dead), (1000, 0, 0));
    stop_tx.send(true).unwrap();
    running.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_message_is_marked_sent_only_once_its_consumer_acknowledged_it() {
    use idem_outbox::transport::InProcess;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}?mode=rwc", dir.path().join("ack.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    outbox::migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("m1", "orders", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_millis(300)));
    let mut rx = transport.subscribe("orders");
    let relay = Relay::new(
        &pool,
        transport,
        RelayConfig {
            backoff: Duration::from_millis(10),
            ..RelayConfig::default()
        },
    );
    // the consumer "crashes": it drops the delivery without acknowledging
    let first = tokio::spawn({
        let relay = relay.clone();
        async move { relay.round().await.unwrap() }
    });
    drop(rx.recv().await.unwrap());
    assert_eq!(first.await.unwrap().failed, 1);
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.pending, s.sent), (1, 0), "not marked sent");
    // a consumer that never answers times out the same way
    tokio::time::sleep(Duration::from_millis(30)).await;
    let silent = tokio::spawn({
        let relay = relay.clone();
        async move { relay.round().await.unwrap() }
    });
    let held = rx.recv().await.unwrap();
    assert_eq!(silent.await.unwrap().failed, 1);
    drop(held);
    // the next attempt is acknowledged after processing: now it is sent
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = tokio::spawn({
        let relay = relay.clone();
        async move { relay.round().await.unwrap() }
    });
    let delivery = rx.recv().await.unwrap();
    assert_eq!(delivery.message.message_id, "m1");
    delivery.ack();
    assert_eq!(second.await.unwrap().sent, 1);
    assert_eq!(outbox::stats(&pool).await.unwrap().sent, 1);
}

/// A header that does not fit the row's encoding is refused at enqueue,
/// with nothing written, rather than cut (and the message's headers lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_too_long_to_keep_is_refused_and_nothing_is_enqueued() {
    let mut oversized = message("too-long", "orders", None);
    oversized
        .headers
        .push(("x-".to_owned() + &"a".repeat(70_000), "v".to_owned()));

    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    let err = outbox::enqueue(&mut tx, &oversized).await.unwrap_err();
    assert!(matches!(err, sqlx::Error::Encode(_)), "{err}");
    tx.rollback().await.unwrap();
    assert_eq!(outbox::stats(&pool).await.unwrap().pending, 0);

    let (lite, _dir) = lite().await;
    let mut tx = lite.begin().await.unwrap();
    let err = outbox::enqueue(&mut tx, &oversized).await.unwrap_err();
    assert!(matches!(err, sqlx::Error::Encode(_)), "{err}");
    tx.rollback().await.unwrap();
    assert_eq!(outbox::stats(&lite).await.unwrap().pending, 0);
}

/// A broker that is down uses up none of a row's attempts: however many
/// rounds fail, the row waits (only a refusal, or a message nothing takes,
/// dead-letters it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_is_down_never_dead_letters_a_row() {
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("m1", "down", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::new(
        &pool,
        Arc::new(Recording::default()),
        RelayConfig {
            max_attempts: 2,
            backoff: Duration::from_millis(5),
            ..RelayConfig::default()
        },
    );
    let mut failed = 0;
    for _ in 0..40 {
        failed += relay.round().await.unwrap().failed;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(failed > 2, "tried more often than its attempts: {failed}");
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.pending, s.dead), (0, 1, 0));
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM idem_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        attempts, 0,
        "each attempt against a broker down is given back"
    );
}

/// A broker that takes a message and never confirms it (here: a consumer
/// that never acknowledges, with an hour to do so) holds a round no longer
/// than half the lease: the row is let go, unconfirmed, its attempt given
/// back, to be sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_confirms_holds_a_round_half_a_lease() {
    use idem_outbox::transport::InProcess;
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("m1", "slow", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(3600)));
    let mut deliveries = transport.subscribe("slow");
    let relay = Relay::new(
        &pool,
        transport.clone(),
        RelayConfig {
            lease: Duration::from_secs(2),
            ..RelayConfig::default()
        },
    );
    let round = tokio::time::timeout(Duration::from_secs(20), relay.round())
        .await
        .expect("the round ends within half its lease, not the hour")
        .unwrap();
    assert_eq!((round.sent, round.failed), (0, 1));
    let held = deliveries.recv().await.unwrap();
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!((s.sent, s.pending, s.dead), (0, 1, 0));
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM idem_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(attempts, 0);
    drop(held);
}

/// A relay whose stop sender is dropped stops (rather than running rounds
/// back to back, `changed` answering at once for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_stop_sender_is_dropped_stops() {
    let (pool, _s) = pg().await;
    let relay = Relay::new(
        &pool,
        Arc::new(Recording::default()),
        RelayConfig {
            poll: Duration::from_secs(3600),
            ..RelayConfig::default()
        },
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(relay.run(stopped));
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(stop);
    let ended = tokio::time::timeout(Duration::from_secs(20), running).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
}

/// A message no transport could carry is refused at enqueue, in the
/// business transaction, with nothing written; the rest of it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_no_transport_carries_is_refused_at_enqueue() {
    let (pool, _s) = pg().await;
    let bad = [
        OutgoingMessage::new("", "orders", "x"),
        OutgoingMessage::new("i".repeat(256), "orders", "x"),
        OutgoingMessage::new("a\nb", "orders", "x"),
        OutgoingMessage::new("m", "", "x"),
        OutgoingMessage::new("m", "d".repeat(256), "x"),
        OutgoingMessage::new("m", "orders", "x").header("a b", "v"),
        OutgoingMessage::new("m", "orders", "x").header("a:b", "v"),
        OutgoingMessage::new("m", "orders", "x").header("", "v"),
        OutgoingMessage::new("m", "orders", "x").header("h".repeat(256), "v"),
        OutgoingMessage::new("m", "orders", "x").header("h", "v\r\nInjected: yes"),
    ];
    let mut tx = pool.begin().await.unwrap();
    for m in &bad {
        let refused = outbox::enqueue(&mut tx, m).await;
        assert!(
            matches!(refused, Err(sqlx::Error::Encode(_))),
            "{m:?}: {refused:?}"
        );
    }
    let fine = OutgoingMessage::new("i".repeat(255), "d".repeat(255), "x")
        .header("h".repeat(255), "any value: ünïcode too");
    outbox::enqueue(&mut tx, &fine).await.unwrap();
    tx.commit().await.unwrap();
    let s = outbox::stats(&pool).await.unwrap();
    assert_eq!(
        (s.pending, s.sent, s.dead),
        (1, 0, 0),
        "only the one that can go"
    );
}

/// Batch after batch failing in one moment of the broker's absence is one
/// step of its outage, not one per batch: the rows of the fourth batch do
/// not wait eight times as long as the first's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_grows_its_backoff_with_time_not_with_batches() {
    let (pool, _s) = pg().await;
    let mut tx = pool.begin().await.unwrap();
    for i in 0..20 {
        outbox::enqueue(&mut tx, &message(&format!("m{i}"), "down", None))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::new(
        &pool,
        Arc::new(Recording::default()),
        RelayConfig {
            batch: 5,
            // A step of the outage is 10 s: the four rounds take far less.
            backoff: Duration::from_secs(5),
            ..RelayConfig::default()
        },
    );
    for _ in 0..4 {
        assert_eq!(relay.round().await.unwrap().failed, 5);
    }
    let longest: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(next_attempt_at) - now())::float8 FROM idem_outbox",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // One step: 10 s at most (40 s if each batch had been a step).
    assert!(longest <= 10.0, "{longest}");
}

/// A relay whose broker is down does not walk the backlog round after
/// round with no pause: a full batch whose every row failed waits for the
/// poll (here an hour, so the one batch is all it publishes). Before, each
/// full failed batch was followed at once by the next, every row of the
/// backlog claimed and marked failed back to back.
///
/// On SQLite: a PostgreSQL relay is also woken by `NOTIFY`, whose channel
/// the other tests' outboxes in the same database share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_that_failed_waits_for_the_poll() {
    let (pool, _dir) = lite().await;
    let mut tx = pool.begin().await.unwrap();
    for i in 0..10 {
        outbox::enqueue(&mut tx, &message(&format!("d-{i}"), "down", None))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = Arc::new(Recording::default());
    let relay = Relay::new(
        &pool,
        publisher.clone(),
        RelayConfig {
            batch: 2,
            poll: Duration::from_secs(3600),
            ..RelayConfig::default()
        },
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(relay.run(stopped));
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while publisher.calls.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < until, "no round in 20 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(publisher.calls.load(Ordering::SeqCst), 1);
    stop.send(true).unwrap();
    drop(stop);
    let ended = tokio::time::timeout(Duration::from_secs(20), running).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
}

/// One destination the broker cannot take (its queue stuck) backs off as
/// its outage goes on while another destination's rows go out every round:
/// its waits double (200 ms, 400 ms, 800 ms, …), so in 3 s of rounds every
/// 50 ms it is tried a handful of times. Before, any row sent ended the
/// one outage the relay kept, and the stuck destination's row was tried
/// again after every first wait (about every 200 ms: a dozen times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_destination_backs_off_while_the_others_flow() {
    let (pool, _dir) = lite().await;
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &message("stuck-1", "down", None))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::new(
        &pool,
        Arc::new(Recording::default()),
        RelayConfig {
            backoff: Duration::from_millis(200),
            ..RelayConfig::default()
        },
    );
    let (mut tried, mut sent, mut rounds) = (0, 0, 0);
    let until = std::time::Instant::now() + Duration::from_secs(3);
    let mut i = 0;
    while std::time::Instant::now() < until {
        let mut tx = pool.begin().await.unwrap();
        outbox::enqueue(&mut tx, &message(&format!("ok-{i}"), "orders", None))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        i += 1;
        let round = relay.round().await.unwrap();
        tried += round.failed;
        sent += round.sent;
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        sent, rounds,
        "the other destination flowed: each round sent its row"
    );
    assert!(
        (1..=6).contains(&tried),
        "the stuck destination was tried {tried} times in 3 s"
    );
}
