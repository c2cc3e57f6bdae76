//! Arbitrary bytes into the JSON fingerprint path.
//!
//! The input is a JSON body, optionally followed by `0xFF` and JSON Pointers
//! separated by `0xFF` (`0xFF` never occurs in valid UTF-8, so a body that is
//! JSON text stays whole). Checks, for every input:
//!
//! - nothing panics;
//! - `canonicalize` succeeds exactly when `parse` does, and on success the
//!   canonical output is a fixed point, parses to a value equal to the
//!   input's, and fingerprints like the input (with and without pointers);
//! - `Fingerprint::of_json` succeeds exactly when the body parses and every
//!   pointer is valid, and ignores pointer order and repeats;
//! - differential: serde_json agrees on what is JSON, except for the
//!   documented differences (duplicate members, depth and number range);
//! - differential: the fast path of `canonicalize` (straight into canonical
//!   bytes) accepts only what the tree path accepts, with the same output,
//!   and gives up on valid JSON only for member names RFC 8785 escapes.
//!
//! The parser itself is reached through `canonical::fuzz_hook`, which exists
//! only under `--cfg fuzzing` (set by cargo-fuzz, and by `.cargo/config.toml`
//! here for a plain `cargo check`).
#![no_main]

use idempotency::canonical::fuzz_hook::{self, Parsed};
use idempotency::canonical::{self, CanonicalError};
use idempotency::Fingerprint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.split(|&b| b == 0xFF);
    let body = parts.next().unwrap_or_default();
    let pointers: Vec<String> = parts
        .take(8)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
    check(body, &pointers);
});

fn check(body: &[u8], pointers: &[&str]) {
    let parsed = fuzz_hook::parse(body);
    let canonical = canonical::canonicalize(body);
    assert_eq!(parsed.is_ok(), canonical.is_ok());
    if let (Err(a), Err(b)) = (&parsed, &canonical) {
        assert_eq!(a, b, "parse and canonicalize report different errors");
    }
    differential(body, &parsed);
    paths_agree(body, &canonical);

    let whole = Fingerprint::of_json(body, &[]);
    assert_eq!(whole.is_ok(), parsed.is_ok());
    let pointers_valid = pointers
        .iter()
        .all(|p| fuzz_hook::validate_pointer(p).is_ok());
    let selected = Fingerprint::of_json(body, pointers);
    if pointers.is_empty() {
        assert_eq!(selected.is_ok(), whole.is_ok());
    } else {
        assert_eq!(selected.is_ok(), pointers_valid && parsed.is_ok());
        let mut shuffled: Vec<&str> = pointers.iter().rev().copied().collect();
        shuffled.extend_from_slice(pointers);
        let again = Fingerprint::of_json(body, &shuffled);
        assert_eq!(
            selected.ok(),
            again.ok(),
            "pointer order or repeats changed it"
        );
    }

    let (Ok(value), Ok(once)) = (parsed, canonical) else {
        return;
    };
    assert!(
        std::str::from_utf8(&once).is_ok(),
        "canonical form is not UTF-8"
    );
    let twice = canonical::canonicalize(&once).expect("canonical output must parse");
    assert_eq!(once, twice, "canonicalization is not idempotent");
    let reparsed = fuzz_hook::parse(&once).expect("canonical output must parse");
    assert_eq!(reparsed, value, "canonical output parses to another value");
    assert_eq!(
        Fingerprint::of_json(&once, &[]).ok(),
        whole.ok(),
        "canonical output fingerprints differently"
    );
    if pointers_valid && !pointers.is_empty() {
        assert_eq!(
            Fingerprint::of_json(&once, pointers).ok(),
            Fingerprint::of_json(body, pointers).ok(),
            "canonical output fingerprints differently with pointers"
        );
    }
}

/// The two paths behind `canonicalize` agree, and it returns the tree
/// path's result (errors and positions included).
fn paths_agree(body: &[u8], canonical: &Result<Vec<u8>, CanonicalError>) {
    let both = fuzz_hook::differential(body);
    match (&both.fast, &both.tree) {
        (Ok(fast), tree) => assert_eq!(
            Some(fast),
            tree.as_ref().ok(),
            "fast path output differs from the tree path"
        ),
        (Err(escaped_name), Ok(_)) => {
            assert!(*escaped_name, "fast path gave up on valid JSON")
        }
        (Err(_), Err(_)) => {}
    }
    assert_eq!(
        canonical, &both.tree,
        "canonicalize differs from the tree path"
    );
}

/// serde_json is a strict RFC 8259 parser too: where it and we disagree, the
/// reason must be one of the documented extra rules.
fn differential(body: &[u8], ours: &Result<Parsed, CanonicalError>) {
    let theirs = serde_json::from_slice::<serde_json::Value>(body);
    match (ours, &theirs) {
        (Ok(_), Err(e)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("number out of range") || msg.contains("recursion limit"),
                "we accept what serde_json rejects: {msg}"
            );
        }
        (Err(e), Ok(_)) => assert!(
            matches!(
                e,
                CanonicalError::DuplicateMember { .. }
                    | CanonicalError::TooDeep { .. }
                    | CanonicalError::NumberOutOfRange { .. }
            ),
            "we reject what serde_json accepts: {e}"
        ),
        _ => {}
    }
}
