//! Outbox → RabbitMQ → inbox, against the real broker and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::BoxFuture;
use idem_outbox::outbox::{self, OutgoingMessage, Published, Publisher, Relay, RelayConfig};
use idem_rabbitmq::{Incoming, QueueSpec, RabbitConsumer, RabbitPublisher};
use idem_test_support::messaging::{
    effects, message, outbox_schema, record_effect, wait_for, Seen,
};
use idem_test_support::postgres::TestSchema;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use tokio::sync::watch;

fn amqp() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

struct Setup {
    pool: sqlx::PgPool,
    _schema: TestSchema,
    spec: QueueSpec,
    publisher: Arc<RabbitPublisher>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let (publisher, spec) = (self.publisher.clone(), self.spec.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                for q in [spec.name().to_owned(), spec.dead_letter_queue()] {
                    let _ = publisher
                        .channel()
                        .queue_delete(q.into(), QueueDeleteOptions::default())
                        .await;
                }
            });
            Some(())
        })
        .join();
    }
}

async fn setup(max_deliveries: i32) -> Setup {
    let (pool, schema) = outbox_schema("idem_rabbit").await;
    let publisher = RabbitPublisher::connect(&amqp()).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach RabbitMQ at {} (`bash scripts/test` starts it): {e}",
            amqp()
        )
    });
    let spec = QueueSpec::new(format!("idem-test-{}", uuid::Uuid::new_v4().simple()))
        .max_deliveries(max_deliveries);
    spec.declare(publisher.channel()).await.unwrap();
    Setup {
        pool,
        _schema: schema,
        spec,
        publisher: Arc::new(publisher),
    }
}

