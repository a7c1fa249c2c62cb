//! Forwarding one request to the upstream and reading its answer, with the
//! outcome classified for the claim: answered (stored, or released on
//! `5xx`), refused before anything was sent (released), or unknown (the
//! claim is kept until its lease runs out).

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_axum::{Idempotency, Problem};
use tracing::{debug, warn};

/// The upstream: where requests go, and the pooled HTTP/1.1 client that
/// takes them there.
#[derive(Debug, Clone)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, Body>,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The upstream URL's path, without its trailing `/`, put before every
    /// request's path.
    base: String,
    timeout: Duration,
    lease: Duration,
    max_answer: usize,
    max_body: usize,
    /// Upstream statuses whose outcome is unknown: they hold the key.
    held: Vec<StatusCode>,
}

/// How long and how much, for [`Upstream::new`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpstreamLimits {
    /// The longest wait for an answer.
    pub(crate) timeout: Duration,
    /// The claims' lease, which a guarded request never outlives.
    pub(crate) lease: Duration,
    /// The largest answer kept for replay.
    pub(crate) max_answer: usize,
    /// The largest request body sent through.
    pub(crate) max_body: usize,
    /// How long an idle pooled connection to the upstream is reused.
    pub(crate) idle: Duration,
}

/// What `--upstream` may be.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// Not a URL.
    #[error("--upstream {0:?} is not a URL: {1}")]
    Invalid(String, http::uri::InvalidUri),
    /// Not `http://host[:port][/path]`.
    #[error("--upstream {0:?} must be http://HOST[:PORT][/PATH] (TLS to the upstream is not supported; put the proxy beside the service)")]
    Unsupported(String),
}

/// How a forwarded request ended.
enum Ended {
    /// The upstream answered (any status), its body read whole.
    Answered(Response),
    /// The connection was refused: nothing was sent.
    Refused(String),
    /// The request may have reached the upstream, but no whole answer came
    /// back (the connection broke).
    Unknown(String),
    /// The upstream answered with a status that is the request's outcome,
    /// and a body larger than the proxy keeps.
    TooLargeToKeep(StatusCode),
    /// No answer within the time allowed.
    TimedOut,
}

