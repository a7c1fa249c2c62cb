//! An in-process transport: the embedded default when no broker is
//! configured. Published messages go to a channel per destination, and a
//! publish counts as done only once the consumer acknowledged the message
//! (after its handler committed), so the relay marks a row sent only after
//! it was processed: a crash in between leaves the row to be published
//! again, and the inbox absorbs the repeat. At-least-once, like a broker.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::Duration;

use idem_core::BoxFuture;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, warn};

use crate::consumer::{ConsumeError, Consumer, Delivery, Handler, InFlight};
use crate::outbox::{OutgoingMessage, PublishError, PublishErrorKind, Published, Publisher};

/// What became of a delivery, as its publisher learns it.
#[derive(Debug)]
enum Settled {
    /// Processed.
    Acked,
    /// Its handler failed, for this reason.
    Failed(String),
    /// Never handed to a handler: the consumer stopped first.
    Unhandled,
}

/// A message handed to an in-process subscriber, to acknowledge or fail.
#[derive(Debug)]
pub struct InProcessDelivery {
    /// The message.
    pub message: OutgoingMessage,
    done: oneshot::Sender<Settled>,
}

impl InProcessDelivery {
    /// The message was processed: the relay may mark it sent.
    pub fn ack(self) {
        let _ = self.done.send(Settled::Acked);
    }

    /// The message failed: the relay retries it later (and dead-letters it
    /// after its attempts). Dropping a delivery unacknowledged fails it too
    /// (a handler that panicked).
    pub fn fail(self, reason: impl Into<String>) {
        let _ = self.done.send(Settled::Failed(reason.into()));
    }

    /// The consumer stopped before handing the message to its handler: the
    /// relay sends it again later without counting an attempt (nothing
    /// failed; a broker returning an unhandled message counts none either).
    pub fn unhandled(self) {
        let _ = self.done.send(Settled::Unhandled);
    }

