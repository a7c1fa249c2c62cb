//! NATS JetStream for idem's outbox and inbox (async-nats).
//!
//! - [`NatsPublisher`]: an outbox [`Publisher`]; every message carries
//!   `Nats-Msg-Id`, so JetStream's own duplicate window drops a republish
//!   inside it, and counts as published only once JetStream acked it.
//! - [`NatsConsumer`]: a durable pull consumer with explicit acks. A handler
//!   error naks with a delay; past `max_deliveries` the message is copied to
//!   the dead-letter subject `<subject>.dlq` and terminated, so a poison
//!   message never blocks the ones behind it. The consumer counts the
//!   deliveries, not the server (which would drop a message whose last
//!   delivery never settled, with no copy). Pair the handler with the
//!   inbox so that redeliveries act once.
//!
//! ```no_run
//! use idem_nats::{NatsConsumer, NatsPublisher, StreamSpec};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let spec = StreamSpec::new("ORDERS", "orders");
//! let publisher = NatsPublisher::connect("nats://127.0.0.1:4222", &spec).await?;
//! let consumer = NatsConsumer::connect("nats://127.0.0.1:4222", &spec, "reserve-stock", 5).await?;
//! # let _ = (publisher, consumer); Ok(()) }
//! ```

use std::num::NonZeroUsize;
use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{pull, AckPolicy, DeliverPolicy},
    AckKind,
};
use futures_core::Stream;
use idem_core::BoxFuture;
use idem_outbox::consumer::{ConsumeError, Consumer, Delivery, Handler, InFlight};
use idem_outbox::outbox::{OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher};
use tokio::sync::watch;
use tracing::{info, warn};

/// The error a NATS client call failed with, whatever the call.
pub type Source = Box<dyn std::error::Error + Send + Sync>;

/// A NATS failure, by what was being done; each keeps the client's error
/// as its [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The server could not be reached (or refused the connection).
    #[error("NATS: cannot connect to {url}")]
    Connect {
        /// The URL tried.
        url: String,
        /// Why.
        #[source]
        source: Source,
    },
    /// The stream could not be created or read.
    #[error("NATS: stream {stream:?} could not be declared")]
    Stream {
        /// The stream.
        stream: String,
        /// Why.
        #[source]
        source: Source,
    },
    /// The durable consumer could not be created or read.
    #[error("NATS: consumer {durable:?} could not be created")]
    Consumer {
        /// The durable consumer's name.
        durable: String,
        /// Why.
        #[source]
        source: Source,
    },
    /// Pulling the next message failed.
    #[error("NATS: the message stream of {subject:?} failed")]
    Messages {
        /// The subject consumed.
        subject: String,
        /// Why.
        #[source]
        source: Source,
    },
    /// Acknowledging (ack, nak or term) a message failed; JetStream will
    /// deliver it again after the ack wait.
    #[error("NATS: a message could not be acknowledged")]
    Ack(#[source] Source),
    /// Copying a message to the dead-letter subject failed. (The consumer
    /// logs it and goes on: the message was not terminated, and comes
    /// again.)
    #[error("NATS: a message could not be dead-lettered to {subject:?}")]
    DeadLetter {
        /// The dead-letter subject.
        subject: String,
        /// Why.
        #[source]
        source: Source,
    },
}

/// A JetStream stream over a subject, and its dead-letter subject.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    stream: String,
    subject: String,
    duplicate_window: Duration,
    replay_horizon: Duration,
}

/// How far back a durable consumer made anew starts by default: the
/// inbox's retention, less an hour for clocks that differ.
pub const DEFAULT_REPLAY_HORIZON: Duration =
    Duration::from_secs(idem_outbox::inbox::DEFAULT_RETENTION.as_secs() - 3600);