impl Upstream {
    /// The upstream at `url`; each request may take `limits.timeout` (a
    /// guarded one, never past its lease), an answer to keep may be
    /// `limits.max_answer` bytes, a body sent through `limits.max_body`.
    pub(crate) fn new(url: &str, limits: UpstreamLimits) -> Result<Self, UpstreamError> {
        let UpstreamLimits {
            timeout,
            lease,
            max_answer,
            max_body,
            idle,
        } = limits;
        let uri: Uri = url
            .parse()
            .map_err(|e| UpstreamError::Invalid(url.to_owned(), e))?;
        let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned())
        else {
            return Err(UpstreamError::Unsupported(url.to_owned()));
        };
        if scheme != http::uri::Scheme::HTTP || uri.query().is_some() {
            return Err(UpstreamError::Unsupported(url.to_owned()));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(5))));
        let client = Client::builder(TokioExecutor::new())
            // Below the upstream's own keep-alive timeout: a request sent on
            // a connection the upstream is closing is an unknown outcome,
            // which holds its key for a lease.
            .pool_idle_timeout(idle)
            .pool_max_idle_per_host(512)
            .build(connector);
        Ok(Self {
            client,
            scheme,
            authority,
            base: uri.path().trim_end_matches('/').to_owned(),
            timeout,
            lease,
            max_answer,
            max_body,
            held: Vec::new(),
        })
    }

    /// Answers of these statuses (`--outcome-unknown-status`, each a
    /// `5xx`) say nothing of what became of the request: they hold the key
    /// until its lease runs out instead of releasing it.
    pub(crate) fn hold_statuses(&mut self, statuses: &[u16]) {
        self.held = statuses
            .iter()
            .filter_map(|s| StatusCode::from_u16(*s).ok())
            .filter(StatusCode::is_server_error)
            .collect();
    }

    /// The largest answer kept for replay, in bytes.
    pub(crate) fn max_answer(&self) -> usize {
        self.max_answer
    }

    /// Keeps answers of at most `bytes` (the store cannot hold more).
    pub(crate) fn limit_answer(&mut self, bytes: usize) {
        self.max_answer = self.max_answer.min(bytes);
    }

    /// The upstream's URL, for messages.
    pub(crate) fn url(&self) -> String {
        format!("{}://{}{}", self.scheme, self.authority, self.base)
    }

    /// Forwards `request` and answers with the upstream's answer, or with
    /// a problem saying why there is none. A guarded request (`idem` is
    /// set) carries the operation id as its `Idempotency-Key`; its answer
    /// is read whole (for the layer to store) and an unknown outcome keeps
    /// its claim.
    pub(crate) async fn forward(
        &self,
        idem: Option<Idempotency>,
        request: Request<Body>,
    ) -> Response {
        let (mut parts, body) = request.into_parts();
        let target = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |p| p.as_str());
        let uri = match Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{target}", self.base))
            .build()
        {
            Ok(uri) => uri,
            Err(e) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request-target",
                    "The request target cannot be forwarded",
                    e.to_string(),
                )
            }
        };
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::EXPECT);
        let Some(idem) = idem else {
            return self.pass_through(parts, body).await;
        };
        // The client's key goes, and `Idempotency_Key` with it: servers that
        // map header names to CGI variables (PHP, Rack, some WSGI servers)
        // read it as the same one, beside the operation id.
        let keys: Vec<HeaderName> = parts
            .headers
            .keys()
            .filter(|name| {
                let dashed = name
                    .as_str()
                    .bytes()
                    .map(|b| if b == b'_' { b'-' } else { b });
                dashed.eq(idem_axum::IDEMPOTENCY_KEY.as_str().bytes())
            })
            .cloned()
            .collect();
        for name in keys {
            parts.headers.remove(name);
        }
        if let Ok(id) = HeaderValue::from_str(&idem.operation_id().to_string()) {
            parts.headers.insert(idem_axum::IDEMPOTENCY_KEY, id);
        }
        // Never past the claim's lease, with a sixth of it to spare: when
        // the lease ends, a retry may take the key over, and the first
        // delivery must be over by then.
        let allowed = self
            .timeout
            .min(idem.lease_left().saturating_sub(self.lease / 6));
        if allowed < MIN_ATTEMPT {
            // The claim itself took most of the lease: send nothing, and
            // let the key go (a 5xx releases it).
            count("not_sent");
            let mut answer = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-slow",
                "The store took too long to claim the key; nothing was sent",
                format!("{} ms of the lease left", idem.lease_left().as_millis()),
            );
            set_retry_after(&mut answer, Duration::from_secs(1));
            return answer;
        }
        // Until the outcome is known, an unfinished request (a panic, a
        // shutdown) keeps the key rather than freeing it beside a delivery
        // that may still be going on.
        idem.keep_claim();
        let started = Instant::now();
        let ended = match tokio::time::timeout(
            allowed,
            self.send_and_read(Request::from_parts(parts, body)),
        )
        .await
        {
            Ok(ended) => ended,
            Err(_) => Ended::TimedOut,
        };
        metrics::histogram!("idem_proxy_upstream_seconds").record(started.elapsed().as_secs_f64());
        let held = idem.lease_left();
        match ended {
            Ended::Answered(mut response) if self.held.contains(&response.status()) => {
                // A gateway inside the upstream gave up, or so the
                // operator says of this status: the service may still be
                // at work. The key stays held (`keep_claim` above) until
                // the lease ends; the retry after it goes under the same
                // operation id.
                count("unknown");
                set_retry_after(&mut response, held);
                response
            }
            Ended::Answered(response) => {
                count("answered");
                if releases(response.status(), response.headers()) {
                    // "Try again later" is not the request's outcome.
                    idem.release_claim();
                } else {
                    idem.settle_by_answer();
                }
                response
            }
            Ended::Refused(why) => {
                count("refused");
                // Nothing was sent: the layer releases the claim (a 5xx).
                idem.settle_by_answer();
                problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unreachable",
                    "The upstream refused the connection; nothing was sent",
                    why,
                )
            }
            Ended::Unknown(why) => {
                count("unknown");
                let mut answer = problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-outcome-unknown",
                    "The upstream may have acted on the request but gave no whole answer",
                    format!("{why}; the key is held until its lease runs out, then a retry reaches the upstream again under the same operation id"),
                );
                set_retry_after(&mut answer, held);
                answer
            }
            Ended::TooLargeToKeep(status) => {
                count("too_large");
                // The upstream acted: its status says so. Held, the key
                // would send the request again after every lease and the
                // client would never get an answer; this one is stored in
                // its place, and every retry gets it.
                idem.store_answer();
                problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-answer-too-large",
                    "The upstream's answer is larger than the proxy passes on",
                    format!(
                        "it answered {status} with more than the {} bytes the proxy keeps (--max-response-body); the request was carried out, and this answer is kept for its key in place of the upstream's",
                        self.max_answer
                    ),
                )
            }
            Ended::TimedOut => {
                count("timeout");
                let mut answer = problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream-timeout",
                    "The upstream did not answer in time",
                    format!("no answer within {} ms; the key is held until its lease runs out, then a retry reaches the upstream again under the same operation id", allowed.as_millis()),
                );
                set_retry_after(&mut answer, held);
                answer
            }
        }
    }

    /// Sends a guarded request and reads the answer whole.
    async fn send_and_read(&self, request: Request<Body>) -> Ended {
        let answer = match self.client.request(request).await {
            Ok(answer) => answer,
            Err(e) if nothing_sent(&e) => return Ended::Refused(crate::chain(&e)),
            Err(e) => return Ended::Unknown(crate::chain(&e)),
        };
        if answer.status().is_informational() {
            // A 101 to a request that asked for no upgrade: no answer to
            // keep or pass on.
            return Ended::Unknown(format!("it answered {}", answer.status()));
        }
        let (mut parts, body) = answer.into_parts();
        let bytes = match Limited::new(body, self.max_answer).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                let too_large = e
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some();
                if too_large
                    && (parts.status.is_server_error() || releases(parts.status, &parts.headers))
                {
                    // An answer that frees the key anyway (or holds it,
                    // a status named by `--outcome-unknown-status`): its
                    // status is known, and passed on without its body,
                    // with the upstream's own `Retry-After` (when to come
                    // back).
                    let key = if self.held.contains(&parts.status) {
                        "the key is held until its lease runs out"
                    } else {
                        "the key is free again"
                    };
                    let mut answer = problem(
                        parts.status,
                        "upstream-answer-too-large",
                        "The upstream's answer is larger than the proxy passes on",
                        format!(
                            "it answered {} with more than the {} bytes the proxy keeps (--max-response-body); {key}",
                            parts.status, self.max_answer
                        ),
                    );
                    if let Some(wait) = parts.headers.get(header::RETRY_AFTER) {
                        answer
                            .headers_mut()
                            .insert(header::RETRY_AFTER, wait.clone());
                    }
                    return Ended::Answered(answer);
                }
                if too_large {
                    return Ended::TooLargeToKeep(parts.status);
                }
                return Ended::Unknown(format!("its answer broke off: {e}"));
            }
        };
        // The body is read whole: it is framed by its own length, never by
        // the upstream's `Content-Length`, which a chunked answer may carry
        // too, and wrong (bytes past it would be read as the next answer
        // on the client's connection).
        parts.headers.remove(header::CONTENT_LENGTH);
        strip_hop_by_hop(&mut parts.headers);
        Ended::Answered(Response::from_parts(parts, Body::from(bytes)))
    }

    /// Forwards a request the layer does not guard, streaming both ways
    /// (the body within `--max-body`).
    async fn pass_through(&self, parts: http::request::Parts, body: Body) -> Response {
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_body as u64) {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "The request body is too large",
                format!("at most {} bytes", self.max_body),
            );
        }
        let body = Body::new(Limited::new(body, self.max_body));
        let request = Request::from_parts(parts, body);
        let sent = tokio::time::timeout(self.timeout, self.client.request(request)).await;
        match sent {
            Ok(Ok(answer)) => {
                count("passed_through");
                let (mut parts, body) = answer.into_parts();
                // Transfer-Encoding framed the body, not the Content-Length
                // that came beside it (RFC 9112 §6.3): passed on, it would
                // frame what this proxy sends otherwise.
                if parts.headers.contains_key(header::TRANSFER_ENCODING) {
                    parts.headers.remove(header::CONTENT_LENGTH);
                }
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(body))
            }
            Ok(Err(e)) if is_too_large(&e) => problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "The request body is too large",
                format!("at most {} bytes", self.max_body),
            ),
            Ok(Err(e)) => {
                count(if nothing_sent(&e) {
                    "refused"
                } else {
                    "unknown"
                });
                debug!(error = %crate::chain(&e), "an unguarded request failed upstream");
                problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unreachable",
                    "The upstream gave no answer",
                    crate::chain(&e),
                )
            }
            Err(_) => {
                count("timeout");
                problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream-timeout",
                    "The upstream did not answer in time",
                    format!("no answer within {} ms", self.timeout.as_millis()),
                )
            }
        }
    }
}

