//! Parsing the `Idempotency-Key` request header.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header, section 2)
//! defines the field as an RFC 8941 Item whose value is a String:
//! `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`. Stripe-style
//! clients send the key bare, without quotes; that form is accepted too, as
//! printable ASCII without whitespace, quotes, backslashes, commas or
//! semicolons (so it cannot be confused with structured-field syntax).

// Header bytes come from the client: no index may panic on them.
#![cfg_attr(not(test), deny(clippy::indexing_slicing))]

use http::header::{GetAll, HeaderValue};

use crate::key::MAX_KEY_BYTES;

/// Reads the key from every `Idempotency-Key` field line of a request.
///
/// `Ok(None)`: no such header. `Err(detail)`: the header is present but is
/// not one well-formed key; `detail` says why, for the problem response.
pub(crate) fn parse_key(values: &GetAll<'_, HeaderValue>) -> Result<Option<String>, String> {
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
        sf_string(value)?
    } else {
        bare_key(value)?
    };
    if key.trim().is_empty() {
        return Err(if key.is_empty() {
            "the idempotency key is empty".into()
        } else {
            "the idempotency key is blank (only whitespace)".into()
        });
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

/// An RFC 8941 Item whose value is a String, with optional parameters
/// (the draft defines none, so they are checked for syntax and ignored).
///
/// Parsed with `sfv`. The bare form cannot be: an RFC 8941 Token must
/// start with a letter or `*`, so a bare UUID like `8e03978e-...` (digits
/// first) or a key with `=` is not an Item at all.
fn sf_string(value: &[u8]) -> Result<String, String> {
    let item: sfv::Item = sfv::Parser::new(value)
        .parse_item()
        .map_err(|e| format!("the quoted key is not a valid structured-field string: {e}"))?;
    match item.bare_item.as_string() {
        Some(s) => Ok(s.as_str().to_owned()),
        None => Err("the Idempotency-Key header must be a structured-field string".into()),
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
    fn blank_keys_are_refused() {
        for bad in [r#"" ""#, r#""   ""#, r#""\t""#] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(parse(r#"" a ""#).as_deref(), Ok(" a "));
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(parse_key(&headers.get_all("idempotency-key")), Ok(None));
        headers.append("idempotency-key", HeaderValue::from_static("a"));
        assert_eq!(
            parse_key(&headers.get_all("idempotency-key")),
            Ok(Some("a".into()))
        );
        headers.append("idempotency-key", HeaderValue::from_static("b"));
        assert!(parse_key(&headers.get_all("idempotency-key")).is_err());
    }
}
