//! How long to wait between attempts: the server's `Retry-After` (the
//! backoff is idem-core's [`Backoff`](idem_core::Backoff)).

use std::time::{Duration, SystemTime};

use http::HeaderValue;

/// A `Retry-After` value as a wait from `now`: delta-seconds, or an
/// HTTP-date (a date in the past is no wait). `None` when it is neither.
pub(crate) fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only too many of them fails to parse, and that is a
        // very long wait.
        return Some(text.parse().map_or(Duration::MAX, Duration::from_secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn parse(v: &str, now: SystemTime) -> Option<Duration> {
        parse_retry_after(&HeaderValue::from_str(v).unwrap(), now)
    }

    #[test]
    fn retry_after_in_both_forms() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse("120", now), Some(Duration::from_secs(120)));
        assert_eq!(parse(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse("99999999999999999999999", now),
            Some(Duration::MAX),
            "too many digits is a very long wait"
        );
        // IMF-fixdate, and the two obsolete forms RFC 9110 still accepts
        for date in [
            "Sun, 06 Nov 1994 08:50:07 GMT",
            "Sunday, 06-Nov-94 08:50:07 GMT",
            "Sun Nov  6 08:50:07 1994",
        ] {
            assert_eq!(parse(date, now), Some(Duration::from_secs(30)), "{date}");
        }
        assert_eq!(
            parse("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO),
            "a date in the past is no wait"
        );
        for junk in ["", "-1", "+5", "1.5", "soon", "Sun, 06 Nov 1994"] {
            assert_eq!(parse(junk, now), None, "{junk:?}");
        }
    }
}
