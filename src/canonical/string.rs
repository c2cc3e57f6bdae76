//! Strings in canonical form: minimal escapes (RFC 8785 §3.2.2.2) and the
//! member name order (RFC 8785 §3.2.3).

use std::cmp::Ordering;

/// Compares strings as sequences of UTF-16 code units (RFC 8785 §3.2.3).
pub(crate) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Writes a string per RFC 8785 §3.2.2.2: `\"`, `\\`, the five short control
/// escapes, `\u00xx` (lowercase) for other control characters, everything
/// else as raw UTF-8.
pub(crate) fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0C => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x00..=0x1F => {
                out.extend_from_slice(b"\\u00");
                out.push(hex_digit(b >> 4));
                out.push(hex_digit(b));
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// The lowercase hex digit for the low four bits of `nibble`.
fn hex_digit(nibble: u8) -> u8 {
    let n = nibble & 0x0F;
    if n < 10 {
        b'0' + n
    } else {
        b'a' + (n - 10)
    }
}

#[cfg(test)]
mod tests {
    use super::super::canonicalize;
    use super::super::parser::parse;
    use super::super::value::JsonValue;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn canon(input: &str) -> Result<String, Box<dyn std::error::Error>> {
        Ok(String::from_utf8(canonicalize(input.as_bytes())?)?)
    }

    /// RFC 8785 §3.2.2.2 string example.
    #[test]
    fn rfc8785_string_example() -> TestResult {
        let input = r#""\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/""#;
        assert_eq!(canon(input)?, r#""€$\u000f\nA'B\"\\\\\"/""#);
        Ok(())
    }

    #[test]
    fn string_escapes_are_minimal() -> TestResult {
        assert_eq!(
            canon(r#""\u0000\u0001\b\f\n\r\t\u001f\u0020\u007f\u0080\u00e9\ud83d\ude00""#)?,
            "\"\\u0000\\u0001\\b\\f\\n\\r\\t\\u001f \u{7f}\u{80}é😀\""
        );
        Ok(())
    }

    /// RFC 8785 §3.2.3 sorting example: UTF-16 order puts the emoji (a
    /// surrogate pair, 0xD83D...) before U+FB33, unlike code point order.
    #[test]
    fn rfc8785_sorting_example() -> TestResult {
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
        let JsonValue::Object(members) = parse(input.as_bytes())? else {
            return Err("not an object".into());
        };
        let values: Vec<&JsonValue> = members.iter().map(|(_, v)| v).collect();
        let expected = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ];
        let expected: Vec<JsonValue> = expected
            .iter()
            .map(|s| JsonValue::String((*s).to_owned()))
            .collect();
        assert_eq!(values, expected.iter().collect::<Vec<_>>());
        assert_eq!(
            canon(input)?,
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\
             \"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
        Ok(())
    }
}
