//! RabbitMQ for idem's outbox and inbox (lapin).
//!
//! - [`RabbitPublisher`]: an outbox [`Publisher`] with publisher confirms;
//!   every message carries its id in the AMQP `message_id` property and is
//!   persistent. A message counts as published only once the broker acked it
//!   and routed it to a queue: it is published `mandatory`, so one whose
//!   destination names no queue comes back and is a publish error
//!   (`Rejected`, retried and then dead-lettered in the outbox), never
//!   marked sent. A message the broker closes the channel over (over its
//!   `max_message_size`; a header RabbitMQ reads itself, such as `CC` or
//!   `BCC` sent as text) is refused for itself: when other confirms of its
//!   batch fail with the channel, they are sent again, half of them at a
//!   time, until the one that closes a channel by itself stands alone, so
//!   the refusal is never charged to a message that was only waiting
//!   beside it.
//! - [`RabbitConsumer`]: a consumer with manual acks and a prefetch window.
//!   A handler error requeues the message; the queue (a quorum queue with
//!   `x-delivery-limit`) dead-letters it to `<queue>.dlq` after the allowed
//!   number of deliveries, so a poison message never blocks the ones behind
//!   it. Pair the handler with the inbox so that redeliveries act once.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idem_rabbitmq::{RabbitConsumer, RabbitPublisher, QueueSpec};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let publisher = RabbitPublisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
//! let spec = QueueSpec::new("orders").max_deliveries(5);
//! spec.declare(&publisher.channel()).await?;
//! let consumer = RabbitConsumer::connect("amqp://guest:guest@127.0.0.1:5672/%2f", spec, 32).await?;
//! # let _ = (Arc::new(publisher), consumer); Ok(()) }
//! ```

use std::num::NonZeroUsize;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use idem_core::BoxFuture;
use idem_outbox::consumer::{ConsumeError, Consumer, Delivery, Handler, InFlight};
use idem_outbox::outbox::{OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::{watch, Mutex};
use tracing::{debug, info, warn};

/// A RabbitMQ failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// The client or the broker failed (a connection, a channel, a
    /// refusal).
    #[error("RabbitMQ: {0}")]
    Client(#[from] lapin::Error),
    /// The broker ended the consumer (its queue deleted, the consumer
    /// cancelled by an operator or a policy): nothing more will be
    /// delivered to it, so [`Consumer::consume`] returns this rather than
    /// `Ok` as after a stop. Restart it (after declaring the queue).
    #[error("RabbitMQ: the broker cancelled the consumer of queue {queue:?}")]
    Cancelled {
        /// The queue it consumed.
        queue: String,
    },
}

/// A queue and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    name: String,
    max_deliveries: i32,
}

impl QueueSpec {
    /// The queue `name` (and `name.dlq`), allowing 5 deliveries by default.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            max_deliveries: 5,
        }
    }

    /// How many times a message may be delivered before it is dead-lettered.
    pub fn max_deliveries(mut self, n: i32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.name)
    }

    /// Declares the dead-letter queue and the quorum queue that feeds it.
    pub async fn declare(&self, channel: &Channel) -> Result<(), RabbitError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut dlq_args = FieldTable::default();
        dlq_args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
        channel
            .queue_declare(self.dead_letter_queue().into(), durable, dlq_args)
            .await?;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
        // RabbitMQ counts deliveries: past the limit it dead-letters the message.
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongInt(self.max_deliveries - 1),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from("")),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(self.dead_letter_queue())),
        );
        channel
            .queue_declare(self.name.clone().into(), durable, args)
            .await?;
        Ok(())
    }
}

/// Publishes outbox messages with publisher confirms; see the crate-level docs.
///
/// A channel the broker closed (a message over its `max_message_size`, a
/// broker restart) or a lost connection is opened again before the next
/// batch (and within a batch, while the message a channel was closed over
/// is told apart from the rest): the relay's next round publishes again by
/// itself.
#[derive(Debug)]
pub struct RabbitPublisher {
    uri: String,
    /// The connection and channel publishing now; held for a whole batch
    /// (one batch at a time, its confirms in order).
    link: Mutex<Link>,
    /// The channel publishing now, for [`RabbitPublisher::channel`].
    current: std::sync::Mutex<Channel>,
    /// The largest payload sent; a larger message is refused for itself.
    max_payload: usize,
    /// How long a batch may spend telling apart the message a channel was
    /// closed over.
    isolate_within: Duration,
}

