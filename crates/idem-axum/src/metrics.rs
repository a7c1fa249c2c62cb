//! What the layer counts and times. Labels come from the enums below, never
//! from keys or scopes.

use std::time::Instant;

/// How a request ended, the `outcome` of `idem_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Fresh,
    Takeover,
    MissingKey,
    InvalidKey,
    TooLarge,
    Invalid,
    StoreUnavailable,
    Mismatch,
    Conflict,
    Replay,
    Released,
    ClaimLost,
    Kept,
    CompletedOutsideTransaction,
}

impl Outcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Fresh => "fresh",
            Self::Takeover => "takeover",
            Self::MissingKey => "missing_key",
            Self::InvalidKey => "invalid_key",
            Self::TooLarge => "too_large",
            Self::Invalid => "invalid",
            Self::StoreUnavailable => "store_unavailable",
            Self::Mismatch => "mismatch",
            Self::Conflict => "conflict",
            Self::Replay => "replay",
            Self::Released => "released",
            Self::ClaimLost => "claim_lost",
            Self::Kept => "kept",
            Self::CompletedOutsideTransaction => "completed_outside_transaction",
        }
    }
}

/// A store operation, the `op` of `idem_store_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreOp {
    Claim,
    Complete,
    Release,
}

impl StoreOp {
    fn label(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Complete => "complete",
            Self::Release => "release",
        }
    }
}

/// Counts one request by how it ended (`idem_requests_total{outcome}`).
pub(crate) fn count(outcome: Outcome) {
    metrics::counter!("idem_requests_total", "outcome" => outcome.label()).increment(1);
}

/// Records how long a store operation took (`idem_store_seconds{store, op}`).
pub(crate) fn timed(store: &'static str, op: StoreOp, started: Instant) {
    metrics::histogram!("idem_store_seconds", "store" => store, "op" => op.label())
        .record(started.elapsed().as_secs_f64());
}
