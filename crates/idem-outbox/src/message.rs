//! What travels: [`OutgoingMessage`], and what a [`Publisher`] says of it
//! ([`Published`], [`PublishError`]).

use std::collections::HashMap;

use bytes::Bytes;
use idem_core::BoxFuture;

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The id consumers deduplicate on; sent to the broker as its message id.
    pub message_id: String,
    /// Where it goes (a RabbitMQ routing key, a NATS subject, a queue name).
    pub destination: String,
    /// Messages with the same key are published in enqueue order, one at a
    /// time; `None`: no ordering.
    pub ordering_key: Option<String>,
    /// The body.
    pub payload: Bytes,
    /// Headers carried to the broker.
    pub headers: Vec<(String, String)>,
}

impl OutgoingMessage {
    /// A message with id `message_id` (what consumers deduplicate on: make
    /// it follow from the business write, e.g. `order-42-placed`, never
    /// random per attempt) to `destination`, unordered, without headers.
    pub fn new(
        message_id: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        Self {
            message_id: message_id.into(),
            destination: destination.into(),
            ordering_key: None,
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Publishes it after every earlier message with the same `key`.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds a header carried to the broker.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The longest message id, destination or header name every transport
/// carries (an AMQP short string).
pub(crate) const MAX_NAME: usize = 255;

/// Refuses, at enqueue, a message some transport could never carry (and
/// that would otherwise wait in the outbox for its attempts to run out):
/// a message id or destination that is empty, over [`MAX_NAME`] bytes, or
/// (the id) holds a line break; a header name that is not 1 to
/// [`MAX_NAME`] visible ASCII characters without `:`; a header value with
/// a line break (NATS headers are lines).
pub(crate) fn check_sendable(m: &OutgoingMessage) -> Result<(), sqlx::Error> {
    let refuse = |why: String| Err(sqlx::Error::Encode(why.into()));
    let shown = |s: &str| s.chars().take(40).collect::<String>();
    let line_break = |s: &str| s.contains(['\r', '\n']);
    if m.message_id.is_empty() || m.message_id.len() > MAX_NAME || line_break(&m.message_id) {
        return refuse(format!(
            "outbox message id {:?}…: 1 to {MAX_NAME} bytes, no line break",
            shown(&m.message_id)
        ));
    }
    if m.destination.is_empty() || m.destination.len() > MAX_NAME {
        return refuse(format!(
            "outbox destination {:?}…: 1 to {MAX_NAME} bytes",
            shown(&m.destination)
        ));
    }
    for (name, value) in &m.headers {
        let name_ok = (1..=MAX_NAME).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_graphic() && b != b':');
        if !name_ok {
            return refuse(format!(
                "outbox header name {:?}…: 1 to {MAX_NAME} visible ASCII characters, no `:`",
                shown(name)
            ));
        }
        if line_break(value) {
            return refuse(format!(
                "outbox header {name:?}: its value holds a line break"
            ));
        }
    }
    Ok(())
}

/// The headers as the outbox row keeps them. A name over 65,535 bytes or a
/// value over 4 GiB does not fit the encoding: refused (nothing enqueued)
/// rather than cut, so a message never loses its headers on the way.
pub(crate) fn encode_headers(headers: &[(String, String)]) -> Result<Vec<u8>, sqlx::Error> {
    if let Some((name, _)) = headers
        .iter()
        .find(|(n, v)| n.len() > usize::from(u16::MAX) || u32::try_from(v.len()).is_err())
    {
        let shown: String = name.chars().take(40).collect();
        return Err(sqlx::Error::Encode(
            format!(
                "outbox header {shown:?}…: a name is at most 65,535 bytes, a value at most 4 GiB"
            )
            .into(),
        ));
    }
    Ok(idem_core::StoredResponse {
        status: 0,
        headers: headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect(),
        body: Bytes::new(),
    }
    .encode_headers())
}

pub(crate) fn decode_headers(bytes: &[u8]) -> Vec<(String, String)> {
    idem_core::StoredResponse::decode_headers(bytes)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect()
}

/// What kind of failure a [`PublishError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The message could not be handed over (in process: no consumer for
    /// its destination): worth retrying as it is; uses up an attempt.
    Unreachable,
    /// The broker is not there: its connection is lost or refused, or it
    /// did not answer in time. Waited out however long it lasts: it uses
    /// up none of a row's attempts (a broker restarting must not turn
    /// every row into a dead letter).
    BrokerDown,
    /// The broker refused the message (a nack, a rejected publish).
    Rejected,
    /// The message was sent but its confirmation never came or was lost:
    /// it may have been published (a republish is absorbed by the broker's
    /// duplicate window and the consumers' inboxes). Uses up an attempt
    /// (a broker that does not answer at all is [`Self::BrokerDown`]).
    Unconfirmed,
    /// The publisher said nothing of the message, or another failure.
    Other,
}

impl std::fmt::Display for PublishErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unreachable => "broker unreachable",
            Self::BrokerDown => "broker down",
            Self::Rejected => "rejected by the broker",
            Self::Unconfirmed => "not confirmed by the broker",
            Self::Other => "not published",
        })
    }
}

/// Why a publish failed: its [kind](PublishErrorKind) and the broker's
/// words. The relay retries it with backoff, then dead-letters the row
/// with this text as `last_error`.
///
/// ```
/// use idem_outbox::outbox::{PublishError, PublishErrorKind};
/// let e = PublishError::new(PublishErrorKind::Rejected, "nack");
/// assert_eq!(e.kind(), PublishErrorKind::Rejected);
/// assert_eq!(e.to_string(), "rejected by the broker: nack");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
}

impl PublishError {
    /// A failure of `kind`, described by `message`.
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A failure of kind [`PublishErrorKind::Other`].
    pub fn other(message: impl Into<String>) -> Self {
        Self::new(PublishErrorKind::Other, message)
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    /// The broker's (or the publisher's) words.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// What a publisher says of each message of a batch, by message id: `Ok`
/// only once the broker confirmed it. A message it says nothing of counts
/// as failed (retried later).
///
/// ```
/// use idem_outbox::outbox::{PublishError, Published};
/// let mut published = Published::default();
/// published.record("m1", Ok(()));
/// published.record("m2", Err(PublishError::other("nack")));
/// assert!(published.get("m1").is_some_and(|r| r.is_ok()));
/// assert!(published.get("m3").is_none());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Published(HashMap<String, Result<(), PublishError>>);

impl Published {
    /// Records what became of `message_id`.
    pub fn record(&mut self, message_id: &str, result: Result<(), PublishError>) {
        self.0.insert(message_id.to_owned(), result);
    }

    /// What became of `message_id`, if the publisher said.
    pub fn get(&self, message_id: &str) -> Option<&Result<(), PublishError>> {
        self.0.get(message_id)
    }

    /// Whether the broker confirmed `message_id`.
    pub fn confirmed(&self, message_id: &str) -> bool {
        self.get(message_id).is_some_and(Result::is_ok)
    }

    /// Whether the broker confirmed every message of `batch`.
    pub fn all_confirmed(&self, batch: &[OutgoingMessage]) -> bool {
        batch.iter().all(|m| self.confirmed(&m.message_id))
    }

    /// How many messages the publisher said something of.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the publisher said nothing at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromIterator<(String, Result<(), PublishError>)> for Published {
    fn from_iter<I: IntoIterator<Item = (String, Result<(), PublishError>)>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

/// Sends messages to a broker, saying of each (by message id) whether the
/// broker confirmed it (publisher confirms, JetStream acks).
pub trait Publisher: Send + Sync + 'static {
    /// Publishes a batch.
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published>;
}
