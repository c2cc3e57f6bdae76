//! Lower-case hex, as the engine's `Lost` items and test reports print
//! keys and bytes.
//!
//! Include it with `#[path = "common/hex.rs"] mod hex;`.

#![allow(dead_code)] // each test file uses what it needs

/// `bytes` in lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of hex text `s`; a pair of digits that is not hex is skipped
/// (as is a last odd digit).
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}
