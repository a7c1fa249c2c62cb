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

/// The deliveries a consumer is handling at once, at most its concurrency:
/// what each transport's consumer uses to run handlers side by side.
///
/// With a concurrency of 1 (every consumer's default) a delivery is
/// settled before the next is taken, so a queue's order is kept. With more,
/// up to that many handlers run at once and settle in whatever order they
/// end: for effects whose order does not matter (an email per payment),
/// where one transaction and one acknowledgement at a time would bound the
/// consumer's rate.
///
/// ```
/// # async fn f() -> Result<(), idem_outbox::consumer::ConsumeError> {
/// use std::num::NonZeroUsize;
/// use idem_outbox::consumer::InFlight;
/// let mut in_flight = InFlight::new(NonZeroUsize::new(4).unwrap_or(NonZeroUsize::MIN));
/// for n in 0..10 {
///     in_flight.ready().await?; // fewer than 4 running
///     in_flight.spawn(async move { let _ = n; Ok::<(), idem_outbox::consumer::ConsumeError>(()) });
/// }
/// in_flight.drain().await?; // every one settled
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct InFlight<E> {
    tasks: tokio::task::JoinSet<Result<(), E>>,
    limit: usize,
}

impl<E: Send + 'static> InFlight<E> {
    /// At most `limit` at once.
    pub fn new(limit: std::num::NonZeroUsize) -> Self {
        Self {
            tasks: tokio::task::JoinSet::new(),
            limit: limit.get(),
        }
    }

    /// Waits until fewer than the limit run. If one of those that ended
    /// failed, the others are waited for first (each settles), and then the
    /// error is returned: the consumer stops with nothing half-done.
    pub async fn ready(&mut self) -> Result<(), E> {
        loop {
            let done = if self.tasks.len() >= self.limit {
                self.tasks.join_next().await
            } else {
                self.tasks.try_join_next()
            };
            let Some(done) = done else {
                return Ok(());
            };
            if let Err(failure) = outcome(done) {
                let _ = self.drain().await;
                return failure.raise();
            }
        }
    }

    /// Runs `settle` (a handler and its acknowledgement) beside the others.
    /// Call [`InFlight::ready`] first to keep to the limit.
    pub fn spawn<F>(&mut self, settle: F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        self.tasks.spawn(settle);
    }

    /// Waits for every one running to end (on stop: each settles before the
    /// consumer returns); the first error is returned after all ended, and a
    /// handler that panicked panics here once the others ended.
    pub async fn drain(&mut self) -> Result<(), E> {
        let mut first: Option<Failure<E>> = None;
        while let Some(done) = self.tasks.join_next().await {
            if let Err(failure) = outcome(done) {
                // a panic outranks an error
                if first.is_none() || matches!(failure, Failure::Panic(_)) {
                    first = Some(failure);
                }
            }
        }
        match first {
            Some(failure) => failure.raise(),
            None => Ok(()),
        }
    }

    /// Waits for every one running to settle, then returns `error`: for a
    /// consumer whose transport failed.
    pub async fn fail<T>(&mut self, error: E) -> Result<T, E> {
        let _ = self.drain().await;
        Err(error)
    }
}

/// How a delivery's task ended badly.
enum Failure<E> {
    Error(E),
    Panic(Box<dyn std::any::Any + Send>),
}

impl<E> Failure<E> {
    /// The error, or the handler's panic resumed here, as if it had run in
    /// line.
    fn raise<T>(self) -> Result<T, E> {
        match self {
            Failure::Error(e) => Err(e),
            Failure::Panic(payload) => std::panic::resume_unwind(payload),
        }
    }
}

fn outcome<E>(done: Result<Result<(), E>, tokio::task::JoinError>) -> Result<(), Failure<E>> {
    match done {
        Ok(result) => result.map_err(Failure::Error),
        Err(e) => match e.try_into_panic() {
            Ok(payload) => Err(Failure::Panic(payload)),
            // Aborted only when the set is dropped, and then nobody asks.
            Err(_) => Ok(()),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::num::NonZeroUsize;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_more_than_the_limit_and_the_first_error_comes_back() {
        let mut in_flight = InFlight::<String>::new(NonZeroUsize::new(3).unwrap());
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        for i in 0..12 {
            in_flight.ready().await.unwrap();
            let (running, most) = (running.clone(), most.clone());
            in_flight.spawn(async move {
                most.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5 + i % 3)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            });
        }
        in_flight.drain().await.unwrap();
        assert_eq!(most.load(Ordering::SeqCst), 3);
        assert_eq!(running.load(Ordering::SeqCst), 0);

        in_flight.spawn(async { Err("first".to_owned()) });
        in_flight.spawn(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err("second".to_owned())
        });
        assert_eq!(in_flight.drain().await, Err("first".to_owned()));
    }

    /// A failure stops the consumer only once the others have settled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_waits_for_the_others_to_settle() {
        let mut in_flight = InFlight::<String>::new(NonZeroUsize::new(2).unwrap());
        let settled = Arc::new(AtomicUsize::new(0));
        let s = settled.clone();
        in_flight.spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        in_flight.spawn(async { Err("failed".to_owned()) });
        assert_eq!(in_flight.ready().await, Err("failed".to_owned()));
        assert_eq!(settled.load(Ordering::SeqCst), 1, "the other settled first");
        assert_eq!(
            in_flight.fail::<()>("transport".to_owned()).await,
            Err("transport".to_owned())
        );
    }

    #[tokio::test]
    #[should_panic(expected = "a handler panicked")]
    async fn a_panic_in_a_handler_panics_in_the_consumer() {
        let mut in_flight = InFlight::<String>::new(NonZeroUsize::MIN);
        in_flight.spawn(async { panic!("a handler panicked") });
        let _ = in_flight.drain().await;
    }
}
