//! Formatting instants and durations for people.

use std::time::Duration;

use idem_core::UnixMillis;
use time::macros::format_description;
use time::OffsetDateTime;

/// `2026-11-29T18:19:27.123Z` (RFC 3339, UTC, milliseconds); an instant
/// beyond what a calendar date can hold, as its raw milliseconds.
pub(crate) fn rfc3339(t: UnixMillis) -> String {
    let format =
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(t.0) * 1_000_000)
        .ok()
        .and_then(|at| at.format(&format).ok())
        .unwrap_or_else(|| format!("{} ms since the epoch", t.0))
}

/// `3h 12m`, `4.2s`, `120ms`.
pub(crate) fn human(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0..=999 => format!("{ms}ms"),
        1000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m {}s", ms / 60_000, (ms % 60_000) / 1000),
        3_600_000..=86_399_999 => format!("{}h {}m", ms / 3_600_000, (ms % 3_600_000) / 60_000),
        _ => format!("{}d {}h", ms / 86_400_000, (ms % 86_400_000) / 3_600_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_instants() {
        assert_eq!(rfc3339(UnixMillis(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(UnixMillis(1_796_000_000_123)),
            "2026-11-30T00:53:20.123Z"
        );
        assert_eq!(
            rfc3339(UnixMillis(951_782_400_000)),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(rfc3339(UnixMillis(-1)), "1969-12-31T23:59:59.999Z");
        assert_eq!(
            rfc3339(UnixMillis(i64::MAX)),
            format!("{} ms since the epoch", i64::MAX)
        );
    }

    #[test]
    fn formats_durations() {
        assert_eq!(human(Duration::from_millis(120)), "120ms");
        assert_eq!(human(Duration::from_millis(4_200)), "4.2s");
        assert_eq!(human(Duration::from_secs(192)), "3m 12s");
        assert_eq!(human(Duration::from_secs(3 * 3600 + 720)), "3h 12m");
        assert_eq!(human(Duration::from_secs(2 * 86_400 + 3600)), "2d 1h");
    }
}
