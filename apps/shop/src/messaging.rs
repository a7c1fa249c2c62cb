//! Events through the outbox, consumed once through the inbox.
//!
//! `POST /orders` enqueues `OrderPlaced`, a successful payment enqueues
//! `PaymentAuthorized`, and a checkout `OrderPaid`, each in the transaction
//! of its business write. A relay publishes them after the commit: through
//! RabbitMQ or NATS JetStream when `--broker-url` names one, in process
//! otherwise. Three consumers act on them once each through the inbox:
//! `reserve-stock` (stock reserved per SKU), `send-email` (one confirmation
//! email per payment) and `send-receipt` (one receipt per paid order).

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::UnixMillis;
use idem_outbox::consumer::{handler, Consumer, Delivery};
use idem_outbox::transport::InProcess;
use idem_outbox::{Handled, OutgoingMessage, Publisher, Relay, RelayConfig};
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::db::{Database, Work};

/// The events, by the suffix of their destination.
pub(crate) const ORDER_PLACED: &str = "orders.placed";
pub(crate) const PAYMENT_AUTHORIZED: &str = "payments.authorized";
pub(crate) const ORDER_PAID: &str = "orders.paid";

/// Each event: its destination's suffix, the consumer that acts on it
/// once, and (NATS) the suffix of its stream's name.
const EVENTS: [(&str, &str, &str); 3] = [
    (ORDER_PLACED, "reserve-stock", "ORDERS"),
    (PAYMENT_AUTHORIZED, "send-email", "PAYMENTS"),
    (ORDER_PAID, "send-receipt", "ORDERS_PAID"),
];

/// The first restart of the relay (after it stopped on an error waiting
/// cannot mend) or of a consumer that ended; each failed restart doubles
/// the delay, up to [`RESTART_MAX`].
const RESTART_FIRST: Duration = Duration::from_secs(1);
/// The longest delay between two restarts of the relay or a consumer; one
/// that ran this long before it stopped starts again from [`RESTART_FIRST`].
const RESTART_MAX: Duration = Duration::from_secs(30);

/// Why the relay is stopped, while it is: `/healthz` answers 503 with it.
#[derive(Debug, Clone)]
pub(crate) struct RelayStopped {
    /// The error it stopped on, with its causes.
    pub(crate) error: String,
    /// When the supervisor tries it again.
    pub(crate) retry_at: Instant,
}

/// Where the supervisor records whether the relay runs.
type RelayStatus = Arc<std::sync::Mutex<Option<RelayStopped>>>;

/// A running relay and its consumers.
pub(crate) struct Messaging {
    relay: Relay,
    prefix: String,
    stop: watch::Sender<bool>,
    tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    relay_status: RelayStatus,
    max_lag: Duration,
}

impl std::fmt::Debug for Messaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messaging")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize)]
struct OrderPlaced {
    order_id: String,
    items: Vec<Line>,
}

#[derive(Debug, Deserialize)]
struct Line {
    sku: String,
    qty: i64,
}

#[derive(Debug, Deserialize)]
struct OrderPaid {
    order_id: String,
    payment_id: String,
    account_id: String,
    amount: i64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct PaymentAuthorized {
    payment_id: String,
    account_id: String,
    amount: i64,
    currency: String,
}

/// How a message ended, the `outcome` of `idem_messages_total`.
#[derive(Debug, Clone, Copy)]
enum MessageOutcome {
    Processed,
    Duplicate,
    Failed,
}

impl MessageOutcome {
    fn label(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Failed => "failed",
        }
    }
}

/// One email about a payment.
fn email(payment_id: String, account_id: String, subject: String, now: i64) -> Work {
    Work::SendEmail {
        payment_id,
        account_id,
        subject,
        now,
    }
}