impl StreamSpec {
    /// Stream `stream` capturing `subject` and `subject.dlq`, with a
    /// two-minute duplicate window, whose consumers made anew start
    /// [`DEFAULT_REPLAY_HORIZON`] back.
    pub fn new(stream: impl Into<String>, subject: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            subject: subject.into(),
            duplicate_window: Duration::from_secs(120),
            replay_horizon: DEFAULT_REPLAY_HORIZON,
        }
    }

    /// How far back a durable consumer starts when it is made (the first
    /// time, or again after it was deleted): keep it below the retention
    /// of the inbox its handler writes to. A consumer made again reads the
    /// stream from there, not from its start: a message older than the
    /// inbox remembers would otherwise act a second time. (Messages older
    /// than it that this consumer never handled are not delivered to it.)
    pub fn replay_horizon(mut self, horizon: Duration) -> Self {
        self.replay_horizon = horizon;
        self
    }

    /// Where a durable consumer made now starts: [`replay_horizon`]
    /// back (the start of the stream if that time cannot be written).
    ///
    /// [`replay_horizon`]: Self::replay_horizon
    fn fresh_start(&self) -> DeliverPolicy {
        let back = std::time::SystemTime::now()
            .checked_sub(self.replay_horizon)
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .and_then(|t| i128::try_from(t.as_nanos()).ok())
            .and_then(|nanos| async_nats::datetime::from_nanos(nanos).ok());
        match back {
            Some(start_time) => DeliverPolicy::ByStartTime { start_time },
            None => DeliverPolicy::All,
        }
    }

    /// The subject messages are published on.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The dead-letter subject.
    pub fn dead_letter_subject(&self) -> String {
        format!("{}.dlq", self.subject)
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// Creates the stream if it is missing.
    pub async fn declare(
        &self,
        js: &jetstream::Context,
    ) -> Result<jetstream::stream::Stream, NatsError> {
        js.get_or_create_stream(jetstream::stream::Config {
            name: self.stream.clone(),
            subjects: vec![self.subject.clone(), self.dead_letter_subject()],
            duplicate_window: self.duplicate_window,
            ..Default::default()
        })
        .await
        .map_err(|e| NatsError::Stream {
            stream: self.stream.clone(),
            source: e.into(),
        })
    }
}

/// Publishes outbox messages to JetStream; see the crate-level docs.
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    js: jetstream::Context,
}

impl NatsPublisher {
    /// Connects and makes sure the stream exists.
    pub async fn connect(url: &str, spec: &StreamSpec) -> Result<Self, NatsError> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| NatsError::Connect {
                url: url.to_owned(),
                source: e.into(),
            })?;
        let js = jetstream::new(client);
        spec.declare(&js).await?;
        Ok(Self { js })
    }

    /// The JetStream context.
    pub fn context(&self) -> &jetstream::Context {
        &self.js
    }
}

/// What a failed send means to the relay: a message the server will never
/// take (over its `max_payload`, an invalid subject) is the broker's
/// refusal, which uses up an attempt; a full ack window or a time-out is
/// the broker down, waited out.
fn send_failure(kind: jetstream::context::PublishErrorKind) -> PublishErrorKind {
    use jetstream::context::PublishErrorKind as Nats;
    match kind {
        Nats::TimedOut | Nats::BrokenPipe | Nats::MaxAckPending => PublishErrorKind::BrokerDown,
        _ => PublishErrorKind::Rejected,
    }
}

/// What a failed acknowledgement means: none in time, the connection lost,
/// no responders or a 503 is the broker down (it may have stored the
/// message; sent again, the duplicate window drops it); any other error
/// JetStream answered (a stream limit, a message too large for the stream)
/// is a refusal.
fn ack_failure(e: &jetstream::context::PublishError) -> PublishErrorKind {
    use jetstream::context::PublishErrorKind as Nats;
    match e.kind() {
        // No responders: no stream captures the subject, or JetStream is not
        // up yet (a server restarting, a stream electing its leader): the
        // latter is an outage, and a subject that no stream captures is
        // waited for too, never dead-lettered for it.
        Nats::TimedOut | Nats::BrokenPipe | Nats::StreamNotFound => PublishErrorKind::BrokerDown,
        // JetStream answered 503 (no quorum, not ready): an outage too.
        Nats::Other if answered_unavailable(e) => PublishErrorKind::BrokerDown,
        _ => PublishErrorKind::Rejected,
    }
}

/// Whether JetStream's own answer was "unavailable" (status 503: a cluster
/// without quorum, a stream without a leader, JetStream not ready).
fn answered_unavailable(e: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some_and(|api| api.code() == 503)
}

/// Why `m` cannot go over NATS: a header name must be visible ASCII
/// without `:`, a header value (the message id is one, `Nats-Msg-Id`) must
/// hold no line break.
fn unsendable(m: &OutgoingMessage) -> Option<String> {
    let broken = |s: &str| s.contains(['\r', '\n']);
    if broken(&m.message_id) {
        return Some("the message id holds a line break, which NATS headers cannot".to_owned());
    }
    m.headers.iter().find_map(|(k, v)| {
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
            Some(format!(
                "header name {k:?} is not visible ASCII without `:`, as NATS requires"
            ))
        } else if broken(v) {
            Some(format!(
                "header {k:?} holds a line break, which NATS headers cannot"
            ))
        } else {
            None
        }
    })
}

