//! Messages, effect once: an idempotent consumer ([`inbox`]) and a
//! transactional [`outbox`] with a batching relay.
//!
//! Brokers deliver at least once, and a relay that crashes after publishing
//! publishes again. The outbox makes every committed change send its
//! message (and no uncommitted one); the inbox makes every message act once
//! however often it arrives. Together: effect once, end to end.

pub mod inbox;
pub mod outbox;
pub mod transport;

pub use inbox::{Handled, InboxError};
pub use outbox::{enqueue, OutgoingMessage, PublishError, Publisher, Relay, RelayConfig};
