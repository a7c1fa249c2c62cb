//! Outbox → NATS JetStream → inbox, against the real server and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::BoxFuture;
use idem_nats::{Incoming, NatsConsumer, NatsPublisher, StreamSpec};
use idem_outbox::outbox::{self, OutgoingMessage, Published, Publisher, Relay, RelayConfig};
use idem_test_support::messaging::{
    effects, message, outbox_schema, record_effect, wait_for, Seen,
};
use idem_test_support::postgres::TestSchema;
use tokio::sync::watch;

fn nats() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

struct Setup {
    pool: sqlx::PgPool,
    _schema: TestSchema,
    spec: StreamSpec,
    publisher: Arc<NatsPublisher>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let (publisher, stream) = (self.publisher.clone(), self.spec.stream().to_owned());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async { publisher.context().delete_stream(stream).await.ok() })
        })
        .join();
    }
}

async fn setup() -> Setup {
    let (pool, schema) = outbox_schema("idem_nats").await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let spec = StreamSpec::new(format!("IDEM_TEST_{id}"), format!("idem-test.{id}"));
    let publisher = NatsPublisher::connect(&nats(), &spec)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach NATS at {} (`bash scripts/test` starts it): {e}",
                nats()
            )
        });
    Setup {
        pool,
        _schema: schema,
        spec,
        publisher: Arc::new(publisher),
    }
}

async fn consumer(
    s: &Setup,
    seen: Arc<Seen>,
    ack_wait: Duration,
    hold: Duration,
    hang: bool,
    fail_on: Option<&'static str>,
    max_deliveries: i64,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let c = NatsConsumer::connect_with_ack_wait(
        &nats(),
        &s.spec,
        "test-consumer",
        max_deliveries,
        ack_wait,
    )
    .await
    .unwrap()
    .retry_delay(Duration::from_millis(50));
    let pool = s.pool.clone();
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(async move {
        let handler = move |m: Incoming| {
            let (pool, seen) = (pool.clone(), seen.clone());
            async move {
                record_effect(&pool, &seen, m.message_id, hold, fail_on).await?;
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok::<(), &'static str>(())
            }
        };
        c.run(handler, stop).await.unwrap();
    });
    (stop_tx, task)
}

