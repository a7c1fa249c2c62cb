//! Outbox → NATS JetStream → inbox, against the real server and PostgreSQL:
//! the broker conformance suite on a stream of each test's own, and what is
//! JetStream's alone (redelivery after the ack wait, typed errors).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use idem_core::BoxFuture;
use idem_nats::{NatsConsumer, NatsPublisher, StreamSpec};
use idem_outbox::consumer::{handler, Consumer, Delivery};
use idem_outbox::outbox::Publisher;
use idem_test_support::broker::Broker;
use idem_test_support::messaging::{
    effects, message, outbox_schema, record_effect, wait_for, Seen,
};
use idem_test_support::postgres::TestSchema;
use tokio::sync::watch;

fn nats() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A stream of the test's own, deleted when dropped, and an outbox in a
/// schema of its own; its consumers share one durable.
struct Nats {
    pool: sqlx::PgPool,
    _schema: TestSchema,
    spec: StreamSpec,
    publisher: Arc<NatsPublisher>,
    max_deliveries: i64,
}

impl Drop for Nats {
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

async fn jetstream(max_deliveries: u32) -> Nats {
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
    Nats {
        pool,
        _schema: schema,
        spec,
        publisher: Arc::new(publisher),
        max_deliveries: i64::from(max_deliveries),
    }
}

impl Nats {
    async fn durable(&self, ack_wait: Duration) -> NatsConsumer {
        NatsConsumer::connect_with_ack_wait(
            &nats(),
            &self.spec,
            "test-consumer",
            self.max_deliveries,
            ack_wait,
        )
        .await
        .unwrap()
        .retry_delay(Duration::from_millis(50))
    }
}

impl Broker for Nats {
    const DROPS_REPUBLISHED_COPIES: bool = true;

    fn destination(&self) -> &str {
        self.spec.subject()
    }
    fn pool(&self) -> &sqlx::PgPool {
        &self.pool
    }
    fn publisher(&self) -> BoxFuture<'_, Arc<dyn Publisher>> {
        Box::pin(async move {
            Arc::new(NatsPublisher::connect(&nats(), &self.spec).await.unwrap())
                as Arc<dyn Publisher>
        })
    }
    fn consumer(&self) -> BoxFuture<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            Box::new(self.durable(Duration::from_secs(2)).await) as Box<dyn Consumer>
        })
    }
    fn concurrent_consumer(&self, n: std::num::NonZeroUsize) -> BoxFuture<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            Box::new(self.durable(Duration::from_secs(2)).await.concurrency(n)) as Box<dyn Consumer>
        })
    }
    fn dead_lettered(&self) -> BoxFuture<'_, u64> {
        Box::pin(async move {
            let Ok(stream) = self
                .publisher
                .context()
                .get_stream(self.spec.stream())
                .await
            else {
                return 0;
            };
            u64::from(
                stream
                    .get_last_raw_message_by_subject(&self.spec.dead_letter_subject())
                    .await
                    .is_ok(),
            )
        })
    }
}

idem_test_support::broker_suite!(jetstream);

/// The first instance holds each message past the ack wait, so JetStream
/// hands it to the second while the first still works: one effect each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_redelivered_to_a_second_instance_while_the_first_works_acts_once() {
    let s = jetstream(5).await;
    let seen = Arc::new(Seen::default());
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let consumer = s.durable(Duration::from_secs(1)).await;
        let (pool, seen) = (s.pool.clone(), seen.clone());
        let on_message = handler(move |d: Delivery| {
            let (pool, seen) = (pool.clone(), seen.clone());
            async move {
                let hold = Duration::from_millis(1500);
                record_effect(&pool, &seen, d.message_id, hold, None).await?;
                Ok(())
            }
        });
        tasks.push(tokio::spawn(
            Box::new(consumer).consume(on_message, stopped.clone()),
        ));
    }
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
    stop.send(true).unwrap();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
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

/// A message NATS headers cannot carry (a line break in the message id or a
/// header value, a header name with a space or `:`) is refused for itself,
/// and the rest of the batch goes out: the NATS client would panic on it,
/// and with it the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_nats_cannot_carry_is_refused_not_a_panic() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let n = jetstream(3).await;
    let to = n.spec.subject().to_owned();
    let batch = [
        OutgoingMessage::new("m\nid", to.clone(), "a line break in the id"),
        OutgoingMessage::new("m-name", to.clone(), "a bad header name").header("a b", "v"),
        OutgoingMessage::new("m-colon", to.clone(), "a bad header name").header("a:b", "v"),
        OutgoingMessage::new("m-value", to.clone(), "a bad header value").header("h", "x\r\ny"),
        OutgoingMessage::new("m-ok", to, "fine").header("h", "v"),
    ];
    let published = n.publisher.publish(&batch).await;
    assert!(
        published.confirmed("m-ok"),
        "the rest of the batch goes out"
    );
    for id in ["m\nid", "m-name", "m-colon", "m-value"] {
        let error = published
            .get(id)
            .expect("the publisher says what became of it")
            .as_ref()
            .expect_err("refused");
        assert_eq!(error.kind(), PublishErrorKind::Rejected, "{id:?}");
        assert!(error.message().contains("NATS"), "{}", error.message());
    }
}

