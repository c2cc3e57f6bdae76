//! Parsing the `Idempotency-Key` request header.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header, section 2)
//! defines the field as an RFC 8941 Item whose value is a String:
//! `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`. Stripe-style
//! clients send the key bare, without quotes; that form is accepted too, as
//! printable ASCII without whitespace, quotes, backslashes, commas or
//! semicolons (so it cannot be confused with structured-field syntax).

use http::header::{GetAll, HeaderValue};

use crate::key::MAX_KEY_BYTES;

/// Reads the key from every `Idempotency-Key` field line of a request.
///
/// `Ok(None)`: no such header. `Err(detail)`: the header is present but is
/// not one well-formed key; `detail` says why, for the problem response.
pub(crate) fn parse_key(values: GetAll<'_, HeaderValue>) -> Result<Option<String>, String> {
    let mut iter = values.iter();
    let Some(value) = iter.next() else {
        return Ok(None);
    };
    if iter.next().is_some() {
        return Err("the Idempotency-Key header appears more than once".into());
    }
    parse_value(value.as_bytes()).map(Some)
}

fn parse_value(raw: &[u8]) -> Result<String, String> {
    let value = trim_ows(raw);
    let key = if value.first() == Some(&b'"') {
        let (key, rest) = sf_string(value)?;
        parameters(rest)?;
        key
    } else {
        bare_key(value)?
    };
    if key.is_empty() {
        return Err("the idempotency key is empty".into());
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the idempotency key is {} bytes long; at most {MAX_KEY_BYTES} are accepted",
            key.len()
        ));
    }
    Ok(key)
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// An RFC 8941 section 4.2.5 String at the start of `s` (which begins with
/// `"`): its value and the bytes after the closing quote.
fn sf_string(s: &[u8]) -> Result<(String, &[u8]), String> {
    let mut out = String::new();
    let mut i = 1;
    while let Some(&b) = s.get(i) {
        i += 1;
        match b {
            b'\\' => match s.get(i) {
                Some(&c @ (b'"' | b'\\')) => {
                    out.push(char::from(c));
                    i += 1;
                }
                _ => return Err("in a quoted key, a backslash may only escape '\"' or '\\'".into()),
            },
            b'"' => return Ok((out, &s[i..])),
            0x20..=0x7E => out.push(char::from(b)),
            _ => {
                return Err(format!(
                    "a quoted key may only hold printable ASCII; found byte 0x{b:02x}"
                ))
            }
        }
    }
    Err("the quoted key has no closing '\"'".into())
}

/// RFC 8941 parameters after an Item (`;name` or `;name=bare-item`). The
/// draft defines none, so they are checked for syntax and ignored.
fn parameters(mut s: &[u8]) -> Result<(), String> {
    let bad = || "unexpected characters after the quoted key".to_string();
    while let [b';', rest @ ..] = s {
        s = rest;
        while let [b' ', rest @ ..] = s {
            s = rest;
        }
        let name_len = s
            .iter()
            .position(|&b| !matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
            .unwrap_or(s.len());
        match s.first() {
            Some(b'a'..=b'z' | b'*') if name_len > 0 => s = &s[name_len..],
            _ => return Err(bad()),
        }
        if let [b'=', rest @ ..] = s {
            s = bare_item(rest).ok_or_else(bad)?;
        }
    }
    if s.is_empty() {
        Ok(())
    } else {
        Err(bad())
    }
}

/// Skips one RFC 8941 bare item; `None` if there is none.
fn bare_item(s: &[u8]) -> Option<&[u8]> {
    let run = |s: &[u8], ok: fn(u8) -> bool| s.iter().position(|&b| !ok(b)).unwrap_or(s.len());
    match s.first()? {
        b'"' => sf_string(s).ok().map(|(_, rest)| rest),
        b'?' => match s.get(1)? {
            b'0' | b'1' => Some(&s[2..]),
            _ => None,
        },
        b':' => {
            let n = run(&s[1..], |b| {
                b.is_ascii_alphanumeric() || b"+/=".contains(&b)
            });
            (s.get(1 + n) == Some(&b':')).then(|| &s[n + 2..])
        }
        b'-' | b'0'..=b'9' => {
            let start = usize::from(s[0] == b'-');
            let n = run(&s[start..], |b| b.is_ascii_digit() || b == b'.');
            (n > 0).then(|| &s[start + n..])
        }
        b'a'..=b'z' | b'A'..=b'Z' | b'*' => {
            let n = run(s, |b| {
                b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b)
            });
            Some(&s[n..])
        }
        _ => None,
    }
}

fn bare_key(s: &[u8]) -> Result<String, String> {
    match s
        .iter()
        .find(|&&b| !(0x21..=0x7E).contains(&b) || b"\"\\,;".contains(&b))
    {
        None => Ok(String::from_utf8_lossy(s).into_owned()),
        Some(&b) => Err(format!(
            "an unquoted key may only hold printable ASCII without whitespace, quotes, \
             backslashes, commas or semicolons; found {}; send it as a structured-field \
             string (\"...\")",
            if b.is_ascii_graphic() || b == b' ' {
                format!("{:?}", char::from(b))
            } else {
                format!("byte 0x{b:02x}")
            }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<String, String> {
        parse_value(s.as_bytes())
    }

    #[test]
    fn structured_string_and_bare_token() {
        assert_eq!(parse(r#""abc""#).as_deref(), Ok("abc"));
        assert_eq!(parse(r#"  "a b\"c\\" "#).as_deref(), Ok(r#"a b"c\"#));
        assert_eq!(
            parse(r#""abc";x;y=?1;z="q";n=-1.5;t=tok/1"#).as_deref(),
            Ok("abc")
        );
        assert_eq!(
            parse("8e03978e-40d5-43e8-bc93-6894a57f9324").as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(parse("key_123:abc/def=").as_deref(), Ok("key_123:abc/def="));
    }

    #[test]
    fn malformed_keys_are_refused_with_a_reason() {
        for bad in [
            "",
            r#""""#,
            r#""abc"#,
            r#""a\nb""#,
            r#""abc" x"#,
            r#""abc";"#,
            r#""abc";X=1"#,
            "a b",
            "a,b",
            r#"a"b"#,
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse_value(b"\"caf\xc3\xa9\"").is_err());
        assert!(parse(&"k".repeat(256)).is_err());
        assert!(parse(&"k".repeat(255)).is_ok());
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(parse_key(headers.get_all("idempotency-key")), Ok(None));
        headers.append("idempotency-key", HeaderValue::from_static("a"));
        assert_eq!(
            parse_key(headers.get_all("idempotency-key")),
            Ok(Some("a".into()))
        );
        headers.append("idempotency-key", HeaderValue::from_static("b"));
        assert!(parse_key(headers.get_all("idempotency-key")).is_err());
    }
}
