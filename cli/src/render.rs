//! Text rendering shared by the commands: tables, ages, timestamps, bytes.

use std::io::{self, Write};

/// How many leading bytes of a binary body `show` prints as hex.
pub const HEX_PREFIX_BYTES: usize = 32;

/// Writes rows under a header, columns padded to their widest cell. The last
/// column is not padded, so long reasons do not leave trailing spaces.
pub fn table<W: Write>(out: &mut W, header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| (*h).to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad + 2));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// A duration in milliseconds as a short human string: `850ms`, `42s`,
/// `5m12s`, `3h05m`, `2d03h`.
pub fn human_ms(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// How long ago `at_ms` was, as seen at `now_ms`; a time in the future (clock
/// skew, a lease still running) reads `in 5s`.
pub fn relative(at_ms: u64, now_ms: u64) -> String {
    if at_ms <= now_ms {
        format!("{} ago", human_ms(now_ms - at_ms))
    } else {
        format!("in {}", human_ms(at_ms - now_ms))
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC with milliseconds
/// (the library's formatter, so the tool and the HTTP problem bodies agree).
pub fn timestamp(ms: u64) -> String {
    idempotency::timestamp::rfc3339(ms)
}

/// A timestamp with its distance from now: `2025-01-02T03:04:05.678Z (5s ago)`.
pub fn when(ms: u64, now_ms: u64) -> String {
    format!("{} ({})", timestamp(ms), relative(ms, now_ms))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes for a terminal: valid UTF-8 is shown as text (control and
/// bidirectional formatting characters other than newline and tab
/// escaped, so a stored body cannot drive the terminal); anything else as
/// `<N bytes> ` and a hex prefix.
pub fn bytes_for_terminal(bytes: &[u8]) -> String {
    bytes_shown(bytes, true)
}

/// [`bytes_for_terminal`] for a value shown on one line (a header value):
/// newlines and tabs are escaped too.
pub fn bytes_for_line(bytes: &[u8]) -> String {
    bytes_shown(bytes, false)
}

fn bytes_shown(bytes: &[u8], multi_line: bool) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => escape(s, multi_line),
        Err(_) => {
            let shown = &bytes[..bytes.len().min(HEX_PREFIX_BYTES)];
            let more = if bytes.len() > shown.len() { "…" } else { "" };
            format!("<{} bytes> {}{more}", bytes.len(), hex(shown))
        }
    }
}

/// How many characters of evidence a table cell shows before it is cut.
pub const EVIDENCE_CHARS: usize = 60;

/// Evidence bytes for a table cell: printable UTF-8 (no control or
/// bidirectional formatting characters) as text, anything else as
/// `<N bytes> ` and a hex prefix; text longer than [`EVIDENCE_CHARS`] is
/// cut and ends in `… (N bytes)`.
pub fn evidence(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if !s.chars().any(|c| c.is_control() || is_bidi_control(c)) => {
            if s.chars().count() <= EVIDENCE_CHARS {
                s.to_string()
            } else {
                let cut: String = s.chars().take(EVIDENCE_CHARS).collect();
                format!("{cut}… ({} bytes)", bytes.len())
            }
        }
        _ => {
            let shown = &bytes[..bytes.len().min(HEX_PREFIX_BYTES)];
            let more = if bytes.len() > shown.len() { "…" } else { "" };
            format!("<{} bytes> {}{more}", bytes.len(), hex(shown))
        }
    }
}

/// Escapes a value shown on one line (a table cell, a `show` field):
/// every control character, newline and tab included, so stored text
/// cannot add a row or a field, and the bidirectional formatting
/// characters, so it cannot reorder what the operator reads.
pub fn escape_controls(s: &str) -> String {
    escape(s, false)
}

/// Unicode's explicit bidirectional formatting characters (category Cf,
/// which key validation lets through).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escape(s: &str, multi_line: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let kept = multi_line && (c == '\n' || c == '\t');
        if (c.is_control() || is_bidi_control(c)) && !kept {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_timestamps() {
        assert_eq!(human_ms(850), "850ms");
        assert_eq!(human_ms(42_000), "42s");
        assert_eq!(human_ms(312_000), "5m12s");
        assert_eq!(human_ms(3 * 3_600_000 + 5 * 60_000), "3h05m");
        assert_eq!(human_ms(2 * 86_400_000 + 3 * 3_600_000), "2d03h");
        assert_eq!(relative(1_000, 6_000), "5s ago");
        assert_eq!(relative(6_000, 1_000), "in 5s");
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        // 2024-02-29T12:34:56.789Z, a leap day.
        assert_eq!(timestamp(1_709_210_096_789), "2024-02-29T12:34:56.789Z");
    }

    #[test]
    fn bytes_are_text_or_hex() {
        assert_eq!(bytes_for_terminal(b"{\"a\":1}"), "{\"a\":1}");
        assert_eq!(bytes_for_terminal(b"a\x1b[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(bytes_for_terminal(&[0xff, 0x00]), "<2 bytes> ff00");
        let long: Vec<u8> = (0..40).map(|i| 0x80 + i).collect();
        let shown = bytes_for_terminal(&long);
        assert!(shown.starts_with("<40 bytes> 808182"), "{shown}");
        assert!(shown.ends_with("9f…"), "{shown}");
    }

    #[test]
    fn evidence_is_printable_text_or_hex_and_cut() {
        assert_eq!(evidence(b"ch_42"), "ch_42");
        assert_eq!(evidence(b"a\nb"), "<3 bytes> 610a62");
        assert_eq!(evidence(&[0xff, 0x01]), "<2 bytes> ff01");
        let long = "x".repeat(100);
        let shown = evidence(long.as_bytes());
        assert_eq!(
            shown,
            format!("{}… (100 bytes)", "x".repeat(EVIDENCE_CHARS))
        );
    }

    #[test]
    fn table_pads_all_but_last_column() -> io::Result<()> {
        let mut out = Vec::new();
        let rows = vec![vec!["long-scope".into(), "k".into(), "x".into()]];
        table(&mut out, &["SCOPE", "KEY", "REASON"], &rows)?;
        let text = String::from_utf8_lossy(&out);
        assert_eq!(text, "SCOPE       KEY  REASON\nlong-scope  k    x\n");
        Ok(())
    }
}
