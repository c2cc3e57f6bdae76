//! [`FingerprintBuilder`]: the hash input of a fingerprint.
//!
//! # Hash input layout (algorithm version 1)
//!
//! The hasher is `blake3::Hasher::new_derive_key(DERIVE_KEY_CONTEXT)`. It is
//! fed a sequence of parts; `len` is a `u64` little-endian byte count and
//! `bytes(x)` is `len(x) ‖ x`:
//!
//! | part                     | bytes                                                                 |
//! |--------------------------|-----------------------------------------------------------------------|
//! | [`FingerprintBuilder::part`] | `0x00 ‖ bytes(name) ‖ bytes(value)`                               |
//! | JSON, whole document     | `0x01 ‖ bytes(name) ‖ bytes(canonical JSON)`                          |
//! | JSON, pointer selection  | `0x02 ‖ bytes(name) ‖ count as u64 LE ‖` per pointer, sorted and deduplicated: `bytes(pointer) ‖ 0x00` if absent, or `bytes(pointer) ‖ 0x01 ‖ bytes(canonical JSON)` if present |
//!
//! Every part is self-delimiting, so different part sequences cannot feed
//! the same bytes. A change to this layout or to the canonical form must
//! come with a new context string and a new
//! [`FINGERPRINT_ALGORITHM_VERSION`](crate::FINGERPRINT_ALGORITHM_VERSION),
//! never a silent collision with old fingerprints.

use std::fmt;
use std::sync::OnceLock;

use serde::Serialize;

use super::{Fingerprint, FingerprintError};
use crate::canonical::{self, JsonValue};

/// The blake3 key derivation context of algorithm version 1.
const DERIVE_KEY_CONTEXT: &str = "idempotency 2026-11-29 request fingerprint v1";

const TAG_BYTES: u8 = 0x00;
const TAG_JSON_DOCUMENT: u8 = 0x01;
const TAG_JSON_POINTERS: u8 = 0x02;

/// Hashes several tagged parts, e.g. HTTP method + path + JSON body, into
/// one [`Fingerprint`].
///
/// Parts are hashed in the order they are added, each with its name and
/// kind, and length-prefixed: `("ab", "c")` and `("a", "bc")` differ, and a
/// byte part never equals a JSON part.
///
/// ```
/// use idempotency::Fingerprint;
///
/// let fingerprint = Fingerprint::builder()
///     .part("method", b"POST")
///     .part("path", b"/payments")
///     .json("body", br#"{"amount": 10}"#, &[])?
///     .finish();
/// # Ok::<_, idempotency::FingerprintError>(())
/// ```
#[derive(Clone)]
pub struct FingerprintBuilder {
    hasher: blake3::Hasher,
}

impl FingerprintBuilder {
    /// An empty builder; the same as [`Fingerprint::builder`].
    #[must_use]
    pub fn new() -> Self {
        // Deriving the key hashes the context string: done once, then cloned.
        static EMPTY: OnceLock<blake3::Hasher> = OnceLock::new();
        FingerprintBuilder {
            hasher: EMPTY
                .get_or_init(|| blake3::Hasher::new_derive_key(DERIVE_KEY_CONTEXT))
                .clone(),
        }
    }

    fn write_len(&mut self, len: usize) {
        // usize is at most 64 bits on every supported target.
        self.hasher.update(&(len as u64).to_le_bytes());
    }

    fn write_bytes(&mut self, bytes: &[u8]) {
        self.write_len(bytes.len());
        self.hasher.update(bytes);
    }

    fn write_header(&mut self, tag: u8, name: &str) {
        self.hasher.update(&[tag]);
        self.write_bytes(name.as_bytes());
    }

    /// Adds raw bytes under `name`, hashed as they are.
    #[must_use]
    pub fn part(mut self, name: &str, bytes: &[u8]) -> Self {
        self.write_header(TAG_BYTES, name);
        self.write_bytes(bytes);
        self
    }

