//! Outbox → RabbitMQ → inbox, against the real broker and PostgreSQL: the
//! broker conformance suite, on a quorum queue of each test's own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use idem_core::BoxFuture;
use idem_outbox::consumer::Consumer;
use idem_outbox::outbox::Publisher;
use idem_rabbitmq::{QueueSpec, RabbitConsumer, RabbitPublisher};
use idem_test_support::broker::Broker;
use idem_test_support::messaging::outbox_schema;
use idem_test_support::postgres::TestSchema;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};

fn amqp() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A quorum queue of the test's own (and its dead-letter queue), deleted
/// when dropped, and an outbox in a schema of its own.
struct Rabbit {
    pool: sqlx::PgPool,
    _schema: TestSchema,
    spec: QueueSpec,
    publisher: Arc<RabbitPublisher>,
}

impl Drop for Rabbit {
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

async fn rabbit(max_deliveries: u32) -> Rabbit {
    let (pool, schema) = outbox_schema("idem_rabbit").await;
    let publisher = RabbitPublisher::connect(&amqp()).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach RabbitMQ at {} (`bash scripts/test` starts it): {e}",
            amqp()
        )
    });
    let spec = QueueSpec::new(format!("idem-test-{}", uuid::Uuid::new_v4().simple()))
        .max_deliveries(i32::try_from(max_deliveries).unwrap());
    spec.declare(&publisher.channel()).await.unwrap();
    Rabbit {
        pool,
        _schema: schema,
        spec,
        publisher: Arc::new(publisher),
    }
}

impl Broker for Rabbit {
    const DROPS_REPUBLISHED_COPIES: bool = false;

    fn destination(&self) -> &str {
        self.spec.name()
    }
    fn pool(&self) -> &sqlx::PgPool {
        &self.pool
    }
    fn publisher(&self) -> BoxFuture<'_, Arc<dyn Publisher>> {
        Box::pin(async move {
            Arc::new(RabbitPublisher::connect(&amqp()).await.unwrap()) as Arc<dyn Publisher>
        })
    }
    fn consumer(&self) -> BoxFuture<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            let c = RabbitConsumer::connect(&amqp(), self.spec.clone(), 50)
                .await
                .unwrap();
            Box::new(c) as Box<dyn Consumer>
        })
    }
    fn concurrent_consumer(&self, n: std::num::NonZeroUsize) -> BoxFuture<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            let c = RabbitConsumer::connect(&amqp(), self.spec.clone(), 50)
                .await
                .unwrap()
                .concurrency(n);
            Box::new(c) as Box<dyn Consumer>
        })
    }
    fn dead_lettered(&self) -> BoxFuture<'_, u64> {
        Box::pin(async move {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            self.publisher
                .channel()
                .queue_declare(
                    self.spec.dead_letter_queue().into(),
                    passive,
                    Default::default(),
                )
                .await
                .map(|q| u64::from(q.message_count()))
                .unwrap_or(0)
        })
    }
}

idem_test_support::broker_suite!(rabbit);

/// A message whose destination names no queue is returned by the broker:
/// a publish error, never confirmed (so the relay never marks it sent).
// Multi-threaded: dropping `Rabbit` deletes its queues over the same
// connection, whose I/O must keep running meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_a_publish_error_not_a_confirm() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let r = rabbit(3).await;
    let nowhere = format!("idem-test-no-queue-{}", uuid::Uuid::new_v4().simple());
    let batch = [
        OutgoingMessage::new("m-lost", nowhere.clone(), "lost?"),
        OutgoingMessage::new("m-ok", r.spec.name().to_owned(), "fine"),
    ];
    let published = r.publisher.publish(&batch).await;
    assert!(
        published.confirmed("m-ok"),
        "a routable message is confirmed"
    );
    let lost = published
        .get("m-lost")
        .expect("the publisher says what became of it");
    let error = lost
        .as_ref()
        .expect_err("an unroutable message is not confirmed");
    assert_eq!(error.kind(), PublishErrorKind::Rejected);
    assert!(
        error.message().contains("unroutable"),
        "{}",
        error.message()
    );
    assert!(error.message().contains(&nowhere), "{}", error.message());
}