/// What a consumer does with one message, once.
async fn act(
    db: &Database,
    destination_suffix: &str,
    message_id: &str,
    payload: &[u8],
) -> Result<(), String> {
    let now = UnixMillis::now().0;
    let (consumer, work) = if destination_suffix == ORDER_PLACED {
        let event: OrderPlaced =
            serde_json::from_slice(payload).map_err(|e| format!("bad OrderPlaced: {e}"))?;
        tracing::debug!(order = %event.order_id, "reserving stock");
        let lines = event.items.into_iter().map(|l| (l.sku, l.qty)).collect();
        ("reserve-stock", Work::ReserveStock(lines))
    } else if destination_suffix == ORDER_PAID {
        let event: OrderPaid =
            serde_json::from_slice(payload).map_err(|e| format!("bad OrderPaid: {e}"))?;
        let subject = format!(
            "Receipt for order {}: {} {} paid",
            event.order_id, event.amount, event.currency
        );
        let work = email(event.payment_id, event.account_id, subject, now);
        ("send-receipt", work)
    } else {
        let event: PaymentAuthorized =
            serde_json::from_slice(payload).map_err(|e| format!("bad PaymentAuthorized: {e}"))?;
        let subject = format!(
            "Payment {} of {} {} authorized",
            event.payment_id, event.amount, event.currency
        );
        let work = email(event.payment_id, event.account_id, subject, now);
        ("send-email", work)
    };
    let outcome = db.consume(consumer, message_id, work).await;
    match outcome {
        Ok(Handled::Processed(())) => {
            metrics::counter!("idem_messages_total", "consumer" => consumer, "outcome" => MessageOutcome::Processed.label()).increment(1);
            info!(message_id, "event processed")
        }
        Ok(Handled::Duplicate) => {
            metrics::counter!("idem_messages_total", "consumer" => consumer, "outcome" => MessageOutcome::Duplicate.label()).increment(1);
            info!(message_id, "duplicate event acknowledged")
        }
        Err(e) => {
            metrics::counter!("idem_messages_total", "consumer" => consumer, "outcome" => MessageOutcome::Failed.label())
                .increment(1);
            return Err(e);
        }
    }
    Ok(())
}

