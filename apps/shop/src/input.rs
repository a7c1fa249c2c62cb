//! What `shop` accepts from a client, checked before anything is written:
//! who is calling (`Authorization: Bearer <client>`), identifiers, amounts,
//! text, and the content type of a JSON body.

use axum::extract::Request;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_axum::Problem;

/// The largest amount in minor units a payment may carry.
pub(crate) const MAX_AMOUNT: i64 = 1_000_000_000;

/// A `400` validation problem.
pub(crate) fn validation(detail: impl Into<String>) -> Response {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "validation",
        "The request is invalid",
    )
    .detail(detail)
    .into_response()
}

/// Whether `s` is an identifier: 1 to 64 characters of `[A-Za-z0-9_.:-]`.
pub(crate) fn is_identifier(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// Checks an identifier (`account_id`, `customer_id`, a SKU, an id in a
/// path), or answers `400` naming it.
pub(crate) fn identifier(name: &str, value: &str) -> Result<(), Response> {
    if is_identifier(value) {
        Ok(())
    } else {
        Err(validation(format!(
            "{name} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '.', ':' or '-'"
        )))
    }
}

/// Checks free text (a product name): 1 to `max` bytes, no control
/// characters (NUL included).
pub(crate) fn text(name: &str, value: &str, max: usize) -> Result<(), Response> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        Err(validation(format!(
            "{name} must be 1 to {max} bytes of text without control characters"
        )))
    } else {
        Ok(())
    }
}

/// Checks an amount in minor units: an integer from 1 to 1,000,000,000.
pub(crate) fn amount(value: Option<&serde_json::Value>) -> Result<i64, Response> {
    match value.and_then(serde_json::Value::as_i64) {
        Some(a) if (1..=MAX_AMOUNT).contains(&a) => Ok(a),
        _ => Err(validation(format!(
            "amount is required: an integer from 1 to {MAX_AMOUNT} (minor units)"
        ))),
    }
}

/// Checks a currency: three ASCII letters.
pub(crate) fn currency(value: Option<&serde_json::Value>) -> Result<String, Response> {
    match value {
        Some(serde_json::Value::String(c))
            if c.len() == 3 && c.bytes().all(|b| b.is_ascii_alphabetic()) =>
        {
            Ok(c.clone())
        }
        _ => Err(validation(
            "currency is required: three letters, e.g. \"EUR\"",
        )),
    }
}

/// The calling client: `Authorization: Bearer <client-id>` (the scheme in
/// any case, RFC 9110), the id 1 to 255 visible ASCII characters. No header
/// is `401`; two headers, another scheme or a bad token is `400`/`401`.
pub(crate) fn client_id(headers: &HeaderMap) -> Result<String, Response> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Err(unauthorized("send Authorization: Bearer <client-id>"));
    };
    if values.next().is_some() {
        return Err(validation("send one Authorization header, not several"));
    }
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|t| !t.is_empty() && t.len() <= 255 && t.bytes().all(|b| b.is_ascii_graphic()));
    match token {
        Some(t) => Ok(t.to_owned()),
        None => Err(unauthorized(
            "send Authorization: Bearer <client-id> (1 to 255 visible ASCII characters)",
        )),
    }
}

fn unauthorized(detail: &str) -> Response {
    let mut response = Problem::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "Authentication required",
    )
    .detail(detail)
    .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

/// Whether a `Content-Type` names JSON: `application/json` or any
/// `application/*+json`, parameters allowed.
pub(crate) fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Middleware for a client's routes that read a JSON body: without
/// credentials `401`, with a body that is not JSON `415`, before the
/// idempotency layer fingerprints it or the handler reads it, so both
/// always read the body the same way.
pub(crate) async fn require_client_json(request: Request, next: Next) -> Response {
    if let Err(refused) = client_id(request.headers()) {
        return refused;
    }
    require_json(request, next).await
}

/// Middleware for routes that read a JSON body: anything else is `415`.
pub(crate) async fn require_json(request: Request, next: Next) -> Response {
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json);
    if json {
        next.run(request).await
    } else {
        Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "The body must be JSON",
        )
        .detail("send Content-Type: application/json")
        .into_response()
    }
}

