//! [`IdempotencyLayer`]: which methods are guarded, how, and for whom.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use idem_core::{Policy, Store};
use tonic::Status;
use tower::Layer;

use crate::service::IdempotencyService;

/// Finds the scope (tenant, authenticated peer) of a call. Keys are only
/// ever compared within one scope, so a key sent by client A is invisible
/// to client B.
///
/// `Err(status)` refuses the call with that status (`UNAUTHENTICATED`,
/// say): a call without a scope is never put in a shared one.
///
/// Any `Fn(&Parts) -> Result<String, Status>` is one: the metadata are the
/// request's headers, and the extensions hold what the transport and the
/// layers before this one put there (tonic's `TcpConnectInfo`, the peer's
/// TLS certificates, your authentication's identity).
///
/// ```
/// use http::request::Parts;
/// use tonic::Status;
///
/// let by_token = |parts: &Parts| {
///     parts.headers.get("authorization")
///         .and_then(|v| v.to_str().ok())
///         .and_then(|v| v.strip_prefix("Bearer "))
///         .map(str::to_owned)
///         .ok_or_else(|| Status::unauthenticated("send authorization: Bearer <token>"))
/// };
/// # fn check(_: impl idem_tonic::ScopeExtractor) {}
/// check(by_token);
/// ```
pub trait ScopeExtractor: Send + Sync + 'static {
    /// The scope of the call, or the status that refuses it.
    fn scope(&self, parts: &Parts) -> Result<String, Status>;
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Result<String, Status> + Send + Sync + 'static,
{
    fn scope(&self, parts: &Parts) -> Result<String, Status> {
        self(parts)
    }
}

/// One scope for every call: for services with a single client, or whose
/// keys are globally unique by construction. Choosing it is explicit, so a
/// shared scope is never an accident.
#[derive(Debug, Clone)]
pub struct SingleScope(pub String);

impl ScopeExtractor for SingleScope {
    fn scope(&self, _: &Parts) -> Result<String, Status> {
        Ok(self.0.clone())
    }
}

/// The scope is the value of one metadata entry that your authentication
/// (a gateway, or a layer before this one) set. A call without it, with it
/// twice, or with an empty or non-visible-ASCII value, is refused with
/// `UNAUTHENTICATED`.
///
/// ```
/// use idem_tonic::{MetadataScope, ScopeExtractor};
/// let scope = MetadataScope::new("x-client-id");
/// let (ok, _) = http::Request::post("/").header("x-client-id", "acme").body(()).unwrap().into_parts();
/// assert_eq!(scope.scope(&ok).unwrap(), "acme");
/// let (missing, _) = http::Request::post("/").body(()).unwrap().into_parts();
/// assert_eq!(scope.scope(&missing).unwrap_err().code(), tonic::Code::Unauthenticated);
/// ```
#[derive(Debug, Clone)]
pub struct MetadataScope(String);

impl MetadataScope {
    /// Scopes by the metadata entry `name` (matched case-insensitively).
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into().to_ascii_lowercase())
    }
}

impl ScopeExtractor for MetadataScope {
    fn scope(&self, parts: &Parts) -> Result<String, Status> {
        let values = parts.headers.get_all(self.0.as_str()).iter();
        idem_core::single_visible_value(values.map(http::HeaderValue::as_bytes))
            .map(str::to_owned)
            .ok_or_else(|| {
                crate::LayerRefusal::ScopeMissing.status(
                    tonic::Code::Unauthenticated,
                    format!(
                        "the {} metadata (set by authentication) is missing or invalid",
                        self.0
                    ),
                )
            })
    }
}

/// Reads a guarded method's message: decodes it (refusing what does not
/// decode), checks it, and gives its canonical encoding for the
/// fingerprint.
pub(crate) type ReadMessage = dyn Fn(&Parts, &[u8]) -> Result<Vec<u8>, Status> + Send + Sync;

/// One guarded method.
#[derive(Clone)]
pub(crate) struct Guarded {
    pub(crate) read: Arc<ReadMessage>,
}

/// What every service the layer wraps shares.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) scope: Arc<dyn ScopeExtractor>,
    pub(crate) methods: HashMap<String, Guarded>,
    pub(crate) replayed_metadata: Vec<String>,
    /// Guarded handlers running in this process past which a new guarded
    /// call is refused.
    pub(crate) max_running: Option<usize>,
}