/// A connection and its publishing channel, confirms on.
#[derive(Debug)]
struct Link {
    connection: Connection,
    channel: Channel,
}

impl Link {
    /// A new connection to `uri`, and its channel.
    async fn open(uri: &str) -> Result<Self, RabbitError> {
        let connection = Connection::connect(uri, ConnectionProperties::default()).await?;
        let channel = confirming(&connection).await?;
        Ok(Self {
            connection,
            channel,
        })
    }

    /// A new channel, on this connection if it still works, else on a new
    /// connection to `uri`.
    async fn reopen(&mut self, uri: &str) -> Result<(), RabbitError> {
        if self.connection.status().connected() {
            self.channel = confirming(&self.connection).await?;
        } else {
            *self = Self::open(uri).await?;
        }
        Ok(())
    }
}

/// A channel on `connection` with publisher confirms on.
async fn confirming(connection: &Connection) -> Result<Channel, RabbitError> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl RabbitPublisher {
    /// Connects and turns publisher confirms on.
    pub async fn connect(uri: &str) -> Result<Self, RabbitError> {
        let link = Link::open(uri).await?;
        Ok(Self {
            uri: uri.to_owned(),
            current: std::sync::Mutex::new(link.channel.clone()),
            link: Mutex::new(link),
            max_payload: DEFAULT_MAX_PAYLOAD,
            isolate_within: DEFAULT_ISOLATE_WITHIN,
        })
    }

    /// The largest payload published (default [`DEFAULT_MAX_PAYLOAD`]): set
    /// it to the broker's `max_message_size`. A larger message is refused
    /// for itself (and dead-lettered in the end) rather than sent to close
    /// the channel under the rest of its batch.
    #[must_use]
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// How long a batch may spend sending again the messages whose confirms
    /// failed with a channel the broker closed over one of them, to find
    /// which (default [`DEFAULT_ISOLATE_WITHIN`]): past it, those not yet
    /// told apart are answered as for a broker down (using up no attempt)
    /// and go out in the relay's next round. Keep it well below the relay's
    /// wait for a batch (half its lease), which otherwise gives up on the
    /// whole batch, the messages confirmed included.
    #[must_use]
    pub fn isolate_within(mut self, within: Duration) -> Self {
        self.isolate_within = within;
        self
    }

    /// The publishing channel now (to declare queues, say).
    pub fn channel(&self) -> Channel {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The link, opened again first if its channel was closed.
    async fn usable(&self) -> Result<tokio::sync::MutexGuard<'_, Link>, RabbitError> {
        let mut link = self.link.lock().await;
        self.reopen_if_closed(&mut link).await?;
        Ok(link)
    }

    /// Opens `link`'s channel again if it was closed.
    async fn reopen_if_closed(&self, link: &mut Link) -> Result<(), RabbitError> {
        if !link.channel.status().connected() {
            link.reopen(&self.uri).await?;
            *self.current.lock().unwrap_or_else(|e| e.into_inner()) = link.channel.clone();
            info!("publishing channel opened again");
        }
        Ok(())
    }
}

/// The most a message's headers may take, names and values together: a
/// message's properties go in one content-header frame, which must fit the
/// connection's `frame_max` (RabbitMQ's default 128 KiB). Larger, the
/// broker closes the whole connection (a frame error), which the relay
/// took for the broker down: the message was never dead-lettered, and
/// each round cut its batch's connection.
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Why `m` cannot go over AMQP, whose message id, routing key and header
/// names are short strings (at most 255 bytes), and whose headers must fit
/// one frame ([`MAX_HEADERS_BYTES`]).
fn unsendable(m: &OutgoingMessage, max_payload: usize) -> Option<String> {
    let long = |what: &str, s: &str| {
        (s.len() > MAX_SHORT_STRING).then(|| {
            format!(
                "{what} is {} bytes; AMQP allows {MAX_SHORT_STRING}",
                s.len()
            )
        })
    };
    let payload = (m.payload.len() > max_payload).then(|| {
        format!(
            "the payload is {} bytes; the broker takes {max_payload} (max_message_size)",
            m.payload.len()
        )
    });
    // Each entry: its name's length byte, the name, a type byte, the
    // value's four length bytes and the value.
    let headers: usize = m
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.len() + 6)
        .fold(0, usize::saturating_add);
    let headers = (headers > MAX_HEADERS_BYTES).then(|| {
        format!("the headers take {headers} bytes; at most {MAX_HEADERS_BYTES} fit one AMQP frame")
    });
    long("the message id", &m.message_id)
        .or_else(|| long("the destination", &m.destination))
        .or_else(|| m.headers.iter().find_map(|(k, _)| long("a header name", k)))
        .or(headers)
        .or(payload)
}

