//! Conditional writes (optimistic concurrency) with `ETag` and `If-Match`,
//! per RFC 9110.
//!
//! Reads send an [`ETag`] derived from the row's version column; writes
//! carry the tag the client saw in `If-Match` ([`IfMatch`]) and update with
//! `… WHERE version = $seen`. Zero rows updated means someone else wrote
//! first: answer [`precondition_failed`] (`412`). A route that requires a
//! precondition rejects a write without one with `428` (extract [`IfMatch`]
//! itself; extract `Option<IfMatch>` where it is optional).
//!
//! ```
//! use axum::{routing::get, Router, Json};
//! use idem_axum::conditional::{ETag, IfMatch};
//!
//! async fn read() -> (ETag, Json<&'static str>) {
//!     (ETag::from_version(7), Json("the product"))
//! }
//!
//! async fn write(if_match: IfMatch) -> String {
//!     // UPDATE products SET … , version = version + 1 WHERE sku = $1 AND version = $2
//!     format!("would update where version = {:?}", if_match.version())
//! }
//!
//! let app: Router = Router::new().route("/products/{sku}", get(read).put(write));
//! assert_eq!(ETag::from_version(7).to_string(), r#""7""#);
//! ```
//!
//! Conditional writes and `Idempotency-Key` solve different problems and
//! combine: the key makes a retried `PATCH` replay its first answer (instead
//! of failing `412` because its own first attempt moved the version); the
//! precondition keeps two different writers from overwriting each other.

use std::fmt;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::request::Parts;
use http::{header, HeaderMap, HeaderValue, StatusCode};

use crate::problem::Problem;

/// A strong entity tag, quoted per RFC 9110 (`"42"`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ETag(String);

impl ETag {
    /// The tag for a version number.
    pub fn from_version(version: i64) -> Self {
        Self(version.to_string())
    }

    /// A tag with an opaque value (visible ASCII except `"`), or `None`.
    pub fn new(opaque: &str) -> Option<Self> {
        opaque
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b))
            .then(|| Self(opaque.to_owned()))
    }

    /// The version this tag was made from, if it was.
    pub fn version(&self) -> Option<i64> {
        self.0.parse().ok()
    }

    /// The quoted header value.
    pub fn header_value(&self) -> HeaderValue {
        // The opaque part is visible ASCII by construction.
        HeaderValue::from_str(&self.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("\"\""))
    }
}

impl fmt::Display for ETag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0)
    }
}

impl IntoResponseParts for ETag {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.headers_mut().insert(header::ETAG, self.header_value());
        Ok(res)
    }
}

/// One entity tag in a precondition list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tag {
    weak: bool,
    opaque: String,
}

/// Parses `"*"` or a comma-separated list of entity tags; `Ok(None)` for `*`.
fn parse_list(
    headers: &HeaderMap,
    name: &header::HeaderName,
) -> Result<Option<Option<Vec<Tag>>>, String> {
    let mut seen = false;
    let mut tags = Vec::new();
    let mut any = false;
    for value in headers.get_all(name) {
        seen = true;
        let value = value
            .to_str()
            .map_err(|_| format!("{name} is not visible ASCII"))?;
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item == "*" {
                any = true;
                continue;
            }
            let (weak, rest) = match item.strip_prefix("W/") {
                Some(rest) => (true, rest),
                None => (false, item),
            };
            let opaque = rest
                .strip_prefix('"')
                .and_then(|r| r.strip_suffix('"'))
                .filter(|o| o.bytes().all(|b| b == 0x21 || (0x23..=0x7e).contains(&b)))
                .ok_or_else(|| {
                    format!("{name}: {item:?} is not an entity tag (expected \"…\" or W/\"…\")")
                })?;
            tags.push(Tag {
                weak,
                opaque: opaque.to_owned(),
            });
        }
    }
    if !seen {
        return Ok(None);
    }
    if any && !tags.is_empty() {
        return Err(format!("{name}: \"*\" cannot be combined with entity tags"));
    }
    if !any && tags.is_empty() {
        return Err(format!("{name} is empty"));
    }
    Ok(Some(if any { None } else { Some(tags) }))
}

/// The `If-Match` precondition: `*` or the entity tags the client saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfMatch(Option<Vec<Tag>>);

impl IfMatch {
    /// Whether the precondition holds for a resource whose current tag is
    /// `current` (`None`: the resource does not exist). Strong comparison:
    /// weak tags never match.
    pub fn matches(&self, current: Option<&ETag>) -> bool {
        match (&self.0, current) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(tags), Some(c)) => tags.iter().any(|t| !t.weak && t.opaque == c.0),
        }
    }

    /// Whether it is `If-Match: *` (any current version).
    pub fn is_any(&self) -> bool {
        self.0.is_none()
    }

    /// The version named by the one strong tag sent, for `… WHERE version =
    /// $v`; `None` for `*`, several tags, weak tags or foreign tags.
    pub fn version(&self) -> Option<i64> {
        match self.0.as_deref() {
            Some([t]) if !t.weak => t.opaque.parse().ok(),
            _ => None,
        }
    }
}