    /// Adds a JSON document under `name`, whole or selected fields, as
    /// described at [`Fingerprint::of_json`].
    ///
    /// # Errors
    ///
    /// As for [`Fingerprint::of_json`].
    pub fn json(
        mut self,
        name: &str,
        body: &[u8],
        pointers: &[&str],
    ) -> Result<Self, FingerprintError> {
        if pointers.is_empty() {
            // The canonical form is length-prefixed, so it is built before
            // it is hashed.
            let mut canonical = Vec::with_capacity(body.len());
            canonical::canonicalize_into(body, &mut canonical)?;
            self.write_header(TAG_JSON_DOCUMENT, name);
            self.write_bytes(&canonical);
            return Ok(self);
        }
        for pointer in pointers {
            canonical::validate_pointer(pointer)?;
        }
        let value = canonical::parse(body)?;
        self.json_pointers_of(name, &value, pointers)
    }

    /// [`FingerprintBuilder::json`] with pointers, on a body parsed
    /// already (the HTTP layer parses a pointer route's body once, for the
    /// fingerprint and its per-pointer digests). The pointers must have
    /// passed `canonical::validate_pointer`.
    pub(crate) fn json_pointers_of(
        mut self,
        name: &str,
        value: &canonical::JsonValue,
        pointers: &[&str],
    ) -> Result<Self, FingerprintError> {
        let mut pointers = pointers.to_vec();
        pointers.sort_unstable();
        pointers.dedup();
        self.write_header(TAG_JSON_POINTERS, name);
        self.write_len(pointers.len());
        for pointer in pointers {
            self.write_bytes(pointer.as_bytes());
            match canonical::resolve(value, pointer)? {
                None => {
                    self.hasher.update(&[0]);
                }
                Some(selected) => {
                    self.hasher.update(&[1]);
                    self.write_canonical(selected);
                }
            }
        }
        Ok(self)
    }

    /// Adds a value under `name` through its JSON form, as described at
    /// [`Fingerprint::of_serialize`]; the same as [`FingerprintBuilder::json`]
    /// with `serde_json::to_vec(value)` and no pointers.
    ///
    /// # Errors
    ///
    /// As for [`Fingerprint::of_serialize`].
    pub fn serialize<T: Serialize + ?Sized>(
        self,
        name: &str,
        value: &T,
    ) -> Result<Self, FingerprintError> {
        let body = serde_json::to_vec(value).map_err(FingerprintError::Serialize)?;
        self.json(name, &body, &[])
    }

    /// Returns the fingerprint of the parts added so far.
    #[must_use]
    pub fn finish(self) -> Fingerprint {
        Fingerprint(*self.hasher.finalize().as_bytes())
    }

    fn write_canonical(&mut self, value: &JsonValue) {
        let mut canonical = Vec::new();
        value.write_canonical(&mut canonical);
        self.write_bytes(&canonical);
    }
}

impl Default for FingerprintBuilder {
    fn default() -> Self {
        FingerprintBuilder::new()
    }
}