/// How many publishes a batch keeps waiting for their acks at once.
/// async-nats lets a context wait for at most 5,000 acks (its
/// `max_ack_inflight`): a send past that waits for an ack to be taken,
/// which a batch that sends everything before it takes any never does.
/// Well below it, so that publishers sharing one context fit too.
const ACKS_AT_ONCE: usize = 1_000;

impl Publisher for NatsPublisher {
    /// Sends the batch a thousand messages at a time, each thousand's acks
    /// waited for before the next is sent.
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
        Box::pin(async move {
            let mut published = Published::default();
            for chunk in batch.chunks(ACKS_AT_ONCE) {
                self.publish_chunk(chunk, &mut published).await;
            }
            published
        })
    }
}

impl NatsPublisher {
    /// Sends `chunk` whole, then waits for every ack, recording each.
    async fn publish_chunk(&self, chunk: &[OutgoingMessage], published: &mut Published) {
        let mut pending = Vec::with_capacity(chunk.len());
        for m in chunk {
            // Refused here rather than panicking in the NATS client: one
            // such row must not stop the relay.
            if let Some(why) = unsendable(m) {
                pending.push(Err(PublishError::new(PublishErrorKind::Rejected, why)));
                continue;
            }
            let mut message = jetstream::message::PublishMessage::build()
                .message_id(&m.message_id)
                .payload(m.payload.clone());
            for (k, v) in &m.headers {
                message = message.header(k.as_str(), v.as_str());
            }
            pending.push(Ok(self
                .js
                .send_publish(m.destination.clone(), message)
                .await));
        }
        for (m, sent) in chunk.iter().zip(pending) {
            published.record(
                &m.message_id,
                match sent {
                    Err(refused) => Err(refused),
                    Ok(Ok(ack)) => ack
                        .await
                        .map(drop)
                        .map_err(|e| PublishError::new(ack_failure(&e), e.to_string())),
                    Ok(Err(e)) => Err(PublishError::new(send_failure(e.kind()), e.to_string())),
                },
            );
        }
    }
}

impl Consumer for NatsConsumer {
    /// Runs `handler` on each message until `stop` turns true: `Ok` acks;
    /// `Err` naks with the retry delay, or, on the last allowed delivery,
    /// copies the message (headers included) to the dead-letter subject and
    /// terminates it. A message in progress when `stop` flips finishes and
    /// is acked first.
    fn consume(
        self: Box<Self>,
        handler: Handler,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, Result<(), ConsumeError>> {
        Box::pin(async move { self.deliver(handler, stop).await.map_err(Into::into) })
    }
}

/// The header a dead-letter copy names its message's own id in (its
/// `Nats-Msg-Id` is that id with `.dlq` after it, which JetStream's
/// duplicate window tells apart from the message's): what an operator
/// sends it again under, so the inboxes know it.
pub const ORIGINAL_MSG_ID: &str = "Idem-Original-Msg-Id";

/// Copies `incoming` (its headers but the message id, which gets a
/// `.dlq` suffix and is kept in [`ORIGINAL_MSG_ID`]) to `subject`,
/// acknowledged by JetStream.
async fn dead_letter(
    js: &jetstream::Context,
    subject: &str,
    incoming: &Delivery,
) -> Result<(), NatsError> {
    let mut copy = jetstream::message::PublishMessage::build().payload(incoming.payload.clone());
    if let Some(id) = &incoming.message_id {
        copy = copy
            .message_id(format!("{id}.dlq"))
            .header(ORIGINAL_MSG_ID, id.as_str());
    }
    for (name, value) in &incoming.headers {
        if !name.eq_ignore_ascii_case("Nats-Msg-Id") && !name.eq_ignore_ascii_case(ORIGINAL_MSG_ID)
        {
            copy = copy.header(name.as_str(), value.as_str());
        }
    }
    let failed = |e: Source| NatsError::DeadLetter {
        subject: subject.to_owned(),
        source: e,
    };
    js.send_publish(subject.to_owned(), copy)
        .await
        .map_err(|e| failed(e.into()))?
        .await
        .map_err(|e| failed(e.into()))?;
    Ok(())
}

/// How long a consumer waits after a failed pull before it pulls again.
const PULL_AGAIN_AFTER: Duration = Duration::from_millis(250);

/// Whether a consumer's messages ended for good: the consumer was deleted,
/// or is not one that can be pulled from as configured.
fn is_fatal(kind: pull::MessagesErrorKind) -> bool {
    matches!(
        kind,
        pull::MessagesErrorKind::ConsumerDeleted
            | pull::MessagesErrorKind::PushBasedConsumer
            | pull::MessagesErrorKind::RequestLimitExceeded
    )
}

/// A durable pull consumer; see the crate-level docs.
#[derive(Debug)]
pub struct NatsConsumer {
    js: jetstream::Context,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    spec: StreamSpec,
    max_deliveries: i64,
    retry_delay: Duration,
    concurrency: NonZeroUsize,
    idle_heartbeat: Duration,
}

impl NatsConsumer {
    /// Connects and creates (or reuses) the durable consumer `durable`,
    /// which redelivers a message not acked within 5 s. A message whose
    /// handler fails on its `max_deliveries`th delivery, or any later one
    /// (the last allowed one never settled: a crash, a stop), is copied to
    /// the dead-letter subject and terminated. The server itself sets no
    /// limit (an existing consumer is updated to none), so a message is
    /// never dropped without that copy. A `max_deliveries` below 1 is no
    /// limit: a failing message comes back for ever.
    pub async fn connect(
        url: &str,
        spec: &StreamSpec,
        durable: &str,
        max_deliveries: i64,
    ) -> Result<Self, NatsError> {
        Self::connect_with_ack_wait(url, spec, durable, max_deliveries, Duration::from_secs(5))
            .await
    }

