//! Request fingerprints: a blake3 hash of the business fields of a request,
//! so that a retried key carrying a different request is detected.
//!
//! JSON is hashed in the canonical form of [`crate::canonical`] (RFC 8785
//! structure with exact decimal numbers), so member order, whitespace and
//! number spelling (`1` vs `1.0`) do not change a fingerprint, while any
//! change of value does. What exactly is hashed is mapped at the top of
//! `fingerprint/builder.rs`.
//!
//! # Unicode: code points, no normalization
//!
//! Strings (values and member names) are hashed as the Unicode code points
//! they spell once JSON escapes are undone, so `"\u00e9"` and `"é"` are
//! the same string. No normalization is applied: `é` as one code point
//! (U+00E9, NFC) and as `e` plus a combining acute accent (U+0065 U+0301,
//! NFD) are different strings, so two requests that differ only in that
//! spelling have different fingerprints (a retry that changes it is
//! [`Begin::Mismatch`](crate::Begin::Mismatch)), and two member names that
//! differ only in it are two members, not duplicates. An app that wants
//! such spellings to count as one request normalizes the fields (to NFC,
//! say) before fingerprinting them.
//!
//! ```
//! use idempotency::Fingerprint;
//!
//! let nfc = Fingerprint::of_json("{\"name\": \"Jos\u{e9}\"}".as_bytes(), &[])?;
//! let nfd = Fingerprint::of_json("{\"name\": \"Jose\u{301}\"}".as_bytes(), &[])?;
//! let escaped = Fingerprint::of_json(br#"{"name": "Jos\u00e9"}"#, &[])?;
//! assert_ne!(nfc, nfd);
//! assert_eq!(nfc, escaped);
//! # Ok::<_, idempotency::FingerprintError>(())
//! ```

mod builder;

use std::fmt;

use serde::Serialize;

use crate::canonical::CanonicalError;

pub use builder::FingerprintBuilder;

/// Version of the fingerprint algorithm (hash input layout, canonical form
/// and the blake3 `derive_key` context, for version 1
/// `"idempotency 2026-11-29 request fingerprint v1"`). Stored beside
/// fingerprints so that a record written by another version is recognized
/// rather than compared.
pub const FINGERPRINT_ALGORITHM_VERSION: u8 = 1;

/// Name of the single part hashed by [`Fingerprint::of_json`] and
/// [`Fingerprint::of_serialize`].
const BODY_PART: &str = "body";

/// A request fingerprint: a 32-byte blake3 hash of a request's business
/// fields, computed by [`FINGERPRINT_ALGORITHM_VERSION`] 1 (see the module
/// docs for exactly what is hashed).
///
/// Strings are compared as Unicode code points, without normalization:
/// NFC and NFD spellings of the same text are different requests (an app
/// that wants otherwise normalizes before fingerprinting).
///
/// `Display` and [`Fingerprint::to_hex`] give 64 lowercase hex digits;
/// `Debug` gives the first 16, as `Fingerprint(0123456789abcdef…)`.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps 32 bytes, e.g. a fingerprint read back from storage.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The 32 hash bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The hash as 64 lowercase hex digits.
    #[must_use]
    pub fn to_hex(&self) -> String {
        let mut hex = String::with_capacity(64);
        for &b in &self.0 {
            hex.push(hex_digit(b >> 4));
            hex.push(hex_digit(b));
        }
        hex
    }

    /// Fingerprints a command value through its JSON form.
    ///
    /// The value is serialized with `serde_json` and then hashed exactly as
    /// [`Fingerprint::of_json`] with no pointers would hash that text, so
    /// `of_serialize(&cmd)` equals `of_json(&serde_json::to_vec(&cmd)?, &[])`
    /// and equals the fingerprint of any JSON text with the same members in
    /// any order.
    ///
    /// Fingerprint the command *after* defaults are applied, so that a
    /// request that spells out a default and one that omits it agree.
    /// Floating-point fields go through `serde_json`'s shortest round-trip
    /// representation, so `0.1_f64` is the decimal `0.1`; `NaN` and infinities
    /// become `null`, as `serde_json` writes them.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::Serialize`] if `serde_json` cannot serialize the
    /// value (e.g. a map with non-string keys); [`FingerprintError::Json`] if
    /// the output has a duplicate member name (a hand-written `Serialize`),
    /// nests deeper than 128 levels, or has a number out of range (see
    /// [`crate::canonical`]).
    pub fn of_serialize<T: Serialize + ?Sized>(
        command: &T,
    ) -> Result<Fingerprint, FingerprintError> {
        Ok(Fingerprint::builder()
            .serialize(BODY_PART, command)?
            .finish())
    }

    /// Fingerprints a JSON request body, or selected fields of it.
    ///
    /// With no `pointers`, the whole document is hashed in canonical form.
    /// Otherwise only the values at the given RFC 6901 JSON Pointers are
    /// hashed, each with its pointer; the order of `pointers` and repeats in
    /// it do not matter, and a field that is absent differs from one that is
    /// `null`. Hashing the whole document and selecting `""` give different
    /// fingerprints.
    ///
    /// This is `Fingerprint::builder().json("body", body, pointers)?.finish()`.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::Json`] holding [`CanonicalError::InvalidPointer`]
    /// if a pointer is malformed (checked before the body is read), or the
    /// error from [`canonicalize`](crate::canonical::canonicalize) if the
    /// body is not strict JSON (see [`crate::canonical`] for the rules and
    /// limits); these say where the problem is.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency::Fingerprint;
    ///
    /// let a = Fingerprint::of_json(br#"{"amount": 1.0, "to": "alice", "note": "hi"}"#, &[])?;
    /// let b = Fingerprint::of_json(br#"{"to":"alice","note":"hi","amount":1}"#, &[])?;
    /// assert_eq!(a, b);
    ///
    /// // Only the selected fields count.
    /// let pointers = ["/amount", "/to"];
    /// let c = Fingerprint::of_json(br#"{"amount": 1, "to": "alice", "note": "hi"}"#, &pointers)?;
    /// let d = Fingerprint::of_json(br#"{"amount": 1, "to": "alice", "note": "bye"}"#, &pointers)?;
    /// assert_eq!(c, d);
    /// assert_eq!(c.to_hex().len(), 64);
    ///
    /// // Errors say where.
    /// let err = Fingerprint::of_json(br#"{"amount": 1, "amount": 2}"#, &[]).unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "duplicate member \"amount\" in the top-level object (byte 14, line 1, column 15)"
    /// );
    /// # Ok::<_, idempotency::FingerprintError>(())
    /// ```
    pub fn of_json(body: &[u8], pointers: &[&str]) -> Result<Fingerprint, FingerprintError> {
        Ok(Fingerprint::builder()
            .json(BODY_PART, body, pointers)?
            .finish())
    }

    /// Starts a fingerprint over several named parts, e.g. HTTP method,
    /// path and JSON body.
    #[must_use]
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder::new()
    }
}

