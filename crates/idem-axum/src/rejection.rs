//! [`IdempotencyRejection`]: every answer the layer, its extractors and the
//! conditional-request helpers make instead of the handler, with its status,
//! problem type and title defined here once.

use std::sync::OnceLock;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use idem_core::KeyError;

use crate::problem::{self, Problem};

/// The header on every answer idem makes instead of the handler, naming its
/// problem type (`idempotency-rejection: idempotency-key-reused`): a client
/// tells idem's `422` for a reused key from the handler's own `422` (axum's
/// JSON rejection, say) at a glance. Never on a handler's answer, nor on a
/// replay of one.
pub const IDEMPOTENCY_REJECTION: http::HeaderName =
    http::HeaderName::from_static("idempotency-rejection");

/// An answer made instead of the handler's, rendered as
/// `application/problem+json` (RFC 9457) with the type
/// [base](crate::problem::problem_type_base) followed by
/// [`problem_type`](Self::problem_type).
///
/// ```
/// use axum::response::IntoResponse;
/// use idem_axum::IdempotencyRejection;
///
/// let answer = IdempotencyRejection::KeyReused.into_response();
/// assert_eq!(answer.status(), 422);
/// assert_eq!(IdempotencyRejection::KeyReused.problem_type(), "idempotency-key-reused");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// `400`: the `Idempotency-Key` header is malformed.
    InvalidKey(KeyError),
    /// `413`: the body is over the policy's limit; nothing was stored.
    PayloadTooLarge {
        /// The limit, in bytes.
        max: usize,
    },
    /// `400`: the body could not be read.
    BodyUnreadable(String),
    /// `409`: a request with this key is in flight.
    KeyInUse {
        /// When to retry (the `Retry-After`, at least one second).
        retry_after: Duration,
    },
    /// `409`: another attempt took this request over while it ran; this
    /// attempt rolled back.
    TakenOver,
    /// `422`: the key was used for another request.
    KeyReused,
    /// `503`: the idempotency store failed; the request did not run.
    StoreUnavailable,
    /// `503`: as many guarded handlers run in this process as the layer
    /// allows ([`IdempotencyLayer::max_running`](crate::IdempotencyLayer::max_running)),
    /// those whose clients went away included; nothing was read or claimed.
    Overloaded {
        /// When to retry (the `Retry-After`, at least one second).
        retry_after: Duration,
    },
    /// `500`: the handler panicked or was dropped; its claim was released
    /// (or kept until its lease runs out, when its outcome was unknown or
    /// its answer was being stored).
    HandlerFailed,
    /// `500`: the handler's response body could not be read (or stored);
    /// the claim is kept until its lease runs out (the effect may have
    /// happened).
    ResponseUnreadable,
    /// `500`: [`DeferredClaim::begin`](crate::DeferredClaim::begin) was
    /// called again after it succeeded.
    ClaimedTwice,
    /// `500`: an idempotency extractor on a route the layer does not guard
    /// (or the wrong one for the layer's claim mode).
    LayerMissing,
    /// `400`: `If-Match` / `If-None-Match` is not `*` or a list of entity tags.
    PreconditionInvalid(String),
    /// `428`: the write requires `If-Match`.
    PreconditionRequired,
    /// `412`: the resource changed since it was read; its current `ETag`
    /// (if it exists) goes with the answer.
    PreconditionFailed {
        /// The current entity tag, as a header value.
        current: Option<HeaderValue>,
    },
}

