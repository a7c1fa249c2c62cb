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
