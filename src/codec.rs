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
//! tuples; see `tables.rs`. All instants are milliseconds since the Unix epoch.
//!
//! A value that does not decode is reported with its key, never a panic; a
//! value with trailing bytes is corrupt too.

use serde::{Deserialize, Serialize};

use crate::entity::EntityState;
use crate::envelope::Envelope;
use crate::fingerprint::{Fingerprint, FINGERPRINT_ALGORITHM_VERSION};
use crate::outbox::OutboxEntry;
use crate::outcome::State;

/// The record format this build reads and writes.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// Record states as stored. Discriminants are part of the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DiskState {
    Processing = 0,
    Completed = 1,
    FailedFinal = 2,
    Unknown = 3,
    Tombstone = 4,
}

impl From<DiskState> for State {
    fn from(s: DiskState) -> State {
        match s {
            DiskState::Processing => State::Processing,
            DiskState::Completed => State::Completed,
            DiskState::FailedFinal => State::FailedFinal,
            DiskState::Unknown => State::Unknown,
            DiskState::Tombstone => State::Tombstone,
        }
    }
}

/// A stored response (version 1 of the envelope layout).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    pub(crate) schema_version: u32,
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    #[serde(with = "byte_buf")]
    pub(crate) body: Vec<u8>,
    pub(crate) resource: Option<String>,
}

/// `Vec<u8>` as a serde byte string. postcard writes exactly the bytes a
/// sequence of `u8` gets (varint length, then the raw bytes), so the format
/// is unchanged; but a byte string is copied in one go, where a sequence is
/// decoded one element at a time (that loop was the largest cost of a
/// replay, see BENCHMARKS.md).
mod byte_buf {
    use serde::de::{Deserializer, Error, SeqAccess, Visitor};
    use serde::Serializer;

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
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

impl StoredResponse {
    pub(crate) fn new(env: Envelope, resource: Option<String>) -> StoredResponse {
        StoredResponse {
            schema_version: env.schema_version,
            status: env.status,
            headers: env.headers,
            body: env.body,
            resource,
        }
    }

    pub(crate) fn envelope(&self) -> Envelope {
        Envelope {
            schema_version: self.schema_version,
            status: self.status,
            headers: self.headers.clone(),
            body: self.body.clone(),
        }
    }
}

/// One idempotency record, format version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) state: DiskState,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) fingerprint_version: u8,
    /// The fencing token of the claim that owns (or owned) the record.
    pub(crate) token: u64,
    /// Provider reference of that claim.
    pub(crate) reference: String,
    pub(crate) claimed_at_ms: u64,
    pub(crate) updated_at_ms: u64,
    /// PROCESSING: the lease runs out at this instant (stale from then on).
    /// UNKNOWN: the original lease end, from which a resolver may settle it.
    pub(crate) lease_until_ms: u64,
    /// COMPLETED / FAILED_FINAL: expires at this instant.
    /// TOMBSTONE: the tombstone runs out at this instant.
    /// 0 for PROCESSING and UNKNOWN, which never expire.
    pub(crate) expires_at_ms: u64,
    /// TOMBSTONE: when the original record expired.
    pub(crate) expired_at_ms: u64,
    /// UNKNOWN: when the record became UNKNOWN.
    pub(crate) unknown_since_ms: u64,
    /// UNKNOWN: resolver answers of "still unknown" so far.
    pub(crate) attempts: u32,
    /// UNKNOWN: why.
    pub(crate) reason: String,
    /// COMPLETED / FAILED_FINAL (TOMBSTONE drops it).
    pub(crate) response: Option<StoredResponse>,
}

impl Record {
    pub(crate) fn processing(
        fingerprint: Fingerprint,
        token: u64,
        reference: String,
        now_ms: u64,
        lease_until_ms: u64,
    ) -> Record {
        Record {
            state: DiskState::Processing,
            fingerprint: *fingerprint.as_bytes(),
            fingerprint_version: FINGERPRINT_ALGORITHM_VERSION,
            token,
            reference,
            claimed_at_ms: now_ms,
            updated_at_ms: now_ms,
            lease_until_ms,
            expires_at_ms: 0,
            expired_at_ms: 0,
            unknown_since_ms: 0,
            attempts: 0,
            reason: String::new(),
            response: None,
        }
    }

    /// Same fingerprint under the same algorithm version. A record written
    /// under another fingerprint version cannot be compared and counts as a
    /// mismatch (the safe answer: never a replay of a different request).
    pub(crate) fn fingerprint_matches(&self, fp: &Fingerprint) -> bool {
        self.fingerprint_version == FINGERPRINT_ALGORITHM_VERSION
            && &self.fingerprint == fp.as_bytes()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        let mut r = Record::processing(Fingerprint::from_bytes([7; 32]), 42, "ref".into(), 1, 2);
        r.state = DiskState::Completed;
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
