//! One way to consume, whatever carries the messages (RabbitMQ, NATS
//! JetStream, or the in-process transport): a [`Consumer`] runs a
//! [`Handler`] on each [`Delivery`], acknowledges it once the handler
//! succeeded, and lets the transport redeliver it (or dead-letter it) when
//! the handler failed. Put the handler's effect in the inbox
//! ([`crate::inbox`]) and a redelivery acts once.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::BoxFuture;
use tokio::sync::watch;

/// A message as a handler sees it, whatever the transport.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delivery {
    /// The message id the inbox deduplicates on (AMQP `message_id`,
    /// `Nats-Msg-Id`, the outbox row's id in process); `None` if the
    /// sender gave none.
    pub message_id: Option<String>,
    /// The body.
    pub payload: Bytes,
    /// The headers the sender set, text values only.
    pub headers: Vec<(String, String)>,
    /// Whether the transport says it delivered this message before.
    pub redelivered: bool,
}

impl Delivery {
    /// The first value of header `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why a handler or a consumer failed.
pub type ConsumeError = Box<dyn std::error::Error + Send + Sync>;

/// What a consumer runs on each delivery: `Ok` acknowledges it.
pub type Handler =
    Arc<dyn Fn(Delivery) -> BoxFuture<'static, Result<(), ConsumeError>> + Send + Sync>;

/// Makes a [`Handler`] of an async function.
///
/// ```
/// use idem_outbox::consumer::{handler, Delivery};
/// let on_message = handler(|d: Delivery| async move {
///     let _id = d.message_id.ok_or("a message without an id")?;
///     Ok(())
/// });
/// # drop(on_message);
/// ```
pub fn handler<F, Fut>(f: F) -> Handler
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ConsumeError>> + Send + 'static,
{
    Arc::new(move |d| Box::pin(f(d)))
}

/// Consumes one queue or subject until `stop` turns true (the delivery in
/// progress finishes and is settled first).
pub trait Consumer: Send {
    /// Runs `handler` on each delivery; `Err` when the transport failed.
    fn consume(
        self: Box<Self>,
        handler: Handler,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, Result<(), ConsumeError>>;
}
