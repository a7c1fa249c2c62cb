//! Unit tests of the key and the retry decisions.

use super::*;

#[test]
fn the_defaults_are_the_documented_ones() {
    let d = IdempotentRetry::default();
    assert_eq!(d.max_attempts, 100);
    assert_eq!(d.max_elapsed, Duration::from_secs(35));
    // longer than the server's default lease: a key held by a crashed
    // holder is taken over within the client's budget
    assert!(d.max_elapsed > idem_core::Policy::default().lease());
    assert_eq!(d.base_delay, Duration::from_millis(100));
    assert_eq!(d.max_delay, Duration::from_secs(2));
    assert_eq!(d.max_retry_after, Duration::from_secs(5));
    assert_eq!(d.key_kind, KeyKind::V4);
    assert_eq!(d.keyed_methods, [Method::POST, Method::PATCH]);
    // the attempt cap alone spans at least a few seconds, whatever the
    // jitter draws
    assert!(d.base_delay * (d.max_attempts - 1) >= Duration::from_secs(2));
}

#[test]
fn retryable_statuses() {
    for s in [409, 429, 500, 502, 503, 504] {
        assert!(
            is_retryable_status(StatusCode::from_u16(s).unwrap_or_default()),
            "{s}"
        );
    }
    for s in [
        200, 201, 301, 400, 401, 403, 404, 408, 410, 412, 413, 422, 501,
    ] {
        assert!(
            !is_retryable_status(StatusCode::from_u16(s).unwrap_or_default()),
            "{s}"
        );
    }
}