/// The lowercase hex digit for the low four bits of `nibble`.
fn hex_digit(nibble: u8) -> char {
    let n = nibble & 0x0F;
    char::from(if n < 10 { b'0' + n } else { b'a' + (n - 10) })
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        write!(f, "Fingerprint({}…)", hex.get(..16).unwrap_or(&hex))
    }
}

/// Why a fingerprint could not be computed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    /// The JSON was not strict JSON, or a JSON Pointer was malformed; the
    /// inner error says where.
    #[error(transparent)]
    Json(#[from] CanonicalError),
    /// `serde_json` could not serialize the value.
    #[error("could not serialize the command to JSON: {0}")]
    Serialize(#[source] serde_json::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn fp(body: &str, pointers: &[&str]) -> Result<Fingerprint, FingerprintError> {
        Fingerprint::of_json(body.as_bytes(), pointers)
    }

    #[test]
    fn order_whitespace_and_number_spelling_do_not_matter() -> TestResult {
        let a = fp(r#"{"amount": 1.0, "to": "alice", "tags": ["x", "y"]}"#, &[])?;
        let b = fp(
            "{\"tags\":[\"x\",\"y\"],\n\"to\":\"alice\",\"amount\":1}",
            &[],
        )?;
        assert_eq!(a, b);
        assert_eq!(fp("1", &[])?, fp("1.0", &[])?);
        assert_eq!(fp("1", &[])?, fp("10e-1", &[])?);
        assert_ne!(fp("[1,2]", &[])?, fp("[2,1]", &[])?);
        Ok(())
    }

    #[test]
    fn big_integers_are_distinguished() -> TestResult {
        assert_ne!(fp("9007199254740993", &[])?, fp("9007199254740992", &[])?);
        assert_ne!(
            fp(r#"{"id": 9007199254740993}"#, &["/id"])?,
            fp(r#"{"id": 9007199254740992}"#, &["/id"])?
        );
        Ok(())
    }

    #[derive(Serialize)]
    struct Payment {
        amount: u64,
        currency: &'static str,
        rate: f64,
        memo: Option<String>,
        lines: Vec<(String, i32)>,
    }

    #[test]
    fn of_serialize_matches_equivalent_json() -> TestResult {
        let payment = Payment {
            amount: 9_007_199_254_740_993,
            currency: "EUR",
            rate: 0.1,
            memo: None,
            lines: vec![("fee".to_owned(), -3)],
        };
        let text = r#"{ "lines": [["fee", -3]], "memo": null, "rate": 1e-1,
                        "currency": "EUR", "amount": 9007199254740993 }"#;
        assert_eq!(Fingerprint::of_serialize(&payment)?, fp(text, &[])?);
        assert_eq!(
            Fingerprint::builder().serialize("x", &payment)?.finish(),
            Fingerprint::builder()
                .json("x", text.as_bytes(), &[])?
                .finish()
        );
        Ok(())
    }

    #[test]
    fn of_serialize_errors() {
        let mut map = std::collections::HashMap::new();
        map.insert(vec![1u8], 1);
        let err = Fingerprint::of_serialize(&map).err();
        assert!(
            matches!(err, Some(FingerprintError::Serialize(_))),
            "{err:?}"
        );
        if let Some(err) = err {
            assert!(err
                .to_string()
                .starts_with("could not serialize the command to JSON: "));
            assert!(std::error::Error::source(&err).is_some());
        }
    }

    #[test]
    fn formatting() {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8) * 8 + 1;
        }
        let f = Fingerprint::from_bytes(bytes);
        assert_eq!(f.as_bytes(), &bytes);
        let hex = f.to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex.starts_with("0109111921293139") && hex.ends_with("f9"));
        assert_eq!(f.to_string(), hex);
        assert_eq!(format!("{f:?}"), "Fingerprint(0109111921293139…)");
        assert_eq!(
            format!("{:?}", FingerprintBuilder::new()),
            "FingerprintBuilder { .. }"
        );
    }

    #[test]
    fn serde_round_trip() -> TestResult {
        let f = fp("{}", &[])?;
        let json = serde_json::to_vec(&f)?;
        assert_eq!(serde_json::from_slice::<Fingerprint>(&json)?, f);
        Ok(())
    }
}
