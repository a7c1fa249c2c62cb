//! Messages, effect once: an idempotent consumer ([`inbox`]) and a
//! transactional [`outbox`] with a batching relay.
//!
//! Brokers deliver at least once, and a relay that crashes after publishing
//! publishes again. The outbox makes every committed change send its
//! message (and no uncommitted one); the inbox makes every message act once
//! however often it arrives. Together: effect once, end to end.

//!
//! Both run on SQLite, PostgreSQL and MySQL/MariaDB (features `sqlite`,
//! `postgres` and `mysql`; none is on by default, so only the driver you
//! ask for is built). Every call takes any of their pools, transactions or
//! connections, one name for all three; the database follows from its type
//! ([`idem_sql::Driver`]):
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
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(unreachable_code, unused_variables, dead_code)
)]

pub mod consumer;
mod db;
pub mod inbox;
mod message;
pub mod outbox;
mod relay;
pub mod transport;

pub use consumer::{Consumer, Delivery};
pub use db::OutboxDialect;
pub use inbox::{Handled, InboxError, InboxTable};
pub use outbox::{
    enqueue, DeadLetter, OutboxStats, OutboxTable, OutgoingMessage, PublishError, PublishErrorKind,
    Published, Publisher, Relay, RelayConfig, RelayError,
};
pub use relay::RelayErrorKind;
