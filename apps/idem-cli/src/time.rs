//! Formatting instants and durations for people, without a date library.

use std::time::Duration;

use idem_core::UnixMillis;

/// `2026-11-29T18:19:27.123Z`.
pub(crate) fn rfc3339(t: UnixMillis) -> String {
    let ms = t.0.rem_euclid(1000);
    let secs = t.0.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
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