impl Messaging {
    /// Starts the relay and both consumers over the transport `broker_url`
    /// names (`amqp://…`, `nats://…`), or in process without one.
    pub(crate) async fn start(
        db: Database,
        broker_url: Option<&str>,
        prefix: &str,
        max_lag: Duration,
        concurrency: std::num::NonZeroUsize,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let (stop, stop_rx) = watch::channel(false);
        let destinations = EVENTS.map(|(suffix, _, _)| format!("{prefix}.{suffix}"));
        // Each event's consumer, on whatever carries the events; the
        // handler and its wiring are the same for all.
        let mut consumers: Vec<(OpenConsumer, &'static str)> = Vec::new();
        let publisher: Arc<dyn Publisher> = match broker_url {
            None => {
                let transport = Arc::new(InProcess::new());
                for (dest, (suffix, _, _)) in destinations.iter().zip(EVENTS) {
                    let (transport, dest) = (transport.clone(), dest.clone());
                    let open: OpenConsumer = Arc::new(move || {
                        let consumer = transport.consumer(&dest).concurrency(concurrency);
                        Box::pin(async move { Ok(Box::new(consumer) as Box<dyn Consumer>) })
                    });
                    consumers.push((open, suffix));
                }
                info!("messaging in process (no --broker-url)");
                transport
            }
            Some(url) if url.starts_with("amqp://") || url.starts_with("amqps://") => {
                let publisher = idem_rabbitmq::RabbitPublisher::connect(url).await?;
                for (dest, (suffix, _, _)) in destinations.iter().zip(EVENTS) {
                    let spec = idem_rabbitmq::QueueSpec::new(dest.clone()).max_deliveries(5);
                    spec.declare(&publisher.channel()).await?;
                    let url = url.to_owned();
                    // The prefetch window no larger than the handlers: what
                    // the broker sent and no handler took goes back to the
                    // queue when the consumer stops, and a quorum queue
                    // counts that return as a delivery (of the 5).
                    let prefetch = u16::try_from(concurrency.get()).unwrap_or(u16::MAX);
                    let open: OpenConsumer = Arc::new(move || {
                        let (url, spec) = (url.clone(), spec.clone());
                        Box::pin(async move {
                            let consumer =
                                idem_rabbitmq::RabbitConsumer::connect(&url, spec, prefetch)
                                    .await?
                                    .concurrency(concurrency);
                            Ok(Box::new(consumer) as Box<dyn Consumer>)
                        })
                    });
                    consumers.push((open, suffix));
                }
                info!(url = %without_credentials(url), "messaging over RabbitMQ");
                Arc::new(publisher)
            }
            Some(url) if url.starts_with("nats://") => {
                let stream_prefix: String = prefix
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() {
                            c.to_ascii_uppercase()
                        } else {
                            '_'
                        }
                    })
                    .collect();
                let specs: Vec<idem_nats::StreamSpec> = destinations
                    .iter()
                    .zip(EVENTS)
                    .map(|(dest, (_, _, stream))| {
                        idem_nats::StreamSpec::new(
                            format!("{stream_prefix}_{stream}"),
                            dest.clone(),
                        )
                    })
                    .collect();
                let publisher = idem_nats::NatsPublisher::connect(url, &specs[0]).await?;
                for spec in &specs[1..] {
                    spec.declare(publisher.context()).await?;
                }
                for (spec, (suffix, durable, _)) in specs.iter().zip(EVENTS) {
                    let (url, spec) = (url.to_owned(), spec.clone());
                    let open: OpenConsumer = Arc::new(move || {
                        let (url, spec) = (url.clone(), spec.clone());
                        Box::pin(async move {
                            let consumer =
                                idem_nats::NatsConsumer::connect(&url, &spec, durable, 5)
                                    .await?
                                    .concurrency(concurrency);
                            Ok(Box::new(consumer) as Box<dyn Consumer>)
                        })
                    });
                    consumers.push((open, suffix));
                }
                info!(url = %without_credentials(url), "messaging over NATS JetStream");
                Arc::new(publisher)
            }
            Some(other) => {
                return Err(
                    format!("unsupported broker URL {other:?}: use amqp://… or nats://…").into(),
                )
            }
        };
        let mut tasks = Vec::new();
        for (open, suffix) in consumers {
            // The first connection's failure fails the start, as before.
            let consumer = open()
                .await
                .map_err(|e| -> Box<dyn std::error::Error> { e })?;
            let db = db.clone();
            let on_message = handler(move |d: Delivery| {
                let db = db.clone();
                async move {
                    let id = d.message_id.ok_or("a message without a message id")?;
                    act(&db, suffix, &id, &d.payload).await?;
                    Ok(())
                }
            });
            tasks.push(tokio::spawn(keep_consuming(
                consumer,
                open,
                on_message,
                stop_rx.clone(),
                suffix,
            )));
        }
        let config = RelayConfig {
            poll: Duration::from_millis(500),
            ..RelayConfig::default()
        };
        let relay = db.relay(publisher, config);
        let relay_status = RelayStatus::default();
        tasks.push(tokio::spawn(supervise(
            relay.clone(),
            stop_rx.clone(),
            relay_status.clone(),
        )));
        Ok(Self {
            relay,
            prefix: prefix.to_owned(),
            stop,
            tasks: std::sync::Mutex::new(tasks),
            relay_status,
            max_lag,
        })
    }

    /// How long the oldest event in the outbox may have waited, as of now
    /// ([`Relay::lag`]).
    pub(crate) fn lag(&self) -> Duration {
        self.relay.lag()
    }

    /// How long the oldest event in the outbox may have waited, and the
    /// limit, when it is past `--outbox-max-lag-secs`.
    pub(crate) fn lagging(&self) -> Option<(Duration, Duration)> {
        let lag = self.relay.lag();
        (lag > self.max_lag).then_some((lag, self.max_lag))
    }

    /// Why the relay is stopped, if it is (its supervisor restarts it).
    pub(crate) fn relay_stopped(&self) -> Option<RelayStopped> {
        self.relay_status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The destination of an event.
    pub(crate) fn destination(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    /// Wakes the relay after a commit that enqueued events.
    pub(crate) fn wake(&self) {
        self.relay.wake();
    }

    /// Stops the relay and the consumers; in-flight messages finish first.
    pub(crate) async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for t in tasks {
            let _ = t.await;
        }
    }
}

/// An error and its causes, on one line.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        line.push_str(": ");
        line.push_str(&c.to_string());
        cause = c.source();
    }
    line
}

/// Opens an event's consumer (again): a connection, a channel, its queue or
/// durable declared.
type OpenConsumer = Arc<
    dyn Fn() -> idem_core::BoxFuture<
            'static,
            Result<Box<dyn Consumer>, idem_outbox::consumer::ConsumeError>,
        > + Send
        + Sync,
>;

