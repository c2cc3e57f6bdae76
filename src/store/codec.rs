//! The on-disk record format: the only place that knows how records are laid
//! out in bytes.
//!
//! Layout of a value in the `idempotency.records` table:
//!
//! ```text
//! byte 0      format version (FORMAT_VERSION = 1)
//! bytes 1..   postcard encoding of `RecordV1` (field order below is the format;
//!             integers are varints, strings and byte strings length-prefixed)
//! ```
//!
//! The outbox (`idempotency.outbox`, u64 sequence → value) and entity
//! (`idempotency.entities`, entity id → value) tables use the same framing:
//! a format-version byte, then postcard of `OutboxEntry` / `EntityState`.
//!
//! Keys of the records table are `[scope length: u8][scope][key]` (see
//! `IdempotencyKey::to_record_key`). Index tables hold `(instant ms, record key)`
//! tuples; see `redb/tables.rs`. All instants are milliseconds since the Unix epoch.
//!
//! A value that does not decode is reported with its key, never a panic; a
//! value with trailing bytes is corrupt too.

use serde::{Deserialize, Serialize};

use crate::message::OutboxEntry;

use super::record::{EntityState, Record};

/// The record format this build reads and writes.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// `Vec<u8>` as a serde byte string. postcard writes exactly the bytes a
/// sequence of `u8` gets (varint length, then the raw bytes), so the format
/// is unchanged; but a byte string is copied in one go, where a sequence is
/// decoded one element at a time (that loop was the largest cost of a
/// replay, see BENCHMARKS.md).
pub(super) mod byte_buf {
    use serde::de::{Deserializer, Error, SeqAccess, Visitor};
    use serde::Serializer;

    pub(crate) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct ByteBuf;
        impl<'de> Visitor<'de> for ByteBuf {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            // Self-describing formats may hand bytes over as a sequence.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = seq.next_element()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(ByteBuf)
    }
}

/// Why a value failed to decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    Empty,
    UnknownVersion(u8),
    Malformed(String),
    TrailingBytes(usize),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Empty => f.write_str("empty value"),
            DecodeError::UnknownVersion(v) => write!(
                f,
                "unknown record format version {v} (this build reads {FORMAT_VERSION})"
            ),
            DecodeError::Malformed(e) => write!(f, "malformed record: {e}"),
            DecodeError::TrailingBytes(n) => write!(f, "{n} trailing bytes after the record"),
        }
    }
}

pub(crate) fn encode(record: &Record) -> Vec<u8> {
    encode_versioned(record)
}

pub(crate) fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    decode_versioned(bytes)
}

/// Outbox table values: `[FORMAT_VERSION][postcard OutboxEntry]`.
pub(crate) fn encode_outbox(entry: &OutboxEntry) -> Vec<u8> {
    encode_versioned(entry)
}

pub(crate) fn decode_outbox(bytes: &[u8]) -> Result<OutboxEntry, DecodeError> {
    decode_versioned(bytes)
}

/// Entity table values: `[FORMAT_VERSION][postcard EntityState]`.
pub(crate) fn encode_entity(entity: &EntityState) -> Vec<u8> {
    encode_versioned(entity)
}

pub(crate) fn decode_entity(bytes: &[u8]) -> Result<EntityState, DecodeError> {
    decode_versioned(bytes)
}

fn encode_versioned<T: Serialize>(value: &T) -> Vec<u8> {
    let out = vec![FORMAT_VERSION];
    // postcard serializes these plain structs infallibly into a Vec; the
    // fallback (a bare version byte, which fails to decode) keeps the
    // function total without an unwrap.
    match postcard::to_extend(value, out) {
        Ok(v) => v,
        Err(_) => vec![FORMAT_VERSION],
    }
}

fn decode_versioned<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DecodeError> {
    let (&version, rest) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(DecodeError::UnknownVersion(version));
    }
    let (value, tail): (T, &[u8]) =
        postcard::take_from_bytes(rest).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !tail.is_empty() {
        return Err(DecodeError::TrailingBytes(tail.len()));
    }
    Ok(value)
}

/// Feeds `bytes` to every decoder (record, outbox, entity); returns whether
/// they decoded as a record. For the `record_decode` fuzz target: no input
/// may panic.
#[cfg(any(test, fuzzing))]
pub(crate) fn decode_all(bytes: &[u8]) -> bool {
    let _ = decode_outbox(bytes);
    let _ = decode_entity(bytes);
    decode(bytes).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;
    use crate::fingerprint::Fingerprint;
    use crate::store::record::{RecordState, StoredResponse};

    fn sample() -> Record {
        let mut r = Record::processing(Fingerprint::from_bytes([7; 32]), 42, "ref".into(), 1, 2);
        r.state = RecordState::Completed;
        r.response = Some(StoredResponse::new(
            Envelope::new(3, 201, b"{\"id\":1}".to_vec()).with_header("content-type", "json"),
            Some("pay_1".into()),
        ));
        r
    }

    #[test]
    fn byte_buf_is_the_seq_format() {
        // The body's byte-string encoding must equal the `Vec<u8>` sequence
        // encoding format 1 was written with.
        #[derive(Serialize, Deserialize)]
        struct Seq {
            v: Vec<u8>,
        }
        #[derive(Serialize, Deserialize)]
        struct Bytes {
            #[serde(with = "byte_buf")]
            v: Vec<u8>,
        }
        for len in [0usize, 1, 127, 128, 300, 20_000] {
            let v: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let seq = postcard::to_allocvec(&Seq { v: v.clone() }).unwrap();
            let bytes = postcard::to_allocvec(&Bytes { v: v.clone() }).unwrap();
            assert_eq!(seq, bytes);
            let back: Bytes = postcard::from_bytes(&seq).unwrap();
            assert_eq!(back.v, v);
        }
    }

    #[test]
    fn round_trips() {
        let r = sample();
        assert_eq!(decode(&encode(&r)), Ok(r));
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        let good = encode(&sample());
        assert_eq!(decode(&[]), Err(DecodeError::Empty));
        assert_eq!(decode(&[9, 0]), Err(DecodeError::UnknownVersion(9)));
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(decode(&trailing), Err(DecodeError::TrailingBytes(1)));
        for cut in 1..good.len() {
            assert!(decode(&good[..cut]).is_err(), "prefix {cut} decoded");
        }
        // The state discriminant is the first field: 9 is no state.
        assert!(matches!(decode(&[1, 9]), Err(DecodeError::Malformed(_))));
    }
}
