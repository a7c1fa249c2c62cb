//! Reading a guarded request: its scope, its key, its body (within the
//! limit) and its fingerprint, before anything is claimed.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderName, HeaderValue};
use http_body_util::BodyExt;
use idem_core::{on_missing_key, ClaimRequest, Fingerprint, IdempotencyKey, KeyError, MissingKey};
use tracing::debug;

use crate::config::Config;
use crate::metrics::{count, Outcome};
use crate::rejection::IdempotencyRejection;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(idem_core::IDEMPOTENCY_KEY_HEADER);

/// Who a request belongs to and under which key, as its headers say.
pub(crate) enum Identified {
    /// A request to guard.
    Guarded {
        /// The scope the key belongs to.
        scope: String,
        /// The key.
        key: IdempotencyKey,
    },
    /// No key, and none required: run the handler as it is.
    PassThrough,
    /// Refused before anything is read (`400`, or the scope's refusal).
    Refused(Response),
}

/// The scope and the key of a request, from its headers.
pub(crate) fn identify(config: &Config, parts: &Parts) -> Identified {
    let values = parts
        .headers
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .map(HeaderValue::as_bytes);
    let key = IdempotencyKey::from_header_values(values);
    // A request without a key, where none is required, is not guarded: it
    // passes through untouched, whatever its scope.
    if matches!(key, Err(KeyError::Missing))
        && matches!(on_missing_key(&config.policy), MissingKey::PassThrough)
    {
        return Identified::PassThrough;
    }
    let scope = match config.scope.scope(parts) {
        Ok(scope) if scope.len() > idem_core::MAX_SCOPE_LEN => {
            return Identified::Refused(crate::scope_missing(format!(
                "the request's scope is {} bytes long; at most {} are kept",
                scope.len(),
                idem_core::MAX_SCOPE_LEN
            )))
        }
        Ok(scope) => scope,
        Err(refusal) => return Identified::Refused(refusal),
    };
    match key {
        Ok(key) => Identified::Guarded { scope, key },
        Err(KeyError::Missing) => match on_missing_key(&config.policy) {
            MissingKey::PassThrough => Identified::PassThrough,
            MissingKey::Reject => {
                debug!("rejecting a request without Idempotency-Key");
                count(Outcome::MissingKey);
                Identified::Refused(IdempotencyRejection::MissingKey.into_response())
            }
        },
        Err(e) => {
            debug!(error = %e, "rejecting an invalid Idempotency-Key");
            count(Outcome::InvalidKey);
            Identified::Refused(IdempotencyRejection::InvalidKey(e).into_response())
        }
    }
}

/// Reads the body within the policy's limit and fingerprints the request:
/// the claim to make, and the body read whole; or the answer (`413`, `400`).
pub(crate) async fn read_guarded(
    config: &Config,
    parts: &Parts,
    body: Body,
    scope: String,
    key: IdempotencyKey,
) -> Result<(ClaimRequest, Bytes), Response> {
    let policy = &config.policy;
    let bytes = read_bounded(policy, parts, body).await?;
    // The path the client sent: inside a router nested under a prefix,
    // axum has stripped the prefix from `parts.uri`, and two nested
    // endpoints would share a fingerprint (one's answer replayed for the
    // other under a reused key, where the contract says 422).
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    let target = uri
        .path_and_query()
        .map_or_else(|| uri.path(), |p| p.as_str());
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let fingerprint = Fingerprint::of_request(parts.method.as_str(), target, content_type, &bytes);
    let request = ClaimRequest {
        scope,
        key: key.into_string(),
        fingerprint,
        lease: policy.lease(),
        retention: policy.retention(),
    };
    Ok((request, bytes))
}

/// A request's whole body, at most the policy's `max_body` (`413` past it,
/// at once for a body declared too large with `Expect: 100-continue`; a
/// body that fails is refused as unreadable).
pub(crate) async fn read_bounded(
    policy: &idem_core::Policy,
    parts: &Parts,
    body: Body,
) -> Result<Bytes, Response> {
    let too_large = || {
        count(Outcome::TooLarge);
        IdempotencyRejection::PayloadTooLarge {
            max: policy.max_body(),
        }
        .into_response()
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A client that asked to be told before sending (`Expect:
    // 100-continue`) a body declared too large gets `413` at once: the body
    // is never polled, so hyper never sends `100 Continue`.
    let expects_continue = parts
        .headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue && declared.is_some_and(|n| n > policy.max_body() as u64) {
        return Err(too_large());
    }
    match read_body(body, policy.max_body(), declared).await {
        Ok(bytes) => Ok(bytes),
        Err(BodyError::TooLarge) => Err(too_large()),
        Err(BodyError::Unreadable(e)) => {
            Err(IdempotencyRejection::BodyUnreadable(e).into_response())
        }
    }
}

enum BodyError {
    TooLarge,
    Unreadable(String),
}

/// How much of an oversized body is read and thrown away before answering
/// `413`, so that a client still sending it reads the answer instead of a
/// broken pipe; beyond it (or after a few seconds) the connection is cut.
const DRAIN_LIMIT: u64 = 32 * 1024 * 1024;

/// Reads the body up to `max` bytes. Past it (declared or found), drains
/// what the client is still sending, within bounds, and reports `TooLarge`;
/// nothing of it is kept.
async fn read_body(mut body: Body, max: usize, declared: Option<u64>) -> Result<Bytes, BodyError> {
    let mut buf = bytes::BytesMut::new();
    let mut too_large = declared.is_some_and(|n| n > max as u64);
    let mut drained: u64 = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let frame = if too_large {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(f) => f,
                Err(_) => return Err(BodyError::TooLarge),
            }
        } else {
            body.frame().await
        };
        let Some(frame) = frame else { break };
        let frame = match frame {
            Ok(f) => f,
            Err(_) if too_large => return Err(BodyError::TooLarge),
            Err(e) => return Err(BodyError::Unreadable(e.to_string())),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if too_large {
            drained += data.len() as u64;
            if drained > DRAIN_LIMIT {
                return Err(BodyError::TooLarge);
            }
        } else if buf.len() + data.len() > max {
            too_large = true;
            drained = (buf.len() + data.len()) as u64;
            buf = bytes::BytesMut::new();
        } else {
            buf.extend_from_slice(&data);
        }
    }
    if too_large {
        Err(BodyError::TooLarge)
    } else {
        Ok(buf.freeze())
    }
}