/// Runs `consumer` until `stop`; if it ends before (its connection lost,
/// its queue deleted, its server gone), opens another with `open` and runs
/// that. The wait before opening starts at 1 s and doubles (up to 30 s)
/// while opening fails or the consumer ends again soon after it started,
/// as the relay's restarts do; a consumer that ran 30 s or more is opened
/// again after 1 s. A stop ends the wait, or an open in progress, at once.
async fn keep_consuming(
    mut consumer: Box<dyn Consumer>,
    open: OpenConsumer,
    on_message: idem_outbox::consumer::Handler,
    mut stop: watch::Receiver<bool>,
    event: &'static str,
) {
    let running = |yes: bool| {
        metrics::gauge!("shop_consumer_running", "event" => event).set(if yes { 1.0 } else { 0.0 });
    };
    running(true);
    let mut delay = RESTART_FIRST;
    loop {
        let started = Instant::now();
        // On a task of its own: a handler's panic (resumed by the consumer)
        // ends that task, not this loop, and the consumer is opened again
        // like one that failed (its message comes again).
        let ended = tokio::spawn(consumer.consume(on_message.clone(), stop.clone())).await;
        if *stop.borrow() {
            return;
        }
        running(false);
        match ended {
            Ok(Ok(())) => warn!(event, "consumer ended; opening another"),
            Ok(Err(e)) => warn!(event, error = %e, "consumer failed; opening another"),
            Err(e) => warn!(event, error = %e, "consumer panicked; opening another"),
        }
        if started.elapsed() >= RESTART_MAX {
            delay = RESTART_FIRST;
        }
        consumer = loop {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                // A dropped sender is a stop too.
                _ = stop.wait_for(|stop| *stop) => return,
            }
            let opened = tokio::select! {
                opened = open() => opened,
                // Opening may hang on a broker that does not answer.
                _ = stop.wait_for(|stop| *stop) => return,
            };
            delay = delay.saturating_mul(2).min(RESTART_MAX);
            match opened {
                Ok(consumer) => break consumer,
                Err(e) => {
                    warn!(event, error = %e, retry_in = ?delay, "cannot open the consumer yet")
                }
            }
        };
        metrics::counter!("shop_consumer_restarts_total", "event" => event).increment(1);
        info!(event, "consumer running again");
        running(true);
    }
}

/// Runs the relay until `stop`, as a service's supervisor would. A relay
/// stops by itself only on an error that waiting cannot mend (a missing
/// table or column, permission denied); then it is recorded for `/healthz`,
/// counted in `shop_outbox_relay_restarts_total`, and tried again after a
/// delay that doubles (1 s up to 30 s) while the error lasts. Nothing is
/// lost meanwhile: the events wait in the outbox table.
async fn supervise(relay: Relay, mut stop: watch::Receiver<bool>, status: RelayStatus) {
    let set = |now: Option<RelayStopped>| {
        metrics::gauge!("shop_outbox_relay_running").set(if now.is_none() { 1.0 } else { 0.0 });
        *status.lock().unwrap_or_else(|e| e.into_inner()) = now;
    };
    set(None);
    let mut delay = RESTART_FIRST;
    let mut restarted = false;
    loop {
        let started = Instant::now();
        let Err(e) = relay.clone().run(stop.clone()).await else {
            return;
        };
        // A relay that ran a while starts over from the first delay; one
        // that stopped again soon after a restart waits longer each time.
        delay = if started.elapsed() >= RESTART_MAX {
            RESTART_FIRST
        } else if restarted {
            delay.saturating_mul(2).min(RESTART_MAX)
        } else {
            delay
        };
        let mut error = with_causes(&e);
        loop {
            error!(error, retry_in = ?delay, "outbox relay stopped; restarting it after the delay");
            set(Some(RelayStopped {
                error: error.clone(),
                retry_at: Instant::now() + delay,
            }));
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                // A dropped sender is a stop too.
                changed = stop.changed() => if changed.is_err() { return },
            }
            if *stop.borrow() {
                return;
            }
            metrics::counter!("shop_outbox_relay_restarts_total").increment(1);
            // One round first: a relay that cannot work yet stays stopped
            // (and reported) rather than flapping between start and stop.
            match relay.round().await {
                Err(e) if e.is_fatal() => {
                    error = with_causes(&e);
                    delay = delay.saturating_mul(2).min(RESTART_MAX);
                }
                // Published, or a failure `run` waits out itself.
                _ => break,
            }
        }
        info!("outbox relay restarted");
        restarted = true;
        set(None);
    }
}

