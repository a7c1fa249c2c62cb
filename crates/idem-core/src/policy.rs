//! The knobs of idempotency handling, validated in one place.

use std::time::Duration;

/// Headers replayed by default: they describe the response, not the session.
/// (`Content-Encoding` is kept whatever the lists say: see
/// [`Policy::replays_header`].)
pub const DEFAULT_REPLAYED_HEADERS: &[&str] = &["location", "content-type", "etag", "retry-after"];

/// Headers that are never stored or replayed, whatever the allow-list says:
/// they belong to a session or to one connection, or each answer gets them
/// afresh (`Date`). Every name of [`NOT_REPLAYED_WITH_ALL`] is here too.
pub const NEVER_REPLAYED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authenticate",
    "proxy-authorization",
    "www-authenticate",
    "connection",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "content-length",
    "keep-alive",
    "upgrade",
    "date",
    "idempotent-replayed",
];

/// Headers never replayed when every other header is
/// ([`PolicyBuilder::replay_all_headers`], as `idem proxy` does): the
/// hop-by-hop ones (RFC 9110 §7.6.1), those of a session (`Set-Cookie`),
/// and those each answer gets afresh (`Date`, `Content-Length`).
pub const NOT_REPLAYED_WITH_ALL: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authenticate",
    "proxy-authorization",
    "set-cookie",
    "set-cookie2",
    "date",
    "content-length",
    "idempotent-replayed",
];

/// How idempotent requests are handled. Build one with [`Policy::builder`];
/// [`Policy::default`] gives the documented defaults.
///
/// ```
/// use std::time::Duration;
/// use idem_core::Policy;
///
/// let policy = Policy::builder()
///     .lease(Duration::from_secs(10))
///     .wait_for_in_flight(Duration::from_secs(2))
///     .replay_header("x-request-cost")
///     .build()
///     .unwrap();
/// assert_eq!(policy.retention(), Duration::from_secs(24 * 3600));
/// assert!(policy.replays_header("X-Request-Cost"));
/// assert!(policy.replays_header("location"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    retention: Duration,
    lease: Duration,
    wait: Option<Duration>,
    retry_after: Duration,
    max_body: usize,
    replayed_headers: Vec<String>,
    replay_all: bool,
    not_replayed: Vec<String>,
    store_client_errors: bool,
    released_client_errors: Vec<u16>,
    require_key: bool,
    store_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            wait: None,
            retry_after: Duration::from_secs(1),
            max_body: 1024 * 1024,
            replayed_headers: DEFAULT_REPLAYED_HEADERS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            replay_all: false,
            not_replayed: Vec::new(),
            store_client_errors: true,
            released_client_errors: DEFAULT_RELEASED_CLIENT_ERRORS.to_vec(),
            require_key: true,
            store_timeout: DEFAULT_STORE_TIMEOUT,
        }
    }
}

/// The `4xx` answers a default policy releases rather than stores:
/// `408 Request Timeout`, `425 Too Early` and `429 Too Many Requests`. Each
/// says "try again later", not what became of the request: a rate limiter
/// or a timeout inside the layer answered instead of the handler (or the
/// handler was cut off mid-way), so storing it would answer every retry
/// with it for the whole retention, and the request would never run. The
/// retry runs afresh under the same operation id.
pub const DEFAULT_RELEASED_CLIENT_ERRORS: [u16; 3] = [408, 425, 429];

/// The default [`Policy::store_timeout`]: 5 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest lease, retention or wait a policy takes: a century (of
/// 366-day years), which every store can hold and add to its clock. A
/// longer one is refused ([`PolicyError::TooLong`]) rather than meaning
/// "for ever" on some stores and failing every claim on others; a store
/// given a longer one in a [`ClaimRequest`](crate::ClaimRequest) of its own
/// making keeps it to this.
pub const LONGEST: Duration = Duration::from_secs(100 * 366 * 24 * 60 * 60);

/// `d` in whole milliseconds, at most [`LONGEST`]'s: what a store binds
/// for a lease or a retention.
pub fn capped_millis(d: Duration) -> i64 {
    const MAX: i64 = LONGEST.as_secs() as i64 * 1000;
    i64::try_from(d.as_millis()).map_or(MAX, |ms| ms.min(MAX))
}