impl IdempotencyRejection {
    /// Every problem type (the slug after
    /// [base](crate::problem::problem_type_base)) this crate
    /// answers with.
    pub const PROBLEM_TYPES: &'static [&'static str] = &[
        "idempotency-key-missing",
        "idempotency-key-invalid",
        "payload-too-large",
        "body-unreadable",
        "idempotency-key-in-use",
        "idempotency-key-reused",
        "store-unavailable",
        "overloaded",
        "handler-failed",
        "response-unreadable",
        "claimed-twice",
        "idempotency-layer-missing",
        "precondition-invalid",
        "precondition-required",
        "precondition-failed",
    ];

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey
            | Self::InvalidKey(_)
            | Self::BodyUnreadable(_)
            | Self::PreconditionInvalid(_) => StatusCode::BAD_REQUEST,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::KeyInUse { .. } | Self::TakenOver => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::StoreUnavailable | Self::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::HandlerFailed
            | Self::ResponseUnreadable
            | Self::ClaimedTwice
            | Self::LayerMissing => StatusCode::INTERNAL_SERVER_ERROR,
            Self::PreconditionRequired => StatusCode::PRECONDITION_REQUIRED,
            Self::PreconditionFailed { .. } => StatusCode::PRECONDITION_FAILED,
        }
    }

    /// The problem type's slug, one of [`PROBLEM_TYPES`](Self::PROBLEM_TYPES).
    pub fn problem_type(&self) -> &'static str {
        match self {
            Self::MissingKey => "idempotency-key-missing",
            Self::InvalidKey(_) => "idempotency-key-invalid",
            Self::PayloadTooLarge { .. } => "payload-too-large",
            Self::BodyUnreadable(_) => "body-unreadable",
            Self::KeyInUse { .. } | Self::TakenOver => "idempotency-key-in-use",
            Self::KeyReused => "idempotency-key-reused",
            Self::StoreUnavailable => "store-unavailable",
            Self::Overloaded { .. } => "overloaded",
            Self::HandlerFailed => "handler-failed",
            Self::ResponseUnreadable => "response-unreadable",
            Self::ClaimedTwice => "claimed-twice",
            Self::LayerMissing => "idempotency-layer-missing",
            Self::PreconditionInvalid(_) => "precondition-invalid",
            Self::PreconditionRequired => "precondition-required",
            Self::PreconditionFailed { .. } => "precondition-failed",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::MissingKey => "An Idempotency-Key header is required",
            Self::InvalidKey(_) => "The Idempotency-Key header is invalid",
            Self::PayloadTooLarge { .. } => "The request body is too large",
            Self::BodyUnreadable(_) => "The request body could not be read",
            Self::KeyInUse { .. } => "A request with this Idempotency-Key is still being processed",
            Self::TakenOver => "Another attempt took this request over",
            Self::KeyReused => "This Idempotency-Key was used for a different request",
            Self::StoreUnavailable => "The idempotency store is unavailable",
            Self::Overloaded { .. } => "The server runs as many requests as it takes",
            Self::HandlerFailed => "The request failed",
            Self::ResponseUnreadable => "The response could not be read",
            Self::ClaimedTwice => "The request was claimed twice",
            Self::LayerMissing => "This route is not guarded by IdempotencyLayer",
            Self::PreconditionInvalid(_) => "The precondition header is invalid",
            Self::PreconditionRequired => "This write requires If-Match",
            Self::PreconditionFailed { .. } => "The resource changed since it was read",
        }
    }

    fn detail(&self) -> Option<String> {
        Some(match self {
            Self::MissingKey => "send an Idempotency-Key header, e.g. a fresh UUID, and keep it across retries of this request".into(),
            Self::InvalidKey(e) => e.to_string(),
            Self::PayloadTooLarge { max } => format!("the body must not exceed {max} bytes"),
            Self::BodyUnreadable(e) | Self::PreconditionInvalid(e) => e.clone(),
            Self::KeyInUse { .. } => "retry after the time given in Retry-After to get its answer".into(),
            Self::TakenOver => "this attempt ran past its lease and was rolled back; retry to get the answer of the attempt that took over".into(),
            Self::KeyReused => "the method, path or body differs from the first request sent with this key; use a new key for a new request".into(),
            Self::StoreUnavailable => "the request was not run; retry it with the same Idempotency-Key".into(),
            Self::Overloaded { .. } => "the request was not run; retry it after the time given in Retry-After with the same Idempotency-Key".into(),
            Self::HandlerFailed => "retry with the same Idempotency-Key".into(),
            Self::ClaimedTwice => "DeferredClaim::begin was called again after it succeeded".into(),
            Self::PreconditionRequired => "read the resource, then send its ETag in If-Match".into(),
            Self::PreconditionFailed { current: Some(_) } => "the version in If-Match is not the current one; read it again".into(),
            Self::PreconditionFailed { current: None } => "the resource does not exist".into(),
            Self::ResponseUnreadable | Self::LayerMissing => return None,
        })
    }

    /// For a rejection whose body never varies (its detail names nothing
    /// of the request), its place in [`FIXED_BODIES`].
    fn fixed_body(&self) -> Option<usize> {
        Some(match self {
            Self::MissingKey => 0,
            Self::KeyInUse { .. } => 1,
            Self::TakenOver => 2,
            Self::KeyReused => 3,
            Self::StoreUnavailable => 4,
            Self::HandlerFailed => 5,
            Self::ResponseUnreadable => 6,
            Self::ClaimedTwice => 7,
            Self::LayerMissing => 8,
            Self::PreconditionRequired => 9,
            Self::PreconditionFailed { current: Some(_) } => 10,
            Self::PreconditionFailed { current: None } => 11,
            Self::Overloaded { .. } => 12,
            Self::InvalidKey(_)
            | Self::PayloadTooLarge { .. }
            | Self::BodyUnreadable(_)
            | Self::PreconditionInvalid(_) => return None,
        })
    }

    /// The `Retry-After`, in seconds, where retrying helps.
    fn retry_after(&self) -> Option<u64> {
        match self {
            // Whole seconds, rounded up: a client that waits that long
            // has waited the policy's hint.
            Self::KeyInUse { retry_after } | Self::Overloaded { retry_after } => Some(
                u64::try_from(retry_after.as_millis().div_ceil(1000))
                    .unwrap_or(u64::MAX)
                    .max(1),
            ),
            Self::TakenOver | Self::StoreUnavailable => Some(1),
            _ => None,
        }
    }
}