/// The outgoing event for a placed order.
pub(crate) fn order_placed(
    m: &Messaging,
    order_id: &str,
    customer_id: &str,
    items_json: &str,
) -> OutgoingMessage {
    OutgoingMessage {
        message_id: format!("order-placed-{order_id}"),
        destination: m.destination(ORDER_PLACED),
        ordering_key: Some(order_id.to_owned()),
        payload: format!(
            r#"{{"order_id":{},"customer_id":{},"items":{items_json}}}"#,
            json(order_id),
            json(customer_id)
        )
        .into(),
        headers: vec![("type".into(), "OrderPlaced".into())],
    }
}

/// The outgoing event for an authorized payment.
pub(crate) fn payment_authorized(m: &Messaging, payment: &crate::db::Payment) -> OutgoingMessage {
    OutgoingMessage {
        message_id: format!("payment-authorized-{}", payment.id),
        destination: m.destination(PAYMENT_AUTHORIZED),
        ordering_key: None,
        payload: serde_json::json!({
            "payment_id": payment.id,
            "account_id": payment.account_id,
            "amount": payment.amount,
            "currency": payment.currency,
        })
        .to_string()
        .into(),
        headers: vec![("type".into(), "PaymentAuthorized".into())],
    }
}

/// The outgoing event for a paid order (its checkout's payment).
pub(crate) fn order_paid(
    m: &Messaging,
    order_id: &str,
    payment: &crate::db::Payment,
) -> OutgoingMessage {
    OutgoingMessage {
        message_id: format!("order-paid-{order_id}"),
        destination: m.destination(ORDER_PAID),
        // Not ordered behind `OrderPlaced`: a receipt must not wait out the
        // relay lease of a placed order's event held by a process that died.
        ordering_key: None,
        payload: serde_json::json!({
            "order_id": order_id,
            "payment_id": payment.id,
            "account_id": payment.account_id,
            "amount": payment.amount,
            "currency": payment.currency,
        })
        .to_string()
        .into(),
        headers: vec![("type".into(), "OrderPaid".into())],
    }
}

fn json(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// `url` as logs may show it: a password (or any user information) before
/// the host is masked (it is taken to end at the last `@`, so a raw `/` or
/// `@` in it is masked too).
fn without_credentials(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rfind('@') {
            Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod credentials_tests {
    use super::without_credentials;

    #[test]
    fn logged_urls_carry_no_credentials() {
        assert_eq!(
            without_credentials("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            without_credentials("nats://user:pa/ss@word@nats:4222"),
            "nats://***@nats:4222"
        );
        assert_eq!(
            without_credentials("nats://127.0.0.1:4222"),
            "nats://127.0.0.1:4222"
        );
    }
}

#[cfg(test)]
mod restart_tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::BoxFuture;
    use idem_outbox::consumer::{handler, ConsumeError, Consumer, Delivery, Handler};
    use tokio::sync::watch;

    use super::{keep_consuming, OpenConsumer};

    /// A consumer that panics, as one does when its handler panicked.
    struct Panics;

    impl Consumer for Panics {
        fn consume(
            self: Box<Self>,
            _: Handler,
            _: watch::Receiver<bool>,
        ) -> BoxFuture<'static, Result<(), ConsumeError>> {
            Box::pin(async { panic!("a handler panicked") })
        }
    }

    /// A consumer that counts its runs and waits for the stop.
    struct Runs(Arc<AtomicUsize>);

    impl Consumer for Runs {
        fn consume(
            self: Box<Self>,
            _: Handler,
            mut stop: watch::Receiver<bool>,
        ) -> BoxFuture<'static, Result<(), ConsumeError>> {
            Box::pin(async move {
                self.0.fetch_add(1, Ordering::SeqCst);
                let _ = stop.wait_for(|stop| *stop).await;
                Ok(())
            })
        }
    }

    /// A consumer that panicked is opened again, as one that failed is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_consumer_that_panicked_is_opened_again() {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let open: OpenConsumer = Arc::new(move || {
            let counted = counted.clone();
            Box::pin(async move { Ok(Box::new(Runs(counted)) as Box<dyn Consumer>) })
        });
        let (stop, stopped) = watch::channel(false);
        let on_message = handler(|_: Delivery| async { Ok(()) });
        let supervising = tokio::spawn(keep_consuming(
            Box::new(Panics),
            open,
            on_message,
            stopped,
            "test",
        ));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while runs.load(Ordering::SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the consumer was not opened again"
            );
            assert!(!supervising.is_finished(), "the supervisor died with it");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.send(true).unwrap();
        supervising.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
