//! Arbitrary bytes into the on-disk record decoder (the stored response
//! envelope is decoded by the same path, inside the record).
//!
//! Never panics (a corrupt value is an error naming its key, see
//! `codec.rs`); garbage is refused: anything accepted starts with a format
//! version byte the decoder reads (2, checksummed, or 1, the legacy format
//! without a checksum), and no accepted value stays accepted with a byte
//! appended (trailing bytes are corruption) or its last byte removed. The
//! decoder checks values against fixed key bytes (`codec::FUZZ_KEY`), so
//! format-2 inputs get past the checksum only from the seeds in
//! `corpus/record_decode` (`<state>.bin`); the field decoder behind it is
//! the same for both formats and is reached through format-1 inputs
//! (`<state>.v1.bin`).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The record format versions the decoder reads (`codec::FORMAT_VERSION_1`
/// and `codec::FORMAT_VERSION`).
const FORMAT_VERSIONS: [u8; 2] = [1, 2];

fuzz_target!(|data: &[u8]| {
    if !idempotency::__fuzz_decode_record(data) {
        return;
    }
    assert!(
        data.first().is_some_and(|v| FORMAT_VERSIONS.contains(v)),
        "accepted another version"
    );
    let mut longer = data.to_vec();
    longer.push(0);
    assert!(
        !idempotency::__fuzz_decode_record(&longer),
        "accepted a record with a trailing byte"
    );
    assert!(
        !idempotency::__fuzz_decode_record(&data[..data.len() - 1]),
        "accepted a record with its last byte cut"
    );
});
