//! Waiting between attempts: exponential backoff with decorrelated
//! jitter, shared by idem's clients (HTTP and gRPC).

use std::time::Duration;

/// Exponential backoff with decorrelated jitter: each wait is drawn
/// uniformly from `[base, 3 × the previous wait]`, then cut to `cap`. Every
/// wait is at least `base` (so a refused connection is never hammered) and
/// at most `cap`; the first is at most `3 × base`.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    previous: Duration,
}

impl Backoff {
    /// Waits from `base` (at least) to `cap` (at most).
    pub fn new(base: Duration, cap: Duration) -> Self {
        let base = base.min(cap);
        Self {
            base,
            cap,
            previous: base,
        }
    }

    /// The next wait.
    pub fn next_wait(&mut self) -> Duration {
        let high = self.previous.saturating_mul(3);
        let wait = self
            .base
            .saturating_add(jitter(high.saturating_sub(self.base)))
            .min(self.cap);
        self.previous = wait;
        wait
    }
}

/// A uniformly random duration in `[0, max]`.
fn jitter(max: Duration) -> Duration {
    let r = uuid::Uuid::new_v4().as_u64_pair().0;
    let fraction = (r >> 11) as f64 / (1u64 << 53) as f64;
    // In floating point, near `Duration::MAX` the product can round past
    // it (`mul_f64` would panic): never more than `max`.
    Duration::try_from_secs_f64(max.as_secs_f64() * fraction)
        .unwrap_or(max)
        .min(max)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

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

    /// Waits near `Duration::MAX` (a cap meaning "no cap") saturate, never
    /// overflow (a guard: the sum of the base and the jitter and the
    /// jitter's floating-point product are now bounded by construction).
    #[test]
    fn huge_waits_do_not_overflow() {
        let mut b = Backoff::new(Duration::from_secs(1 << 40), Duration::MAX);
        for _ in 0..100 {
            let w = b.next_wait();
            assert!(w >= Duration::from_secs(1 << 40));
        }
        let mut b = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(b.next_wait(), Duration::MAX);
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