/// Middleware over every route: a body declared (`Content-Length`) larger
/// than `max` bytes is `413`. With `Expect: 100-continue` the answer goes at
/// once and the body is never read, so the client is never told to go on;
/// without it, what the client is still sending is read and dropped (up to
/// 32 MiB, for at most 5 s) so that it reads the answer instead of a broken
/// pipe.
pub(crate) async fn refuse_oversized(
    axum::extract::State(max): axum::extract::State<usize>,
    request: Request,
    next: Next,
) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_none_or(|n| n <= max as u64) {
        return next.run(request).await;
    }
    let expects_continue = request
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if !expects_continue {
        use http_body_util::BodyExt;
        let mut body = request.into_body();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut drained: u64 = 0;
        while let Ok(Some(Ok(frame))) = tokio::time::timeout_at(deadline, body.frame()).await {
            drained += frame.data_ref().map_or(0, |d| d.len() as u64);
            if drained > 32 * 1024 * 1024 {
                break;
            }
        }
    }
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload-too-large",
        "The body is too large",
    )
    .detail(format!("the body must not exceed {max} bytes"))
    .into_response()
}

/// Middleware over every route: an error answer that is not problem+json
/// yet (an unknown route, a method not allowed, a body too large, an
/// extractor's rejection) becomes one, with its status and headers (such as
/// `Allow`) kept.
pub(crate) async fn problems_everywhere(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let detail = match axum::body::to_bytes(body, 4096).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).into_owned(),
        _ => String::new(),
    };
    let (kind, title) = match status {
        StatusCode::NOT_FOUND => ("not-found", "No such resource"),
        StatusCode::METHOD_NOT_ALLOWED => ("method-not-allowed", "Method not allowed"),
        StatusCode::PAYLOAD_TOO_LARGE => ("payload-too-large", "The body is too large"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ("unsupported-media-type", "The body must be JSON"),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            "header-fields-too-large",
            "The request headers are too large",
        ),
        s if s.is_client_error() => ("bad-request", "The request is invalid"),
        _ => ("internal", "The request failed"),
    };
    let mut problem = Problem::new(status, kind, title);
    if !detail.is_empty() {
        problem = problem.detail(detail);
    }
    let fresh = problem.into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::CONTENT_TYPE);
    let (fresh_parts, body) = fresh.into_parts();
    parts.headers.extend(fresh_parts.headers);
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        for ok in ["acc_1", "cust-1", "a", "x.y:z", &"a".repeat(64)] {
            assert!(is_identifier(ok), "{ok}");
        }
        for bad in ["", "a b", "a\0b", "a\nb", "é", "a/b", &"a".repeat(65)] {
            assert!(!is_identifier(bad), "{bad:?}");
        }
    }

    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/merge-patch+json",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in ["text/plain", "application/jsonx", "", "text/json", "json"] {
            assert!(!is_json(bad), "{bad}");
        }
    }

    #[test]
    fn bearer_tokens() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::AUTHORIZATION, v.parse().unwrap());
            }
            client_id(&h).map_err(|r| r.status())
        };
        assert_eq!(with(&["Bearer client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&["bearer client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&["BEARER client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&[]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(with(&["Basic abc"]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(with(&["Bearer "]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(
            with(&["Bearer a", "Bearer b"]),
            Err(StatusCode::BAD_REQUEST)
        );
    }

    #[test]
    fn amounts() {
        use serde_json::json;
        assert_eq!(amount(Some(&json!(1))).ok(), Some(1));
        assert_eq!(amount(Some(&json!(MAX_AMOUNT))).ok(), Some(MAX_AMOUNT));
        for bad in [
            json!(0),
            json!(-1),
            json!(MAX_AMOUNT + 1),
            json!(1.5),
            json!("5"),
        ] {
            assert!(amount(Some(&bad)).is_err(), "{bad}");
        }
        assert!(amount(None).is_err());
    }
}
