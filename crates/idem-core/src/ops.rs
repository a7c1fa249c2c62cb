//! What operators see of a store: counts and single records.

use crate::record::{Record, UnixMillis};

/// Counts over a store's records, for `idem stats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreStats {
    /// Records whose operation is running (or whose holder died).
    pub in_progress: u64,
    /// In-progress records whose lease has run out (crashed or released
    /// holders, waiting for a retry to take over).
    pub leases_expired: u64,
    /// Completed records, kept for replay.
    pub completed: u64,
    /// Records past their retention, waiting for the sweep.
    pub past_retention: u64,
    /// When the oldest record was created.
    pub oldest_created_at: Option<UnixMillis>,
    /// The store's clock when the counts were taken.
    pub now: UnixMillis,
}

/// One record as an operator sees it, expired or not, with the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The record.
    pub record: Record,
    /// The store's clock when it was read.
    pub now: UnixMillis,
}