impl Config {
    /// Whether the metadata entry `name` is stored and replayed.
    pub(crate) fn replays(&self, name: &str) -> bool {
        self.replayed_metadata.iter().any(|n| n == name)
    }
}

/// A tower [`Layer`] that makes chosen unary methods of a tonic server
/// idempotent; see the crate-level docs for the contract.
///
/// Put it on the server (`Server::builder().layer(layer)`) or on one
/// service. Only the methods named with [`unary`](Self::unary) (or
/// [`unary_checked`](Self::unary_checked)) are guarded; every other call
/// passes through untouched.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store`, applying `policy` (its lease, retention, wait,
    /// retry hint, size limit, whether the key is required and whether
    /// error statuses are stored), keying records by the scope `scope`
    /// finds in each call. It guards no method until told which.
    pub fn new(store: Arc<dyn Store>, policy: Policy, scope: impl ScopeExtractor) -> Self {
        Self {
            config: Arc::new(Config {
                // Every call it makes ends within the policy's store
                // timeout: a partition costs a bounded wait (503).
                store: Arc::new(idem_once::BoundedStore::new(store, policy.store_timeout())),
                policy: Arc::new(policy),
                scope: Arc::new(scope),
                methods: HashMap::new(),
                replayed_metadata: Vec::new(),
                max_running: None,
            }),
        }
    }

    /// Guards the unary method at `path` (`/package.Service/Method`, as
    /// tonic routes it), whose request message is `M`. The fingerprint is
    /// taken over `M` decoded and encoded again: two encodings of one
    /// message (fields in another order, a default value sent or left
    /// out, fields `M` does not know) are the same request. A message that
    /// does not decode as `M` is `INVALID_ARGUMENT`, and nothing is stored.
    ///
    /// `map` fields: prost decodes them into a `HashMap` by default, whose
    /// order (and so the encoding, and the fingerprint) differs from one
    /// decoding to the next. Generate such messages with
    /// `prost_build::Config::btree_map(["."])` (ordered by key), or a
    /// retry of the same call may be refused as another request.
    pub fn unary<M>(self, path: impl Into<String>) -> Self
    where
        M: prost::Message + Default + 'static,
    {
        self.unary_checked::<M, _>(path, |_, _| Ok(()))
    }

    /// Like [`unary`](Self::unary), and checks each decoded message
    /// **before** its key is claimed. An `Err` is sent as it is and
    /// nothing is stored, so the client may correct the call and send it
    /// again under the same key. Check here what decides whether the call
    /// can run at all (its bounds, its syntax); leave to the handler what
    /// depends on the state (a missing account), whose answer is stored.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use idem_tonic::{IdempotencyLayer, SingleScope};
    /// use tonic::Status;
    ///
    /// #[derive(Clone, PartialEq, prost::Message)]
    /// struct Charge {
    ///     #[prost(int64, tag = "1")]
    ///     amount: i64,
    /// }
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(idem_memory::MemoryStore::new()),
    ///     Default::default(), SingleScope("app".into()))
    ///     .unary_checked("/bank.v1.Bank/Charge", |_parts, charge: &Charge| {
    ///         if charge.amount > 0 { Ok(()) } else { Err(Status::invalid_argument("amount must be positive")) }
    ///     });
    /// ```
    pub fn unary_checked<M, F>(mut self, path: impl Into<String>, check: F) -> Self
    where
        M: prost::Message + Default + 'static,
        F: Fn(&Parts, &M) -> Result<(), Status> + Send + Sync + 'static,
    {
        let read = move |parts: &Parts, bytes: &[u8]| {
            let message = M::decode(bytes).map_err(|e| {
                crate::LayerRefusal::MessageUnreadable.status(
                    tonic::Code::InvalidArgument,
                    format!("the request message does not decode: {e}"),
                )
            })?;
            check(parts, &message)?;
            Ok(message.encode_to_vec())
        };
        // As gRPC sends it, `/package.Service/Method`: one written without
        // its leading slash is taken as meant (it would never match, and
        // every call would pass through unguarded).
        let path = path.into();
        let path = if path.starts_with('/') {
            path
        } else {
            format!("/{path}")
        };
        Arc::make_mut(&mut self.config).methods.insert(
            path,
            Guarded {
                read: Arc::new(read),
            },
        );
        self
    }

    /// Stores and replays the metadata entry `name` (in the answer's
    /// headers or trailers). By default a replay carries only what a
    /// client needs to read it: the content type and the status
    /// (`grpc-status`, `grpc-message`, `grpc-status-details-bin`). Never
    /// name what is meant for one caller (a session, a cookie): those that
    /// HTTP never replays ([`idem_core::policy::NEVER_REPLAYED`], `set-cookie` and
    /// `authorization` among them) are not replayed even if named.
    pub fn replay_metadata(mut self, name: impl Into<String>) -> Self {
        let name = name.into().to_ascii_lowercase();
        if !idem_core::policy::NEVER_REPLAYED.contains(&name.as_str()) {
            Arc::make_mut(&mut self.config).replayed_metadata.push(name);
        }
        self
    }

    /// Refuses a new guarded call while `n` guarded calls run in this
    /// process (`UNAVAILABLE` with a retry hint, reason
    /// `IDEMPOTENCY_OVERLOADED`; nothing read or claimed; `n` is at least
    /// 1). A call counts from the moment it is let in (its message still
    /// to read) until its handler's task ends, even after its caller went
    /// away: a call cancelled mid-way runs on to store its answer, so
    /// without a bound a client that opens a call and cancels it, again
    /// and again on one connection, starts handlers without end (the
    /// connection's stream limit counts only calls still open). The count
    /// is the process's (`idem_once::detached::running`, HTTP's guarded
    /// requests too); replays and refusals count while they are served.
    /// Unbounded by default.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// let layer = idem_tonic::IdempotencyLayer::new(
    ///     Arc::new(idem_memory::MemoryStore::new()),
    ///     Default::default(),
    ///     idem_tonic::MetadataScope::new("x-client-id"),
    /// )
    /// .max_running(1024);
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
        let mut methods: Vec<_> = self.config.methods.keys().collect();
        methods.sort();
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.config.store)
            .field("policy", &self.config.policy)
            .field("methods", &methods)
            .field("replayed_metadata", &self.config.replayed_metadata)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Charge {
        #[prost(string, tag = "1")]
        account: String,
        #[prost(int64, tag = "2")]
        amount: i64,
    }

    fn read(layer: &IdempotencyLayer, bytes: &[u8]) -> Result<Vec<u8>, Status> {
        let (parts, _) = http::Request::post("/").body(()).unwrap().into_parts();
        (layer.config.methods["/b.Bank/Charge"].read)(&parts, bytes)
    }

    /// Metadata named for replay is replayed, but never a cookie or a
    /// credential, whatever is named.
    #[test]
    fn what_is_never_replayed_stays_so_when_named() {
        let layer = IdempotencyLayer::new(
            Arc::new(idem_memory::MemoryStore::new()),
            Policy::default(),
            SingleScope("s".into()),
        )
        .replay_metadata("X-Cost")
        .replay_metadata("set-cookie")
        .replay_metadata("authorization");
        assert!(layer.config.replays("x-cost"));
        assert!(!layer.config.replays("set-cookie"));
        assert!(!layer.config.replays("authorization"));
        assert!(!layer.config.replays("x-other"));
    }

    /// Two encodings of one message are one request; another message is not.
    #[test]
    fn the_fingerprinted_form_is_the_decoded_message() {
        let layer = IdempotencyLayer::new(
            Arc::new(idem_memory::MemoryStore::new()),
            Policy::default(),
            SingleScope("s".into()),
        )
        .unary::<Charge>("/b.Bank/Charge");
        // account "a" (field 1) then amount 5 (field 2), as prost writes it
        let in_order = b"\x0a\x01a\x10\x05";
        // the same fields the other way round, an explicit default-valued
        // field 1 first (overwritten), and an unknown field 9
        let reordered = b"\x0a\x00\x10\x05\x0a\x01a\x48\x01";
        assert_eq!(
            read(&layer, in_order).unwrap(),
            read(&layer, reordered).unwrap()
        );
        assert_ne!(
            read(&layer, in_order).unwrap(),
            read(&layer, b"\x0a\x01a\x10\x06").unwrap()
        );
        // amount 0 sent or left out: the same
        assert_eq!(
            read(&layer, b"\x0a\x01a\x10\x00").unwrap(),
            read(&layer, b"\x0a\x01a").unwrap()
        );
        let refused = read(&layer, b"\x0a\x05ab").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused.message().contains("does not decode"),
            "{}",
            refused.message()
        );
    }
}
