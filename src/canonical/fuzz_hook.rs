//! The parser, for the fuzz targets in `fuzz/` only: compiled when cargo-fuzz
//! (or `fuzz/.cargo/config.toml`) sets `--cfg fuzzing`, empty otherwise.
//! Not part of the API.
//!
//! Except [`differential`]: the two paths of
//! [`canonicalize`](super::canonicalize) side by side, always compiled
//! (hidden) so that `tests/prop_canonical.rs` can compare them too.

// `fuzzing` is cargo-fuzz's cfg; rustc does not know it as a built-in name.

#[cfg(fuzzing)]
use super::{CanonicalError, JsonValue};

/// A parsed JSON value; equal exactly when the values are equal (numbers by
/// exact decimal value, objects regardless of member order).
#[cfg(fuzzing)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed(JsonValue);

/// Parses JSON text as [`super::canonicalize`] does.
///
/// # Errors
///
/// As for [`super::canonicalize`].
#[cfg(fuzzing)]
pub fn parse(bytes: &[u8]) -> Result<Parsed, CanonicalError> {
    super::parse(bytes).map(Parsed)
}

/// Checks a JSON Pointer as [`crate::Fingerprint::of_json`] does.
///
/// # Errors
///
/// [`CanonicalError::InvalidPointer`] if it is malformed.
#[cfg(fuzzing)]
pub fn validate_pointer(pointer: &str) -> Result<(), CanonicalError> {
    super::validate_pointer(pointer)
}

/// What each path of [`super::canonicalize`] makes of some bytes, for
/// differential tests. Not part of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Differential {
    /// The fast path's output, or `Err(true)` if it gave up on a member
    /// name that RFC 8785 escapes (`"`, `\\`, a control character; valid
    /// JSON it leaves to the tree path), `Err(false)` if it gave up for any
    /// other reason.
    pub fast: Result<Vec<u8>, bool>,
    /// The tree path's output or error.
    pub tree: Result<Vec<u8>, super::CanonicalError>,
}

/// Runs both paths of [`super::canonicalize`] on `bytes`. Not part of the
/// API.
pub fn differential(bytes: &[u8]) -> Differential {
    let mut fast = Vec::new();
    let fast = match super::direct::write_canonical(bytes, &mut fast) {
        Ok(()) => Ok(fast),
        Err(fallback) => Err(fallback == super::direct::Fallback::EscapedName),
    };
    let mut tree = Vec::new();
    let tree = super::tree_canonicalize_into(bytes, &mut tree).map(|()| tree);
    Differential { fast, tree }
}