/// The `If-None-Match` precondition; on a write, `If-None-Match: *` means
/// "create only, never overwrite".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfNoneMatch(Option<Vec<Tag>>);

impl IfNoneMatch {
    /// Whether it is `If-None-Match: *`.
    pub fn is_any(&self) -> bool {
        self.0.is_none()
    }

    /// Whether the precondition holds: no current resource, or none of the
    /// tags matches it (weak comparison, as RFC 9110 asks).
    pub fn holds(&self, current: Option<&ETag>) -> bool {
        match (&self.0, current) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(tags), Some(c)) => !tags.iter().any(|t| t.opaque == c.0),
        }
    }
}

/// A precondition header was missing where required (`428`) or malformed
/// (`400`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PreconditionRejection {
    /// The route requires `If-Match` and the request has none.
    Missing,
    /// The header is not `*` or a list of entity tags.
    Malformed(String),
}

impl IntoResponse for PreconditionRejection {
    fn into_response(self) -> Response {
        match self {
            PreconditionRejection::Missing => precondition_required(),
            PreconditionRejection::Malformed(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "precondition-invalid",
                "The precondition header is invalid",
            )
            .detail(detail)
            .into_response(),
        }
    }
}

/// `428 Precondition Required`: updates need `If-Match`.
pub fn precondition_required() -> Response {
    Problem::new(
        StatusCode::PRECONDITION_REQUIRED,
        "precondition-required",
        "This write requires If-Match",
    )
    .detail("read the resource, then send its ETag in If-Match")
    .into_response()
}

/// `412 Precondition Failed`, with the current `ETag` when the resource
/// exists, so the client can re-read and decide.
pub fn precondition_failed(current: Option<&ETag>) -> Response {
    let mut response = Problem::new(
        StatusCode::PRECONDITION_FAILED,
        "precondition-failed",
        "The resource changed since it was read",
    )
    .detail(match current {
        Some(_) => "the version in If-Match is not the current one; read it again",
        None => "the resource does not exist",
    })
    .into_response();
    if let Some(tag) = current {
        response
            .headers_mut()
            .insert(header::ETAG, tag.header_value());
    }
    response
}

impl<S: Send + Sync> FromRequestParts<S> for IfMatch {
    type Rejection = PreconditionRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        match parse_list(&parts.headers, &header::IF_MATCH) {
            Ok(Some(list)) => Ok(IfMatch(list)),
            Ok(None) => Err(PreconditionRejection::Missing),
            Err(e) => Err(PreconditionRejection::Malformed(e)),
        }
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IfMatch {
    type Rejection = PreconditionRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        parse_list(&parts.headers, &header::IF_MATCH)
            .map(|o| o.map(IfMatch))
            .map_err(PreconditionRejection::Malformed)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IfNoneMatch {
    type Rejection = PreconditionRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        parse_list(&parts.headers, &header::IF_NONE_MATCH)
            .map(|o| o.map(IfNoneMatch))
            .map_err(PreconditionRejection::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: header::HeaderName, values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(name.clone(), v.parse().unwrap());
        }
        h
    }

    fn if_match(values: &[&str]) -> Result<Option<IfMatch>, String> {
        parse_list(&headers(header::IF_MATCH, values), &header::IF_MATCH).map(|o| o.map(IfMatch))
    }

    #[test]
    fn etags_are_strong_and_quoted() {
        let t = ETag::from_version(42);
        assert_eq!(t.to_string(), "\"42\"");
        assert_eq!(t.header_value(), "\"42\"");
        assert_eq!(t.version(), Some(42));
        assert!(ETag::new("a\"b").is_none());
    }

    #[test]
    fn if_match_parsing_and_strong_comparison() {
        let v3 = ETag::from_version(3);
        assert_eq!(if_match(&[]).unwrap(), None);
        let m = if_match(&["\"3\""]).unwrap().unwrap();
        assert!(m.matches(Some(&v3)));
        assert_eq!(m.version(), Some(3));
        assert!(!m.matches(Some(&ETag::from_version(4))));
        assert!(!m.matches(None));
        let weak = if_match(&["W/\"3\""]).unwrap().unwrap();
        assert!(!weak.matches(Some(&v3)), "If-Match uses strong comparison");
        assert_eq!(weak.version(), None);
        let list = if_match(&["\"1\", \"3\"", "\"9\""]).unwrap().unwrap();
        assert!(list.matches(Some(&v3)));
        assert_eq!(list.version(), None);
        let any = if_match(&["*"]).unwrap().unwrap();
        assert!(any.is_any() && any.matches(Some(&v3)) && !any.matches(None));
        for bad in ["3", "\"3", "*, \"3\"", "W/3", ""] {
            assert!(if_match(&[bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn if_none_match_star_means_create_only() {
        let any = parse_list(
            &headers(header::IF_NONE_MATCH, &["*"]),
            &header::IF_NONE_MATCH,
        )
        .unwrap()
        .map(IfNoneMatch)
        .unwrap();
        assert!(any.is_any());
        assert!(any.holds(None));
        assert!(!any.holds(Some(&ETag::from_version(1))));
    }
}