/// What a failed confirm means to the relay: the broker closing the channel
/// over the message itself (a precondition failed, the content too large:
/// over its `max_message_size`) is a refusal, which uses up an attempt and
/// ends in the dead-letter state; anything else (the connection lost) is
/// the broker down, and waited out.
fn confirm_failure(e: &lapin::Error) -> PublishErrorKind {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(
                AMQPSoftError::PRECONDITIONFAILED | AMQPSoftError::CONTENTTOOLARGE,
            ) => PublishErrorKind::Rejected,
            _ => PublishErrorKind::BrokerDown,
        },
        _ => PublishErrorKind::BrokerDown,
    }
}

/// The largest payload sent by default: RabbitMQ 4's default
/// `max_message_size` (16 MiB); a larger one would close the channel.
pub const DEFAULT_MAX_PAYLOAD: usize = 16 << 20;

/// The longest AMQP short string, in bytes.
const MAX_SHORT_STRING: usize = 255;

fn properties(m: &OutgoingMessage) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (k, v) in &m.headers {
        headers.insert(
            k.clone().into(),
            AMQPValue::LongString(LongString::from(v.clone())),
        );
    }
    BasicProperties::default()
        .with_message_id(ShortString::from(m.message_id.clone()))
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// What one message's sending came to, before the batch's outcome is
/// decided: a confirm that failed because the broker closed the channel
/// over a message (`Rejected` kind) is kept apart, since it may be another
/// message's refusal.
enum Sent {
    /// The message's outcome, known.
    Done(Result<(), PublishError>),
    /// Its confirm failed with the channel, closed over a message.
    ChannelRefused(lapin::Error),
    /// It was not sent: the channel failed (or was closing) as it was
    /// published.
    Unsent(lapin::Error),
}

/// The outcome of one message's confirm (or of its publish failing).
fn sent(m: &OutgoingMessage, confirm: Result<Confirmation, lapin::Error>) -> Sent {
    Sent::Done(match confirm {
        Ok(Confirmation::Ack(None)) => Ok(()),
        // Acked, but returned first: no queue is bound to the destination,
        // so nobody will ever read it.
        Ok(Confirmation::Ack(Some(returned))) => Err(PublishError::new(
            PublishErrorKind::Rejected,
            format!(
                "unroutable: no queue receives messages for {:?} (the broker returned it: {} {})",
                m.destination, returned.reply_code, returned.reply_text
            ),
        )),
        Ok(other) => Err(PublishError::new(
            PublishErrorKind::Rejected,
            format!("the broker did not ack: {other:?}"),
        )),
        Err(e) => match confirm_failure(&e) {
            PublishErrorKind::Rejected => return Sent::ChannelRefused(e),
            kind => Err(PublishError::new(kind, e.to_string())),
        },
    })
}

impl RabbitPublisher {
    /// Sends `m` on the link's channel; the confirm to wait for.
    async fn send(
        &self,
        link: &Link,
        m: &OutgoingMessage,
    ) -> Result<lapin::PublisherConfirm, lapin::Error> {
        link.channel
            .basic_publish(
                "".into(),
                m.destination.clone().into(),
                // Mandatory: a message no queue receives comes back
                // (basic.return) instead of being confirmed and dropped.
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &m.payload,
                properties(m),
            )
            .await
    }

