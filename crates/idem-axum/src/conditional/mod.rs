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
use http::{header, HeaderMap, HeaderValue};

use crate::rejection::IdempotencyRejection;

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
            .all(is_etagc)
            .then(|| Self(opaque.to_owned()))
    }

    /// The version this tag was made from, if it was (its opaque value is
    /// exactly what [`ETag::from_version`] makes).
    pub fn version(&self) -> Option<i64> {
        version_of(&self.0)
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

/// Whether `b` may appear between an entity tag's quotes (RFC 9110's
/// `etagc`, without `obs-text`, which no [`ETag`] holds).
fn is_etagc(b: u8) -> bool {
    b == 0x21 || (0x23..=0x7e).contains(&b)
}

/// Whether `b` is optional whitespace (`OWS`).
fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// How much of a malformed element a problem detail quotes back.
const QUOTED_MAX: usize = 64;

/// One element of a precondition list.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Element {
    /// `*`.
    Any,
    /// An entity tag.
    Tag(Tag),
}

/// Parses one field line of `"*" / #entity-tag` (RFC 9110 §13.1.1) into
/// `out`. Empty list elements are skipped, as §5.6.1 asks; a comma inside
/// an entity tag's quotes is part of the tag.
fn parse_line(name: &header::HeaderName, line: &str, out: &mut Vec<Element>) -> Result<(), String> {
    let bytes = line.as_bytes();
    let skip_ows = |mut i: usize| {
        while bytes.get(i).copied().is_some_and(is_ows) {
            i += 1;
        }
        i
    };
    let malformed = |start: usize| {
        let rest = line.get(start..).unwrap_or_default();
        let element = rest.split(',').next().unwrap_or_default().trim();
        let shown: String = element.chars().take(QUOTED_MAX).collect();
        let ellipsis = if shown.len() < element.len() {
            "…"
        } else {
            ""
        };
        format!("{name}: {shown:?}{ellipsis} is not an entity tag (expected \"…\", W/\"…\" or *)")
    };
    let mut i = skip_ows(0);
    while let Some(&b) = bytes.get(i) {
        if b == b',' {
            i = skip_ows(i + 1);
            continue;
        }
        let start = i;
        let element = if b == b'*' {
            i += 1;
            Element::Any
        } else {
            let weak = line.get(i..).is_some_and(|r| r.starts_with("W/"));
            if weak {
                i += 2;
            }
            if bytes.get(i) != Some(&b'"') {
                return Err(malformed(start));
            }
            let open = i + 1;
            let Some(len) = bytes
                .get(open..)
                .and_then(|r| r.iter().position(|&c| c == b'"'))
            else {
                return Err(malformed(start));
            };
            let opaque = line.get(open..open + len).unwrap_or_default();
            if !opaque.bytes().all(is_etagc) {
                return Err(malformed(start));
            }
            i = open + len + 1;
            Element::Tag(Tag {
                weak,
                opaque: opaque.to_owned(),
            })
        };
        // An element ends at a comma or at the end of the line.
        i = skip_ows(i);
        match bytes.get(i) {
            None => {}
            Some(b',') => i = skip_ows(i + 1),
            Some(_) => return Err(malformed(start)),
        }
        out.push(element);
    }
    Ok(())
}

/// Parses `"*"` or a list of entity tags, over every field line of `name`;
/// `Ok(None)` when there is none, `Ok(Some(None))` for `*`.
fn parse_list(
    headers: &HeaderMap,
    name: &header::HeaderName,
) -> Result<Option<Option<Vec<Tag>>>, String> {
    let mut seen = false;
    let mut elements = Vec::new();
    for value in headers.get_all(name) {
        seen = true;
        let line = value
            .to_str()
            .map_err(|_| format!("{name} holds bytes outside visible ASCII"))?;
        parse_line(name, line, &mut elements)?;
    }
    if !seen {
        return Ok(None);
    }
    let mut any = false;
    let mut tags = Vec::new();
    for element in elements {
        match element {
            Element::Any => any = true,
            Element::Tag(tag) => tags.push(tag),
        }
    }
    if any && !tags.is_empty() {
        return Err(format!("{name}: \"*\" cannot be combined with entity tags"));
    }
    if !any && tags.is_empty() {
        return Err(format!("{name} is empty: send \"*\" or an entity tag"));
    }
    Ok(Some(if any { None } else { Some(tags) }))
}

/// The version an entity tag names, if its opaque value is exactly what
/// [`ETag::from_version`] makes (`"7"`, not `"07"` or `"+7"`), so that it
/// agrees with strong comparison.
fn version_of(opaque: &str) -> Option<i64> {
    opaque
        .parse::<i64>()
        .ok()
        .filter(|v| v.to_string() == opaque)
}

/// The `If-Match` precondition: `*` or the entity tags the client saw.
///
/// Per RFC 9110 §13.1.1, `*` matches any current representation, and a
/// list (`If-Match: "1", "2"`, on one field line or several) matches when
/// one of its strong tags equals the current `ETag`; weak tags (`W/"1"`)
/// never match.
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
    /// $v`; `None` for `*`, several tags, weak tags or foreign tags. For a
    /// list, see [`IfMatch::versions`].
    pub fn version(&self) -> Option<i64> {
        match self.0.as_deref() {
            Some([t]) if !t.weak => version_of(&t.opaque),
            _ => None,
        }
    }

    /// The versions named by the strong tags sent, in order and without
    /// repeats, for `… WHERE version = ANY($v)`: the write may go ahead if
    /// the current version is one of them. Empty for `*` (check
    /// [`IfMatch::is_any`] first) and when no strong tag names a version
    /// (then nothing matches).
    pub fn versions(&self) -> Vec<i64> {
        let mut versions = Vec::new();
        for tag in self.0.iter().flatten().filter(|t| !t.weak) {
            if let Some(v) = version_of(&tag.opaque) {
                if !versions.contains(&v) {
                    versions.push(v);
                }
            }
        }
        versions
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
            PreconditionRejection::Missing => IdempotencyRejection::PreconditionRequired,
            PreconditionRejection::Malformed(detail) => {
                IdempotencyRejection::PreconditionInvalid(detail)
            }
        }
        .into_response()
    }
}

/// `428 Precondition Required`: updates need `If-Match`.
pub fn precondition_required() -> Response {
    IdempotencyRejection::PreconditionRequired.into_response()
}

/// `412 Precondition Failed`, with the current `ETag` when the resource
/// exists, so the client can re-read and decide.
pub fn precondition_failed(current: Option<&ETag>) -> Response {
    IdempotencyRejection::PreconditionFailed {
        current: current.map(ETag::header_value),
    }
    .into_response()
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
mod tests;
