//! The broker conformance suite: outbox → broker → inbox, written once and
//! run on every broker (RabbitMQ, NATS JetStream), as the store suite is
//! run on every store. A broker's test file implements [`Broker`] for a
//! destination of the test's own on the real server and instantiates the
//! cases with [`broker_suite!`](crate::broker_suite).

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::BoxFuture;
use idem_outbox::consumer::{handler, Consumer, Delivery};
use idem_outbox::outbox::{self, OutgoingMessage, Published, Publisher, Relay, RelayConfig};
use tokio::sync::watch;

use crate::messaging::{effects, message, record_effect, wait_for, Seen};

/// One broker under test: a destination (a queue, a subject) of the test's
/// own, and an outbox in a PostgreSQL schema of its own.
pub trait Broker: Send + Sync + 'static {
    /// Whether the broker itself drops a copy published again under the
    /// same message id (NATS JetStream's duplicate window does; RabbitMQ
    /// delivers it, and the inbox absorbs it).
    const DROPS_REPUBLISHED_COPIES: bool;
    /// Where messages go.
    fn destination(&self) -> &str;
    /// The outbox's database.
    fn pool(&self) -> &sqlx::PgPool;
    /// A publisher, on a connection of its own.
    fn publisher(&self) -> BoxFuture<'_, Arc<dyn Publisher>>;
    /// A consumer of the destination, on a connection of its own (several
    /// share the destination's deliveries).
    fn consumer(&self) -> BoxFuture<'_, Box<dyn Consumer>>;
    /// A consumer like [`Broker::consumer`] that handles up to `n`
    /// deliveries at once.
    fn concurrent_consumer(&self, n: NonZeroUsize) -> BoxFuture<'_, Box<dyn Consumer>>;
    /// How many messages the dead-letter destination holds.
    fn dead_lettered(&self) -> BoxFuture<'_, u64>;
}

/// Instantiates every case as a `#[tokio::test]`, each with a fresh broker
/// from `$make`, a closure taking the delivery limit (how many times a
/// message is tried before it is dead-lettered) and returning a future of
/// the [`Broker`].
#[macro_export]
macro_rules! broker_suite {
    ($make:expr) => {
        $crate::broker_suite!(@cases $make;
            a_consumer_killed_after_commit_before_ack_acts_once_on_redelivery,
            a_relay_killed_after_the_broker_confirmed_publishes_again_and_it_acts_once,
            a_message_published_twice_acts_once,
            two_relays_move_ten_thousand_messages_none_lost,
            a_poison_message_is_dead_lettered_without_blocking_the_rest,
            the_consumer_hands_over_id_body_and_headers,
            a_consumer_handles_one_delivery_at_a_time_in_order_by_default,
            a_consumer_handles_as_many_deliveries_at_once_as_its_concurrency,
            on_stop_the_deliveries_in_progress_settle_first
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::broker::$case($make).await;
            }
        )*
    };
}

/// A consumer running until the returned sender says stop: it records one
/// effect per message through the inbox, failing the message `fail_on`;
/// with `hang`, it commits and then never acknowledges.
pub async fn consume<B: Broker>(
    b: &B,
    seen: Arc<Seen>,
    hang: bool,
    fail_on: Option<&'static str>,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let consumer = b.consumer().await;
    let pool = b.pool().clone();
    let (stop_tx, stop) = watch::channel(false);
    let on_message = handler(move |d: Delivery| {
        let (pool, seen) = (pool.clone(), seen.clone());
        async move {
            record_effect(&pool, &seen, d.message_id, Duration::ZERO, fail_on).await?;
            if hang {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    });
    let task = tokio::spawn(async move {
        consumer
            .consume(on_message, stop)
            .await
            .unwrap_or_else(|e| panic!("the consumer failed: {e}"));
    });
    (stop_tx, task)
}

/// The consumer commits its effect, then dies before acknowledging: the
/// message is delivered again, and the inbox recognises it.
pub async fn a_consumer_killed_after_commit_before_ack_acts_once_on_redelivery<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(5).await;
    let batch = [message("m-1", b.destination())];
    assert!(b.publisher().await.publish(&batch).await.confirmed("m-1"));
    let first = Arc::new(Seen::default());
    let (_stop, task) = consume(&b, first.clone(), true, None).await;
    let pool = b.pool().clone();
    wait_for(
        "the first consumer to commit",
        Duration::from_secs(10),
        move || {
            let pool = pool.clone();
            Box::pin(async move { effects(&pool).await == 1 })
        },
    )
    .await;
    // The consumer dies: its connection goes; the message was never acked.
    task.abort();
    let _ = task.await;
    let second = Arc::new(Seen::default());
    let (stop, task) = consume(&b, second.clone(), false, None).await;
    let seen = second.clone();
    wait_for("the redelivery", Duration::from_secs(30), move || {
        let seen = seen.clone();
        Box::pin(async move { seen.duplicates.load(Ordering::SeqCst) == 1 })
    })
    .await;
    assert_eq!(effects(b.pool()).await, 1, "the effect exists once");
    stop.send(true).unwrap_or(());
    task.await.unwrap_or(());
}

/// A publisher that confirms, then panics before the relay marks its rows:
/// the relay died after the broker confirmed.
struct DiesAfterConfirm(Arc<dyn Publisher>);

impl Publisher for DiesAfterConfirm {
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
        Box::pin(async move {
            let published = self.0.publish(batch).await;
            assert!(published.all_confirmed(batch));
            panic!("the relay died after the broker confirmed, before marking the rows");
        })
    }
}

