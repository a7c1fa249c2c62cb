//! Where a request's idempotency scope comes from.

use axum::response::Response;
use http::request::Parts;

/// Finds the scope (tenant, authenticated client) of a request. Keys are
/// only ever compared within one scope, so a key sent by client A is
/// invisible to client B.
///
/// Returning `Err(response)` refuses the request with that response (for
/// example `401`): a request without a scope is never silently put in a
/// shared one.
///
/// Any `Fn(&Parts) -> Result<String, Response>` is a scope extractor:
///
/// ```
/// use axum::response::IntoResponse;
/// use http::{request::Parts, StatusCode};
///
/// let by_header = |parts: &Parts| {
///     parts.headers.get("x-client-id")
///         .and_then(|v| v.to_str().ok())
///         .map(str::to_owned)
///         .ok_or_else(|| StatusCode::UNAUTHORIZED.into_response())
/// };
/// # fn check(_: impl idem_axum::ScopeExtractor) {}
/// check(by_header);
/// ```
pub trait ScopeExtractor: Send + Sync + 'static {
    /// The scope of the request, or the response that refuses it.
    fn scope(&self, parts: &Parts) -> Result<String, Response>;
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Result<String, Response> + Send + Sync + 'static,
{
    fn scope(&self, parts: &Parts) -> Result<String, Response> {
        self(parts)
    }
}

/// The answer for a request whose scope cannot be found: `401`
/// problem+json of idem's own type `scope-missing`, saying `detail`. For a
/// scope function of yours to refuse the way [`HeaderScope`] does:
///
/// ```
/// use http::request::Parts;
///
/// let by_token = |parts: &Parts| {
///     parts.headers.get("authorization")
///         .and_then(|v| v.to_str().ok())
///         .and_then(|v| v.strip_prefix("Bearer "))
///         .map(str::to_owned)
///         .ok_or_else(|| idem_axum::scope_missing("send Authorization: Bearer <token>"))
/// };
/// let (parts, _) = http::Request::get("/").body(()).unwrap().into_parts();
/// let refused = by_token(&parts).unwrap_err();
/// assert_eq!(refused.status(), 401);
/// assert_eq!(refused.headers()["content-type"], "application/problem+json");
/// # fn check(_: impl idem_axum::ScopeExtractor) {}
/// # check(by_token);
/// ```
pub fn scope_missing(detail: impl Into<String>) -> Response {
    axum::response::IntoResponse::into_response(
        crate::Problem::new(
            http::StatusCode::UNAUTHORIZED,
            "scope-missing",
            "The request does not say which client it is",
        )
        .detail(detail.into()),
    )
}

/// One scope for every request: for services with a single client, or whose
/// keys are globally unique by construction. Choosing it is explicit, so a
/// shared scope is never an accident.
#[derive(Debug, Clone)]
pub struct SingleScope(pub String);

impl ScopeExtractor for SingleScope {
    fn scope(&self, _: &Parts) -> Result<String, Response> {
        Ok(self.0.clone())
    }
}

/// The scope is the value of one request header: the client id that your
/// authentication (a gateway, or a middleware that runs before this layer)
/// put there. Never trust a header a client can set itself: the scope is
/// what keeps one client's keys (and replayed answers) from another's.
///
/// A request without the header, with it twice, or with an empty or
/// non-visible-ASCII value, is refused with `401` problem+json
/// (`scope-missing`); so is any request whose scope, from any extractor,
/// is longer than [`MAX_SCOPE_LEN`](idem_core::MAX_SCOPE_LEN) bytes.
///
/// ```
/// use idem_axum::{HeaderScope, ScopeExtractor};
/// let scope = HeaderScope::new("x-client-id");
/// let (ok, _) = http::Request::get("/").header("x-client-id", "acme").body(()).unwrap().into_parts();
/// assert_eq!(scope.scope(&ok).unwrap(), "acme");
/// let (missing, _) = http::Request::get("/").body(()).unwrap().into_parts();
/// assert_eq!(scope.scope(&missing).unwrap_err().status(), 401);
/// let (twice, _) = http::Request::get("/").header("x-client-id", "mallory")
///     .header("x-client-id", "acme").body(()).unwrap().into_parts();
/// assert_eq!(scope.scope(&twice).unwrap_err().status(), 401);
/// ```
#[derive(Debug, Clone)]
pub struct HeaderScope(String);

impl HeaderScope {
    /// Scopes by the header `name` (matched case-insensitively).
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into().to_ascii_lowercase())
    }
}

impl ScopeExtractor for HeaderScope {
    fn scope(&self, parts: &Parts) -> Result<String, Response> {
        let values = parts.headers.get_all(self.0.as_str()).iter();
        idem_core::single_visible_value(values.map(http::HeaderValue::as_bytes))
            .map(str::to_owned)
            .ok_or_else(|| {
                scope_missing(format!(
                    "the {} header (set by authentication) is missing or invalid",
                    self.0
                ))
            })
    }
}