/// How many rejections have a body that never varies
/// ([`IdempotencyRejection::fixed_body`]).
const FIXED: usize = 13;

/// The bodies of the rejections that never vary, rendered the first time
/// each is answered: with the default problem type base, and with the one
/// [`set_problem_type_base`](crate::problem::set_problem_type_base) set
/// (at most once, so neither goes stale).
static FIXED_BODIES: [[OnceLock<Box<[u8]>>; FIXED]; 2] =
    [const { [const { OnceLock::new() }; FIXED] }; 2];

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        if matches!(self, Self::LayerMissing) {
            tracing::error!("an idempotency extractor on a route without IdempotencyLayer, a method it does not guard, or the wrong one for its claim mode (Idempotency with the layer's claim, DeferredClaim with claim_in_transaction)");
        }
        let (base, set) = problem::current_base();
        let render = || {
            let problem =
                Problem::with_base(base, self.status(), self.problem_type(), self.title());
            match self.detail() {
                Some(detail) => problem.detail(detail),
                None => problem,
            }
            .body()
        };
        let body = match self.fixed_body() {
            // Rendered once per process (and base): a duplicate of a request
            // in flight, the commonest rejection, costs no serialising.
            Some(slot) => {
                let by_base = &FIXED_BODIES[usize::from(set)];
                Bytes::from_static(by_base[slot].get_or_init(|| render().into_boxed_slice()))
            }
            None => Bytes::from(render()),
        };
        let mut response = problem::response(self.status(), body, self.retry_after());
        response.headers_mut().insert(
            IDEMPOTENCY_REJECTION,
            HeaderValue::from_static(self.problem_type()),
        );
        if let Self::PreconditionFailed { current: Some(tag) } = self {
            response.headers_mut().insert(header::ETAG, tag);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{problem_type_base, PROBLEM_JSON};

    fn every() -> Vec<IdempotencyRejection> {
        vec![
            IdempotencyRejection::MissingKey,
            IdempotencyRejection::InvalidKey(KeyError::Empty),
            IdempotencyRejection::PayloadTooLarge { max: 1 },
            IdempotencyRejection::BodyUnreadable("x".into()),
            IdempotencyRejection::KeyInUse {
                retry_after: Duration::from_secs(2),
            },
            IdempotencyRejection::TakenOver,
            IdempotencyRejection::KeyReused,
            IdempotencyRejection::StoreUnavailable,
            IdempotencyRejection::Overloaded {
                retry_after: Duration::from_secs(3),
            },
            IdempotencyRejection::HandlerFailed,
            IdempotencyRejection::ResponseUnreadable,
            IdempotencyRejection::ClaimedTwice,
            IdempotencyRejection::LayerMissing,
            IdempotencyRejection::PreconditionInvalid("x".into()),
            IdempotencyRejection::PreconditionRequired,
            IdempotencyRejection::PreconditionFailed { current: None },
        ]
    }

    /// The body a rejection must answer with, spelled out field by field.
    fn expected_body(rejection: &IdempotencyRejection) -> serde_json::Value {
        let mut body = serde_json::json!({
            "type": format!("{}{}", problem_type_base(), rejection.problem_type()),
            "title": rejection.title(),
            "status": rejection.status().as_u16(),
        });
        if let Some(detail) = rejection.detail() {
            body["detail"] = detail.into();
        }
        body
    }

    #[tokio::test]
    async fn every_body_is_its_own_the_first_time_and_after() {
        use http_body_util::BodyExt;
        let mut every = every();
        every.push(IdempotencyRejection::PreconditionFailed {
            current: Some(HeaderValue::from_static("\"v3\"")),
        });
        // Twice over: the second answer of a fixed body is the one kept
        // from the first.
        for rejection in every.iter().chain(&every) {
            let expected = expected_body(rejection);
            let response = rejection.clone().into_response();
            assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body, expected, "{rejection:?}");
        }
        // Each fixed body has a place of its own.
        let slots: Vec<usize> = every.iter().filter_map(|r| r.fixed_body()).collect();
        let distinct: std::collections::BTreeSet<_> = slots.iter().collect();
        assert_eq!(distinct.len(), slots.len());
        assert!(slots.iter().all(|&slot| slot < FIXED));
    }

    #[test]
    fn retry_after_is_rounded_up_to_whole_seconds() {
        for (millis, secs) in [(1, "1"), (1000, "1"), (1001, "2"), (1500, "2"), (3000, "3")] {
            let answer = IdempotencyRejection::Overloaded {
                retry_after: Duration::from_millis(millis),
            }
            .into_response();
            assert_eq!(answer.headers()[header::RETRY_AFTER], secs, "{millis} ms");
        }
    }

    #[test]
    fn every_problem_type_is_listed_once_and_used() {
        let used: std::collections::BTreeSet<_> = every()
            .iter()
            .map(IdempotencyRejection::problem_type)
            .collect();
        let listed: std::collections::BTreeSet<_> = IdempotencyRejection::PROBLEM_TYPES
            .iter()
            .copied()
            .collect();
        assert_eq!(listed.len(), IdempotencyRejection::PROBLEM_TYPES.len());
        assert_eq!(used, listed);
    }

    #[test]
    fn answers_carry_their_status_and_retry_after() {
        for rejection in every() {
            let status = rejection.status();
            let retry = rejection.retry_after();
            let slug = rejection.problem_type();
            let response = rejection.into_response();
            assert_eq!(response.status(), status);
            assert_eq!(response.headers()[IDEMPOTENCY_REJECTION], slug);
            assert_eq!(
                response.headers().get(header::RETRY_AFTER).is_some(),
                retry.is_some(),
                "{status}"
            );
            assert!(
                status.is_client_error() || status.is_server_error(),
                "{status}"
            );
        }
        let conflict = IdempotencyRejection::KeyInUse {
            retry_after: Duration::from_millis(200),
        }
        .into_response();
        assert_eq!(conflict.headers()[header::RETRY_AFTER], "1");
        let stale = IdempotencyRejection::PreconditionFailed {
            current: Some(HeaderValue::from_static("\"v3\"")),
        }
        .into_response();
        assert_eq!(stale.headers()[header::ETAG], "\"v3\"");
    }

    /// The contract guide lists every problem type of the contract.
    #[test]
    fn the_contract_guide_lists_the_problem_types() {
        let readme = include_str!("../../idem/guide/contract.md");
        for slug in IdempotencyRejection::PROBLEM_TYPES {
            assert!(
                readme.contains(&format!("`{slug}`")),
                "crates/idem/guide/contract.md does not mention the problem type `{slug}`"
            );
        }
    }
}