/// The relay dies after the broker confirmed: the rows are published
/// again after the lease, and each message acts once.
pub async fn a_relay_killed_after_the_broker_confirmed_publishes_again_and_it_acts_once<B, F, Fut>(
    make: F,
) where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(5).await;
    let mut tx = b.pool().begin().await.unwrap();
    for i in 0..20 {
        outbox::enqueue(&mut tx, &message(&format!("dp-{i}"), b.destination()))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let short = RelayConfig {
        lease: Duration::from_millis(300),
        ..RelayConfig::default()
    };
    let publisher = b.publisher().await;
    let dying = Relay::new(
        b.pool(),
        Arc::new(DiesAfterConfirm(publisher.clone())),
        short.clone(),
    );
    assert!(tokio::spawn(async move { dying.round().await })
        .await
        .is_err_and(|e| e.is_panic()));
    // Past the lease (the policy's margin, not the machine's).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let healthy = Relay::new(b.pool(), publisher, short);
    assert_eq!(healthy.round().await.unwrap().sent, 20, "published again");
    let seen = Arc::new(Seen::default());
    let (stop, task) = consume(&b, seen.clone(), false, None).await;
    let watch_seen = seen.clone();
    let deliveries = if B::DROPS_REPUBLISHED_COPIES { 20 } else { 40 };
    wait_for(
        "every delivery handled",
        Duration::from_secs(30),
        move || {
            let seen = watch_seen.clone();
            Box::pin(async move { seen.handled() == deliveries })
        },
    )
    .await;
    assert_eq!(effects(b.pool()).await, 20, "consumed once each");
    stop.send(true).unwrap_or(());
    task.await.unwrap_or(());
}

/// Each message published twice, with two consumers sharing the
/// deliveries: one effect per message.
pub async fn a_message_published_twice_acts_once<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(5).await;
    let seen = Arc::new(Seen::default());
    let (stop_a, a) = consume(&b, seen.clone(), false, None).await;
    let (stop_b, c) = consume(&b, seen.clone(), false, None).await;
    let mut batch = Vec::new();
    for i in 0..30 {
        batch.push(message(&format!("twin-{i}"), b.destination()));
        batch.push(message(&format!("twin-{i}"), b.destination()));
    }
    assert!(b
        .publisher()
        .await
        .publish(&batch)
        .await
        .all_confirmed(&batch));
    let deliveries = if B::DROPS_REPUBLISHED_COPIES { 30 } else { 60 };
    let watch_seen = seen.clone();
    wait_for(
        "every delivery handled",
        Duration::from_secs(30),
        move || {
            let seen = watch_seen.clone();
            Box::pin(async move { seen.handled() == deliveries })
        },
    )
    .await;
    assert_eq!(effects(b.pool()).await, 30);
    assert_eq!(seen.duplicates.load(Ordering::SeqCst), deliveries - 30);
    stop_a.send(true).unwrap_or(());
    stop_b.send(true).unwrap_or(());
    a.await.unwrap_or(());
    c.await.unwrap_or(());
}