const NO_HOLD: Duration = Duration::ZERO;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_after_commit_before_ack_gets_a_duplicate_on_redelivery() {
    let s = setup().await;
    assert!(s
        .publisher
        .publish(&[message("m-1", s.spec.subject())])
        .await
        .confirmed("m-1"));
    let first = Arc::new(Seen::default());
    let wait = Duration::from_secs(1);
    let (_stop, task) = consumer(&s, first, wait, NO_HOLD, true, None, 5).await;
    let pool = s.pool.clone();
    wait_for(
        "the first consumer to commit",
        Duration::from_secs(10),
        move || {
            let pool = pool.clone();
            Box::pin(async move { effects(&pool).await == 1 })
        },
    )
    .await;
    task.abort(); // dies before acking
    let _ = task.await;
    let second = Arc::new(Seen::default());
    let (stop, task) = consumer(&s, second.clone(), wait, NO_HOLD, false, None, 5).await;
    let seen = second.clone();
    wait_for("the redelivery", Duration::from_secs(20), move || {
        let seen = seen.clone();
        Box::pin(async move { seen.duplicates.load(Ordering::SeqCst) == 1 })
    })
    .await;
    assert_eq!(effects(&s.pool).await, 1);
    stop.send(true).unwrap();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_after_the_ack_publishes_again_and_the_message_is_consumed_once() {
    let s = setup().await;
    let mut tx = s.pool.begin().await.unwrap();
    for i in 0..20 {
        outbox::enqueue(&mut tx, &message(&format!("dp-{i}"), s.spec.subject()))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    struct DiesAfterAck(Arc<NatsPublisher>);
    impl Publisher for DiesAfterAck {
        fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
            Box::pin(async move {
                let published = self.0.publish(batch).await;
                assert!(published.all_confirmed(batch));
                panic!("the relay died after JetStream acked, before marking the rows");
            })
        }
    }
    let short = RelayConfig {
        lease: Duration::from_millis(300),
        ..RelayConfig::default()
    };
    let dying = Relay::new(
        &s.pool,
        Arc::new(DiesAfterAck(s.publisher.clone())),
        short.clone(),
    );
    assert!(tokio::spawn(async move { dying.round().await })
        .await
        .unwrap_err()
        .is_panic());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let healthy = Relay::new(&s.pool, s.publisher.clone(), short);
    assert_eq!(
        healthy.round().await.unwrap().sent,
        20,
        "published again (JetStream drops the copies by Nats-Msg-Id)"
    );
    let seen = Arc::new(Seen::default());
    let (stop, task) = consumer(
        &s,
        seen.clone(),
        Duration::from_secs(5),
        NO_HOLD,
        false,
        None,
        5,
    )
    .await;
    let pool = s.pool.clone();
    wait_for("every message", Duration::from_secs(20), move || {
        let pool = pool.clone();
        Box::pin(async move { effects(&pool).await == 20 })
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(effects(&s.pool).await, 20, "consumed once each");
    stop.send(true).unwrap();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_redelivered_to_a_second_instance_while_the_first_works_acts_once() {
    let s = setup().await;
    let seen = Arc::new(Seen::default());
    // the first instance holds each message past the 1 s ack wait, so
    // JetStream hands it to the second instance while the first still works
    let wait = Duration::from_secs(1);
    let (stop_a, a) = consumer(
        &s,
        seen.clone(),
        wait,
        Duration::from_millis(1500),
        false,
        None,
        5,
    )
    .await;
    let (stop_b, b) = consumer(
        &s,
        seen.clone(),
        wait,
        Duration::from_millis(1500),
        false,
        None,
        5,
    )
    .await;
    let batch: Vec<_> = (0..5)
        .map(|i| message(&format!("twin-{i}"), s.spec.subject()))
        .collect();
    assert!(s.publisher.publish(&batch).await.all_confirmed(&batch));
    let watch_seen = seen.clone();
    wait_for("redeliveries", Duration::from_secs(30), move || {
        let seen = watch_seen.clone();
        Box::pin(async move {
            seen.duplicates.load(Ordering::SeqCst) >= 1 && seen.ids.lock().unwrap().len() == 5
        })
    })
    .await;
    assert_eq!(effects(&s.pool).await, 5, "one effect per message");
    stop_a.send(true).unwrap();
    stop_b.send(true).unwrap();
    a.await.unwrap();
    b.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_move_ten_thousand_messages_through_jetstream_none_lost() {
    let s = setup().await;
    for chunk in 0..20 {
        let mut tx = s.pool.begin().await.unwrap();
        for i in 0..500 {
            outbox::enqueue(
                &mut tx,
                &message(&format!("bulk-{}", chunk * 500 + i), s.spec.subject()),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let seen = Arc::new(Seen::default());
    let (stop_c, c) = consumer(
        &s,
        seen.clone(),
        Duration::from_secs(30),
        NO_HOLD,
        false,
        None,
        5,
    )
    .await;
    let (stop, relays_stop) = watch::channel(false);
    let config = RelayConfig {
        poll: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let started = Instant::now();
    let r1 = tokio::spawn(
        Relay::new(&s.pool, s.publisher.clone(), config.clone()).run(relays_stop.clone()),
    );
    let second = Arc::new(NatsPublisher::connect(&nats(), &s.spec).await.unwrap());
    let r2 = tokio::spawn(Relay::new(&s.pool, second, config).run(relays_stop));
    let pool = s.pool.clone();
    wait_for(
        "every row marked sent",
        Duration::from_secs(120),
        move || {
            let pool = pool.clone();
            Box::pin(async move { outbox::stats(&pool).await.unwrap().sent == 10_000 })
        },
    )
    .await;
    let relayed = started.elapsed();
    let watch_seen = seen.clone();
    wait_for(
        "every message consumed",
        Duration::from_secs(120),
        move || {
            let seen = watch_seen.clone();
            Box::pin(async move { seen.ids.lock().unwrap().len() == 10_000 })
        },
    )
    .await;
    stop.send(true).unwrap();
    r1.await.unwrap().unwrap();
    r2.await.unwrap().unwrap();
    let ids: HashSet<String> = seen.ids.lock().unwrap().iter().cloned().collect();
    assert_eq!(ids.len(), 10_000, "none lost");
    eprintln!(
        "relayed 10000 messages through JetStream in {relayed:?} ({:.0}/s); {} duplicate deliveries absorbed",
        10_000.0 / relayed.as_secs_f64(),
        seen.duplicates.load(Ordering::SeqCst)
    );
    assert_eq!(effects(&s.pool).await, 10_000);
    stop_c.send(true).unwrap();
    c.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_message_is_dead_lettered_without_blocking_the_rest() {
    let s = setup().await;
    let mut batch = vec![message("poison", s.spec.subject())];
    for i in 0..10 {
        batch.push(message(&format!("fine-{i}"), s.spec.subject()));
    }
    assert!(s.publisher.publish(&batch).await.all_confirmed(&batch));
    let seen = Arc::new(Seen::default());
    let (stop, task) = consumer(
        &s,
        seen.clone(),
        Duration::from_secs(5),
        NO_HOLD,
        false,
        Some("poison"),
        3,
    )
    .await;
    let pool = s.pool.clone();
    wait_for("the good messages", Duration::from_secs(20), move || {
        let pool = pool.clone();
        Box::pin(async move { effects(&pool).await == 10 })
    })
    .await;
    let js = s.publisher.context().clone();
    let (stream, dlq) = (s.spec.stream().to_owned(), s.spec.dead_letter_subject());
    wait_for(
        "the poison message on the dead-letter subject",
        Duration::from_secs(20),
        move || {
            let (js, stream, dlq) = (js.clone(), stream.clone(), dlq.clone());
            Box::pin(async move {
                match js.get_stream(stream).await {
                    Ok(st) => st.get_last_raw_message_by_subject(&dlq).await.is_ok(),
                    Err(_) => false,
                }
            })
        },
    )
    .await;
    assert_eq!(
        seen.deliveries.load(Ordering::SeqCst),
        10 + 3,
        "tried 3 times, then dead-lettered"
    );
    stop.send(true).unwrap();
    task.await.unwrap();
}

/// Through the transport-neutral `Consumer` trait, a handler sees the
/// message id, the body and the headers the sender set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_trait_hands_over_id_body_and_headers() {
    use idem_outbox::consumer::{handler, Consumer, Delivery};
    let s = setup().await;
    assert!(s
        .publisher
        .publish(&[message("h-1", s.spec.subject())])
        .await
        .confirmed("h-1"));
    let c = NatsConsumer::connect(&nats(), &s.spec, "trait-consumer", 5)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop) = watch::channel(false);
    let on_message = handler(move |d: Delivery| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(d);
            Ok(())
        }
    });
    let task = tokio::spawn(Box::new(c).consume(on_message, stop));
    let d = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.message_id.as_deref(), Some("h-1"));
    assert_eq!(d.header("type"), Some("OrderPlaced"));
    assert_eq!(&d.payload[..], br#"{"id":"h-1"}"#);
    assert!(!d.redelivered);
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
}

/// A server that is not there is a typed error naming the URL, with the
/// client's error as its source: no string to parse.
#[tokio::test]
async fn an_unreachable_server_is_a_typed_connect_error() {
    let spec = StreamSpec::new("IDEM_NOWHERE", "idem.nowhere");
    // Port 1 on loopback: nothing listens there; the connection is refused.
    let err = NatsPublisher::connect("nats://127.0.0.1:1", &spec)
        .await
        .unwrap_err();
    match &err {
        idem_nats::NatsError::Connect { url, .. } => assert_eq!(url, "nats://127.0.0.1:1"),
        other => panic!("{other:?}"),
    }
    assert!(std::error::Error::source(&err).is_some());
    let err = NatsConsumer::connect("nats://127.0.0.1:1", &spec, "c", 3)
        .await
        .unwrap_err();
    assert!(
        matches!(err, idem_nats::NatsError::Connect { .. }),
        "{err:?}"
    );
}
