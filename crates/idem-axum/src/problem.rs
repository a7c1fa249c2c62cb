//! `application/problem+json` (RFC 9457) answers, and the definition of
//! every problem type idem answers with.
//!
//! A problem's `type` is a base followed by a slug. The default base,
//! [`DEFAULT_PROBLEM_TYPE_BASE`], points at the headings below, so a client
//! (or a person) following `type` lands on its definition. Serve your own
//! documentation instead with [`set_problem_type_base`], once, at start-up.
//! Clients should match on the slug at the end of `type` (or on the
//! `Idempotency-Rejection` header, which carries the slug alone).
//!
//! ### `idempotency-key-missing`
//! 400: a guarded request came without `Idempotency-Key` (and the policy
//! requires one). Not stored. Send a fresh key, and keep it across retries.
//!
//! ### `idempotency-key-invalid`
//! 400: the key is empty, too long, or not a Structured Field string or
//! token. Not stored.
//!
//! ### `payload-too-large`
//! 413: the body is over the policy's `max_body`. Not stored.
//!
//! ### `body-unreadable`
//! 400: the request body could not be read (the client hung up mid-body).
//!
//! ### `idempotency-key-in-use`
//! 409 with `Retry-After`: a request with this key is still in flight (or
//! was taken over by another attempt). Retry later with the same key.
//!
//! ### `idempotency-key-reused`
//! 422: the key was used before with a different request (method, path or
//! body). Never replayed as the first answer: use a new key for a new
//! request.
//!
//! ### `store-unavailable`
//! 503 with `Retry-After`: the idempotency store (or the request's
//! transaction) could not be reached; nothing was committed. Retry with the
//! same key.
//!
//! ### `handler-failed`
//! 500: the handler panicked or its task died; the claim was released, so
//! a retry runs afresh. It is kept until its lease runs out instead (a
//! retry gets `409`, then runs under the same operation id) when the
//! handler had kept it (`keep_claim`, `store_answer`), or when the panic
//! came after it answered, while its answer was read or stored.
//!
//! ### `response-unreadable`
//! 500: the handler's response body could not be read to store it.
//!
//! ### `claimed-twice`
//! 500: a handler under `claim_in_transaction` began its claim twice.
//!
//! ### `idempotency-layer-missing`
//! 500: a handler extracted `Idempotency` on a route the layer does not
//! guard (a wiring mistake).
//!
//! ### `scope-missing`
//! 401: [`HeaderScope`](crate::HeaderScope) found no client id in the
//! request; nothing ran and nothing was stored.
//!
//! ### `precondition-invalid`
//! 400: `If-Match` / `If-None-Match` is not a valid list of entity tags.
//!
//! ### `precondition-required`
//! 428: the write requires `If-Match`.
//!
//! ### `precondition-failed`
//! 412: the resource changed since the client read it (its `ETag` is in the
//! answer).

use std::sync::OnceLock;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;

/// The default prefix of every problem `type`: this module's page, whose
/// headings define each slug (`…#idempotency-key-missing`).
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/idem-axum/latest/idem_axum/problem/index.html#";

static BASE: OnceLock<String> = OnceLock::new();

/// Why [`set_problem_type_base`] refused a base.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProblemBaseError {
    /// A base was set already (to another value): problem types must not
    /// change while the process serves.
    #[error("the problem type base is set already, to {0:?}")]
    AlreadySet(String),
    /// Not an absolute URI (a scheme, then no spaces, quotes or controls).
    #[error("{0:?} is not an absolute URI (e.g. https://errors.example.com/problems/)")]
    NotAUri(String),
}

/// Sets the prefix of every problem `type` idem (and [`Problem::new`])
/// answers with, e.g. `https://api.example.com/problems/`: the slug is
/// appended as is. Call it once, before serving; setting it again to the
/// same value is fine, to another is refused.
///
/// ```
/// idem_axum::problem::set_problem_type_base("https://api.example.com/problems/").unwrap();
/// assert_eq!(idem_axum::problem::problem_type_base(), "https://api.example.com/problems/");
/// assert!(idem_axum::problem::set_problem_type_base("https://elsewhere.example/").is_err());
/// ```
pub fn set_problem_type_base(base: impl Into<String>) -> Result<(), ProblemBaseError> {
    let base = base.into();
    let scheme_end = base.find(':').unwrap_or(0);
    let scheme_ok = scheme_end > 0
        && base.as_bytes()[0].is_ascii_alphabetic()
        && base[..scheme_end]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.');
    let chars_ok = base
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'<' && b != b'>' && b != b'\\');
    if !(scheme_ok && chars_ok) {
        return Err(ProblemBaseError::NotAUri(base));
    }
    let set = BASE.get_or_init(|| base.clone());
    if *set == base {
        Ok(())
    } else {
        Err(ProblemBaseError::AlreadySet(set.clone()))
    }
}

/// The prefix of every problem `type`: what [`set_problem_type_base`] set,
/// or [`DEFAULT_PROBLEM_TYPE_BASE`].
pub fn problem_type_base() -> &'static str {
    current_base().0
}

/// The base, and whether it is one [`set_problem_type_base`] set (read
/// once, so the two agree).
pub(crate) fn current_base() -> (&'static str, bool) {
    match BASE.get() {
        Some(set) => (set, true),
        None => (DEFAULT_PROBLEM_TYPE_BASE, false),
    }
}

/// The media type of problem answers.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem details answer.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idem_axum::Problem;
///
/// let response = Problem::new(StatusCode::BAD_REQUEST, "validation", "The body is invalid")
///     .detail("amount must be a positive integer")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    kind: String,
    title: String,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip)]
    retry_after: Option<u64>,
}

impl Problem {
    /// A problem whose `type` is the [base](problem_type_base) followed by
    /// `slug`.
    pub fn new(status: StatusCode, slug: &str, title: impl Into<String>) -> Self {
        Self::with_base(problem_type_base(), status, slug, title)
    }

    /// [`Problem::new`] with the `type` prefixed by `base`.
    pub(crate) fn with_base(
        base: &str,
        status: StatusCode,
        slug: &str,
        title: impl Into<String>,
    ) -> Self {
        Self {
            kind: format!("{base}{slug}"),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Adds a human-readable explanation of this occurrence.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header, in seconds.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The problem's `type` URI.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The JSON body.
    pub(crate) fn body(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec())
    }
}

/// The answer with a problem `body` already rendered: `status`, the
/// problem media type and, if given, `Retry-After`.
pub(crate) fn response(status: StatusCode, body: Bytes, retry_after: Option<u64>) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(secs) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        response(status, Bytes::from(self.body()), self.retry_after)
    }
}
