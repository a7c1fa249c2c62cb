//! What the layer counts and times. Labels come from the enums below, never
//! from keys or scopes.
//!
//! Each metric's key (its name and labels) is made once and kept, rather
//! than made afresh for every request as `metrics`' macros make it (one
//! allocation each time a request is counted or a store call timed).

use std::sync::OnceLock;
use std::time::Instant;

use metrics::{Key, Label, Level, Metadata};

/// Where the layer's metrics come from, as the macros would say.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

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
    Overloaded,
}

impl Outcome {
    /// Every outcome, in the order of [`Outcome::index`].
    const ALL: [Self; 15] = [
        Self::Fresh,
        Self::Takeover,
        Self::MissingKey,
        Self::InvalidKey,
        Self::TooLarge,
        Self::Invalid,
        Self::StoreUnavailable,
        Self::Mismatch,
        Self::Conflict,
        Self::Replay,
        Self::Released,
        Self::ClaimLost,
        Self::Kept,
        Self::CompletedOutsideTransaction,
        Self::Overloaded,
    ];

    /// Where this outcome stands in [`Outcome::ALL`].
    fn index(self) -> usize {
        self as usize
    }

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
            Self::Overloaded => "overloaded",
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
    /// Every operation, in the order of [`StoreOp::index`].
    const ALL: [Self; 3] = [Self::Claim, Self::Complete, Self::Release];

    /// Where this operation stands in [`StoreOp::ALL`].
    fn index(self) -> usize {
        self as usize
    }

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
    let key = &outcome_keys()[outcome.index()];
    metrics::with_recorder(|r| r.register_counter(key, &METADATA)).increment(1);
}

/// The keys of `idem_requests_total{outcome}`, by [`Outcome::index`].
fn outcome_keys() -> &'static [Key; Outcome::ALL.len()] {
    static KEYS: OnceLock<[Key; Outcome::ALL.len()]> = OnceLock::new();
    KEYS.get_or_init(|| {
        Outcome::ALL.map(|o| {
            Key::from_parts(
                "idem_requests_total",
                vec![Label::from_static_parts("outcome", o.label())],
            )
        })
    })
}

/// How many stores' timing keys are kept (a process has one or two); a
/// store beyond them has its key made for each call.
const KEPT_STORES: usize = 4;

/// The keys of `idem_store_seconds` for one store, by operation.
struct StoreKeys {
    store: &'static str,
    ops: [Key; 3],
}

impl StoreKeys {
    fn new(store: &'static str) -> Self {
        Self {
            store,
            ops: StoreOp::ALL.map(|op| store_key(store, op)),
        }
    }
}

/// The key of `idem_store_seconds{store, op}`.
fn store_key(store: &'static str, op: StoreOp) -> Key {
    Key::from_parts(
        "idem_store_seconds",
        vec![
            Label::from_static_parts("store", store),
            Label::from_static_parts("op", op.label()),
        ],
    )
}

/// Records how long a store operation took (`idem_store_seconds{store, op}`).
pub(crate) fn timed(store: &'static str, op: StoreOp, started: Instant) {
    static KEPT: [OnceLock<StoreKeys>; KEPT_STORES] = [const { OnceLock::new() }; KEPT_STORES];
    let seconds = started.elapsed().as_secs_f64();
    let kept = kept_keys(&KEPT, store);
    let record = |key: &Key| {
        metrics::with_recorder(|r| r.register_histogram(key, &METADATA)).record(seconds);
    };
    match kept {
        Some(keys) => record(&keys.ops[op.index()]),
        None => record(&store_key(store, op)),
    }
}

/// The keys of `store` in `slots`: in the first slot that holds them, or
/// that is free (then filled with them; a slot another store filled first
/// is passed over); `None` once every slot holds another store's.
fn kept_keys<'s>(slots: &'s [OnceLock<StoreKeys>], store: &'static str) -> Option<&'s StoreKeys> {
    slots
        .iter()
        .map(|slot| slot.get_or_init(|| StoreKeys::new(store)))
        .find(|keys| keys.store == store)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept keys are the ones the macros would make.
    #[test]
    fn keys_name_their_metric_and_labels() {
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome.index(), n);
            let key = &outcome_keys()[n];
            assert_eq!(key.name(), "idem_requests_total");
            let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
            assert_eq!(labels, [("outcome", outcome.label())]);
        }
        for (n, op) in StoreOp::ALL.into_iter().enumerate() {
            assert_eq!(op.index(), n);
        }
        // Two slots: the first two stores keep their keys, in the order
        // they came; a third store's are made for each call.
        let slots: [OnceLock<StoreKeys>; 2] = [const { OnceLock::new() }; 2];
        for store in ["memory", "redis", "memory", "other", "redis"] {
            let kept = kept_keys(&slots, store);
            assert_eq!(kept.map(|k| k.store), (store != "other").then_some(store));
        }
        assert_eq!(
            slots.each_ref().map(|s| s.get().map(|k| k.store)),
            [Some("memory"), Some("redis")]
        );
        for store in ["memory", "redis", "a", "b", "c", "d", "e"] {
            let keys = StoreKeys::new(store);
            for op in StoreOp::ALL {
                let key = &keys.ops[op.index()];
                assert_eq!(key.name(), "idem_store_seconds");
                let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
                assert_eq!(labels, [("store", store), ("op", op.label())]);
            }
        }
    }
}
