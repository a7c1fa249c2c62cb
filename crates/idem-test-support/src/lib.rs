//! What idem's tests share, beside the store conformance suite
//! (`idem-store-suite`):
//!
//! - [`postgres`]: a PostgreSQL schema of its own for each test, dropped
//!   after it, so tests run in parallel and leave nothing behind;
//! - [`mysql`]: a MySQL / MariaDB database of its own for each test,
//!   dropped after it;
//! - [`broker`]: the broker conformance suite, run on RabbitMQ and NATS;
//! - [`messaging`]: the outbox and inbox fixtures the broker tests use (an
//!   outbox in a fresh schema, messages, recorded effects).
//!
//! A test that needs a server fails loudly when it cannot reach it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod broker;
pub mod messaging;
pub mod mysql;
pub mod postgres;