    /// Sends the messages of `batch` at `which` on the link's channel
    /// (opened again first if a message closed it), all of them before
    /// any confirm is awaited, then waits for their confirms: one round of
    /// confirms, in `which`'s order.
    async fn send_all(
        &self,
        link: &mut Link,
        batch: &[OutgoingMessage],
        which: &[usize],
    ) -> Vec<Sent> {
        if let Err(e) = self.reopen_if_closed(link).await {
            return which
                .iter()
                .map(|_| {
                    Sent::Done(Err(PublishError::new(
                        PublishErrorKind::BrokerDown,
                        format!("cannot open a channel: {e}"),
                    )))
                })
                .collect();
        }
        let mut pending = Vec::with_capacity(which.len());
        for &i in which {
            let m = &batch[i];
            // Refused here rather than panicking in the AMQP library: one
            // such row must not stop the relay.
            if let Some(why) = unsendable(m, self.max_payload) {
                pending.push(Err(PublishError::new(PublishErrorKind::Rejected, why)));
                continue;
            }
            pending.push(Ok(self.send(link, m).await));
        }
        let mut outcomes = Vec::with_capacity(which.len());
        for (&i, sent_now) in which.iter().zip(pending) {
            outcomes.push(match sent_now {
                Err(refused) => Sent::Done(Err(refused)),
                Ok(Ok(confirm)) => sent(&batch[i], confirm.await),
                Ok(Err(e)) => Sent::Unsent(e),
            });
        }
        outcomes
    }
}

/// The default [`RabbitPublisher::isolate_within`]: 5 s, a third of the
/// relay's default wait for a batch (half its 30 s lease).
pub const DEFAULT_ISOLATE_WITHIN: Duration = Duration::from_secs(5);

impl Publisher for RabbitPublisher {
    /// Publishes the whole batch, then waits for every confirm: one round of
    /// confirms per batch, not per message.
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
        Box::pin(async move {
            let mut published = Published::default();
            // One batch at a time, on a channel that works.
            let mut link = match self.usable().await {
                Ok(link) => link,
                Err(e) => {
                    for m in batch {
                        published.record(
                            &m.message_id,
                            Err(PublishError::new(
                                PublishErrorKind::BrokerDown,
                                format!("cannot open a channel: {e}"),
                            )),
                        );
                    }
                    return published;
                }
            };
            // The broker closes the channel over one message (a precondition
            // failed, the content too large), and every confirm still
            // pending on it fails the same way: the messages behind it, and
            // those before it whose confirms had not come yet (a durable
            // queue confirms once the message is on disk); the messages
            // still being published then are not sent at all. Which one the
            // broker refused is not said. Of the confirms failed so, one is
            // that message's own; of several, each half is sent again (as a
            // batch, its confirms awaited together), and so on until each
            // failure stands alone; those not sent are sent again too. The
            // refusal (which uses up an attempt, and dead-letters in the
            // end) is charged to a message that closes a channel by itself,
            // never to one that was only waiting beside it. One culprit
            // among n takes about 2 log2(n) rounds.
            let mut groups: Vec<Vec<usize>> = vec![(0..batch.len()).collect()];
            let deadline = tokio::time::Instant::now() + self.isolate_within;
            let mut first = true;
            let late = |published: &mut Published, group: Vec<usize>| {
                for i in group {
                    published.record(
                        &batch[i].message_id,
                        Err(PublishError::new(
                            PublishErrorKind::BrokerDown,
                            "not told apart in time from a message the channel was closed over: sent again next round",
                        )),
                    );
                }
            };
            while let Some(group) = groups.pop() {
                // The first round is the batch's own, bounded by the
                // relay's wait; those after it, by the deadline.
                let outcomes = if first {
                    first = false;
                    self.send_all(&mut link, batch, &group).await
                } else if tokio::time::Instant::now() >= deadline {
                    late(&mut published, group);
                    continue;
                } else {
                    match tokio::time::timeout_at(deadline, self.send_all(&mut link, batch, &group))
                        .await
                    {
                        Ok(outcomes) => outcomes,
                        Err(_) => {
                            late(&mut published, group);
                            continue;
                        }
                    }
                };
                let (refused, not_sent) = settle(batch, &group, outcomes, &mut published);
                match refused.as_slice() {
                    [] => {
                        // No channel closed over a message: what was not
                        // sent waits for the next round (the broker away).
                        for (i, e) in not_sent {
                            published.record(
                                &batch[i].message_id,
                                Err(PublishError::new(
                                    PublishErrorKind::BrokerDown,
                                    e.to_string(),
                                )),
                            );
                        }
                        continue;
                    }
                    [(i, e)] => published.record(
                        &batch[*i].message_id,
                        Err(PublishError::new(PublishErrorKind::Rejected, e.to_string())),
                    ),
                    several => {
                        let (front, back) = several.split_at(several.len() / 2);
                        for half in [back, front] {
                            groups.push(half.iter().map(|(i, _)| *i).collect());
                        }
                    }
                }
                if !not_sent.is_empty() {
                    groups.push(not_sent.into_iter().map(|(i, _)| i).collect());
                }
            }
            published
        })
    }
}

