//! Strings in canonical form: minimal escapes (RFC 8785 §3.2.2.2) and the
//! member name order (RFC 8785 §3.2.3).

use std::cmp::Ordering;

/// Compares strings as sequences of UTF-16 code units (RFC 8785 §3.2.3).
pub(crate) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Compares valid UTF-8 strings as sequences of UTF-16 code units (RFC 8785
/// §3.2.3), byte-wise.
///
/// UTF-8 byte order is code point order, which is UTF-16 order except
/// between U+E000..=U+FFFF (lead bytes `0xEE`, `0xEF`) and U+10000 and above
/// (lead bytes `0xF0`..=`0xF4`, surrogate pairs starting at 0xD800 in
/// UTF-16): those compare the other way round. The first differing byte is
/// at the same character boundary in both strings (their prefixes are
/// equal), so looking at it alone decides.
pub(crate) fn cmp_utf16_bytes(a: &[u8], b: &[u8]) -> Ordering {
    let Some((&x, &y)) = a.iter().zip(b).find(|(x, y)| x != y) else {
        return a.len().cmp(&b.len());
    };
    match (x, y) {
        (0xEE | 0xEF, 0xF0..) => Ordering::Greater,
        (0xF0.., 0xEE | 0xEF) => Ordering::Less,
        _ => x.cmp(&y),
    }
}

/// Writes a string per RFC 8785 §3.2.2.2: `\"`, `\\`, the five short control
/// escapes, `\u00xx` (lowercase) for other control characters, everything
/// else as raw UTF-8.
pub(crate) fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in s.as_bytes() {
        write_byte(b, out);
    }
    out.push(b'"');
}

/// Writes one character of a string's content as [`write_string`] does;
/// returns whether it was escaped.
pub(crate) fn write_char(c: char, out: &mut Vec<u8>) -> bool {
    match u8::try_from(c) {
        Ok(b) if b.is_ascii() => write_byte(b, out),
        _ => {
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
            false
        }
    }
}

/// Writes one byte of a string's UTF-8 content, escaped if RFC 8785 says
/// so; returns whether it was escaped.
fn write_byte(b: u8, out: &mut Vec<u8>) -> bool {
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
        _ => {
            out.push(b);
            return false;
        }
    }
    true
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

    /// The byte-wise comparison agrees with the UTF-16 one, around every
    /// boundary where UTF-8 and UTF-16 orders could differ.
    #[test]
    fn byte_wise_order_is_utf16_order() {
        let chars: Vec<char> = [
            0x0, 0x1f, 0x20, 0x41, 0x7f, 0x80, 0x7ff, 0x800, 0xd7ff, 0xe000, 0xe001, 0xfb33,
            0xfffd, 0xffff, 0x10000, 0x10001, 0x1f600, 0x10ffff,
        ]
        .into_iter()
        .filter_map(char::from_u32)
        .collect();
        let mut strings = vec![String::new()];
        for &a in &chars {
            strings.push(a.to_string());
            for &b in &chars {
                strings.push([a, b].iter().collect());
                strings.push(['x', a, b].iter().collect());
            }
        }
        for a in &strings {
            for b in &strings {
                assert_eq!(
                    super::cmp_utf16_bytes(a.as_bytes(), b.as_bytes()),
                    super::cmp_utf16(a, b),
                    "{a:?} vs {b:?}"
                );
            }
        }
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