    /// Like [`NatsConsumer::connect`], with the time after which an
    /// unacknowledged message is delivered again (to any instance).
    pub async fn connect_with_ack_wait(
        url: &str,
        spec: &StreamSpec,
        durable: &str,
        max_deliveries: i64,
        ack_wait: Duration,
    ) -> Result<Self, NatsError> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| NatsError::Connect {
                url: url.to_owned(),
                source: e.into(),
            })?;
        let js = jetstream::new(client);
        let stream = spec.declare(&js).await?;
        let consumer_failed = |e: Source| NatsError::Consumer {
            durable: durable.to_owned(),
            source: e,
        };
        // The server delivers without limit: this consumer counts the
        // deliveries and dead-letters past `max_deliveries` itself. A limit
        // of the server's would end a message whose last allowed delivery
        // never settled (a crash, a stop with it still buffered, a
        // dead-letter copy the server did not take) with no copy anywhere.
        // Made now (the first time, or again after someone deleted it),
        // it starts at the replay horizon: from the stream's start, it
        // would act again on every message the inbox no longer remembers.
        let config = pull::Config {
            durable_name: Some(durable.to_owned()),
            filter_subject: spec.subject.clone(),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_deliver: -1,
            deliver_policy: spec.fresh_start(),
            ..Default::default()
        };
        let mut consumer = match stream.get_or_create_consumer(durable, config.clone()).await {
            Ok(consumer) => consumer,
            // Another instance made it first (with its own start time).
            Err(e) => stream
                .get_consumer(durable)
                .await
                .map_err(|_| consumer_failed(e.into()))?,
        };
        let kept = &consumer.cached_info().config;
        if kept.max_deliver != config.max_deliver || kept.ack_wait != config.ack_wait {
            // Made by an earlier version, or with another ack wait: both
            // are fields JetStream lets an existing consumer change.
            info!(
                durable,
                "updating the durable consumer's delivery limit and ack wait"
            );
            // Every other setting (where it starts, an operator's own
            // limits) is kept as it is.
            let mut update =
                <pull::Config as jetstream::consumer::FromConsumer>::try_from_consumer_config(
                    kept.clone(),
                )
                .map_err(&consumer_failed)?;
            update.max_deliver = config.max_deliver;
            update.ack_wait = config.ack_wait;
            consumer = stream
                .create_consumer(update)
                .await
                .map_err(|e| consumer_failed(e.into()))?;
        }
        Ok(Self {
            js,
            consumer,
            spec: spec.clone(),
            max_deliveries,
            retry_delay: Duration::from_secs(1),
            concurrency: NonZeroUsize::MIN,
            idle_heartbeat: Duration::from_secs(5),
        })
    }

    /// Handles up to `n` messages at once (default 1: one at a time, in the
    /// stream's order); see [`InFlight`]. A message not acknowledged within
    /// the ack wait is delivered again, so keep `n` handlers' time under it.
    pub fn concurrency(mut self, n: NonZeroUsize) -> Self {
        self.concurrency = n;
        self
    }

    /// How often the server says it is there while no message comes
    /// (default 5 s, at most 15 s): two missed in a row and the consumer
    /// pulls again, so one that lost its server (a restart, a partition)
    /// resumes by itself once it is back.
    pub fn idle_heartbeat(mut self, every: Duration) -> Self {
        self.idle_heartbeat = every.clamp(Duration::from_millis(100), Duration::from_secs(15));
        self
    }

    /// The delay before a failed message is delivered again (default 1 s),
    /// doubling with each delivery before it, at most 30 s: with 5
    /// deliveries, a database away for 15 s dead-letters nothing.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// What [`Consumer::consume`] runs.
    async fn deliver(
        self,
        handler: Handler,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), NatsError> {
        let messages_failed = |e: Source| NatsError::Messages {
            subject: self.spec.subject.clone(),
            source: e,
        };
        // Few messages buffered ahead of the handlers: one waiting in the
        // client's buffer past the ack wait would be delivered again (and
        // its delivery count, read from the buffered copy, be stale).
        let mut messages = self
            .consumer
            .stream()
            .max_messages_per_batch(self.concurrency.get().saturating_mul(4).max(8))
            .heartbeat(self.idle_heartbeat)
            .messages()
            .await
            .map_err(|e| messages_failed(e.into()))?;
        info!(subject = %self.spec.subject, concurrency = self.concurrency.get(), "consumer started");
        let mut in_flight = InFlight::<NatsError>::new(self.concurrency);
        loop {
            in_flight.ready().await?;
            let next = std::future::poll_fn(|cx| Pin::new(&mut messages).poll_next(cx));
            let message = tokio::select! {
                m = next => m,
                _ = stop.changed() => None,
            };
            let Some(message) = message else {
                // what is in progress settles first; an ack is sent
                // without waiting for a reply, so the connection is flushed
                // before it may close with acks still in its buffer
                let settled = in_flight.drain().await;
                if let Err(e) = self.js.client().flush().await {
                    warn!(subject = %self.spec.subject, error = %e, "acks not flushed; their messages come again");
                }
                info!(subject = %self.spec.subject, "consumer stopped");
                return settled;
            };
            let message = match message {
                Ok(message) => message,
                // The consumer is gone or cannot be pulled from as it is:
                // what is in progress settles first, then the error.
                Err(e) if is_fatal(e.kind()) => {
                    return in_flight.fail(messages_failed(e.into())).await
                }
                // A missed heartbeat, a pull that failed, no responders
                // (the server restarting): the client pulls again by
                // itself, and the messages come as soon as it can.
                Err(e) => {
                    warn!(subject = %self.spec.subject, error = %e, "pulling messages failed; pulling again");
                    tokio::time::sleep(PULL_AGAIN_AFTER).await;
                    continue;
                }
            };
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
            let incoming = Delivery {
                message_id: message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned()),
                payload: message.payload.clone(),
                redelivered: delivered > 1,
                headers: message
                    .headers
                    .as_ref()
                    .map(|h| {
                        h.iter()
                            .filter_map(|(k, vs)| {
                                vs.first().map(|v| (k.to_string(), v.as_str().to_owned()))
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            };
            let (handler, js, dead_letter_subject) = (
                handler.clone(),
                self.js.clone(),
                self.spec.dead_letter_subject(),
            );
            let (max_deliveries, retry_delay) = (self.max_deliveries, self.retry_delay);
            in_flight.spawn(async move {
                // Later each time: a database restarting for a few seconds
                // does not use up the deliveries at once.
                let wait = retry_delay
                    .saturating_mul(1 << (delivered - 1).clamp(0, 16))
                    .min(Duration::from_secs(30));
                // (A limit below 1 is none: never dead-lettered.) Past the
                // limit, a delivery whose last one never settled (a crash,
                // a stop, a dead-letter copy that failed) runs once more:
                // done since, it is a duplicate the inbox acks.
                let last = max_deliveries >= 1 && delivered >= max_deliveries;
                match handler(incoming.clone()).await {
                    Ok(()) => return message.ack().await.map_err(NatsError::Ack),
                    Err(e) if last => {
                        warn!(error = %e, delivered, "handler failed for the last time; dead-lettering");
                    }
                    Err(e) => {
                        warn!(error = %e, delivered, ?wait, "handler failed; retrying later");
                        return message
                            .ack_with(AckKind::Nak(Some(wait)))
                            .await
                            .map_err(NatsError::Ack);
                    }
                }
                match dead_letter(&js, &dead_letter_subject, &incoming).await {
                    Ok(()) => message.ack_with(AckKind::Term).await.map_err(NatsError::Ack),
                    Err(e) => {
                        // Not terminated: the server delivers it again (it
                        // sets no limit), and the copy is tried again then.
                        warn!(error = %e, ?wait, "the dead-letter copy failed; the message comes back");
                        message
                            .ack_with(AckKind::Nak(Some(wait)))
                            .await
                            .map_err(NatsError::Ack)
                    }
                }
            });
        }
    }
}
