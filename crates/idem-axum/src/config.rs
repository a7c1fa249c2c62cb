//! What the layer shares with every service it wraps.

use std::sync::Arc;

use http::Method;
use idem_core::{Policy, Store};

use crate::scope::ScopeExtractor;

/// Checks a guarded request before its key is claimed: `Err` is the answer
/// (a `400`), and nothing is stored.
pub(crate) type Validator = dyn Fn(&http::request::Parts, &bytes::Bytes) -> Result<(), axum::response::Response>
    + Send
    + Sync;

/// What every service the layer wraps shares; cloned on write
/// ([`Arc::make_mut`]) by the builder methods.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) scope: Arc<dyn ScopeExtractor>,
    pub(crate) methods: Vec<Method>,
    pub(crate) claim_in_handler: bool,
    pub(crate) validate: Option<Arc<Validator>>,
    /// Guarded handlers running in this process past which a new guarded
    /// request is refused.
    pub(crate) max_running: Option<usize>,
}