/// Starts a consumer whose handler records one effect per message through
/// the inbox; `hang_after_commit` makes it commit and then never ack.
async fn consumer(
    s: &Setup,
    seen: Arc<Seen>,
    hang_after_commit: bool,
    fail_on: Option<&'static str>,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let c = RabbitConsumer::connect(&amqp(), s.spec.clone(), 50)
        .await
        .unwrap();
    let pool = s.pool.clone();
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(async move {
        let handler = move |m: Incoming| {
            let (pool, seen) = (pool.clone(), seen.clone());
            async move {
                record_effect(&pool, &seen, m.message_id, Duration::ZERO, fail_on).await?;
                if hang_after_commit {
                    std::future::pending::<()>().await;
                }
                Ok::<(), &'static str>(())
            }
        };
        c.run(handler, stop).await.unwrap();
    });
    (stop_tx, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_after_commit_before_ack_gets_a_duplicate_on_redelivery() {
    let s = setup(5).await;
    let results = s.publisher.publish(&[message("m-1", s.spec.name())]).await;
    assert!(results.confirmed("m-1"));
    let first = Arc::new(Seen::default());
    let (_stop, task) = consumer(&s, first.clone(), true, None).await;
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
    // the consumer dies: its connection goes, the message was never acked
    task.abort();
    let _ = task.await;
    let second = Arc::new(Seen::default());
    let (stop, task) = consumer(&s, second.clone(), false, None).await;
    let seen = second.clone();
    wait_for("the redelivery", Duration::from_secs(20), move || {
        let seen = seen.clone();
        Box::pin(async move { seen.duplicates.load(Ordering::SeqCst) == 1 })
    })
    .await;
    assert_eq!(effects(&s.pool).await, 1, "the effect exists once");
    stop.send(true).unwrap();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_after_the_confirm_publishes_again_and_the_message_is_consumed_once() {
    let s = setup(5).await;
    let mut tx = s.pool.begin().await.unwrap();
    for i in 0..20 {
        outbox::enqueue(&mut tx, &message(&format!("dp-{i}"), s.spec.name()))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    struct DiesAfterConfirm(Arc<RabbitPublisher>);
    impl Publisher for DiesAfterConfirm {
        fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
            Box::pin(async move {
                let published = self.0.publish(batch).await;
                assert!(published.all_confirmed(batch));
                panic!("the relay died after the broker confirmed, before marking the rows");
            })
        }
    }
    let short = RelayConfig {
        lease: Duration::from_millis(300),
        ..RelayConfig::default()
    };
    let dying = Relay::new(
        &s.pool,
        Arc::new(DiesAfterConfirm(s.publisher.clone())),
        short.clone(),
    );
    assert!(tokio::spawn(async move { dying.round().await })
        .await
        .unwrap_err()
        .is_panic());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let healthy = Relay::new(&s.pool, s.publisher.clone(), short);
    assert_eq!(healthy.round().await.unwrap().sent, 20, "published again");
    let seen = Arc::new(Seen::default());
    let (stop, task) = consumer(&s, seen.clone(), false, None).await;
    let watch_seen = seen.clone();
    wait_for(
        "both copies of every message, handled",
        Duration::from_secs(20),
        move || {
            let seen = watch_seen.clone();
            Box::pin(async move { seen.handled() == 40 })
        },
    )
    .await;
    assert_eq!(seen.duplicates.load(Ordering::SeqCst), 20);
    assert_eq!(effects(&s.pool).await, 20, "consumed once each");
    stop.send(true).unwrap();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_message_delivered_to_two_consumers_at_once_acts_once() {
    let s = setup(5).await;
    let seen = Arc::new(Seen::default());
    let (stop_a, a) = consumer(&s, seen.clone(), false, None).await;
    let (stop_b, b) = consumer(&s, seen.clone(), false, None).await;
    // 30 messages, each published twice: the copies land on both consumers
    let mut batch = Vec::new();
    for i in 0..30 {
        batch.push(message(&format!("twin-{i}"), s.spec.name()));
        batch.push(message(&format!("twin-{i}"), s.spec.name()));
    }
    assert!(s.publisher.publish(&batch).await.all_confirmed(&batch));
    let watch_seen = seen.clone();
    wait_for(
        "all 60 deliveries, handled",
        Duration::from_secs(20),
        move || {
            let seen = watch_seen.clone();
            Box::pin(async move { seen.handled() == 60 })
        },
    )
    .await;
    assert_eq!(effects(&s.pool).await, 30);
    assert_eq!(seen.duplicates.load(Ordering::SeqCst), 30);
    stop_a.send(true).unwrap();
    stop_b.send(true).unwrap();
    a.await.unwrap();
    b.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_move_ten_thousand_messages_through_rabbitmq_none_lost() {
    let s = setup(5).await;
    for chunk in 0..20 {
        let mut tx = s.pool.begin().await.unwrap();
        for i in 0..500 {
            outbox::enqueue(
                &mut tx,
                &message(&format!("bulk-{}", chunk * 500 + i), s.spec.name()),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let seen = Arc::new(Seen::default());
    let (stop_c, c) = consumer(&s, seen.clone(), false, None).await;
    let (stop, relays_stop) = watch::channel(false);
    let config = RelayConfig {
        poll: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let started = Instant::now();
    let r1 = tokio::spawn(
        Relay::new(&s.pool, s.publisher.clone(), config.clone()).run(relays_stop.clone()),
    );
    let second = Arc::new(RabbitPublisher::connect(&amqp()).await.unwrap());
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
    let duplicates = seen.duplicates.load(Ordering::SeqCst);
    eprintln!(
        "relayed 10000 messages through RabbitMQ in {relayed:?} ({:.0}/s); {duplicates} duplicate deliveries absorbed",
        10_000.0 / relayed.as_secs_f64()
    );
    assert_eq!(effects(&s.pool).await, 10_000);
    stop_c.send(true).unwrap();
    c.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_message_ends_in_the_dead_letter_queue_without_blocking_the_rest() {
    let s = setup(3).await;
    let mut batch = vec![message("poison", s.spec.name())];
    for i in 0..10 {
        batch.push(message(&format!("fine-{i}"), s.spec.name()));
    }
    assert!(s.publisher.publish(&batch).await.all_confirmed(&batch));
    let seen = Arc::new(Seen::default());
    let (stop, task) = consumer(&s, seen.clone(), false, Some("poison")).await;
    let pool = s.pool.clone();
    wait_for("the good messages", Duration::from_secs(20), move || {
        let pool = pool.clone();
        Box::pin(async move { effects(&pool).await == 10 })
    })
    .await;
    let channel = s.publisher.channel().clone();
    let dlq = s.spec.dead_letter_queue();
    wait_for(
        "the poison message in the dead-letter queue",
        Duration::from_secs(20),
        move || {
            let (channel, dlq) = (channel.clone(), dlq.clone());
            Box::pin(async move {
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                channel
                    .queue_declare(dlq.into(), passive, Default::default())
                    .await
                    .map(|q| q.message_count() == 1)
                    .unwrap_or(false)
            })
        },
    )
    .await;
    assert_eq!(
        seen.deliveries.load(Ordering::SeqCst),
        10 + 3,
        "the poison message was tried 3 times"
    );
    stop.send(true).unwrap();
    task.await.unwrap();
}

/// Through the transport-neutral `Consumer` trait, a handler sees the
/// message id, the body and the headers the sender set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_trait_hands_over_id_body_and_headers() {
    use idem_outbox::consumer::{handler, Consumer, Delivery};
    let s = setup(5).await;
    assert!(s
        .publisher
        .publish(&[message("h-1", s.spec.name())])
        .await
        .confirmed("h-1"));
    let c = RabbitConsumer::connect(&amqp(), s.spec.clone(), 10)
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
