//! What the SIGKILL loops (`kill_loop.rs`, `kill_format3.rs`) write for a
//! key and check after each kill: a fingerprint and a response, both
//! deterministic from the key's name, so the parent knows the bytes a
//! replay must give without the child telling it. Uses the crate root's
//! `split_mix` module (each test includes `common/split_mix.rs`).

#![allow(dead_code)] // each test file uses some of it

use idempotency::{Envelope, Fingerprint, FingerprintError};

use super::split_mix::SplitMix64;

/// FNV-1a, 64 bits: the body hash written to the ack log.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The fingerprint of the request for `name` in the loop `op`.
pub fn request_fp(op: &str, name: &str) -> Result<Fingerprint, FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"op":"{op}","key":"{name}"}}"#).as_bytes(), &[])
}

/// The response stored for `name`: status 200-202 and 50 to `max_body`
/// printable body bytes, all from the name, and an `x-key` header.
pub fn response(name: &str, max_body: u64) -> Envelope {
    let mut rng = SplitMix64(fnv1a(name.as_bytes()));
    let status = [200, 201, 202][rng.below(3) as usize];
    let len = 50 + rng.below(max_body.saturating_sub(49).max(1)) as usize;
    let body: Vec<u8> = (0..len).map(|_| b' ' + rng.below(95) as u8).collect();
    Envelope::new(1, status, body).with_header("x-key", name)
}