/// Counts a forwarded request by how it ended
/// (`idem_proxy_upstream_total{outcome}`).
fn count(outcome: &'static str) {
    metrics::counter!("idem_proxy_upstream_total", "outcome" => outcome).increment(1);
}

/// A problem+json answer of the proxy's own.
pub(crate) fn problem(
    status: StatusCode,
    slug: &str,
    title: &str,
    detail: impl Into<String>,
) -> Response {
    let detail = detail.into();
    if status.is_server_error() {
        warn!(%status, slug, %detail, "answering with a problem");
    }
    Problem::new(status, slug, title)
        .detail(detail)
        .into_response()
}

/// The shortest wait for the upstream worth sending a guarded request for.
const MIN_ATTEMPT: Duration = Duration::from_millis(10);

/// Whether an upstream answer of `status` with `headers` releases the key
/// instead of being stored: a "try again later" (`408`, `425`, `429`:
/// [`idem_core::DEFAULT_RELEASED_CLIENT_ERRORS`], which the layer's policy
/// releases too), or a `409` that says when
/// to come back (`Retry-After`): the upstream's own "this operation is
/// still in flight", as after a takeover that reached it while the first
/// delivery still ran. Stored, it would answer every retry with `409` for
/// the whole retention, although the operation completes upstream. A `409`
/// without `Retry-After` is a conflict, the request's outcome: stored.
fn releases(status: StatusCode, headers: &HeaderMap) -> bool {
    idem_core::DEFAULT_RELEASED_CLIENT_ERRORS.contains(&status.as_u16())
        || (status == StatusCode::CONFLICT && headers.contains_key(header::RETRY_AFTER))
}