    /// Whether the publisher stopped waiting for this delivery (its batch
    /// ran out of time): the relay publishes the message again, so this
    /// copy need not be handled.
    pub fn is_abandoned(&self) -> bool {
        self.done.is_closed()
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
    /// A transport with no destinations yet, waiting up to 10 s for a
    /// batch's acknowledgements.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits up to `timeout` for a batch's acknowledgements, all together:
    /// the messages acknowledged by then are published, the others fail
    /// and are retried later. Keep it under half the relay's lease (the
    /// relay gives up on a whole batch then, acknowledged messages too).
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
        let pending: Vec<Result<oneshot::Receiver<Settled>, PublishError>> = {
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
        // One deadline for the batch: a slow consumer gets the batch's
        // time, not each message's (a batch of 500 would otherwise wait up
        // to 500 times it, and the relay give up on the whole batch,
        // acknowledged messages too).
        let deadline = tokio::time::Instant::now() + self.ack_timeout;
        Box::pin(async move {
            let mut published = Published::default();
            for (m, p) in batch.iter().zip(pending) {
                published.record(
                    &m.message_id,
                    match p {
                        Err(e) => Err(e),
                        Ok(acked) => match tokio::time::timeout_at(deadline, acked).await {
                            Ok(Ok(Settled::Acked)) => Ok(()),
                            Ok(Ok(Settled::Failed(reason))) => {
                                Err(PublishError::new(PublishErrorKind::Rejected, reason))
                            }
                            // The consumer stopped first: as a broker that
                            // is away, sent again, no attempt used up.
                            Ok(Ok(Settled::Unhandled)) => Err(PublishError::new(
                                PublishErrorKind::BrokerDown,
                                "the consumer stopped before handling it",
                            )),
                            Ok(Err(_)) => Err(PublishError::new(
                                PublishErrorKind::Unconfirmed,
                                "the consumer dropped the message unacknowledged",
                            )),
                            // The consumer is the broker here: one that does
                            // not answer in time is waited out, as a broker
                            // down is (its copy is handled once, by the inbox).
                            Err(_) => Err(PublishError::new(
                                PublishErrorKind::BrokerDown,
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
            concurrency: NonZeroUsize::MIN,
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
    concurrency: NonZeroUsize,
}

impl Drop for InProcessConsumer {
    /// The deliveries still queued (the consumer stopped, or ended on an
    /// error) go back unhandled: their publisher sends them again without
    /// counting an attempt.
    fn drop(&mut self) {
        self.rx.close();
        while let Ok(delivery) = self.rx.try_recv() {
            delivery.unhandled();
        }
    }
}

impl InProcessConsumer {
    /// Handles up to `n` deliveries at once (default 1: one at a time, in
    /// order); see [`InFlight`].
    pub fn concurrency(mut self, n: NonZeroUsize) -> Self {
        self.concurrency = n;
        self
    }
}

impl Consumer for InProcessConsumer {
    /// Runs `handler` on each delivery, up to the concurrency at once; on
    /// stop, the deliveries in progress finish and are settled first.
    fn consume(
        mut self: Box<Self>,
        handler: Handler,
        mut stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, Result<(), ConsumeError>> {
        Box::pin(async move {
            let mut in_flight = InFlight::<ConsumeError>::new(self.concurrency);
            loop {
                in_flight.ready().await?;
                // A stop first: once asked to stop, no new delivery is
                // taken (those queued come back unhandled when the consumer
                // is dropped).
                let next = tokio::select! {
                    biased;
                    _ = stop.changed() => None,
                    d = self.rx.recv() => d,
                };
                let Some(delivery) = next else {
                    return in_flight.drain().await;
                };
                if delivery.is_abandoned() {
                    // Its batch ran out of time: the relay sends it again.
                    // Skipped, the copies a slow consumer's backlog holds
                    // drain at once rather than each being handled.
                    debug!(destination = %self.destination, message_id = %delivery.message.message_id, "skipping a delivery its publisher no longer waits for");
                    continue;
                }
                let m = &delivery.message;
                let seen = Delivery {
                    message_id: Some(m.message_id.clone()),
                    payload: m.payload.clone(),
                    headers: m.headers.clone(),
                    redelivered: false,
                };
                let (handler, destination) = (handler.clone(), self.destination.clone());
                in_flight.spawn(async move {
                    match handler(seen).await {
                        Ok(()) => delivery.ack(),
                        Err(e) => {
                            warn!(%destination, message_id = %delivery.message.message_id, error = %e, "handler failed; the relay will retry");
                            delivery.fail(e.to_string());
                        }
                    }
                    Ok(())
                });
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::consumer::handler;

    fn batch(destination: &str, n: usize) -> Vec<OutgoingMessage> {
        (0..n)
            .map(|i| OutgoingMessage {
                message_id: format!("m-{i}"),
                destination: destination.to_owned(),
                ordering_key: None,
                payload: Bytes::from_static(b"{}"),
                headers: vec![],
            })
            .collect()
    }

    /// Runs a consumer of "d" on `transport` with `on_message`, publishes
    /// `n` messages and returns how many were acknowledged.
    async fn run(
        transport: Arc<InProcess>,
        consumer: InProcessConsumer,
        n: usize,
        on_message: Handler,
    ) -> usize {
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(Box::new(consumer).consume(on_message, stop));
        let published =
            tokio::time::timeout(Duration::from_secs(20), transport.publish(&batch("d", n)))
                .await
                .expect("every delivery settles");
        stop_tx.send(true).unwrap();
        task.await.unwrap().unwrap();
        (0..n)
            .filter(|i| published.confirmed(&format!("m-{i}")))
            .count()
    }

    /// A consumer that stops with deliveries still queued gives them back
    /// unhandled: their publisher is told what a broker that is away says
    /// (sent again, no attempt used up), not a failure that counts one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deliveries_queued_when_the_consumer_stops_come_back_unhandled() {
        let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(20)));
        let consumer = transport.consumer("d");
        let started = Arc::new(tokio::sync::Notify::new());
        let s = started.clone();
        let on_message = handler(move |_d: Delivery| {
            let s = s.clone();
            async move {
                s.notify_one();
                // Long enough that the stop comes while the first runs.
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok(())
            }
        });
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(Box::new(consumer).consume(on_message, stop));
        let t = transport.clone();
        let publishing = tokio::spawn(async move { t.publish(&batch("d", 5)).await });
        started.notified().await;
        stop_tx.send(true).unwrap();
        task.await.unwrap().unwrap();
        let published = tokio::time::timeout(Duration::from_secs(20), publishing)
            .await
            .expect("every delivery settles")
            .unwrap();
        assert!(
            published.confirmed("m-0"),
            "the one in progress settles first"
        );
        for i in 1..5 {
            let e = published
                .get(&format!("m-{i}"))
                .unwrap()
                .as_ref()
                .unwrap_err();
            assert_eq!(e.kind(), PublishErrorKind::BrokerDown, "m-{i}: {e:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn by_default_one_delivery_at_a_time() {
        let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(20)));
        let consumer = transport.consumer("d");
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, m) = (running.clone(), most.clone());
        let on_message = handler(move |_d: Delivery| {
            let (running, most) = (r.clone(), m.clone());
            async move {
                most.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        });
        assert_eq!(run(transport, consumer, 5, on_message).await, 5);
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    /// Each handler waits until all N have started: only a consumer that
    /// runs N at once gets through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_a_concurrency_of_n_n_deliveries_at_once() {
        const N: usize = 5;
        let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(20)));
        let consumer = transport
            .consumer("d")
            .concurrency(NonZeroUsize::new(N).unwrap());
        let all = Arc::new(tokio::sync::Barrier::new(N));
        let on_message = handler(move |_d: Delivery| {
            let all = all.clone();
            async move {
                all.wait().await;
                Ok(())
            }
        });
        assert_eq!(run(transport, consumer, N, on_message).await, N);
    }

    /// A consumer slower than the batch: what it acknowledged by the ack
    /// timeout is published, the rest fail (one deadline for the batch, not
    /// one per message), and the copies it has not reached are skipped
    /// rather than handled, since the relay sends them again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_consumer_gets_one_deadline_per_batch_and_skips_what_was_given_up() {
        let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(1)));
        let consumer = transport.consumer("d");
        let handled = Arc::new(Mutex::new(Vec::<String>::new()));
        let seen = handled.clone();
        let on_message = handler(move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(d.message_id.unwrap_or_default());
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(())
            }
        });
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(Box::new(consumer).consume(on_message, stop));
        // 20 messages of 200 ms each, one at a time: 4 s of work.
        let slow = batch("d", 20);
        let published = transport.publish(&slow).await;
        let confirmed: Vec<&str> = slow
            .iter()
            .map(|m| m.message_id.as_str())
            .filter(|id| published.confirmed(id))
            .collect();
        assert!(
            !confirmed.is_empty(),
            "the first ones were acknowledged in time"
        );
        assert!(
            confirmed.len() < 20,
            "not all 20 within one second: {confirmed:?}"
        );
        // A later message comes after every copy left in the channel: once
        // it is acknowledged, the consumer has been through them all.
        let last = OutgoingMessage {
            message_id: "last".to_owned(),
            ..slow[0].clone()
        };
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while !transport
            .publish(std::slice::from_ref(&last))
            .await
            .confirmed("last")
        {
            assert!(
                std::time::Instant::now() < until,
                "the consumer never caught up"
            );
        }
        stop_tx.send(true).unwrap();
        task.await.unwrap().unwrap();
        let handled: Vec<String> = handled
            .lock()
            .unwrap()
            .iter()
            .filter(|id| *id != "last")
            .cloned()
            .collect();
        assert!(
            handled.len() <= confirmed.len() + 2,
            "only the acknowledged ones and those in hand about the deadline: {handled:?}"
        );
    }

    /// A failed handler's delivery goes back to the relay; the others are
    /// acknowledged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_is_the_failed_delivery_alone() {
        let transport = Arc::new(InProcess::new().ack_timeout(Duration::from_secs(20)));
        let consumer = transport
            .consumer("d")
            .concurrency(NonZeroUsize::new(3).unwrap());
        let on_message = handler(move |d: Delivery| async move {
            if d.message_id.as_deref() == Some("m-1") {
                return Err("no".into());
            }
            Ok(())
        });
        assert_eq!(run(transport, consumer, 4, on_message).await, 3);
    }
}
