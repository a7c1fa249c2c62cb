//! Answers: the calls the layer refuses, the gRPC status of an answer and
//! whether it is stored, and an answer as stored and replayed.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body as HttpBody, Frame, SizeHint};
use idem_core::{Policy, StoredResponse};
use tonic::{body::Body, Code, Status};
use tracing::warn;

/// The metadata that marks a replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The standard gRPC retry pushback (gRPC proposal A6): how many
/// milliseconds a client should wait before it retries.
pub const RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The same hint in whole seconds, as HTTP's `Retry-After` gives it.
pub const RETRY_AFTER: HeaderName = HeaderName::from_static("retry-after");

/// The metadata a stored answer always keeps: what a gRPC client needs to
/// read it.
const ALWAYS_KEPT: [&str; 4] = [
    "content-type",
    "grpc-status",
    "grpc-message",
    "grpc-status-details-bin",
];

/// How a stored trailer's name starts: `/` is not allowed in a metadata
/// name, so a header can never pass for a trailer.
const TRAILER: &str = "trailer/";

/// A refusal as an HTTP response carrying a gRPC status in its headers
/// ("trailers-only").
pub(crate) fn refuse(status: Status) -> http::Response<Body> {
    status.into_http()
}

/// `ABORTED`: the key is in flight; retry after `retry_after`, which the
/// metadata says twice, as gRPC's pushback and as seconds.
pub(crate) fn in_flight(retry_after: Duration) -> http::Response<Body> {
    hinted(
        crate::LayerRefusal::InFlight.status(
            Code::Aborted,
            format!(
                "a call with this idempotency-key is in flight; retry after {} ms with the same key",
                retry_after.as_millis()
            ),
        ),
        retry_after,
    )
}

/// `UNAVAILABLE` with a retry hint: too many guarded calls run in this
/// process; nothing was read or claimed.
pub(crate) fn overloaded(retry_after: Duration) -> http::Response<Body> {
    hinted(
        crate::LayerRefusal::Overloaded.status(
            Code::Unavailable,
            format!(
                "this server runs as many guarded calls as it takes; nothing ran: retry after {} ms with the same key",
                retry_after.as_millis()
            ),
        ),
        retry_after,
    )
}

/// `status` with a retry hint, said twice in its metadata: as gRPC's
/// pushback (milliseconds) and as `retry-after` (whole seconds, rounded
/// up).
fn hinted(status: Status, retry_after: Duration) -> http::Response<Body> {
    let mut response = refuse(status);
    let headers = response.headers_mut();
    headers.insert(
        RETRY_PUSHBACK,
        HeaderValue::from(u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX)),
    );
    headers.insert(
        RETRY_AFTER,
        HeaderValue::from(
            u64::try_from(retry_after.as_millis().div_ceil(1000))
                .unwrap_or(u64::MAX)
                .max(1),
        ),
    );
    response
}

/// The gRPC status code of an answer: from its trailers, or its headers
/// for a trailers-only answer. An answer with no status, or not `200`, is
/// `UNKNOWN`, as a client would read it.
pub(crate) fn code_of(
    status: http::StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
) -> Code {
    if status != http::StatusCode::OK {
        return Code::Unknown;
    }
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .map_or(Code::Unknown, |v| Code::from_bytes(v.as_bytes()))
}

/// Whether an answer with `code` is stored for replay (otherwise the claim
/// is released for a retry): every status but those a retry may get past,
/// and the server's faults (`UNIMPLEMENTED`, `DATA_LOSS`: HTTP's `501` and
/// `500`, released as every `5xx` is over HTTP). `RESOURCE_EXHAUSTED` is
/// HTTP's `429` (a rate limit, a quota): released where the policy
/// releases a `429` ([`Policy::releases_client_error`], the default). When
/// the policy does not store client errors, only `OK` is stored.
/// (`CANCELLED` keeps the claim: see `finish`.)
pub(crate) fn is_stored(code: Code, policy: &Policy) -> bool {
    match code {
        Code::Ok => true,
        Code::Unavailable
        | Code::Internal
        | Code::Unknown
        | Code::DeadlineExceeded
        | Code::Unimplemented
        | Code::DataLoss => false,
        Code::ResourceExhausted => !policy.releases_client_error(429),
        _ => policy.store_client_errors(),
    }
}

/// An answer as it is stored: the status `200`, its headers and trailers
/// that `keep` allows (and those a client needs to read it), its body (the
/// response's message frames) byte for byte.
pub(crate) fn stored(
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
    body: Bytes,
    keep: impl Fn(&str) -> bool,
) -> StoredResponse {
    let kept = |name: &HeaderName| ALWAYS_KEPT.contains(&name.as_str()) || keep(name.as_str());
    let mut stored = Vec::new();
    for (name, value) in headers {
        if kept(name) {
            stored.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
        }
    }
    for (name, value) in trailers.into_iter().flatten() {
        if kept(name) {
            stored.push((format!("{TRAILER}{name}"), value.as_bytes().to_vec()));
        }
    }
    StoredResponse {
        status: 200,
        headers: stored,
        body,
    }
}

