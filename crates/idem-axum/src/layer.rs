//! [`IdempotencyLayer`]: configuration shared by every service it wraps.

use std::fmt;
use std::sync::Arc;

use http::Method;
use idem_core::{Policy, Store};
use tower::Layer;

use crate::config::Config;
use crate::scope::ScopeExtractor;
use crate::service::IdempotencyService;

/// A tower [`Layer`] that makes `POST` and `PATCH` requests idempotent; see
/// the crate-level docs for the contract it implements.
///
/// ```
/// use std::sync::Arc;
/// use axum::{routing::post, Router};
/// use idem_axum::{IdempotencyLayer, SingleScope};
/// use idem_core::Policy;
/// use idem_memory::MemoryStore;
///
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()), Policy::default(), SingleScope("app".into()));
/// let app: Router = Router::new().route("/orders", post(|| async { "created" })).layer(layer);
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store`, applying `policy`, keying records by the scope
    /// that `scope` finds in each request. Guards `POST` and `PATCH`.
    pub fn new(store: Arc<dyn Store>, policy: Policy, scope: impl ScopeExtractor) -> Self {
        Self {
            config: Arc::new(Config {
                // Every call it makes ends within the policy's store
                // timeout: a partition costs a bounded wait (503).
                store: Arc::new(idem_once::BoundedStore::new(store, policy.store_timeout())),
                policy: Arc::new(policy),
                scope: Arc::new(scope),
                methods: vec![Method::POST, Method::PATCH],
                claim_in_handler: false,
                validate: None,
                max_running: None,
            }),
        }
    }

    /// A layer over `store`, like [`new`](Self::new), for a store of a
    /// type of its own: give the router's state the same store, for
    /// [`Guarded<S>`](crate::Guarded) handlers to complete their records
    /// in (the compiler checks its type).
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use idem_axum::{IdempotencyLayer, SingleScope};
    /// use idem_memory::MemoryStore;
    ///
    /// // Any store that clones as a handle (the SQL stores do); others in an Arc.
    /// let store = std::sync::Arc::new(MemoryStore::new());
    /// let layer = IdempotencyLayer::from_store(store, Default::default(), SingleScope("app".into()));
    /// let app: Router = Router::new().route("/orders", post(|| async { "created" }).route_layer(layer));
    /// ```
    pub fn from_store<S>(store: S, policy: Policy, scope: impl ScopeExtractor) -> Self
    where
        S: Store + Clone + 'static,
    {
        Self::new(Arc::new(store), policy, scope)
    }

    /// Replaces the set of guarded methods (default `POST` and `PATCH`).
    /// Other methods pass through untouched. To guard only some routes, put
    /// the layer on those routes (`route(..).layer(..)`) rather than on the
    /// whole router.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idem_axum::{IdempotencyLayer, SingleScope};
    /// use http::Method;
    /// let layer = IdempotencyLayer::new(Arc::new(idem_memory::MemoryStore::new()),
    ///     Default::default(), SingleScope("app".into()))
    ///     .methods([Method::POST, Method::PUT, Method::PATCH, Method::DELETE]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        Arc::make_mut(&mut self.config).methods = methods.into_iter().collect();
        self
    }

    /// Leaves the claim to the handler, which makes it with
    /// [`DeferredClaim::begin`](crate::DeferredClaim::begin) and gets the
    /// business transaction that holds it: the claim commits first (the key
    /// is bound to this request and its operation id before any effect),
    /// and the transaction holds it until it ends, so a crash or a rollback
    /// frees it at once instead of after the lease. The layer still checks
    /// the key and the body size, fingerprints the request, and settles the
    /// claim after the handler answers.
    ///
    /// Handlers extract [`DeferredClaim`](crate::DeferredClaim) instead of
    /// [`Idempotency`](crate::Idempotency). The trade-off is in
    /// [`ClaimInTransaction`](idem_core::ClaimInTransaction): the
    /// transaction stays open for the whole handler, holding a connection;
    /// a holder idle in it longer than the lease has its session ended by
    /// the database. Meant for short handlers.
    pub fn claim_in_transaction(mut self) -> Self {
        Arc::make_mut(&mut self.config).claim_in_handler = true;
        self
    }

    /// Checks each guarded request (its head and whole body) **before**
    /// its key is claimed. An `Err` is answered as it is and nothing is
    /// stored: the client may correct the request and send it again under
    /// the same key, as with Stripe, which saves nothing when parameters
    /// fail validation. Without it, a handler's `4xx` is an answer, stored
    /// and replayed (see the contract guide for which answers are stored).
    ///
    /// Validate here what decides whether the request can run at all
    /// (its syntax, its bounds, its headers); leave to the handler what
    /// depends on the state (a missing account, a declined card), whose
    /// answer is stored.
    ///
    /// Where keys are optional ([`require_key(false)`](idem_core::PolicyBuilder::require_key)),
    /// a guarded route's request without a key is checked too (its body
    /// read whole, within the policy's `max_body`, `413` past it), so a
    /// handler may count on the check having passed either way.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use axum::{http::StatusCode, response::IntoResponse};
    /// use idem_axum::{IdempotencyLayer, SingleScope};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(idem_memory::MemoryStore::new()),
    ///     Default::default(), SingleScope("app".into()))
    ///     .validate(|_parts, body| match serde_json::from_slice::<serde_json::Value>(body) {
    ///         Ok(v) if v["amount"].as_i64().is_some_and(|a| a > 0) => Ok(()),
    ///         _ => Err((StatusCode::BAD_REQUEST, "amount must be a positive integer").into_response()),
    ///     });
    /// ```
    pub fn validate<F>(mut self, check: F) -> Self
    where
        F: Fn(&http::request::Parts, &bytes::Bytes) -> Result<(), axum::response::Response>
            + Send
            + Sync
            + 'static,
    {
        Arc::make_mut(&mut self.config).validate = Some(Arc::new(check));
        self
    }

    /// Refuses a new guarded request while `n` guarded requests run in
    /// this process (`503 overloaded` with `Retry-After`; nothing read or
    /// claimed; `n` is at least 1). A request counts from the moment it is
    /// let in (its body still to read) until its handler's task ends, even
    /// after its client went away: a request cut off mid-way runs on to
    /// store its answer, so without a bound a client that sends a request
    /// and hangs up, again and again (over HTTP/2, by resetting streams on
    /// one connection), starts handlers without end. The count is the
    /// process's (`idem_once::detached::running`, gRPC's guarded calls
    /// too); replays, `409`s and waits for a request in flight count while
    /// they are served. Unbounded by default; [`serve`](crate::serve) also
    /// stops accepting connections while as many handlers run on whose
    /// clients went away as it allows connections.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use idem_axum::{IdempotencyLayer, SingleScope};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(idem_memory::MemoryStore::new()),
    ///     Default::default(), SingleScope("app".into()))
    ///     .max_running(1024);
    /// # let _ = layer;
    /// ```
    pub fn max_running(mut self, n: usize) -> Self {
        Arc::make_mut(&mut self.config).max_running = Some(n);
        self
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The store records go to.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.config.store
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.config.store)
            .field("policy", &self.config.policy)
            .field("methods", &self.config.methods)
            .field("claim_in_handler", &self.config.claim_in_handler)
            .field("validates", &self.config.validate.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.config.clone())
    }
}