impl fmt::Debug for FingerprintBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintBuilder").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::CanonicalError;
    use crate::FINGERPRINT_ALGORITHM_VERSION;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn fp(body: &str, pointers: &[&str]) -> Result<Fingerprint, FingerprintError> {
        Fingerprint::of_json(body.as_bytes(), pointers)
    }

    #[test]
    fn absent_differs_from_null() -> TestResult {
        let absent = fp(r#"{"a": 1}"#, &["/a", "/b"])?;
        let null = fp(r#"{"a": 1, "b": null}"#, &["/a", "/b"])?;
        assert_ne!(absent, null);
        Ok(())
    }

    #[test]
    fn pointer_selection() -> TestResult {
        let pointers = ["/amount", "/to"];
        let a = fp(r#"{"amount": 5, "to": "bob", "trace": "1"}"#, &pointers)?;
        let b = fp(r#"{"trace": "2", "to": "bob", "amount": 5.0}"#, &pointers)?;
        assert_eq!(a, b, "unselected fields are ignored");
        let c = fp(r#"{"amount": 6, "to": "bob", "trace": "1"}"#, &pointers)?;
        assert_ne!(a, c, "selected fields count");

        let body = r#"{"amount": 5, "to": "bob", "trace": "1"}"#;
        assert_eq!(
            a,
            fp(body, &["/to", "/amount", "/to"])?,
            "order and repeats are irrelevant"
        );
        assert_ne!(a, fp(body, &["/amount"])?, "different pointer sets differ");
        assert_ne!(
            a,
            fp(body, &["/amount", "/to", "/missing"])?,
            "an extra absent pointer still counts"
        );
        assert_ne!(
            fp(body, &[])?,
            fp(body, &[""])?,
            "whole document vs pointer \"\""
        );
        // The same values under different pointers differ.
        assert_ne!(
            fp(r#"{"a": 1, "b": 1}"#, &["/a"])?,
            fp(r#"{"a": 1, "b": 1}"#, &["/b"])?
        );
        Ok(())
    }

    #[test]
    fn entry_points_are_the_documented_builders() -> TestResult {
        let body = br#"{"a": 1, "b": [true]}"#;
        assert_eq!(
            Fingerprint::of_json(body, &[])?,
            Fingerprint::builder().json("body", body, &[])?.finish()
        );
        assert_eq!(
            Fingerprint::of_json(body, &["/b"])?,
            Fingerprint::builder().json("body", body, &["/b"])?.finish()
        );
        assert_ne!(
            Fingerprint::of_json(body, &[])?,
            Fingerprint::builder().json("other", body, &[])?.finish(),
            "the part name is hashed"
        );
        // A byte part holding the canonical text is not a JSON part.
        assert_ne!(
            Fingerprint::of_json(body, &[])?,
            Fingerprint::builder()
                .part("body", br#"{"a":1,"b":[true]}"#)
                .finish()
        );
        Ok(())
    }

    #[test]
    fn builder_parts_are_delimited() {
        let parts = |list: &[(&str, &[u8])]| {
            list.iter()
                .fold(Fingerprint::builder(), |b, (name, bytes)| {
                    b.part(name, bytes)
                })
                .finish()
        };
        let all = [
            parts(&[("ab", b"c")]),
            parts(&[("a", b"bc")]),
            parts(&[("abc", b"")]),
            parts(&[("", b"abc")]),
            parts(&[("a", b""), ("b", b"c")]),
            parts(&[("b", b"c"), ("a", b"")]),
            parts(&[]),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(parts(&[("a", b"bc")]), parts(&[("a", b"bc")]));
        assert_eq!(
            Fingerprint::builder().finish(),
            FingerprintBuilder::default().finish()
        );
    }

    #[test]
    fn errors_propagate_with_position() -> TestResult {
        let err = fp(r#"{"a": 1}"#, &["/a", "b"]).err().ok_or("accepted")?;
        assert!(matches!(
            &err,
            FingerprintError::Json(CanonicalError::InvalidPointer { pointer, .. }) if pointer == "b"
        ));
        assert_eq!(
            err.to_string(),
            "invalid JSON Pointer \"b\": must be empty or start with '/'"
        );
        // Pointers are checked before the body is read.
        let err = fp("not json", &["/a~2"]).err().ok_or("accepted")?;
        assert!(matches!(
            err,
            FingerprintError::Json(CanonicalError::InvalidPointer { .. })
        ));

        let err = fp(r#"{"p": {"amount": 1, "amount": 1}}"#, &["/q"])
            .err()
            .ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "duplicate member \"amount\" in object at /p (byte 20, line 1, column 21)"
        );
        let err = fp("{\"a\": 1,\n \"b\" 2}", &[]).err().ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "invalid JSON at byte 14 (line 2, column 6): expected ':' after object member name"
        );
        let err = Fingerprint::builder()
            .json("body", b"[1] x", &[])
            .err()
            .ok_or("accepted")?;
        let FingerprintError::Json(inner) = err else {
            return Err("wrong variant".into());
        };
        assert_eq!(inner.position().map(|p| p.offset), Some(4));
        Ok(())
    }

    #[test]
    fn known_answer() -> TestResult {
        // Pins algorithm version 1: if this changes, stored fingerprints no
        // longer match and FINGERPRINT_ALGORITHM_VERSION must change too.
        assert_eq!(FINGERPRINT_ALGORITHM_VERSION, 1);
        let expected = {
            let mut h = blake3::Hasher::new_derive_key(DERIVE_KEY_CONTEXT);
            h.update(&[TAG_JSON_DOCUMENT]);
            h.update(&4u64.to_le_bytes());
            h.update(b"body");
            h.update(&7u64.to_le_bytes());
            h.update(br#"{"a":1}"#);
            Fingerprint::from_bytes(*h.finalize().as_bytes())
        };
        assert_eq!(fp(r#"{ "a" : 1.0 }"#, &[])?, expected);
        assert_eq!(
            expected.to_hex(),
            "e69e40282ccc3ae769a54919a0e09ce3b7193c02aab69a4fec4c70c043f1be3d"
        );
        Ok(())
    }
}