/// A stored answer, as first sent, marked `idempotent-replayed: true`.
pub(crate) fn replay(stored: &StoredResponse) -> http::Response<Body> {
    let mut headers = HeaderMap::new();
    let mut trailers = HeaderMap::new();
    for (name, value) in &stored.headers {
        let (into, name) = match name.strip_prefix(TRAILER) {
            Some(trailer) => (&mut trailers, trailer),
            None => (&mut headers, name.as_str()),
        };
        let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            warn!(metadata = ?name, "skipping stored metadata that is no longer valid");
            continue;
        };
        if into.len() >= MAX_REPLAYED || into.try_append(n, v).is_err() {
            warn!("a stored answer holds more metadata than a replay sends; replaying the first");
            break;
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let trailers = (!trailers.is_empty()).then_some(trailers);
    let mut response = http::Response::new(Body::new(Buffered::new(stored.body.clone(), trailers)));
    *response.headers_mut() = headers;
    response
}

/// The most metadata entries a replay sends, in its headers and in its
/// trailers (a real answer carries a handful).
const MAX_REPLAYED: usize = 1024;

/// A body read whole: its data, then its trailers.
#[derive(Debug)]
pub(crate) struct Buffered {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Buffered {
    pub(crate) fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }
}

impl HttpBody for Buffered {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.data {
            Some(d) => SizeHint::with_exact(d.len() as u64),
            None => SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use http_body_util::BodyExt;

    use super::*;

    #[test]
    fn which_codes_are_stored() {
        let stores = Policy::default();
        let releases = Policy::builder()
            .store_client_errors(false)
            .build()
            .unwrap();
        for code in [
            Code::Unavailable,
            Code::Internal,
            Code::Unknown,
            Code::DeadlineExceeded,
            Code::Unimplemented,
            Code::DataLoss,
        ] {
            assert!(!is_stored(code, &stores), "{code:?}");
            assert!(!is_stored(code, &releases), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::PermissionDenied,
            Code::Cancelled,
        ] {
            assert!(is_stored(code, &stores), "{code:?}");
            assert!(!is_stored(code, &releases), "{code:?}");
        }
        // A rate limit says "come back later" unless the policy stores 429.
        assert!(!is_stored(Code::ResourceExhausted, &stores));
        assert!(!is_stored(Code::ResourceExhausted, &releases));
        let keeps_429 = Policy::builder().store_client_error(429).build().unwrap();
        assert!(is_stored(Code::ResourceExhausted, &keeps_429));
        assert!(is_stored(Code::Ok, &releases));
    }

    #[test]
    fn the_code_comes_from_trailers_then_headers() {
        let mut headers = HeaderMap::new();
        let mut trailers = HeaderMap::new();
        assert_eq!(code_of(http::StatusCode::OK, &headers, None), Code::Unknown);
        headers.insert("grpc-status", HeaderValue::from_static("5"));
        assert_eq!(
            code_of(http::StatusCode::OK, &headers, None),
            Code::NotFound
        );
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        assert_eq!(
            code_of(http::StatusCode::OK, &headers, Some(&trailers)),
            Code::Ok
        );
        assert_eq!(
            code_of(http::StatusCode::BAD_GATEWAY, &headers, Some(&trailers)),
            Code::Unknown
        );
    }

    #[tokio::test]
    async fn an_answer_replays_as_stored_with_only_what_is_kept() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.insert("x-cost", HeaderValue::from_static("3"));
        headers.insert("x-secret", HeaderValue::from_static("s"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("x-cost", HeaderValue::from_static("4"));
        trailers.insert("x-trace", HeaderValue::from_static("t"));
        let body = Bytes::from_static(b"\0\0\0\0\x02\x08\x01");
        let stored = stored(&headers, Some(&trailers), body.clone(), |n| n == "x-cost");
        assert_eq!(stored.status, 200);
        let names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "x-cost",
                "trailer/grpc-status",
                "trailer/x-cost"
            ]
        );

        let replayed = replay(&stored);
        assert_eq!(replayed.headers()["content-type"], "application/grpc");
        assert_eq!(replayed.headers()["x-cost"], "3");
        assert_eq!(replayed.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replayed.headers().get("x-secret").is_none());
        let collected = replayed.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap();
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(trailers["x-cost"], "4");
        assert!(trailers.get("x-trace").is_none());
        assert_eq!(collected.to_bytes(), body);
    }

    #[tokio::test]
    async fn a_trailers_only_answer_replays_trailers_only() {
        let refused = refuse(Status::not_found("no such payment"));
        let stored = stored(refused.headers(), None, Bytes::new(), |_| false);
        let replayed = replay(&stored);
        let status = Status::from_header_map(replayed.headers()).unwrap();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "no such payment");
        let collected = replayed.into_body().collect().await.unwrap();
        assert!(collected.trailers().is_none());
        assert!(collected.to_bytes().is_empty());
    }

    #[test]
    fn in_flight_says_when_to_retry() {
        let r = in_flight(Duration::from_millis(1500));
        assert_eq!(r.headers()[RETRY_PUSHBACK], "1500");
        assert_eq!(r.headers()[RETRY_AFTER], "2");
        assert_eq!(
            Status::from_header_map(r.headers()).unwrap().code(),
            Code::Aborted
        );
    }
}
