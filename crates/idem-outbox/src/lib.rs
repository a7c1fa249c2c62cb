//! Messages, effect once: an idempotent consumer ([`inbox`]) and a
//! transactional [`outbox`] with a batching relay.
//!
//! Brokers deliver at least once, and a relay that crashes after publishing
//! publishes again. The outbox makes every committed change send its
//! message (and no uncommitted one); the inbox makes every message act once
//! however often it arrives. Together: effect once, end to end.

//!
//! Both run on PostgreSQL and on SQLite (features `postgres` and `sqlite`;
//! neither is on by default, so only the driver you ask for is built).
//! Every call takes either pool or connection, one name for both:
//!
//! | | the default table | a table of your own |
//! |---|---|---|
//! | create or upgrade | [`outbox::migrate`], [`inbox::migrate`] | [`OutboxTable::migrate`], [`InboxTable::migrate`] |
//! | enqueue in your transaction | [`outbox::enqueue`] | [`OutboxTable::enqueue`] |
//! | publish what committed | [`Relay::new`] | [`RelayConfig::table`] |
//! | act once per message | [`inbox::process`] | [`InboxTable::process`] |
//! | forget old message ids | [`inbox::sweep`] | [`InboxTable::sweep`] |
//! | operators' counts | [`outbox::stats`], [`outbox::dead_letters`] | [`OutboxTable::stats`] |
//!
//! Messages travel through a [`Publisher`] (RabbitMQ in `idem-rabbitmq`,
//! NATS JetStream in `idem-nats`, or [`transport::InProcess`]) and arrive
//! through a [`Consumer`].

#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(unreachable_code, unused_variables, dead_code)
)]

pub mod consumer;
mod db;
pub mod inbox;
pub mod outbox;
mod relay;
pub mod transport;

pub use consumer::{Consumer, Delivery};
pub use db::Db;
pub use inbox::{Handled, InboxError, InboxTable};
pub use outbox::{
    enqueue, OutboxConnection, OutboxTable, OutgoingMessage, PublishError, PublishErrorKind,
    Published, Publisher, Relay, RelayConfig, RelayError,
};

use idem_core::BoxFuture;

/// A pool whose inbox can process messages: PostgreSQL's or SQLite's, for
/// code written once for both; see [`inbox::process`].
pub trait InboxPool {
    /// The database.
    type Db: sqlx::Database;

    /// Processes `message_id` for `consumer` once, in `table`; `handler`
    /// gets the open transaction.
    fn process_in<'a, T, E, F>(
        &'a self,
        table: &'a InboxTable,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> BoxFuture<'a, Result<Handled<T>, InboxError<E>>>
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, Self::Db>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a;

    /// Processes `message_id` for `consumer` once, in the default inbox.
    fn process<'a, T, E, F>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> BoxFuture<'a, Result<Handled<T>, InboxError<E>>>
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, Self::Db>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a,
    {
        self.process_in(inbox::default_table(), consumer, message_id, handler)
    }
}

#[cfg(feature = "postgres")]
impl InboxPool for sqlx::PgPool {
    type Db = sqlx::Postgres;

    fn process_in<'a, T, E, F>(
        &'a self,
        table: &'a InboxTable,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> BoxFuture<'a, Result<Handled<T>, InboxError<E>>>
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, sqlx::Postgres>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a,
    {
        Box::pin(async move {
            let tx = self.begin().await.map_err(InboxError::Database)?;
            inbox::process_in(table, true, tx, consumer, message_id, handler).await
        })
    }
}

#[cfg(feature = "sqlite")]
impl InboxPool for sqlx::SqlitePool {
    type Db = sqlx::Sqlite;

    fn process_in<'a, T, E, F>(
        &'a self,
        table: &'a InboxTable,
        consumer: &'a str,
        message_id: &'a str,
        handler: F,
    ) -> BoxFuture<'a, Result<Handled<T>, InboxError<E>>>
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
            ) -> BoxFuture<'c, Result<T, E>>
            + Send
            + 'a,
        T: Send + 'a,
        E: Send + 'a,
    {
        Box::pin(async move {
            // The write lock first: a racing consumer waits here, not at
            // the commit.
            let tx = self
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(InboxError::Database)?;
            inbox::process_in(table, false, tx, consumer, message_id, handler).await
        })
    }
}
