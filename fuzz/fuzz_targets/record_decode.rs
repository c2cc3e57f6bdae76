//! Arbitrary bytes into the on-disk record decoder (the stored response
//! envelope is decoded by the same path, inside the record).
//!
//! Never panics (a corrupt value is an error naming its key, see
//! `codec.rs`); garbage is refused: anything accepted starts with the
//! format version byte, and no accepted value stays accepted with a byte
//! appended (trailing bytes are corruption) or its last byte removed.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The record format version the decoder reads (`codec::FORMAT_VERSION`).
const FORMAT_VERSION: u8 = 1;

fuzz_target!(|data: &[u8]| {
    if !idempotency::__fuzz_decode_record(data) {
        return;
    }
    assert_eq!(
        data.first(),
        Some(&FORMAT_VERSION),
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