/// `Retry-After` in whole seconds, rounded up (at least one): a client that
/// waits that long finds the key free.
fn set_retry_after(answer: &mut Response, wait: Duration) {
    let secs = wait.as_millis().div_ceil(1000).max(1);
    let secs = u64::try_from(secs).unwrap_or(u64::MAX);
    answer
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
}

/// Whether the client failed before any of the request was written: the
/// connection was refused, or hyper gave the request back unsent.
fn nothing_sent(e: &hyper_util::client::legacy::Error) -> bool {
    if e.is_connect() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_canceled();
        }
        source = s.source();
    }
    false
}

/// Whether the request failed because its body went over `--max-body`.
fn is_too_large(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The hop-by-hop headers of RFC 9110 §7.6.1, which belong to one
/// connection and are never forwarded; the ones a `Connection` header
/// names are removed with them.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes the hop-by-hop headers from `headers`.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert("etag", HeaderValue::from_static("\"1\""));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["content-type", "etag"]);
    }

    #[test]
    fn only_plain_http_upstreams_are_taken() {
        let t = UpstreamLimits {
            timeout: Duration::from_secs(1),
            lease: Duration::from_secs(2),
            max_answer: 1,
            max_body: 1,
            idle: Duration::from_secs(1),
        };
        let ok = Upstream::new("http://127.0.0.1:9000/api/", t).unwrap();
        assert_eq!(ok.url(), "http://127.0.0.1:9000/api");
        assert_eq!(Upstream::new("http://svc", t).unwrap().url(), "http://svc");
        for bad in [
            "https://svc",
            "svc:80",
            "/path",
            "http://svc/?q=1",
            "not a url",
        ] {
            assert!(Upstream::new(bad, t).is_err(), "{bad}");
        }
    }
}