/// A batch larger than the acks the NATS client lets one context wait for
/// at once (5,000): sent a thousand at a time, every message is confirmed.
/// Sent whole before any ack is taken, the 5,001st send waited for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_the_client_s_acks_in_flight_is_confirmed_whole() {
    use idem_outbox::outbox::OutgoingMessage;
    let n = jetstream(3).await;
    let to = n.spec.subject().to_owned();
    let batch: Vec<OutgoingMessage> = (0..6_500)
        .map(|i| OutgoingMessage::new(format!("big-{i}"), to.clone(), "x"))
        .collect();
    let published = tokio::time::timeout(Duration::from_secs(60), n.publisher.publish(&batch))
        .await
        .expect("the batch still waits after 60 s");
    assert!(
        published.all_confirmed(&batch),
        "{} said of",
        published.len()
    );
}

/// A `nats-server` with JetStream of the test's own, on a free port, its
/// store in `dir`; killed when dropped.
struct OwnServer(std::process::Child);

impl OwnServer {
    fn start(port: u16, dir: &std::path::Path) -> Self {
        let child = std::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server (`bash scripts/test` installs it)");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self(child)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The server restarts while a consumer waits: its heartbeats stop, the
/// client reconnects, and the consumer pulls again rather than ending, so
/// a message published after the restart is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_rides_out_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let server = OwnServer::start(port, dir.path());
    let spec = StreamSpec::new("RESTART", "restart.events");
    let publisher = NatsPublisher::connect(&url, &spec).await.unwrap();
    let consumer = NatsConsumer::connect(&url, &spec, "restart", 5)
        .await
        .unwrap()
        .idle_heartbeat(Duration::from_millis(300));
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let on_message = handler(move |d: Delivery| {
        let seen_tx = seen_tx.clone();
        async move {
            let _ = seen_tx.send(d.message_id);
            Ok(())
        }
    });
    let (stop, stopped) = watch::channel(false);
    let consuming = tokio::spawn(Box::new(consumer).consume(on_message, stopped));
    let publish = async |id: &str| {
        let m = idem_outbox::outbox::OutgoingMessage::new(id, "restart.events", "x");
        // The client may still be reconnecting: a few tries.
        for _ in 0..50 {
            if publisher
                .publish(std::slice::from_ref(&m))
                .await
                .confirmed(id)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("{id} was never confirmed");
    };
    publish("before").await;
    let first = tokio::time::timeout(Duration::from_secs(20), seen.recv()).await;
    assert_eq!(first.unwrap().flatten().as_deref(), Some("before"));

    drop(server);
    // Long enough for the heartbeats (300 ms) to be missed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !consuming.is_finished(),
        "the consumer ended when its server went away"
    );
    let _server = OwnServer::start(port, dir.path());
    publish("after").await;
    // "before" may come again first: its ack can be lost with the server
    // (at least once; the inbox absorbs the copy). Nothing else may.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let next = tokio::time::timeout_at(deadline, seen.recv()).await;
        match next
            .expect("the message after the restart is handled")
            .flatten()
            .as_deref()
        {
            Some("after") => break,
            Some("before") => continue,
            other => panic!("unexpected delivery {other:?}"),
        }
    }
    stop.send(true).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), consuming).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
}

/// A message whose handler failed comes back later each time (the delay
/// doubles with its deliveries): a database away for a few seconds does
/// not use up its deliveries at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_message_comes_back_later_each_time() {
    use std::time::Instant;
    let s = jetstream(5).await;
    let m = idem_outbox::outbox::OutgoingMessage::new("m-retry", s.spec.subject(), "x");
    assert!(s
        .publisher
        .publish(std::slice::from_ref(&m))
        .await
        .confirmed("m-retry"));
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
    let consumer = s
        .durable(Duration::from_secs(5))
        .await
        .retry_delay(Duration::from_millis(300));
    let (stop, stopped) = watch::channel(false);
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

/// What the server will never take (a payload over `max_payload`) is the
/// broker's refusal: it uses up an attempt, and is dead-lettered in the
/// end. No responders (no stream captures the subject, or JetStream is not
/// up yet) is waited out as the broker down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_server_never_takes_is_a_refusal() {
    use idem_outbox::outbox::{OutgoingMessage, PublishErrorKind};
    let n = jetstream(3).await;
    let nowhere = format!("idem-test-nowhere.{}", uuid::Uuid::new_v4().simple());
    let batch = [
        OutgoingMessage::new("m-huge", n.spec.subject(), vec![b'x'; 2 << 20]),
        OutgoingMessage::new("m-nowhere", nowhere, "x"),
        OutgoingMessage::new("m-ok", n.spec.subject(), "fine"),
    ];
    let published = n.publisher.publish(&batch).await;
    assert!(published.confirmed("m-ok"));
    let huge = published
        .get("m-huge")
        .unwrap()
        .as_ref()
        .expect_err("refused");
    assert_eq!(huge.kind(), PublishErrorKind::Rejected, "{huge}");
    let nowhere = published
        .get("m-nowhere")
        .unwrap()
        .as_ref()
        .expect_err("not taken");
    assert_eq!(nowhere.kind(), PublishErrorKind::BrokerDown, "{nowhere}");
}

