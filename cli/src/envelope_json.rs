//! The JSON form of an [`Envelope`], read by `idem resolve --completed` and
//! written by `idem show --json`.
//!
//! ```json
//! {
//!   "schema_version": 1,
//!   "status": 201,
//!   "headers": [["content-type", "application/json"]],
//!   "body": {"payment": "p_123"}
//! }
//! ```
//!
//! - `schema_version` (u32) and `status` (u16) are required.
//! - `headers` is optional: an array of `[name, value]` string pairs, in order.
//! - The body is at most one of:
//!   - `body`: a JSON string is stored as its UTF-8 bytes, verbatim; any other
//!     JSON value is stored as its compact serialization;
//!   - `body_base64`: standard base64 (RFC 4648 §4, padding optional), for
//!     bodies that are not UTF-8.
//!
//!   Neither means an empty body.
//! - `body_bytes` is optional: if given, it must equal the body's length.
//! - Any other member is an error (a misspelt `bodyy` would otherwise store an
//!   empty body).
//!
//! `show --json` writes the same shape (UTF-8 bodies as a `body` string,
//! others as `body_base64`), so a record's `response` can be fed back to
//! `resolve --completed`. Header values that are not UTF-8 are shown lossily.

use std::fmt;

use idempotency::Envelope;
use serde_json::{json, Map, Value};

/// Why an envelope file was refused; the message names the member at fault.
#[derive(Debug)]
pub struct EnvelopeError(String);

impl fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EnvelopeError {}

fn err(msg: impl Into<String>) -> EnvelopeError {
    EnvelopeError(msg.into())
}

/// Parses and validates the JSON text of an envelope file.
///
/// # Errors
///
/// Invalid JSON (with line and column), a missing or mistyped member, an
/// unknown member, both `body` and `body_base64`, invalid base64.
pub fn parse(text: &str) -> Result<Envelope, EnvelopeError> {
    let value: Value = serde_json::from_str(text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(err("expected a JSON object"));
    };
    const KNOWN: [&str; 6] = [
        "schema_version",
        "status",
        "headers",
        "body",
        "body_base64",
        "body_bytes",
    ];
    if let Some(unknown) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(err(format!(
            "unknown member {unknown:?} (expected one of: {})",
            KNOWN.join(", ")
        )));
    }
    let schema_version = uint(&obj, "schema_version", u64::from(u32::MAX))?;
    let status = uint(&obj, "status", u64::from(u16::MAX))?;
    let mut envelope = Envelope::new(
        u32::try_from(schema_version).map_err(|_| err("schema_version out of range"))?,
        u16::try_from(status).map_err(|_| err("status out of range"))?,
        body(&obj)?,
    );
    if obj.contains_key("body_bytes") {
        let want = uint(&obj, "body_bytes", u64::MAX)?;
        if want != envelope.body.len() as u64 {
            return Err(err(format!(
                "\"body_bytes\" is {want} but the body is {} bytes",
                envelope.body.len()
            )));
        }
    }
    match obj.get("headers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(headers)) => {
            for (i, h) in headers.iter().enumerate() {
                let pair = h.as_array().filter(|p| p.len() == 2);
                let strings = pair.and_then(|p| Some((p[0].as_str()?, p[1].as_str()?)));
                let Some((name, value)) = strings else {
                    return Err(err(format!(
                        "headers[{i}]: expected a [name, value] pair of strings, got {h}"
                    )));
                };
                if name.is_empty() {
                    return Err(err(format!("headers[{i}]: empty header name")));
                }
                envelope
                    .headers
                    .push((name.to_string(), value.as_bytes().to_vec()));
            }
        }
        Some(other) => {
            return Err(err(format!(
                "\"headers\" must be an array of [name, value] pairs, got {other}"
            )))
        }
    }
    Ok(envelope)
}

fn uint(obj: &Map<String, Value>, name: &str, max: u64) -> Result<u64, EnvelopeError> {
    match obj.get(name) {
        None => Err(err(format!("missing required member {name:?}"))),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= max)
            .ok_or_else(|| err(format!("{name:?} must be an integer in 0..={max}, got {v}"))),
    }
}

fn body(obj: &Map<String, Value>) -> Result<Vec<u8>, EnvelopeError> {
    match (obj.get("body"), obj.get("body_base64")) {
        (Some(_), Some(_)) => Err(err("give at most one of \"body\" and \"body_base64\"")),
        (Some(Value::String(s)), None) => Ok(s.as_bytes().to_vec()),
        (Some(v), None) => Ok(v.to_string().into_bytes()),
        (None, Some(Value::String(b64))) => {
            base64_decode(b64).map_err(|e| err(format!("\"body_base64\": {e}")))
        }
        (None, Some(v)) => Err(err(format!("\"body_base64\" must be a string, got {v}"))),
        (None, None) => Ok(Vec::new()),
    }
}

