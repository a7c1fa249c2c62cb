//! What `shop` accepts from a client, checked before anything is written:
//! identifiers, amounts, text, JSON bodies and their size and type.

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_axum::Problem;
use serde::de::DeserializeOwned;

use super::error::{Error, Result};

/// The largest amount in minor units a payment may carry.
pub(crate) const MAX_AMOUNT: i64 = 1_000_000_000;

/// Whether `s` is an identifier: 1 to 64 characters of `[A-Za-z0-9_.:-]`.
pub(crate) fn is_identifier(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// Checks an identifier (`account_id`, `customer_id`, a SKU, an id in a
/// path), or answers `400` naming it.
pub(crate) fn identifier(name: &str, value: &str) -> Result<()> {
    if is_identifier(value) {
        Ok(())
    } else {
        Err(Error::validation(format!(
            "{name} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '.', ':' or '-'"
        )))
    }
}

/// Checks free text (a product name): 1 to `max` bytes, no control
/// characters (NUL included).
pub(crate) fn text(name: &str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        Err(Error::validation(format!(
            "{name} must be 1 to {max} bytes of text without control characters"
        )))
    } else {
        Ok(())
    }
}

/// Checks an amount in minor units: from 1 to 1,000,000,000.
pub(crate) fn amount(value: i64) -> Result<i64> {
    if (1..=MAX_AMOUNT).contains(&value) {
        Ok(value)
    } else {
        Err(Error::validation(format!(
            "amount must be an integer from 1 to {MAX_AMOUNT} (minor units)"
        )))
    }
}

/// Checks a currency: three ASCII letters.
pub(crate) fn currency(value: &str) -> Result<()> {
    if value.len() == 3 && value.bytes().all(|b| b.is_ascii_alphabetic()) {
        Ok(())
    } else {
        Err(Error::validation(
            "currency must be three letters, e.g. \"EUR\"",
        ))
    }
}

/// Reads a JSON body into `T` (whose fields are named, typed, and nothing
/// else allowed), or answers `400` saying what is wrong with it.
pub(crate) fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    serde_json::from_slice(body)
        .map_err(|e| Error::validation(format!("the body is not valid: {e}")))
}

/// The most header fields a request may carry.
pub(crate) const MAX_HEADER_FIELDS: usize = 100;

/// The most bytes a request's header fields (names and values) may hold.
pub(crate) const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Middleware over every route: more than [`MAX_HEADER_FIELDS`] header
/// fields, or more than [`MAX_HEADER_BYTES`] of them, is `431` problem+json.
///
/// hyper's own limits sit above these (`serve`: 1,000 fields, its read
/// buffer of about 400 KiB); a request past *those* is answered by hyper, a
/// bare `431` before any of shop's code runs, and the connection closed.
pub(crate) async fn refuse_large_headers(request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() <= MAX_HEADER_FIELDS && bytes <= MAX_HEADER_BYTES {
        return next.run(request).await;
    }
    Problem::new(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "header-fields-too-large",
        "The request headers are too large",
    )
    .detail(format!(
        "send at most {MAX_HEADER_FIELDS} header fields and {MAX_HEADER_BYTES} bytes of them"
    ))
    .into_response()
}

/// Whether a `Content-Type` names JSON: `application/json` or any
/// `application/*+json`, parameters allowed — the same test the
/// fingerprint applies, so the layer and the handler read a body alike.
pub(crate) fn is_json(content_type: &str) -> bool {
    idem_core::fingerprint::is_json_media_type(content_type)
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
    fn amounts_and_currencies() {
        assert_eq!(amount(1).ok(), Some(1));
        assert_eq!(amount(MAX_AMOUNT).ok(), Some(MAX_AMOUNT));
        for bad in [0, -1, MAX_AMOUNT + 1, i64::MIN, i64::MAX] {
            assert!(amount(bad).is_err(), "{bad}");
        }
        assert!(currency("EUR").is_ok());
        for bad in ["", "EU", "EURO", "E1R", "EÜ"] {
            assert!(currency(bad).is_err(), "{bad}");
        }
    }
}