impl Policy {
    /// A builder starting from the defaults.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder {
            policy: Self::default(),
            not_a_client_error: None,
        }
    }

    /// A builder starting from this policy's settings.
    ///
    /// ```
    /// let strict = idem_core::Policy::default();
    /// let lenient = strict.to_builder().require_key(false).build().unwrap();
    /// assert_eq!(lenient.lease(), strict.lease());
    /// assert!(!lenient.require_key());
    /// ```
    pub fn to_builder(&self) -> PolicyBuilder {
        PolicyBuilder {
            policy: self.clone(),
            not_a_client_error: None,
        }
    }

    /// How long a record counts after its first claim (default 24 h). After
    /// it, the key is new again.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How long a holder may run before a retry may take its claim over
    /// (default 30 s).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How long one call to the store may take before the edges (the axum
    /// and tonic layers, the proxy) give up on the calls they make
    /// themselves (default 5 s; what a handler runs in its own transaction
    /// is the handler's to bound): a claim or
    /// a read then answers `503` with `Retry-After` (the request did not
    /// run), a completion that gets no answer leaves the claim to its lease,
    /// and a release leaves it to its lease. A network partition between
    /// the service and its store therefore costs a bounded wait, never a
    /// request that hangs until the partition heals.
    pub fn store_timeout(&self) -> Duration {
        self.store_timeout
    }

    /// How long a duplicate of an in-flight request waits for the original to
    /// finish before it gets `409` (default `None`: answer `409` at once).
    pub fn wait(&self) -> Option<Duration> {
        self.wait
    }

    /// The `Retry-After` a `409` suggests while a request is in flight
    /// (default 1 s), never longer than the rest of the holder's lease.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// The largest request body accepted, in bytes (default 1 MiB).
    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// The lowercase names of the headers kept for replay.
    pub fn replayed_headers(&self) -> &[String] {
        &self.replayed_headers
    }

    /// Whether every response header is kept for replay except
    /// [`NOT_REPLAYED_WITH_ALL`] and those named by
    /// [`PolicyBuilder::never_replay_header`] (default `false`: only the
    /// allow-list).
    pub fn replays_all_headers(&self) -> bool {
        self.replay_all
    }

    /// Whether a response header is kept for replay (case-insensitive).
    /// `Content-Encoding` always is: the body is kept as the handler sent
    /// it (compressed by a layer inside idem's, say), and replayed without
    /// the header that says how to read it, it would be garbage.
    ///
    /// ```
    /// let p = idem_core::Policy::builder().never_replay_header("content-encoding").build().unwrap();
    /// assert!(p.replays_header("Content-Encoding"));
    /// ```
    pub fn replays_header(&self, name: &str) -> bool {
        if name.eq_ignore_ascii_case("content-encoding") {
            return true;
        }
        // Every list holds lowercase names (the builder lowercases them):
        // `name` is compared with each case-insensitively, not copied.
        let named = |n: &str| n.eq_ignore_ascii_case(name);
        if self.not_replayed.iter().any(|n| named(n)) {
            return false;
        }
        if self.replay_all {
            !NOT_REPLAYED_WITH_ALL.iter().any(|n| named(n))
        } else {
            !NEVER_REPLAYED.iter().any(|n| named(n))
                && self.replayed_headers.iter().any(|n| named(n))
        }
    }

    /// Whether `4xx` answers are stored and replayed (default yes), but
    /// those [`releases_client_error`](Self::releases_client_error) names
    /// (`408`, `425` and `429` by default).
    pub fn store_client_errors(&self) -> bool {
        self.store_client_errors
    }

    /// Whether a `4xx` answer of `status` releases the claim rather than
    /// being stored: every `4xx` when [`store_client_errors`](Self::store_client_errors)
    /// is `false`; otherwise those of
    /// [`DEFAULT_RELEASED_CLIENT_ERRORS`], as changed by
    /// [`PolicyBuilder::release_client_error`] and
    /// [`PolicyBuilder::store_client_error`]. Any other status: `false`
    /// (a `5xx` always releases; see [`on_handler_end`](crate::on_handler_end)).
    ///
    /// ```
    /// let p = idem_core::Policy::default();
    /// assert!(p.releases_client_error(429));
    /// assert!(!p.releases_client_error(404));
    /// assert!(!p.releases_client_error(503));
    /// ```
    pub fn releases_client_error(&self, status: u16) -> bool {
        (400..=499).contains(&status)
            && (!self.store_client_errors || self.released_client_errors.contains(&status))
    }

    /// Whether a guarded request without a key is refused with `400`
    /// (default yes) or passed through unguarded.
    pub fn require_key(&self) -> bool {
        self.require_key
    }
}