/// The JSON form of an envelope (see the module docs).
pub fn to_json(envelope: &Envelope) -> Value {
    let headers: Vec<Value> = envelope
        .headers
        .iter()
        .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
        .collect();
    let mut obj = json!({
        "schema_version": envelope.schema_version,
        "status": envelope.status,
        "headers": headers,
        "body_bytes": envelope.body.len(),
    });
    let (name, body) = match std::str::from_utf8(&envelope.body) {
        Ok(s) => ("body", s.to_string()),
        Err(_) => ("body_base64", base64_encode(&envelope.body)),
    };
    obj[name] = Value::String(body);
    obj
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (RFC 4648 §4).
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64; padding is optional, whitespace is not allowed.
pub fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let data = text.trim_end_matches('=');
    if text.len() - data.len() > 2 || data.len() % 4 == 1 {
        return Err("invalid base64 length".into());
    }
    let mut out = Vec::with_capacity(data.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for (i, c) in data.bytes().enumerate() {
        let Some(v) = ALPHABET.iter().position(|&a| a == c) else {
            return Err(format!(
                "invalid base64 character {:?} at offset {i}",
                char::from(c)
            ));
        };
        // `v` is below 64, so it fits the accumulator's low 6 bits.
        acc = acc << 6 | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits & 0xff) as u8);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() -> Result<(), String> {
        for len in 0..20u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
            let text = base64_encode(&bytes);
            assert_eq!(base64_decode(&text)?, bytes);
            assert_eq!(base64_decode(text.trim_end_matches('='))?, bytes);
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert!(base64_decode("Zm9v!").is_err());
        assert!(base64_decode("Z").is_err());
        Ok(())
    }

    #[test]
    fn parses_string_json_and_base64_bodies() -> Result<(), EnvelopeError> {
        let e = parse(
            r#"{"schema_version":1,"status":201,
                "headers":[["content-type","application/json"]],
                "body":{"id": "p_1"}}"#,
        )?;
        assert_eq!((e.schema_version, e.status), (1, 201));
        assert_eq!(e.header("Content-Type"), Some(&b"application/json"[..]));
        assert_eq!(e.body, br#"{"id":"p_1"}"#);
        let e = parse(r#"{"schema_version":2,"status":200,"body":"plain text"}"#)?;
        assert_eq!(e.body, b"plain text");
        let e = parse(r#"{"schema_version":2,"status":200,"body_base64":"/wA="}"#)?;
        assert_eq!(e.body, [0xff, 0]);
        let e = parse(r#"{"schema_version":2,"status":204}"#)?;
        assert!(e.body.is_empty() && e.headers.is_empty());
        Ok(())
    }

    #[test]
    fn refuses_bad_envelopes_with_the_member_named() {
        let cases = [
            ("[]", "expected a JSON object"),
            ("{", "invalid JSON"),
            (
                r#"{"status":200}"#,
                "missing required member \"schema_version\"",
            ),
            (
                r#"{"schema_version":1,"status":70000}"#,
                "\"status\" must be an integer",
            ),
            (
                r#"{"schema_version":-1,"status":200}"#,
                "\"schema_version\" must be",
            ),
            (
                r#"{"schema_version":1,"status":200,"bodyy":1}"#,
                "unknown member \"bodyy\"",
            ),
            (
                r#"{"schema_version":1,"status":200,"body":"","body_base64":""}"#,
                "at most one",
            ),
            (
                r#"{"schema_version":1,"status":200,"headers":[["a"]]}"#,
                "headers[0]",
            ),
            (
                r#"{"schema_version":1,"status":200,"headers":{}}"#,
                "\"headers\" must be",
            ),
            (
                r#"{"schema_version":1,"status":200,"body_base64":"%%"}"#,
                "\"body_base64\": invalid",
            ),
        ];
        for (text, want) in cases {
            match parse(text) {
                Err(e) => assert!(e.to_string().contains(want), "{text}: {e}"),
                Ok(env) => panic!("{text}: accepted as {env:?}"),
            }
        }
    }

    #[test]
    fn shown_json_parses_back() -> Result<(), EnvelopeError> {
        let env = Envelope::new(3, 202, vec![0xde, 0xad, 0xbe, 0xef]).with_header("x-a", "b");
        let back = parse(&to_json(&env).to_string())?;
        assert_eq!(back, env);
        let env = Envelope::new(3, 202, "héllo");
        assert_eq!(parse(&to_json(&env).to_string())?, env);
        Ok(())
    }
}
