//! What the broker tests share: a PostgreSQL schema with the inbox, the
//! outbox and an `effects` table, and a handler that records one effect per
//! message through the inbox.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::BoxFuture;
use idem_outbox::inbox::{self, Handled};
use idem_outbox::outbox::{self, OutgoingMessage};

use crate::postgres::TestSchema;

/// A schema of the test's own, with the inbox, the outbox and `effects`.
pub async fn outbox_schema(prefix: &str) -> (sqlx::PgPool, TestSchema) {
    let schema = TestSchema::create(prefix).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&schema.url())
        .await
        .unwrap_or_else(|e| panic!("connect to the test schema: {e}"));
    inbox::migrate(&pool)
        .await
        .unwrap_or_else(|e| panic!("inbox: {e}"));
    outbox::migrate(&pool)
        .await
        .unwrap_or_else(|e| panic!("outbox: {e}"));
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("effects: {e}"));
    (pool, schema)
}

/// What consumers saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// Deliveries handed to the handler.
    pub deliveries: AtomicUsize,
    /// Deliveries the inbox recognised as processed before.
    pub duplicates: AtomicUsize,
    /// Message ids processed (each once).
    pub ids: Mutex<Vec<String>>,
}

impl Seen {
    /// Deliveries fully handled: processed or recognised as duplicates.
    pub fn handled(&self) -> usize {
        self.ids.lock().map(|ids| ids.len()).unwrap_or(0) + self.duplicates.load(Ordering::SeqCst)
    }
}

/// The handler every broker test runs: records one effect per message id
/// through the inbox (holding the transaction `hold` long after the insert),
/// failing for the message id `fail_on`.
pub async fn record_effect(
    pool: &sqlx::PgPool,
    seen: &Seen,
    message_id: Option<String>,
    hold: Duration,
    fail_on: Option<&str>,
) -> Result<(), &'static str> {
    seen.deliveries.fetch_add(1, Ordering::SeqCst);
    let id = message_id.ok_or("no message id")?;
    if Some(id.as_str()) == fail_on {
        return Err("this message always fails");
    }
    let effect_id = id.clone();
    let handled = inbox::process(pool, "test-consumer", &id, async move |tx| {
        sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
            .bind(effect_id)
            .execute(&mut *tx)
            .await?;
        tokio::time::sleep(hold).await;
        Ok::<_, sqlx::Error>(())
    })
    .await
    .map_err(|_| "inbox failed")?;
    match handled {
        Handled::Processed(()) => {
            if let Ok(mut ids) = seen.ids.lock() {
                ids.push(id);
            }
        }
        Handled::Duplicate => {
            seen.duplicates.fetch_add(1, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// A publisher for tests: records what it published; fails for
/// destinations named `poison` (a refusal) and `down` (the broker down),
/// and says nothing of those named `silent`.
#[derive(Debug, Default)]
pub struct Recording {
    /// The message ids published, in order.
    pub published: Mutex<Vec<String>>,
    /// How many batches it was handed.
    pub calls: AtomicUsize,
}

impl idem_outbox::outbox::Publisher for Recording {
    fn publish<'a>(
        &'a self,
        batch: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, idem_outbox::outbox::Published> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let results = match self.published.lock() {
            Ok(mut published) => batch
                .iter()
                // A publisher that says nothing of a message: it is not sent.
                .filter(|m| m.destination != "silent")
                .map(|m| {
                    let result = if m.destination == "poison" {
                        Err(idem_outbox::outbox::PublishError::other(
                            "the broker refused it",
                        ))
                    } else if m.destination == "down" {
                        Err(idem_outbox::outbox::PublishError::new(
                            idem_outbox::outbox::PublishErrorKind::BrokerDown,
                            "connection refused",
                        ))
                    } else {
                        published.push(m.message_id.clone());
                        Ok(())
                    };
                    (m.message_id.clone(), result)
                })
                .collect(),
            Err(_) => idem_outbox::outbox::Published::default(),
        };
        Box::pin(async move { results })
    }
}

/// A test message to `destination`.
pub fn message(id: &str, destination: &str) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.to_owned(),
        destination: destination.to_owned(),
        ordering_key: None,
        payload: Bytes::from(format!("{{\"id\":\"{id}\"}}")),
        headers: vec![("type".into(), "OrderPlaced".into())],
    }
}

/// How many effects were recorded.
pub async fn effects(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("count effects: {e}"))
}

/// Polls `done` until it holds, failing the test after `within`.
pub async fn wait_for(
    what: &str,
    within: Duration,
    mut done: impl FnMut() -> BoxFuture<'static, bool>,
) {
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
