//! Messages, effect once: an idempotent consumer ([`inbox`]) and a
//! transactional [`outbox`] with a batching relay.
//!
//! Brokers deliver at least once, and a relay that crashes after publishing
//! publishes again. The outbox makes every committed change send its
//! message (and no uncommitted one); the inbox makes every message act once
//! however often it arrives. Together: effect once, end to end.

pub mod consumer;
pub mod inbox;
pub mod outbox;
mod relay;
pub mod transport;

pub use consumer::{Consumer, Delivery};
pub use inbox::{Handled, InboxError};
pub use outbox::{
    enqueue, OutgoingMessage, PublishError, Published, Publisher, Relay, RelayConfig,
};

use std::future::Future;

use idem_core::BoxFuture;

/// A connection an outbox row can be enqueued on: PostgreSQL
/// ([`outbox::enqueue`]) or SQLite ([`outbox::enqueue_sqlite`]), for code
/// written once for both.
pub trait OutboxConnection {
    /// Enqueues `message` in the open transaction on this connection.
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
}

impl OutboxConnection for sqlx::PgConnection {
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(outbox::enqueue(self, message))
    }
}

impl OutboxConnection for sqlx::SqliteConnection {
    fn enqueue<'a>(
        &'a mut self,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(outbox::enqueue_sqlite(self, message))
    }
}

/// A pool whose inbox can process messages: PostgreSQL or SQLite, for code
/// written once for both; see [`inbox::process_postgres`].
pub trait InboxPool {
    /// The database.
    type Db: sqlx::Database;

    /// Processes `message_id` for `consumer` once; `handler` gets the open
    /// transaction.
    fn process<'a, T, E, F>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> impl Future<Output = Result<Handled<T>, InboxError<E>>> + Send + 'a
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, Self::Db>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a;
}

impl InboxPool for sqlx::PgPool {
    type Db = sqlx::Postgres;

    fn process<'a, T, E, F>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> impl Future<Output = Result<Handled<T>, InboxError<E>>> + Send + 'a
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, sqlx::Postgres>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a,
    {
        inbox::process_postgres(self, consumer, message_id, handler)
    }
}

impl InboxPool for sqlx::SqlitePool {
    type Db = sqlx::Sqlite;

    fn process<'a, T, E, F>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> impl Future<Output = Result<Handled<T>, InboxError<E>>> + Send + 'a
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a,
    {
        inbox::process_sqlite(self, consumer, message_id, handler)
    }
}