/// A message AMQP cannot carry (a message id, or a header name, over 255
/// bytes) is refused for itself, and the rest of the batch goes out: the
/// AMQP library would panic on it, and with it the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_amqp_cannot_carry_is_refused_not_a_panic() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let r = rabbit(3).await;
    let to = r.spec.name().to_owned();
    let batch = [
        OutgoingMessage::new("i".repeat(256), to.clone(), "long id"),
        OutgoingMessage::new("m-header", to.clone(), "long header name")
            .header("h".repeat(256), "v"),
        OutgoingMessage::new("m-big", to.clone(), vec![b'x'; (16 << 20) + 1]),
        // Over a frame: the broker would close the whole connection.
        OutgoingMessage::new("m-headers", to.clone(), "large headers")
            .header("h", "v".repeat(200 * 1024)),
        OutgoingMessage::new("m-ok", to, "fine"),
    ];
    let published = r.publisher.publish(&batch).await;
    assert!(
        published.confirmed("m-ok"),
        "the rest of the batch goes out"
    );
    let big = published
        .get("m-big")
        .unwrap()
        .as_ref()
        .expect_err("refused");
    assert_eq!(big.kind(), PublishErrorKind::Rejected);
    assert!(
        big.message().contains("max_message_size"),
        "{}",
        big.message()
    );
    let headers = published
        .get("m-headers")
        .unwrap()
        .as_ref()
        .expect_err("refused");
    assert_eq!(headers.kind(), PublishErrorKind::Rejected);
    assert!(headers.message().contains("frame"), "{}", headers.message());
    for id in ["i".repeat(256), "m-header".to_owned()] {
        let error = published
            .get(&id)
            .expect("the publisher says what became of it")
            .as_ref()
            .expect_err("refused");
        assert_eq!(error.kind(), PublishErrorKind::Rejected);
        assert!(error.message().contains("255"), "{}", error.message());
    }
}

/// A delivery whose handler failed is held before it goes back, longer
/// after each failure (the quorum queue counts them): a database away for a
/// few seconds does not use up a message's deliveries in milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delivery_goes_back_later_each_time() {
    use std::time::{Duration, Instant};

    use idem_outbox::consumer::{handler, Delivery};
    use idem_outbox::outbox::OutgoingMessage;
    let r = rabbit(5).await;
    let batch = [OutgoingMessage::new(
        "m-retry",
        r.spec.name().to_owned(),
        "x",
    )];
    assert!(r.publisher.publish(&batch).await.confirmed("m-retry"));
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let seen = arrivals.clone();
    let on_message = handler(move |_: Delivery| {
        let seen = seen.clone();
        async move {
            let mut seen = seen.lock().unwrap();
            seen.push(Instant::now());
            if seen.len() < 3 {
                return Err("the database is away".into());
            }
            Ok(())
        }
    });
    let consumer = RabbitConsumer::connect(&amqp(), r.spec.clone(), 10)
        .await
        .unwrap()
        .retry_delay(Duration::from_millis(300));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let consuming = tokio::spawn(Box::new(consumer).consume(on_message, stopped));
    let deadline = Instant::now() + Duration::from_secs(30);
    while arrivals.lock().unwrap().len() < 3 {
        assert!(Instant::now() < deadline, "never handled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    consuming.await.unwrap().unwrap();
    let at = arrivals.lock().unwrap().clone();
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps[0] >= Duration::from_millis(300), "{gaps:?}");
    assert!(gaps[1] >= Duration::from_millis(600), "doubled: {gaps:?}");
}

/// The broker closes the publishing channel (as it does for a message over
/// its `max_message_size`): the next batch goes out on a channel opened
/// again, rather than every later publish failing for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_publishing_channel_is_opened_again() {
    use idem_outbox::outbox::OutgoingMessage;
    let r = rabbit(3).await;
    let to = r.spec.name().to_owned();
    let first = [OutgoingMessage::new("m-1", to.clone(), "x")];
    assert!(r.publisher.publish(&first).await.confirmed("m-1"));
    r.publisher
        .channel()
        .close(200, "closed by the test".into())
        .await
        .unwrap();
    assert!(!r.publisher.channel().status().connected());
    let second = [OutgoingMessage::new("m-2", to, "x")];
    assert!(
        r.publisher.publish(&second).await.confirmed("m-2"),
        "published on a channel opened again"
    );
    assert!(r.publisher.channel().status().connected());
}

/// RabbitMQ goes away (the link to it cut and partitioned) while rows wait:
/// every round fails with the broker down, which uses up none of a row's
/// attempts however long it lasts; once the broker is back, the relay opens
/// a connection again and the row goes out. Nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_for_a_while_loses_no_row() {
    use std::time::Duration;

    use idem_outbox::outbox::{self, OutgoingMessage, Relay, RelayConfig};
    use idem_test_support::faults::{Fault, FaultProxy};
    let r = rabbit(3).await;
    let upstream = amqp();
    let host = upstream
        .rsplit_once('@')
        .map_or(upstream.as_str(), |(_, h)| h)
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let proxy = FaultProxy::start(&host).await;
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let publisher = Arc::new(RabbitPublisher::connect(&url).await.unwrap());
    let mut tx = r.pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, &OutgoingMessage::new("m-1", r.spec.name(), "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::new(
        &r.pool,
        publisher,
        RelayConfig {
            max_attempts: 2,
            backoff: Duration::from_millis(10),
            // A round waits half of it for the broker: 1 s.
            lease: Duration::from_secs(2),
            ..RelayConfig::default()
        },
    );
    proxy.set(Fault::Partition);
    proxy.cut();
    let mut failed = 0;
    for _ in 0..4 {
        failed += relay.round().await.unwrap().failed;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(failed > 2, "tried more often than its attempts: {failed}");
    let s = outbox::stats(&r.pool).await.unwrap();
    assert_eq!((s.sent, s.pending, s.dead), (0, 1, 0));

    proxy.set(Fault::None);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while outbox::stats(&r.pool).await.unwrap().sent == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "never sent once the broker was back"
        );
        relay.round().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(outbox::stats(&r.pool).await.unwrap().dead, 0);
}

