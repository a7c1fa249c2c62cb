//! How long to wait between attempts: the backoff, and the server's
//! `Retry-After`.

use std::time::{Duration, SystemTime};

use http::HeaderValue;

/// Exponential backoff with decorrelated jitter: each wait is drawn
/// uniformly from `[base, 3 × the previous wait]`, then cut to `cap`. Every
/// wait is at least `base` (so a refused connection is never hammered) and
/// at most `cap`; the first is at most `3 × base`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    previous: Duration,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        let base = base.min(cap);
        Self {
            base,
            cap,
            previous: base,
        }
    }

    /// The next wait.
    pub(crate) fn next_wait(&mut self) -> Duration {
        let high = self.previous.saturating_mul(3);
        let wait = (self.base + jitter(high.saturating_sub(self.base))).min(self.cap);
        self.previous = wait;
        wait
    }
}

/// A uniformly random duration in `[0, max]`.
fn jitter(max: Duration) -> Duration {
    let r = uuid::Uuid::new_v4().as_u64_pair().0;
    let fraction = (r >> 11) as f64 / (1u64 << 53) as f64;
    max.mul_f64(fraction)
}

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

    #[test]
    fn backoff_stays_between_base_and_cap() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        for _ in 0..200 {
            let mut b = Backoff::new(base, cap);
            let first = b.next_wait();
            assert!(first >= base && first <= base * 3, "{first:?}");
            let mut previous = first;
            for _ in 0..30 {
                let w = b.next_wait();
                assert!(w >= base && w <= cap && w <= previous * 3, "{w:?}");
                previous = w;
            }
        }
        // a base above the cap is cut to it
        let mut b = Backoff::new(Duration::from_secs(5), cap);
        assert_eq!(b.next_wait(), cap);
        // no wait at all, if asked
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(b.next_wait(), Duration::ZERO);
    }

    #[test]
    fn backoff_grows() {
        // Over many runs the waits climb toward the cap: the mean of the
        // tenth wait is far above the first's (it is about 1.5 s).
        let (mut first, mut tenth) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..500 {
            let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
            first += b.next_wait();
            for _ in 0..8 {
                b.next_wait();
            }
            tenth += b.next_wait();
        }
        assert!(tenth > first * 3, "{first:?} {tenth:?}");
    }
}