/// Builds a [`Policy`]; see [`Policy::builder`].
#[derive(Debug, Clone)]
pub struct PolicyBuilder {
    policy: Policy,
    /// The first status given as a client error that is not one.
    not_a_client_error: Option<u16>,
}

/// A policy that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The lease is zero, or shorter than a millisecond (stores count
    /// leases in whole milliseconds: one shorter would end as it began).
    #[error("the lease must be at least a millisecond")]
    ZeroLease,
    /// The retention is not longer than the lease.
    #[error("the retention ({retention:?}) must be longer than the lease ({lease:?})")]
    RetentionNotAboveLease {
        /// The retention asked for.
        retention: Duration,
        /// The lease asked for.
        lease: Duration,
    },
    /// The body limit is zero.
    #[error("the largest body must be at least one byte")]
    ZeroBodyLimit,
    /// The store timeout is zero.
    #[error("the store timeout must be longer than zero")]
    ZeroStoreTimeout,
    /// A duration is longer than [`LONGEST`] (a century): a "for ever"
    /// that not every store can add to its clock.
    #[error("the {setting} ({asked:?}) is longer than a century, the longest every store keeps")]
    TooLong {
        /// Which setting: `lease`, `retention`, `wait`, `store timeout` or
        /// `retry after`.
        setting: &'static str,
        /// What was asked for.
        asked: Duration,
    },
    /// A header on the allow-list is not a valid header name.
    #[error("{0:?} is not a valid header name")]
    InvalidHeaderName(String),
    /// A header on the allow-list is one that must never be replayed.
    #[error("{0:?} is tied to a session or a connection and is never replayed")]
    ForbiddenHeader(String),
    /// A status given to [`PolicyBuilder::release_client_error`] or
    /// [`PolicyBuilder::store_client_error`] is not a `4xx` (a `5xx`
    /// always releases, anything below `400` is always stored).
    #[error("{0} is not a client error (4xx): only those can be told to be stored or released")]
    NotAClientError(u16),
}

impl PolicyBuilder {
    /// How long records count (default 24 h).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let p = idem_core::Policy::builder().retention(Duration::from_secs(3600)).build().unwrap();
    /// assert_eq!(p.retention(), Duration::from_secs(3600));
    /// ```
    pub fn retention(mut self, d: Duration) -> Self {
        self.policy.retention = d;
        self
    }

    /// How long one store call may take (default 5 s); see
    /// [`Policy::store_timeout`].
    ///
    /// ```
    /// # use std::time::Duration;
    /// let p = idem_core::Policy::builder().store_timeout(Duration::from_secs(2)).build().unwrap();
    /// assert_eq!(p.store_timeout(), Duration::from_secs(2));
    /// assert!(idem_core::Policy::builder().store_timeout(Duration::ZERO).build().is_err());
    /// ```
    pub fn store_timeout(mut self, d: Duration) -> Self {
        self.policy.store_timeout = d;
        self
    }

    /// How long a holder's lease lasts (default 30 s).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let p = idem_core::Policy::builder().lease(Duration::from_secs(5)).build().unwrap();
    /// assert_eq!(p.lease(), Duration::from_secs(5));
    /// ```
    pub fn lease(mut self, d: Duration) -> Self {
        self.policy.lease = d;
        self
    }

    /// Let duplicates of an in-flight request wait up to `d` for it, then
    /// replay its answer (default: don't wait, answer `409`). A zero duration
    /// turns waiting off.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let p = idem_core::Policy::builder().wait_for_in_flight(Duration::from_millis(500)).build().unwrap();
    /// assert_eq!(p.wait(), Some(Duration::from_millis(500)));
    /// ```
    pub fn wait_for_in_flight(mut self, d: Duration) -> Self {
        self.policy.wait = (!d.is_zero()).then_some(d);
        self
    }

