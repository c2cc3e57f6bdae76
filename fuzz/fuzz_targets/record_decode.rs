//! Arbitrary bytes into the on-disk record decoder (the stored response
//! envelope is decoded by the same path, inside the record).
//!
//! Byte 0 picks the mode (see `codec::fuzz_decode`):
//!
//! - even: the rest is a stored value as is, checked against fixed key
//!   bytes (`codec::FUZZ_KEY`): the framing, the version byte and the
//!   checksum. Random bytes never carry a matching checksum, so in this
//!   mode format-2 inputs get past it only from the seeds
//!   (`corpus/record_decode/raw-<state>.bin`), and the field decoder is
//!   reached through format-1 inputs (`raw-<state>.v1.bin`).
//! - odd: the rest is a postcard payload that the hook frames with a
//!   correct checksum (for the record, outbox, entity and meta decoders
//!   each), so every mutation reaches the field decoders
//!   (`framed-<state>.bin`).
//!
//! Never panics (a corrupt value is an error naming its key, see
//! `codec.rs`); garbage is refused: anything accepted as is starts with a
//! format version byte the decoder reads (2, checksummed, or 1, the legacy
//! format without a checksum), and in both modes no accepted value stays
//! accepted with a byte appended (trailing bytes are corruption) or its
//! last byte removed (a postcard value is self-delimiting).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The record format versions the decoder reads (`codec::FORMAT_VERSION_1`
/// and `codec::FORMAT_VERSION`).
const FORMAT_VERSIONS: [u8; 2] = [1, 2];

fuzz_target!(|data: &[u8]| {
    if !idempotency::__fuzz_decode_record(data) {
        return;
    }
    // Accepted: a mode byte and at least one byte of value.
    let (mode, value) = (data[0], &data[1..]);
    if mode.is_multiple_of(2) {
        assert!(
            value.first().is_some_and(|v| FORMAT_VERSIONS.contains(v)),
            "accepted another version"
        );
    }
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