/// A message over the broker's `max_message_size` that is sent anyway (the
/// publisher told a larger cap) closes the channel: it alone is refused
/// (and so dead-lettered in the end); the messages behind it in its batch,
/// whose confirms fail with the channel, are sent again and confirmed,
/// using up no attempt; and the next batch goes out on a channel opened
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_broker_closes_the_channel_over_refuses_only_itself() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let r = rabbit(3).await;
    let publisher = RabbitPublisher::connect(&amqp())
        .await
        .unwrap()
        .max_payload(usize::MAX);
    let to = r.spec.name().to_owned();
    let batch = [
        OutgoingMessage::new("m-too-big", to.clone(), vec![b'x'; 130 << 20]),
        OutgoingMessage::new("m-behind", to.clone(), "x"),
    ];
    let published = publisher.publish(&batch).await;
    let big = published
        .get("m-too-big")
        .unwrap()
        .as_ref()
        .expect_err("refused");
    assert_eq!(big.kind(), PublishErrorKind::Rejected, "{big}");
    assert!(
        published.confirmed("m-behind"),
        "{:?}",
        published.get("m-behind")
    );
    let again = [OutgoingMessage::new("m-again", to, "x")];
    assert!(publisher.publish(&again).await.confirmed("m-again"));
}

/// The messages before one the broker closes the channel over may still
/// wait for their confirms (a durable queue confirms once the message is on
/// disk) when the channel closes, and then fail with the same error as the
/// culprit's, as do all the messages behind it. None of them is charged the
/// refusal on a guess: they are sent again, half at a time, until each
/// message that closes a channel by itself stands alone. Two such messages
/// in one batch are each refused, and every other message is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusal_is_charged_to_the_message_that_closed_the_channel() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let r = rabbit(3).await;
    let publisher = RabbitPublisher::connect(&amqp())
        .await
        .unwrap()
        .max_payload(usize::MAX);
    let to = r.spec.name().to_owned();
    let mut batch: Vec<OutgoingMessage> = (0..200)
        .map(|i| OutgoingMessage::new(format!("m-{i}"), to.clone(), vec![b'x'; 4096]))
        .collect();
    // RabbitMQ reads `CC` as a list of routing keys; as text it closes the
    // channel at once (PRECONDITION_FAILED), while the confirms of the
    // messages before it are still on their way.
    for at in [60, 150] {
        let mut bad = OutgoingMessage::new(format!("m-cc-{at}"), to.clone(), "x");
        bad.headers.push(("CC".to_owned(), "elsewhere".to_owned()));
        batch.insert(at, bad);
    }
    // As the relay does: what waits as for a broker down (not told apart
    // in time, on a slow machine) goes out again in the next round. No
    // message is ever refused but the two, and every other is confirmed.
    let mut left = batch.clone();
    for _ in 0..20 {
        if left.is_empty() {
            break;
        }
        let published = publisher.publish(&left).await;
        let mut again = Vec::new();
        for m in left {
            match published.get(&m.message_id).unwrap() {
                Ok(()) => assert!(
                    !m.message_id.starts_with("m-cc-"),
                    "{} confirmed",
                    m.message_id
                ),
                Err(e) if e.kind() == PublishErrorKind::Rejected => assert!(
                    m.message_id.starts_with("m-cc-"),
                    "{} refused: {e}",
                    m.message_id
                ),
                Err(_) => again.push(m),
            }
        }
        left = again;
    }
    assert!(left.is_empty(), "never settled: {left:?}");
    let again = [OutgoingMessage::new("m-again", to, "x")];
    assert!(publisher.publish(&again).await.confirmed("m-again"));
}

/// A consumer whose queue is deleted (the broker cancels it) ends with an
/// error that says so, not `Ok` as after a stop: a caller that spawned it
/// and waits for its end learns that nothing is consumed any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_the_broker_cancels_ends_with_an_error() {
    use std::time::Duration;

    use idem_outbox::consumer::{handler, Delivery};
    let r = rabbit(5).await;
    let consumer = RabbitConsumer::connect(&amqp(), r.spec.clone(), 1)
        .await
        .unwrap();
    let on_message = handler(|_: Delivery| async { Ok(()) });
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let consuming = tokio::spawn(Box::new(consumer).consume(on_message, stopped));
    // Until the broker counts the consumer, then the queue goes.
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let q = r
            .publisher
            .channel()
            .queue_declare(r.spec.name().into(), passive, Default::default())
            .await
            .unwrap();
        if q.consumer_count() > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no consumer in 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    r.publisher
        .channel()
        .queue_delete(r.spec.name().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), consuming)
        .await
        .expect("the consumer ended once cancelled")
        .unwrap();
    let e = ended.expect_err("a cancelled consumer is an error");
    assert!(e.to_string().contains("cancelled"), "{e}");
}