/// The messages of a round still to be settled, with their errors.
type Unsettled = Vec<(usize, lapin::Error)>;

/// Records in `published` the outcomes of `which` that are known, and
/// returns those whose confirms failed with a channel closed over a message
/// (still to be told apart), and those not sent.
fn settle(
    batch: &[OutgoingMessage],
    which: &[usize],
    outcomes: Vec<Sent>,
    published: &mut Published,
) -> (Unsettled, Unsettled) {
    let (mut refused, mut not_sent) = (Vec::new(), Vec::new());
    for (&i, outcome) in which.iter().zip(outcomes) {
        match outcome {
            Sent::Done(result) => published.record(&batch[i].message_id, result),
            Sent::ChannelRefused(e) => refused.push((i, e)),
            Sent::Unsent(e) => not_sent.push((i, e)),
        }
    }
    (refused, not_sent)
}

/// The text-valued entries of an AMQP header table.
fn text_headers(table: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(table) = table else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .filter_map(|(k, v)| match v {
            AMQPValue::LongString(s) => Some((
                k.as_str().to_owned(),
                String::from_utf8_lossy(s.as_bytes()).into_owned(),
            )),
            AMQPValue::ShortString(s) => Some((k.as_str().to_owned(), s.as_str().to_owned())),
            _ => None,
        })
        .collect()
}

