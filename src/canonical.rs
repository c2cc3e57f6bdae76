//! Canonical JSON: the form in which request bodies enter a [`Fingerprint`].
//!
//! [`canonicalize`] accepts exactly the JSON text of RFC 8259 (UTF-8, no
//! byte order mark, nothing after the value) and writes it in the canonical
//! form of RFC 8785 (JSON Canonicalization Scheme): no insignificant
//! whitespace, object members sorted by their names as UTF-16 code unit
//! sequences (§3.2.3), minimal string escapes (§3.2.2.2). Canonicalizing the
//! output again returns it unchanged.
//!
//! Beyond RFC 8259 it rejects, with a [`CanonicalError`] that says where
//! (byte offset, line, column, and for duplicates the RFC 6901 JSON Pointer
//! of the object):
//!
//! - objects with **duplicate member names**, compared after unescaping
//!   (which member wins is ambiguous across parsers);
//! - nesting deeper than **128** arrays and objects (a top-level array is
//!   level 1);
//! - non-zero numbers whose decimal exponent in scientific notation is
//!   beyond **±1,000,000** (`1e1000000` is accepted, `1e1000001` is not;
//!   zero is accepted with any exponent).
//!
//! Input size is not limited here; callers bound it.
//!
//! Strings are written as the code points they spell (escapes undone, then
//! re-escaped minimally): no Unicode normalization, so NFC and NFD
//! spellings of the same text stay different, and member names that differ
//! only in normalization are not duplicates.
//!
//! # Numbers: a deliberate deviation from RFC 8785
//!
//! RFC 8785 rounds every number through an IEEE 754 double. Here numbers keep
//! their exact decimal value instead: `9007199254740993` and
//! `9007199254740992` stay different, and `1e400` is a valid number. Numbers
//! that denote the same value are equal (`1`, `1.0`, `1e0`, `10e-1`; `-0` and
//! `0`), and they are written in the ECMAScript `Number::toString` layout that
//! RFC 8785 §3.2.2.3 uses, so a number written with the shortest digits that
//! round-trip a double is canonicalized exactly as RFC 8785 would.
//!
//! [`Fingerprint`]: crate::Fingerprint

mod direct;
mod error;
#[doc(hidden)]
pub mod fuzz_hook;
mod number;
mod parser;
mod pointer;
mod string;
mod value;

pub use error::{CanonicalError, Position};
pub(crate) use parser::parse;
pub(crate) use pointer::{resolve, validate_pointer};
pub(crate) use value::JsonValue;

/// Parses JSON text strictly and returns its canonical form (see the
/// [module docs](self) for the rules and limits).
///
/// # Errors
///
/// [`CanonicalError::Syntax`] for anything RFC 8259 does not allow,
/// [`CanonicalError::DuplicateMember`], [`CanonicalError::TooDeep`] and
/// [`CanonicalError::NumberOutOfRange`]; each says where. When an object has
/// a duplicate name and also a syntax error inside a later member, the
/// syntax error is reported: duplicates are detected once an object is
/// complete.
///
/// # Examples
///
/// ```
/// use idempotency::canonical::canonicalize;
///
/// let canonical = canonicalize(br#"{ "b": [1.0, 2e-3], "a": "\u00e9" }"#)?;
/// assert_eq!(canonical, r#"{"a":"é","b":[1,0.002]}"#.as_bytes());
///
/// let err = canonicalize(b"{\"a\": 1,\n \"a\": 2}").unwrap_err();
/// assert_eq!(err.position().map(|p| (p.line, p.column)), Some((2, 2)));
/// # Ok::<_, idempotency::canonical::CanonicalError>(())
/// ```
pub fn canonicalize(bytes: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    let mut out = Vec::with_capacity(bytes.len());
    canonicalize_into(bytes, &mut out)?;
    Ok(out)
}

/// Appends the canonical form of `bytes` to `out`, as [`canonicalize`]
/// returns it.
///
/// The fast path writes the canonical bytes while parsing; whatever it does
/// not accept (every error among others) goes through the tree parser, so
/// results and errors, with their positions, are the tree parser's.
///
/// # Errors
///
/// As for [`canonicalize`]; `out` is then left as it was.
pub(crate) fn canonicalize_into(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    let start = out.len();
    if direct::write_canonical(bytes, out).is_ok() {
        return Ok(());
    }
    out.truncate(start);
    tree_canonicalize_into(bytes, out)
}

/// The tree path of [`canonicalize_into`]: parse, then write.
fn tree_canonicalize_into(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    let value = parse(bytes)?;
    value.write_canonical(out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn canon(input: &str) -> Result<String, Box<dyn std::error::Error>> {
        Ok(String::from_utf8(canonicalize(input.as_bytes())?)?)
    }

    /// RFC 8785 §3.2.2 example, except for the first number (see below).
    #[test]
    fn rfc8785_structure_example() -> TestResult {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        // RFC 8785 writes the first number as 333333333.3333333 after rounding
        // it to a double; we keep the exact decimal by design.
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.33333329,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canon(input)?, expected);
        Ok(())
    }

    /// Deterministic mutation test: no input panics, and every accepted
    /// input canonicalizes to a fixed point that `serde_json` also accepts.
    #[test]
    fn mutations_never_panic_and_canonical_form_is_a_fixed_point() -> TestResult {
        let seeds: [&[u8]; 6] = [
            br#"{"a": [1, -2.5e3, true, null, "x\u00e9\ud83d\ude00"], "b": {"c": 0.000001}}"#,
            br#"[1e30, 4.50, 2e-3, 333333333.33333329, "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/"]"#,
            br#"{"\u20ac":1,"\r":2,"\ufb33":3,"1":4,"\ud83d\ude00":5,"\u0080":6,"\u00f6":7}"#,
            b"[[[[{\"k\":[]}]]]]",
            b"  -0.0E-0 ",
            "\"caf\u{e9} \u{1F600}\"".as_bytes(),
        ];
        let alphabet = b"{}[],:\"\\/-+.0123456789eEtrufalsn \t\n\xC3\xA9\xED\xFFu";
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for round in 0..20_000 {
            let mut input = seeds[round % seeds.len()].to_vec();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() as usize) % (input.len() + 1);
                let byte = alphabet[(next() as usize) % alphabet.len()];
                match next() % 3 {
                    0 if at < input.len() => input[at] = byte,
                    1 if at < input.len() => {
                        input.remove(at);
                    }
                    _ => input.insert(at, byte),
                }
            }
            if let Ok(once) = canonicalize(&input) {
                accepted += 1;
                assert_eq!(canonicalize(&once)?, once);
                assert!(
                    serde_json::from_slice::<serde::de::IgnoredAny>(&input).is_ok(),
                    "{}",
                    String::from_utf8_lossy(&input)
                );
                assert!(
                    serde_json::from_slice::<serde_json::Value>(&once).is_ok()
                        || once.contains(&b'e')
                );
            }
        }
        assert!(accepted > 1000, "only {accepted} mutated inputs were valid");
        Ok(())
    }

    #[test]
    fn canonicalize_is_idempotent() -> TestResult {
        for input in [
            r#"{"z": [1.50, {"b": "\u0001", "a": -0}], "a": 1e-7, "é": "\/"}"#,
            "[1e21, 1e20, 123456789012345678901234567890, 0.0000012, 1.5e-7]",
        ] {
            let once = canonicalize(input.as_bytes())?;
            assert_eq!(canonicalize(&once)?, once);
        }
        Ok(())
    }
}