/// Two relays publish 10,000 committed rows through the broker to a
/// consumer: every message arrives, each acts once.
pub async fn two_relays_move_ten_thousand_messages_none_lost<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    const N: usize = 10_000;
    let b = make(5).await;
    for chunk in 0..20 {
        let mut tx = b.pool().begin().await.unwrap();
        for i in 0..500 {
            let id = format!("bulk-{}", chunk * 500 + i);
            outbox::enqueue(&mut tx, &message(&id, b.destination()))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let seen = Arc::new(Seen::default());
    let (stop_c, c) = consume(&b, seen.clone(), false, None).await;
    let (stop, relays_stop) = watch::channel(false);
    let config = RelayConfig {
        poll: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let started = Instant::now();
    let r1 = tokio::spawn(
        Relay::new(b.pool(), b.publisher().await, config.clone()).run(relays_stop.clone()),
    );
    let r2 = tokio::spawn(Relay::new(b.pool(), b.publisher().await, config).run(relays_stop));
    let pool = b.pool().clone();
    wait_for(
        "every row marked sent",
        Duration::from_secs(120),
        move || {
            let pool = pool.clone();
            Box::pin(async move { outbox::stats(&pool).await.is_ok_and(|s| s.sent == N as i64) })
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
            Box::pin(async move { seen.ids.lock().map(|ids| ids.len()).unwrap_or(0) == N })
        },
    )
    .await;
    stop.send(true).unwrap_or(());
    r1.await.unwrap().unwrap();
    r2.await.unwrap().unwrap();
    let ids: HashSet<String> = seen.ids.lock().unwrap().iter().cloned().collect();
    assert_eq!(ids.len(), N, "none lost");
    eprintln!(
        "relayed {N} messages in {relayed:?} ({:.0}/s); {} duplicate deliveries absorbed",
        N as f64 / relayed.as_secs_f64(),
        seen.duplicates.load(Ordering::SeqCst)
    );
    assert_eq!(effects(b.pool()).await, N as i64);
    stop_c.send(true).unwrap_or(());
    c.await.unwrap_or(());
}

/// A message whose handler always fails is tried as often as allowed,
/// then dead-lettered; the others go through meanwhile.
pub async fn a_poison_message_is_dead_lettered_without_blocking_the_rest<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(3).await;
    let mut batch = vec![message("poison", b.destination())];
    for i in 0..10 {
        batch.push(message(&format!("fine-{i}"), b.destination()));
    }
    assert!(b
        .publisher()
        .await
        .publish(&batch)
        .await
        .all_confirmed(&batch));
    let seen = Arc::new(Seen::default());
    let (stop, task) = consume(&b, seen.clone(), false, Some("poison")).await;
    let pool = b.pool().clone();
    wait_for("the good messages", Duration::from_secs(20), move || {
        let pool = pool.clone();
        Box::pin(async move { effects(&pool).await == 10 })
    })
    .await;
    let b = Arc::new(b);
    let watch = b.clone();
    wait_for(
        "the poison message dead-lettered",
        Duration::from_secs(20),
        move || {
            let b = watch.clone();
            Box::pin(async move { b.dead_lettered().await == 1 })
        },
    )
    .await;
    assert_eq!(
        seen.deliveries.load(Ordering::SeqCst),
        10 + 3,
        "the poison message was tried 3 times"
    );
    stop.send(true).unwrap_or(());
    task.await.unwrap_or(());
}

/// A handler sees the message id, the body and the headers the sender set.
pub async fn the_consumer_hands_over_id_body_and_headers<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(5).await;
    let batch = [message("h-1", b.destination())];
    assert!(b.publisher().await.publish(&batch).await.confirmed("h-1"));
    let consumer = b.consumer().await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop) = watch::channel(false);
    let on_message = handler(move |d: Delivery| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(d);
            Ok(())
        }
    });
    let task = tokio::spawn(consumer.consume(on_message, stop));
    let d = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.message_id.as_deref(), Some("h-1"));
    assert_eq!(d.header("type"), Some("OrderPlaced"));
    assert_eq!(&d.payload[..], br#"{"id":"h-1"}"#);
    assert!(!d.redelivered);
    stop_tx.send(true).unwrap_or(());
    task.await.unwrap().unwrap();
}

/// Publishes `ids` in one batch and checks the broker confirmed each.
async fn publish_all<B: Broker>(b: &B, ids: &[String]) {
    let batch: Vec<OutgoingMessage> = ids.iter().map(|id| message(id, b.destination())).collect();
    let published = b.publisher().await.publish(&batch).await;
    for id in ids {
        assert!(published.confirmed(id), "{id} confirmed");
    }
}

/// Receives `n` message ids from `rx`, waiting at most 20 s in all.
async fn receive(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Option<String>>,
    n: usize,
) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(id)) => got.push(id.unwrap_or_default()),
            _ => panic!("{} of {n} deliveries handled in 20 s: {got:?}", got.len()),
        }
    }
    got
}

/// Counts the handlers running at once, and the most seen.
#[derive(Default)]
struct Overlap {
    running: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl Overlap {
    /// Runs `work` counted as one handler running.
    async fn during<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let out = work.await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        out
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }
}

