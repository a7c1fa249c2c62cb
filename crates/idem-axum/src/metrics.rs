//! What the layer counts and times. Labels never carry keys or scopes.

use std::time::Instant;

/// Counts one request by how it ended (`idem_requests_total{outcome}`).
pub(crate) fn count(outcome: &'static str) {
    metrics::counter!("idem_requests_total", "outcome" => outcome).increment(1);
}

/// Records how long a store operation took (`idem_store_seconds{store, op}`).
pub(crate) fn timed(store: &'static str, op: &'static str, started: Instant) {
    metrics::histogram!("idem_store_seconds", "store" => store, "op" => op)
        .record(started.elapsed().as_secs_f64());
}
