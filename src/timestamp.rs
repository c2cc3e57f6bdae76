//! RFC 3339 timestamps: how the engine's instants (milliseconds since the
//! Unix epoch, as in [`crate::InDoubt`] or [`crate::RecordInfo`]) are
//! written for people, in HTTP problem bodies (`lease_ends_at`,
//! `reusable_at`) and in the `idem` tool's output.

/// Milliseconds since the Unix epoch as an RFC 3339 (section 5.6) UTC
/// timestamp with milliseconds, e.g. `2026-12-01T15:04:05.678Z`.
///
/// Never fails or panics: instants past the year 9999 (which RFC 3339's
/// four-digit year cannot spell) are written as its last millisecond.
///
/// ```
/// assert_eq!(idempotency::timestamp::rfc3339(0), "1970-01-01T00:00:00.000Z");
/// ```
#[must_use]
pub fn rfc3339(ms: u64) -> String {
    // 9999-12-31T23:59:59.999Z
    const LAST_MS: u64 = 253_402_300_799_999;
    let ms = ms.min(LAST_MS);
    let secs = ms / 1000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's
/// `civil_from_days`, for dates from the epoch on).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(rfc3339(951_827_696_789), "2000-02-29T12:34:56.789Z");
        assert_eq!(rfc3339(1_796_137_445_001), "2026-12-01T15:04:05.001Z");
        assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59.999Z");
    }
}