/// By default a consumer settles each delivery before it takes the next:
/// never two handlers at once, and the destination's order kept.
pub async fn a_consumer_handles_one_delivery_at_a_time_in_order_by_default<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let b = make(5).await;
    let ids: Vec<String> = (0..5).map(|i| format!("o-{i}")).collect();
    publish_all(&b, &ids).await;
    let consumer = b.consumer().await;
    let overlap = Arc::new(Overlap::default());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop) = watch::channel(false);
    let o = overlap.clone();
    let on_message = handler(move |d: Delivery| {
        let (overlap, tx) = (o.clone(), tx.clone());
        async move {
            // long enough for a second delivery to start, were it allowed
            overlap
                .during(tokio::time::sleep(Duration::from_millis(30)))
                .await;
            let _ = tx.send(d.message_id);
            Ok(())
        }
    });
    let task = tokio::spawn(consumer.consume(on_message, stop));
    let got = receive(&mut rx, ids.len()).await;
    assert_eq!(got, ids, "in the order published");
    assert_eq!(overlap.most(), 1, "one handler at a time");
    stop_tx.send(true).unwrap_or(());
    task.await.unwrap().unwrap();
}

/// With a concurrency of N, N deliveries are in their handlers at once,
/// and never more: of 2N messages, each handler waits until N have started
/// (which one at a time would never reach), and no more than N run.
pub async fn a_consumer_handles_as_many_deliveries_at_once_as_its_concurrency<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    const N: usize = 6;
    let b = make(5).await;
    let ids: Vec<String> = (0..2 * N).map(|i| format!("c-{i:02}")).collect();
    publish_all(&b, &ids).await;
    let consumer = b
        .concurrent_consumer(NonZeroUsize::new(N).unwrap_or(NonZeroUsize::MIN))
        .await;
    let all_started = Arc::new(tokio::sync::Barrier::new(N));
    let overlap = Arc::new(Overlap::default());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop) = watch::channel(false);
    let o = overlap.clone();
    let on_message = handler(move |d: Delivery| {
        let (all_started, tx, overlap) = (all_started.clone(), tx.clone(), o.clone());
        async move {
            overlap.during(all_started.wait()).await;
            let _ = tx.send(d.message_id);
            Ok(())
        }
    });
    let task = tokio::spawn(consumer.consume(on_message, stop));
    let mut got = receive(&mut rx, 2 * N).await;
    got.sort();
    assert_eq!(got, ids);
    assert_eq!(overlap.most(), N, "never more than the concurrency");
    stop_tx.send(true).unwrap_or(());
    task.await.unwrap().unwrap();
}

/// A consumer told to stop while deliveries are in their handlers returns
/// only once each has finished and been acknowledged: none comes back.
pub async fn on_stop_the_deliveries_in_progress_settle_first<B, F, Fut>(make: F)
where
    B: Broker,
    F: FnOnce(u32) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    const N: usize = 4;
    let b = make(5).await;
    let ids: Vec<String> = (0..N).map(|i| format!("s-{i}")).collect();
    publish_all(&b, &ids).await;
    // room for one more, so the consumer waits on its next delivery (and
    // sees the stop) rather than on a free place
    let consumer = b
        .concurrent_consumer(NonZeroUsize::new(N + 1).unwrap_or(NonZeroUsize::MIN))
        .await;
    // the test waits with the handlers until all are in progress
    let all_started = Arc::new(tokio::sync::Barrier::new(N + 1));
    let (open, gate) = watch::channel(false);
    let seen = Arc::new(Seen::default());
    let pool = b.pool().clone();
    let (stop_tx, stop) = watch::channel(false);
    let (started, effects_seen) = (all_started.clone(), seen.clone());
    let on_message = handler(move |d: Delivery| {
        let (started, mut gate, pool, seen) = (
            started.clone(),
            gate.clone(),
            pool.clone(),
            effects_seen.clone(),
        );
        async move {
            started.wait().await;
            let _ = gate.wait_for(|open| *open).await;
            record_effect(&pool, &seen, d.message_id, Duration::ZERO, None).await?;
            Ok(())
        }
    });
    let task = tokio::spawn(consumer.consume(on_message, stop));
    tokio::time::timeout(Duration::from_secs(20), all_started.wait())
        .await
        .unwrap_or_else(|_| panic!("{N} deliveries in progress at once"));
    stop_tx.send(true).unwrap_or(());
    // the consumer has seen the stop; its handlers are still waiting
    tokio::time::sleep(Duration::from_millis(200)).await;
    open.send(true).unwrap_or(());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap_or_else(|_| panic!("the consumer stops once its deliveries settled"))
        .unwrap()
        .unwrap();
    assert_eq!(effects(b.pool()).await, N as i64);
    // Nothing was left unacknowledged: a new consumer is handed nothing,
    // past the redelivery time of an unacknowledged message.
    let again = Arc::new(Seen::default());
    let (stop_again, task_again) = consume(&b, again.clone(), false, None).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        again.deliveries.load(Ordering::SeqCst),
        0,
        "nothing redelivered"
    );
    stop_again.send(true).unwrap_or(());
    task_again.await.unwrap_or(());
}
