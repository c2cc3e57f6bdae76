//! The parser, for the fuzz targets in `fuzz/` only: compiled when cargo-fuzz
//! (or `fuzz/.cargo/config.toml`) sets `--cfg fuzzing`, empty otherwise.
//! Not part of the API.

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
