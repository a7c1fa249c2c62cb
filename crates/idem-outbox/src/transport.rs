//! An in-process transport: the embedded default when no broker is
//! configured. Published messages go to a channel per destination, and a
//! publish counts as done only once the consumer acknowledged the message
//! (after its handler committed), so the relay marks a row sent only after
//! it was processed: a crash in between leaves the row to be published
//! again, and the inbox absorbs the repeat. At-least-once, like a broker.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idem_core::BoxFuture;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::warn;

use crate::consumer::{ConsumeError, Consumer, Delivery, Handler};
use crate::outbox::{OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher};

/// A message handed to an in-process subscriber, to acknowledge or fail.
#[derive(Debug)]
pub struct InProcessDelivery {
    /// The message.
    pub message: OutgoingMessage,
    done: oneshot::Sender<Result<(), String>>,
}

impl InProcessDelivery {
    /// The message was processed: the relay may mark it sent.
    pub fn ack(self) {
        let _ = self.done.send(Ok(()));
    }

    /// The message failed: the relay retries it later (and dead-letters it
    /// after its attempts). Dropping a delivery unacknowledged fails it too.
    pub fn fail(self, reason: impl Into<String>) {
        let _ = self.done.send(Err(reason.into()));
    }
}

/// Channels per destination; see the [module docs](self).
#[derive(Debug)]
pub struct InProcess {
    senders: Mutex<HashMap<String, mpsc::UnboundedSender<InProcessDelivery>>>,
    ack_timeout: Duration,
}

impl Default for InProcess {
    fn default() -> Self {
        Self {
            senders: Mutex::default(),
            ack_timeout: Duration::from_secs(10),
        }
    }
}

impl InProcess {
    /// A transport with no destinations yet, waiting up to 10 s for each
    /// acknowledgement.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits up to `timeout` for each acknowledgement (then the publish
    /// fails and the row is retried later).
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Subscribes to `destination`, replacing an earlier subscriber.
    pub fn subscribe(&self, destination: &str) -> mpsc::UnboundedReceiver<InProcessDelivery> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.senders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(destination.to_owned(), tx);
        rx
    }
}

impl Publisher for InProcess {
    fn publish<'a>(&'a self, batch: &'a [OutgoingMessage]) -> BoxFuture<'a, Published> {
        let pending: Vec<Result<oneshot::Receiver<Result<(), String>>, PublishError>> = {
            let senders = self.senders.lock().unwrap_or_else(|e| e.into_inner());
            batch
                .iter()
                .map(|m| {
                    let Some(tx) = senders.get(&m.destination) else {
                        return Err(PublishError::new(
                            PublishErrorKind::Unreachable,
                            format!("no consumer subscribed to {}", m.destination),
                        ));
                    };
                    let (done, acked) = oneshot::channel();
                    tx.send(InProcessDelivery {
                        message: m.clone(),
                        done,
                    })
                    .map_err(|_| {
                        PublishError::new(
                            PublishErrorKind::Unreachable,
                            format!("no consumer on {}", m.destination),
                        )
                    })?;
                    Ok(acked)
                })
                .collect()
        };
        let timeout = self.ack_timeout;
        Box::pin(async move {
            let mut published = Published::default();
            for (m, p) in batch.iter().zip(pending) {
                published.record(
                    &m.message_id,
                    match p {
                        Err(e) => Err(e),
                        Ok(acked) => match tokio::time::timeout(timeout, acked).await {
                            Ok(Ok(Ok(()))) => Ok(()),
                            Ok(Ok(Err(reason))) => {
                                Err(PublishError::new(PublishErrorKind::Rejected, reason))
                            }
                            Ok(Err(_)) => Err(PublishError::new(
                                PublishErrorKind::Unconfirmed,
                                "the consumer dropped the message unacknowledged",
                            )),
                            Err(_) => Err(PublishError::new(
                                PublishErrorKind::Unconfirmed,
                                "no acknowledgement in time",
                            )),
                        },
                    },
                );
            }
            published
        })
    }
}

impl InProcess {
    /// A [`Consumer`] of `destination` (subscribing to it, replacing an
    /// earlier subscriber).
    pub fn consumer(&self, destination: &str) -> InProcessConsumer {
        InProcessConsumer {
            destination: destination.to_owned(),
            rx: self.subscribe(destination),
        }
    }
}

/// The in-process [`Consumer`] of one destination: a delivery is
/// acknowledged (and its outbox row marked sent) only once its handler
/// succeeded; a failure goes back to the relay, which retries it later.
#[derive(Debug)]
pub struct InProcessConsumer {
    destination: String,
    rx: mpsc::UnboundedReceiver<InProcessDelivery>,
}

impl Consumer for InProcessConsumer {
    fn consume(
        mut self: Box<Self>,
        handler: Handler,
        mut stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, Result<(), ConsumeError>> {
        Box::pin(async move {
            loop {
                let next = tokio::select! {
                    d = self.rx.recv() => d,
                    _ = stop.changed() => None,
                };
                let Some(delivery) = next else { return Ok(()) };
                let m = &delivery.message;
                let seen = Delivery {
                    message_id: Some(m.message_id.clone()),
                    payload: m.payload.clone(),
                    headers: m.headers.clone(),
                    redelivered: false,
                };
                match handler(seen).await {
                    Ok(()) => delivery.ack(),
                    Err(e) => {
                        warn!(destination = %self.destination, message_id = %m.message_id, error = %e, "handler failed; the relay will retry");
                        delivery.fail(e.to_string());
                    }
                }
            }
        })
    }
}