    /// How long a `409` for an in-flight request tells the client to wait
    /// before retrying (`Retry-After`, default 1 s, whole seconds, at least
    /// one): a hint, since the original usually answers in milliseconds.
    /// Never more than the rest of the holder's lease.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let p = idem_core::Policy::builder().retry_after(Duration::from_secs(2)).build().unwrap();
    /// assert_eq!(p.retry_after(), Duration::from_secs(2));
    /// ```
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.policy.retry_after = d;
        self
    }

    /// The largest request body accepted, in bytes (default 1 MiB).
    ///
    /// ```
    /// let p = idem_core::Policy::builder().max_body(64 * 1024).build().unwrap();
    /// assert_eq!(p.max_body(), 65536);
    /// ```
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.policy.max_body = bytes;
        self
    }

    /// Adds a header to the replay allow-list (besides `Location`,
    /// `Content-Type`, `ETag` and `Retry-After`).
    ///
    /// ```
    /// let p = idem_core::Policy::builder().replay_header("X-Trace").build().unwrap();
    /// assert!(p.replays_header("x-trace"));
    /// ```
    pub fn replay_header(mut self, name: impl Into<String>) -> Self {
        let name = name.into().to_ascii_lowercase();
        if !self.policy.replayed_headers.contains(&name) {
            self.policy.replayed_headers.push(name);
        }
        self
    }

    /// Keeps every response header for replay, except the hop-by-hop ones,
    /// `Set-Cookie`, `Date` and `Content-Length` ([`NOT_REPLAYED_WITH_ALL`])
    /// and those named by [`never_replay_header`](Self::never_replay_header):
    /// for a gateway that cannot know which headers its upstream's answers
    /// carry. The allow-list is then unused.
    ///
    /// ```
    /// let p = idem_core::Policy::builder().replay_all_headers()
    ///     .never_replay_header("X-Request-Id").build().unwrap();
    /// assert!(p.replays_header("x-anything") && p.replays_header("www-authenticate"));
    /// assert!(!p.replays_header("Set-Cookie") && !p.replays_header("date"));
    /// assert!(!p.replays_header("x-request-id") && !p.replays_header("connection"));
    /// ```
    pub fn replay_all_headers(mut self) -> Self {
        self.policy.replay_all = true;
        self
    }

    /// Never keeps the header `name` for replay, whatever else says so
    /// (a per-answer id, a trace header); `Content-Encoding` excepted,
    /// which describes the stored body.
    ///
    /// ```
    /// let p = idem_core::Policy::builder().replay_header("x-trace")
    ///     .never_replay_header("X-Trace").build().unwrap();
    /// assert!(!p.replays_header("x-trace"));
    /// ```
    pub fn never_replay_header(mut self, name: impl Into<String>) -> Self {
        let name = name.into().to_ascii_lowercase();
        if !self.policy.not_replayed.contains(&name) {
            self.policy.not_replayed.push(name);
        }
        self
    }

    /// Whether `4xx` answers are stored and replayed (default `true`), but
    /// the "try again later" ones ([`DEFAULT_RELEASED_CLIENT_ERRORS`]; see
    /// [`release_client_error`](Self::release_client_error)). With
    /// `false`, every `4xx` releases the claim like a `5xx` does. `5xx`
    /// answers always release.
    ///
    /// ```
    /// let p = idem_core::Policy::builder().store_client_errors(false).build().unwrap();
    /// assert!(!p.store_client_errors());
    /// ```
    pub fn store_client_errors(mut self, yes: bool) -> Self {
        self.policy.store_client_errors = yes;
        self
    }

    /// Releases the claim on a `4xx` answer of `status` instead of storing
    /// it: the answer says "try again later", not what became of the
    /// request, as [`DEFAULT_RELEASED_CLIENT_ERRORS`] (`408`, `425`, `429`)
    /// do. A status outside `400..=499` is refused at
    /// [`build`](Self::build) ([`PolicyError::NotAClientError`]).
    ///
    /// ```
    /// let p = idem_core::Policy::builder().release_client_error(423).build().unwrap();
    /// assert!(p.releases_client_error(423));
    /// assert!(p.releases_client_error(429));
    /// ```
    pub fn release_client_error(mut self, status: u16) -> Self {
        if (400..=499).contains(&status) {
            let released = &mut self.policy.released_client_errors;
            if let Err(at) = released.binary_search(&status) {
                // Kept in order: two policies that release the same
                // statuses are equal.
                released.insert(at, status);
            }
        } else {
            self.not_a_client_error.get_or_insert(status);
        }
        self
    }

    /// Stores a `4xx` answer of `status` like any other, one of
    /// [`DEFAULT_RELEASED_CLIENT_ERRORS`] too: for a service whose `429`
    /// is its answer (a quota spent for the day, say) rather than "come
    /// back in a moment". A status outside `400..=499` is refused at
    /// [`build`](Self::build) ([`PolicyError::NotAClientError`]).
    ///
    /// ```
    /// let p = idem_core::Policy::builder().store_client_error(429).build().unwrap();
    /// assert!(!p.releases_client_error(429));
    /// assert!(p.releases_client_error(408));
    /// ```
    pub fn store_client_error(mut self, status: u16) -> Self {
        if (400..=499).contains(&status) {
            self.policy.released_client_errors.retain(|s| *s != status);
        } else {
            self.not_a_client_error.get_or_insert(status);
        }
        self
    }

    /// Whether a guarded request must carry a key (default `true`: `400`
    /// without one). With `false`, requests without a key pass through
    /// (checked by the route's validator, where the edge has one)
    /// unguarded.
    ///
    /// ```
    /// let p = idem_core::Policy::builder().require_key(false).build().unwrap();
    /// assert!(!p.require_key());
    /// ```
    pub fn require_key(mut self, yes: bool) -> Self {
        self.policy.require_key = yes;
        self
    }

    /// Checks the settings and returns the policy.
    pub fn build(self) -> Result<Policy, PolicyError> {
        if let Some(status) = self.not_a_client_error {
            return Err(PolicyError::NotAClientError(status));
        }
        let p = self.policy;
        let durations = [
            ("lease", Some(p.lease)),
            ("retention", Some(p.retention)),
            ("wait", p.wait),
            ("store timeout", Some(p.store_timeout)),
            ("retry after", Some(p.retry_after)),
        ];
        for (setting, asked) in durations {
            if let Some(asked) = asked.filter(|d| *d > LONGEST) {
                return Err(PolicyError::TooLong { setting, asked });
            }
        }
        if p.lease < Duration::from_millis(1) {
            return Err(PolicyError::ZeroLease);
        }
        if p.retention <= p.lease {
            return Err(PolicyError::RetentionNotAboveLease {
                retention: p.retention,
                lease: p.lease,
            });
        }
        if p.max_body == 0 {
            return Err(PolicyError::ZeroBodyLimit);
        }
        if p.store_timeout.is_zero() {
            return Err(PolicyError::ZeroStoreTimeout);
        }
        let valid = |name: &str| {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        };
        for name in &p.replayed_headers {
            if !valid(name) {
                return Err(PolicyError::InvalidHeaderName(name.clone()));
            }
            if NEVER_REPLAYED.contains(&name.as_str()) {
                return Err(PolicyError::ForbiddenHeader(name.clone()));
            }
        }
        if let Some(name) = p.not_replayed.iter().find(|n| !valid(n)) {
            return Err(PolicyError::InvalidHeaderName(name.clone()));
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "for ever" past a century is refused, whichever duration it is:
    /// PostgreSQL's interval and Redis's expiry failed every claim with it
    /// while SQLite and MySQL kept a century, and a wait or a lease that
    /// long overflowed the clock it was added to (a panic).
    #[test]
    fn durations_past_a_century_are_refused() {
        let too_long = LONGEST + Duration::from_millis(1);
        let builders = [
            (
                "lease",
                Policy::builder().lease(too_long).retention(Duration::MAX),
            ),
            ("retention", Policy::builder().retention(Duration::MAX)),
            ("wait", Policy::builder().wait_for_in_flight(Duration::MAX)),
            ("store timeout", Policy::builder().store_timeout(too_long)),
            ("retry after", Policy::builder().retry_after(too_long)),
        ];
        for (name, builder) in builders {
            match builder.build() {
                Err(PolicyError::TooLong { setting, .. }) => assert_eq!(setting, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let century = Policy::builder()
            .retention(LONGEST)
            .lease(LONGEST - Duration::from_secs(1))
            .wait_for_in_flight(LONGEST)
            .build()
            .unwrap();
        assert_eq!(century.retention(), LONGEST);
        assert_eq!(capped_millis(Duration::MAX), capped_millis(LONGEST));
        assert_eq!(capped_millis(Duration::from_millis(7)), 7);
    }

    #[test]
    fn defaults() {
        let p = Policy::default();
        assert_eq!(
            p.replayed_headers(),
            ["location", "content-type", "etag", "retry-after"]
        );
        assert_eq!(p.retry_after(), Duration::from_secs(1));
        assert_eq!(p.retention(), Duration::from_secs(86_400));
        assert_eq!(p.lease(), Duration::from_secs(30));
        assert_eq!(p.wait(), None);
        assert_eq!(p.max_body(), 1 << 20);
        assert!(p.store_client_errors());
        assert!(p.require_key());
        for h in ["Location", "content-type", "ETag", "retry-after"] {
            assert!(p.replays_header(h), "{h}");
        }
        assert!(!p.replays_header("set-cookie"));
        assert!(!p.replays_header("x-other"));
        assert_eq!(Policy::builder().build().unwrap(), p);
    }

    /// A header's name is matched in any case against every list: the
    /// allow-list, the names never replayed, and those never replayed with
    /// every other header.
    #[test]
    fn header_names_match_in_any_case() {
        let listed = Policy::builder()
            .replay_header("X-Trace")
            .replay_header("x-cost")
            .never_replay_header("X-COST")
            .build()
            .unwrap();
        for h in [
            "x-trace",
            "X-TRACE",
            "x-Trace",
            "CONTENT-TYPE",
            "Retry-After",
        ] {
            assert!(listed.replays_header(h), "{h}");
        }
        for h in [
            "x-cost",
            "X-Cost",
            "SET-COOKIE",
            "Content-Length",
            "x-trac",
            "x-tracee",
            "",
        ] {
            assert!(!listed.replays_header(h), "{h}");
        }
        let all = Policy::builder()
            .replay_all_headers()
            .never_replay_header("x-request-id")
            .build()
            .unwrap();
        for h in ["X-Anything", "WWW-Authenticate", "Location"] {
            assert!(all.replays_header(h), "{h}");
        }
        for h in [
            "X-Request-ID",
            "DATE",
            "Transfer-Encoding",
            "Idempotent-Replayed",
        ] {
            assert!(!all.replays_header(h), "{h}");
        }
    }

    #[test]
    fn validation() {
        assert_eq!(
            Policy::builder().lease(Duration::ZERO).build(),
            Err(PolicyError::ZeroLease)
        );
        assert_eq!(
            Policy::builder().lease(Duration::from_micros(999)).build(),
            Err(PolicyError::ZeroLease)
        );
        assert!(matches!(
            Policy::builder()
                .lease(Duration::from_secs(60))
                .retention(Duration::from_secs(60))
                .build(),
            Err(PolicyError::RetentionNotAboveLease { .. })
        ));
        assert_eq!(
            Policy::builder().max_body(0).build(),
            Err(PolicyError::ZeroBodyLimit)
        );
        assert_eq!(
            Policy::builder().replay_header("Set-Cookie").build(),
            Err(PolicyError::ForbiddenHeader("set-cookie".into()))
        );
        // Nothing the replay-all mode leaves out can be allow-listed either.
        for name in NOT_REPLAYED_WITH_ALL {
            assert_eq!(
                Policy::builder().replay_header(*name).build(),
                Err(PolicyError::ForbiddenHeader((*name).into())),
                "{name}"
            );
        }
        assert_eq!(
            Policy::builder().replay_header("bad header").build(),
            Err(PolicyError::InvalidHeaderName("bad header".into()))
        );
        for status in [0, 200, 399, 500, 503, 600] {
            assert_eq!(
                Policy::builder().release_client_error(status).build(),
                Err(PolicyError::NotAClientError(status)),
                "{status}"
            );
            assert_eq!(
                Policy::builder().store_client_error(status).build(),
                Err(PolicyError::NotAClientError(status)),
                "{status}"
            );
        }
        // The same statuses released, in whatever order: the same policy.
        assert_eq!(
            Policy::builder()
                .release_client_error(423)
                .release_client_error(408)
                .build(),
            Policy::builder().release_client_error(423).build()
        );
        assert_ne!(
            Policy::builder().release_client_error(423).build(),
            Policy::builder().build()
        );
        for status in [400, 499] {
            assert!(Policy::builder()
                .release_client_error(status)
                .build()
                .is_ok());
            assert!(Policy::builder().store_client_error(status).build().is_ok());
        }
        assert_eq!(
            Policy::builder()
                .wait_for_in_flight(Duration::ZERO)
                .build()
                .unwrap()
                .wait(),
            None
        );
    }
}