/// A message whose last allowed delivery never settles (the process
/// handling it dies) is not dropped: the server delivers it again, and,
/// failing again, it is dead-lettered then. A durable an earlier version
/// made, with the server's own delivery limit, is updated to none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_delivery_that_never_settled_is_dead_lettered_not_dropped() {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;
    let s = jetstream(2).await;
    // As an earlier version made it: the server stops after 2 deliveries.
    let stream = s
        .publisher
        .context()
        .get_stream(s.spec.stream())
        .await
        .unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some("test-consumer".to_owned()),
            filter_subject: s.spec.subject().to_owned(),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            max_deliver: 2,
            // An operator's own setting, which the update keeps.
            max_ack_pending: 77,
            ..Default::default()
        })
        .await
        .unwrap();
    let first = s.durable(Duration::from_secs(1)).await;
    let kept = stream.consumer_info("test-consumer").await.unwrap().config;
    assert_eq!(kept.max_deliver, -1, "the server's own limit is lifted");
    assert_eq!(kept.max_ack_pending, 77, "the rest is kept");

    let m = idem_outbox::outbox::OutgoingMessage::new("m-last", s.spec.subject(), "x");
    assert!(s
        .publisher
        .publish(std::slice::from_ref(&m))
        .await
        .confirmed("m-last"));
    // Fails the first time; the second (the last allowed) never ends.
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let on_message = handler(move |_: Delivery| {
        let counted = counted.clone();
        async move {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err("the database is away".into());
            }
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let (_stop, stopped) = watch::channel(false);
    let crashing = tokio::spawn(Box::new(first).consume(on_message, stopped));
    let deadline = Instant::now() + Duration::from_secs(30);
    while runs.load(Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "the second delivery never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The process dies with the last delivery in its hands.
    crashing.abort();
    let _ = crashing.await;
    assert_eq!(s.dead_lettered().await, 0);

    let after = Arc::new(AtomicUsize::new(0));
    let counted = after.clone();
    let on_message = handler(move |_: Delivery| {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Err("the database is still away".into())
        }
    });
    let (stop, stopped) = watch::channel(false);
    let consuming = tokio::spawn(
        Box::new(s.durable(Duration::from_secs(1)).await).consume(on_message, stopped),
    );
    // Delivered again once the ack wait is over: dead-lettered.
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.dead_lettered().await == 0 {
        assert!(
            Instant::now() < deadline,
            "the message was dropped: no dead-letter copy after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(true).unwrap();
    consuming.await.unwrap().unwrap();
    assert_eq!(
        after.load(Ordering::SeqCst),
        1,
        "handled a third time, once"
    );
    // The copy names the message's own id, for whoever sends it again.
    let copy = stream
        .get_last_raw_message_by_subject(&s.spec.dead_letter_subject())
        .await
        .unwrap();
    let headers = copy.headers;
    assert_eq!(
        headers
            .get(idem_nats::ORIGINAL_MSG_ID)
            .map(|v| v.as_str().to_owned()),
        Some("m-last".to_owned())
    );
    assert_eq!(
        headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()),
        Some("m-last.dlq".to_owned())
    );
}

/// A durable consumer made anew (the first time, or again after someone
/// deleted it) starts at the stream's replay horizon, not at its start: a
/// message older than the inbox remembers would act a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_made_anew_starts_at_the_replay_horizon() {
    use std::time::Instant;
    let mut s = jetstream(5).await;
    s.spec = s.spec.clone().replay_horizon(Duration::from_secs(2));
    let publish = |id: &'static str| {
        let m = idem_outbox::outbox::OutgoingMessage::new(id, s.spec.subject(), id);
        let publisher = s.publisher.clone();
        async move {
            assert!(publisher
                .publish(std::slice::from_ref(&m))
                .await
                .confirmed(id));
        }
    };
    publish("m-old").await;
    // Older than the horizon by the time the consumer is made (and only
    // older, however slow this machine is).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let on_message = {
        let seen = seen.clone();
        handler(move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(d.message_id.unwrap_or_default());
                Ok(())
            }
        })
    };
    let consumer = s.durable(Duration::from_secs(5)).await;
    publish("m-new").await;
    let (stop, stopped) = watch::channel(false);
    let consuming = tokio::spawn(Box::new(consumer).consume(on_message, stopped));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !seen.lock().unwrap().contains(&"m-new".to_owned()) {
        assert!(Instant::now() < deadline, "m-new never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    consuming.await.unwrap().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        ["m-new"],
        "m-old is before the horizon"
    );
}