impl Consumer for RabbitConsumer {
    /// Runs `handler` on each delivery until `stop` turns true: `Ok` acks,
    /// `Err` requeues (the queue dead-letters it past its delivery limit).
    /// A delivery in progress when `stop` flips finishes and is acked first;
    /// nothing is acked before its handler succeeded.
    fn consume(
        self: Box<Self>,
        handler: Handler,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, Result<(), ConsumeError>> {
        Box::pin(async move { self.deliver(handler, stop).await.map_err(Into::into) })
    }
}

/// Consumes a queue with manual acks; see the crate-level docs.
#[derive(Debug)]
pub struct RabbitConsumer {
    _connection: Connection,
    channel: Channel,
    spec: QueueSpec,
    concurrency: NonZeroUsize,
    retry_delay: Duration,
}

/// How long a delivery whose handler failed is held before it goes back:
/// `first`, doubling with each failure before it (the quorum queue's
/// `x-delivery-count`), at most 30 s.
fn backoff(first: Duration, failed_before: u32) -> Duration {
    first
        .saturating_mul(1 << failed_before.min(16))
        .min(Duration::from_secs(30))
}

/// How often a quorum queue's message was returned before
/// (`x-delivery-count`; absent on its first delivery).
fn delivery_count(headers: Option<&FieldTable>) -> u32 {
    let value = headers.and_then(|h| {
        h.inner()
            .iter()
            .find(|(k, _)| k.as_str() == "x-delivery-count")
            .map(|(_, v)| v)
    });
    let n: i128 = match value {
        Some(AMQPValue::LongLongInt(n)) => (*n).into(),
        Some(AMQPValue::LongInt(n)) => (*n).into(),
        Some(AMQPValue::LongUInt(n)) => (*n).into(),
        Some(AMQPValue::ShortInt(n)) => (*n).into(),
        Some(AMQPValue::ShortUInt(n)) => (*n).into(),
        Some(AMQPValue::ShortShortInt(n)) => (*n).into(),
        Some(AMQPValue::ShortShortUInt(n)) => (*n).into(),
        _ => 0,
    };
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

impl RabbitConsumer {
    /// Connects, declares the queues, and sets the prefetch window.
    ///
    /// Keep the window near the [`concurrency`](Self::concurrency):
    /// deliveries the broker sent that no handler took yet go back to the
    /// queue when the consumer stops (a deploy, a reconnect), and a quorum
    /// queue counts such a return as a delivery (before RabbitMQ 4.3 every
    /// return, from 4.3 a channel closed), so a window far above the
    /// concurrency spends the delivery limit of messages that never ran on
    /// every stop. `shop` sets it to its concurrency.
    pub async fn connect(uri: &str, spec: QueueSpec, prefetch: u16) -> Result<Self, RabbitError> {
        let connection = Connection::connect(uri, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        spec.declare(&channel).await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        Ok(Self {
            _connection: connection,
            channel,
            spec,
            concurrency: NonZeroUsize::MIN,
            retry_delay: Duration::from_secs(1),
        })
    }

    /// How long a delivery whose handler failed is held before it is
    /// returned to the queue (default 1 s), doubling with each failure
    /// before it, at most 30 s: with the queue's 5 deliveries, a database
    /// away for 15 s dead-letters nothing. The wait holds one of the
    /// consumer's handlers.
    pub fn retry_delay(mut self, first: Duration) -> Self {
        self.retry_delay = first;
        self
    }

    /// Handles up to `n` deliveries at once (default 1: one at a time, in
    /// the queue's order); see [`InFlight`]. The broker hands over at most
    /// the prefetch window unacknowledged, so a concurrency above it waits
    /// on the broker.
    pub fn concurrency(mut self, n: NonZeroUsize) -> Self {
        self.concurrency = n;
        self
    }

    /// What [`Consumer::consume`] runs.
    async fn deliver(
        self,
        handler: Handler,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), RabbitError> {
        let mut consumer = self
            .channel
            .basic_consume(
                self.spec.name.clone().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        info!(queue = %self.spec.name, concurrency = self.concurrency.get(), "consumer started");
        let mut in_flight = InFlight::<RabbitError>::new(self.concurrency);
        loop {
            in_flight.ready().await?;
            let next = std::future::poll_fn(|cx| match Pin::new(&mut consumer).poll_next(cx) {
                Poll::Ready(item) => Poll::Ready(item),
                Poll::Pending => Poll::Pending,
            });
            let (delivery, stopping) = tokio::select! {
                d = next => (d, false),
                _ = stop.changed() => (None, true),
            };
            let Some(delivery) = delivery else {
                // what is in progress settles first
                let settled = in_flight.drain().await;
                if !stopping {
                    // The stream ended without a stop: the broker ended the
                    // consumer (lapin ends it on a `basic.cancel`).
                    warn!(queue = %self.spec.name, "the broker cancelled the consumer");
                    settled?;
                    return Err(RabbitError::Cancelled {
                        queue: self.spec.name.clone(),
                    });
                }
                info!(queue = %self.spec.name, "consumer stopped");
                return settled;
            };
            let delivery = match delivery {
                Ok(delivery) => delivery,
                // the transport failed: what is in progress settles first
                Err(e) => return in_flight.fail(e.into()).await,
            };
            let incoming = Delivery {
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.as_str().to_owned()),
                payload: delivery.data.clone().into(),
                redelivered: delivery.redelivered,
                headers: text_headers(delivery.properties.headers().as_ref()),
            };
            let (handler, queue) = (handler.clone(), self.spec.name.clone());
            let failed_before = delivery_count(delivery.properties.headers().as_ref());
            let (retry_delay, mut stopping) = (self.retry_delay, stop.clone());
            let channel = self.channel.clone();
            in_flight.spawn(async move {
                match handler(incoming).await {
                    Ok(()) => {
                        delivery.acker.ack(BasicAckOptions::default()).await?;
                    }
                    Err(e) => {
                        // Held a while before it goes back, longer each time
                        // (the broker would hand it over again at once): a
                        // database restarting for a few seconds does not use
                        // up its deliveries in milliseconds. A stop cuts the
                        // wait short.
                        let wait = backoff(retry_delay, failed_before);
                        warn!(%queue, error = %e, ?wait, "handler failed; requeueing after a wait");
                        // A channel that closed meanwhile has returned the
                        // delivery already: the consumer can end (and be
                        // opened again) without waiting for the hold.
                        let closed = async {
                            while channel.status().connected() {
                                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                            }
                        };
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            _ = stopping.wait_for(|stop| *stop) => {}
                            () = closed => {}
                        }
                        // `basic.reject`, not `basic.nack`: from RabbitMQ
                        // 4.3 only a reject counts as a failed delivery
                        // (`x-delivery-count`, what `x-delivery-limit`
                        // dead-letters by); a nack is a return that counts
                        // nothing, and a poison message would cycle for
                        // ever. Older servers count both alike.
                        delivery
                            .acker
                            .reject(BasicRejectOptions { requeue: true })
                            .await?;
                    }
                }
                debug!(%queue, "delivery settled");
                Ok(())
            });
        }
    }
}
