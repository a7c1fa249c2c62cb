//! An in-process transport: the embedded default when no broker is
//! configured. Published messages go to a channel per destination; a
//! consumer reads them. At-least-once like a broker: a relay that
//! republishes delivers again, and the inbox absorbs it.

use std::collections::HashMap;
use std::sync::Mutex;

use idem_core::BoxFuture;
use tokio::sync::mpsc;

use crate::outbox::{OutgoingMessage, PublishError, Publisher};

/// Channels per destination; see the [module docs](self).
#[derive(Debug, Default)]
pub struct InProcess {
    senders: Mutex<HashMap<String, mpsc::UnboundedSender<OutgoingMessage>>>,
}

impl InProcess {
    /// A transport with no destinations yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Subscribes to `destination`, replacing an earlier subscriber.
    pub fn subscribe(&self, destination: &str) -> mpsc::UnboundedReceiver<OutgoingMessage> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.senders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(destination.to_owned(), tx);
        rx
    }
}

impl Publisher for InProcess {
    fn publish<'a>(
        &'a self,
        batch: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        let senders = self.senders.lock().unwrap_or_else(|e| e.into_inner());
        let results = batch
            .iter()
            .map(|m| match senders.get(&m.destination) {
                Some(tx) => tx
                    .send(m.clone())
                    .map_err(|_| PublishError(format!("no consumer on {}", m.destination))),
                None => Err(PublishError(format!(
                    "no consumer subscribed to {}",
                    m.destination
                ))),
            })
            .collect();
        Box::pin(async move { results })
    }
}
