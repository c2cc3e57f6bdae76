//! The on-disk value format: the only place that knows how stored values
//! are laid out in bytes. This comment is the format's specification.
//!
//! # Format 2 (written by this build)
//!
//! Every value in the `idempotency.records`, `idempotency.outbox` and
//! `idempotency.entities` tables (and the `record` column of PostgreSQL's
//! records table) is framed the same way:
//!
//! ```text
//! byte 0           format version (FORMAT_VERSION = 2)
//! bytes 1..n-8     postcard encoding of the value's wire struct
//!                  (`RecordWire`, `OutboxWire`, `EntityWire` in `wire.rs`,
//!                  the only types serialized here; field order is the
//!                  format; integers are varints, strings and byte strings
//!                  length-prefixed)
//! bytes n-8..n     checksum, u64 little-endian:
//!                  rapidhash_v3(bytes 0..n-8) with the secrets S and the seed
//!                  rapidhash_v3(domain tag ‖ key length as u64 LE ‖ key bytes)
//!                  with the secrets S, where S = RapidSecrets::seed(CHECKSUM_SEED)
//! ```
//!
//! rapidhash v3 is the portable, stable hash of the `rapidhash` crate
//! (`rapidhash::v3`, the C++ rapidhash V3 algorithm with the secrets
//! `RapidSecrets::seed(CHECKSUM_SEED)`); it passes `SMHasher`, so a damaged
//! value goes unnoticed with probability about 2^-64. It replaced BLAKE3
//! here before format 2 was released: a checksum only has to catch damage,
//! and BLAKE3 cost a fifth of a replay.
//!
//! The domain tag names the table (`b"idempotency.record\0"`,
//! `b"idempotency.outbox\0"`, `b"idempotency.entity\0"`), so a value copied
//! into another table does not verify. The key bytes are the value's key as
//! stored: the record key `[scope length: u8][scope][key]` (see
//! `key::record_key`, the same bytes on redb and PostgreSQL), the outbox
//! sequence number as u64 little-endian, the entity id's UTF-8 bytes. So a
//! value whose bytes changed, or that sits under key bytes it was not
//! written for (a damaged key), fails with [`DecodeError::ChecksumMismatch`]
//! before its fields are decoded.
//!
//! The checksum catches damage; it is not a signature (anyone who can
//! write the file can compute it).
//!
//! # Format 1 (read, never written)
//!
//! `[1][postcard T]`: the same postcard encoding, no checksum. Values of
//! format 1 still decode, for the migration of a format-1 redb file
//! (`redb/migrate.rs`), read-only views of such files, and PostgreSQL rows
//! written by a format-1 build. A format-2 value whose version byte flipped
//! to 1 does not pass for one: its checksum is 8 trailing bytes.
//!
//! # The meta table (redb)
//!
//! `idempotency.meta` maps a key name (UTF-8) to a small value; its keys
//! and their payloads are owned by `redb/meta.rs`. In format 2 every meta
//! value is framed like the values above, with the payload's bytes as they
//! are instead of postcard:
//!
//! ```text
//! byte 0           format version (2)
//! bytes 1..n-8     payload (by key, below)
//! bytes n-8..n     checksum, u64 little-endian, as above, with the domain
//!                  tag b"idempotency.meta\0" and the key name's UTF-8 bytes
//! ```
//!
//! | key | payload |
//! |---|---|
//! | `format_version` | empty: the value is `[2][checksum]` |
//! | `next_token`, `next_outbox_seq`, `journal_lsn`, `ttl_ms` | u64 LE |
//! | `expiry_policy` | `[0]` forget, or `[1]` then the tombstone time, u64 LE ms |
//! | `journal_id` | 16 bytes |
//! | `journal_clean` | `[1]` closed cleanly, `[0]` open (or crashed) |
//!
//! A value whose checksum, version byte or payload length is wrong is
//! damaged, and an error naming its key. `format_version`, `next_token`
//! and `next_outbox_seq` are always present in format 2; `journal_id`,
//! `journal_lsn` and `journal_clean` are present together or not at all,
//! and so are `ttl_ms` and `expiry_policy`: a missing one (a damaged key)
//! is damage too.
//!
//! **How an open learns the format.** The first byte of `format_version`
//! is the file's format in every format, so it is read before any other
//! value:
//!
//! - `[1]` (one byte): format 1. Meta values are the bare payloads, no
//!   version byte, no checksum.
//! - `[2][checksum]` whose checksum verifies: format 2.
//! - `[2]` alone: a pre-release build of format 2 (meta values without
//!   checksums, value checksums in BLAKE3, changed before release). Refused
//!   with its own error: this build cannot read its values. Unless another
//!   meta value verifies as format 2: then `format_version` was cut short,
//!   and that is damage.
//! - a 9-byte value whose checksum verifies once its first byte is set to
//!   2: a format-2 value with a damaged version byte (damage, not a newer
//!   format). Any other value starting with 1 or 2 is damage too.
//! - a value starting with any other byte: a format this build does not
//!   know (refused as such).
//!
//! # Around the values
//!
//! Keys of the records table are `[scope length: u8][scope][key]` (see
//! `IdempotencyKey::record_key`). Index tables hold `(instant ms, record
//! key)` tuples; see `redb/tables.rs`. All instants are milliseconds since
//! the Unix epoch; all fixed-width integers are little-endian.
//!
//! A value that does not decode is reported with its key, never a panic; a
//! value with trailing bytes is corrupt too.

use serde::{Deserialize, Serialize};

use crate::message::OutboxEntry;

use super::record::{EntityState, Record};
use super::step::{HistoryRecord, StepRecord};
use super::wire::{DeadLetterWire, EntityWire, HistoryWire, OutboxWire, RecordWire, StepWire};
use crate::dead_letter::DeadLetter;

/// The format this build writes (and the newest it reads).
pub(crate) const FORMAT_VERSION: u8 = 2;

/// The format without checksums, still read.
pub(crate) const FORMAT_VERSION_1: u8 = 1;

/// The file format of partitioned records (redb's format 3,
/// docs/format3-plan.md). Its values are framed as format 2's (version
/// byte 2); only the meta value `format_version` says 3, as
/// [`format_3_marker`].
pub(crate) const FORMAT_VERSION_3: u8 = 3;

/// The meta value `format_version` of a format-3 file: `[3]` and the
/// checksum of that byte under the meta key (9 bytes). A format-2 build
/// reads it as a format it does not know (its first byte is 3, and put
/// back as 2 it does not verify), so it refuses the file, naming format 3,
/// instead of reading a file whose records it cannot find.
pub(crate) fn format_3_marker() -> Vec<u8> {
    let mut value = vec![FORMAT_VERSION_3];
    let sum = checksum(META_TAG, b"format_version", &value);
    value.extend_from_slice(&sum);
    value
}

/// Bytes of the checksum at the end of a format-2 value.
const CHECKSUM_BYTES: usize = 8;

/// The seed of the checksum's rapidhash secrets: part of the format.
const CHECKSUM_SEED: u64 = 0x6964_656d_706f_7465; // "idempote"

/// The checksum's rapidhash v3 secrets, derived at compile time.
const CHECKSUM_SECRETS: rapidhash::v3::RapidSecrets =
    rapidhash::v3::RapidSecrets::seed(CHECKSUM_SEED);

/// Domain tags: which table a checksummed value belongs to.
const RECORD_TAG: &[u8] = b"idempotency.record\0";
const OUTBOX_TAG: &[u8] = b"idempotency.outbox\0";
const ENTITY_TAG: &[u8] = b"idempotency.entity\0";
const META_TAG: &[u8] = b"idempotency.meta\0";
const STEP_TAG: &[u8] = b"idempotency.step\0";
const HISTORY_TAG: &[u8] = b"idempotency.history\0";
const DEAD_LETTER_TAG: &[u8] = b"idempotency.dead_letter\0";

/// Why a value failed to decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    Empty,
    UnknownVersion(u8),
    /// A format-2 value too short to hold its checksum.
    Truncated(usize),
    /// The stored checksum does not match the value and its key.
    ChecksumMismatch,
    Malformed(String),
    TrailingBytes(usize),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Empty => f.write_str("empty value"),
            DecodeError::UnknownVersion(v) => write!(
                f,
                "unknown record format version {v} (this build reads versions {FORMAT_VERSION_1} and {FORMAT_VERSION})"
            ),
            DecodeError::Truncated(n) => write!(
                f,
                "a format-{FORMAT_VERSION} value of {n} bytes is too short to hold its checksum"
            ),
            DecodeError::ChecksumMismatch => f.write_str(
                "the stored checksum does not match: the value or its key was damaged",
            ),
            DecodeError::Malformed(e) => write!(f, "malformed record: {e}"),
            DecodeError::TrailingBytes(n) => write!(f, "{n} trailing bytes after the record"),
        }
    }
}

/// A record stored under `rkey` (its record key, `key::record_key`).
pub(crate) fn encode(rkey: &[u8], record: &Record) -> Vec<u8> {
    encode_checked(RECORD_TAG, rkey, &RecordWire::from(record))
}

/// The record stored under `rkey`; the checksum is verified on `bytes` as
/// stored, before anything is decoded.
pub(crate) fn decode(rkey: &[u8], bytes: &[u8]) -> Result<Record, DecodeError> {
    decode_checked::<RecordWire>(RECORD_TAG, rkey, bytes).map(Record::from)
}

/// The outbox message with sequence number `seq`.
pub(crate) fn encode_outbox(seq: u64, entry: &OutboxEntry) -> Vec<u8> {
    encode_checked(OUTBOX_TAG, &seq.to_le_bytes(), &OutboxWire::from(entry))
}

/// The outbox message stored under sequence number `seq`.
pub(crate) fn decode_outbox(seq: u64, bytes: &[u8]) -> Result<OutboxEntry, DecodeError> {
    decode_checked::<OutboxWire>(OUTBOX_TAG, &seq.to_le_bytes(), bytes).map(OutboxEntry::from)
}

/// Dead letter `seq` (`idempotency.dead_letters`, redb; keyed like an
/// outbox message, by its sequence number as u64 LE, under its own tag).
pub(crate) fn encode_dead_letter(seq: u64, letter: &DeadLetter) -> Vec<u8> {
    encode_checked(
        DEAD_LETTER_TAG,
        &seq.to_le_bytes(),
        &DeadLetterWire::from(letter),
    )
}

/// The dead letter stored under sequence number `seq`.
pub(crate) fn decode_dead_letter(seq: u64, bytes: &[u8]) -> Result<DeadLetter, DecodeError> {
    decode_checked::<DeadLetterWire>(DEAD_LETTER_TAG, &seq.to_le_bytes(), bytes)
        .map(DeadLetter::from)
}

/// The state of entity `id`.
pub(crate) fn encode_entity(id: &str, entity: &EntityState) -> Vec<u8> {
    encode_checked(ENTITY_TAG, id.as_bytes(), &EntityWire::from(entity))
}

/// The entity state stored under `id`.
pub(crate) fn decode_entity(id: &str, bytes: &[u8]) -> Result<EntityState, DecodeError> {
    decode_checked::<EntityWire>(ENTITY_TAG, id.as_bytes(), bytes).map(EntityState::from)
}

/// The checksum's key bytes of step `name` of the record key `rkey`:
/// `[rkey length: u32 LE][rkey][name]` (the length keeps the split
/// between the two unambiguous).
fn step_key(rkey: &[u8], name: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(4 + rkey.len() + name.len());
    key.extend_from_slice(&u32::try_from(rkey.len()).unwrap_or(u32::MAX).to_le_bytes());
    key.extend_from_slice(rkey);
    key.extend_from_slice(name.as_bytes());
    key
}

/// The checksum's key bytes of entry `seq` of the log of `rkey`:
/// `[rkey][seq: u32 LE]`.
fn history_key(rkey: &[u8], seq: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(rkey.len() + 4);
    key.extend_from_slice(rkey);
    key.extend_from_slice(&seq.to_le_bytes());
    key
}

/// Effect step `step` of the record key `rkey`, stored under
/// `(rkey, step.name)`.
pub(crate) fn encode_step(rkey: &[u8], step: &StepRecord) -> Vec<u8> {
    encode_checked(STEP_TAG, &step_key(rkey, &step.name), &StepWire::from(step))
}

/// The step stored under `(rkey, name)`. Steps only exist in format 2: a
/// value of any other version is refused. A value whose name field is not
/// `name` is refused too (it cannot pass the checksum unless written so).
pub(crate) fn decode_step(
    rkey: &[u8],
    name: &str,
    bytes: &[u8],
) -> Result<StepRecord, DecodeError> {
    only_format_2(bytes)?;
    let step =
        decode_checked::<StepWire>(STEP_TAG, &step_key(rkey, name), bytes).map(StepRecord::from)?;
    if step.name != name {
        return Err(DecodeError::Malformed(format!(
            "the step stored under {name:?} names itself {:?}",
            step.name
        )));
    }
    Ok(step)
}

/// Entry `entry.seq` of the evidence log of `rkey`, stored under
/// `(rkey, entry.seq)`.
pub(crate) fn encode_history(rkey: &[u8], entry: &HistoryRecord) -> Vec<u8> {
    encode_checked(
        HISTORY_TAG,
        &history_key(rkey, entry.seq),
        &HistoryWire::from(entry),
    )
}

/// The log entry stored under `(rkey, seq)` (format 2 only).
pub(crate) fn decode_history(
    rkey: &[u8],
    seq: u32,
    bytes: &[u8],
) -> Result<HistoryRecord, DecodeError> {
    only_format_2(bytes)?;
    let entry = decode_checked::<HistoryWire>(HISTORY_TAG, &history_key(rkey, seq), bytes)
        .map(HistoryRecord::from)?;
    if entry.seq != seq {
        return Err(DecodeError::Malformed(format!(
            "the entry stored as #{seq} names itself #{}",
            entry.seq
        )));
    }
    Ok(entry)
}

/// Refuses a value whose version byte is not format 2's (tables added in
/// format 2 never held format 1).
fn only_format_2(bytes: &[u8]) -> Result<(), DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&FORMAT_VERSION) => Ok(()),
        Some(&v) => Err(DecodeError::UnknownVersion(v)),
    }
}

/// The meta value (format 2) with `payload` under the meta key `name`.
pub(crate) fn encode_meta(name: &str, payload: &[u8]) -> Vec<u8> {
    framed(META_TAG, name.as_bytes(), payload)
}

/// The payload of the format-2 meta value `bytes` stored under the meta
/// key `name`; the checksum is verified first. The payload's length is
/// the caller's to check (it depends on the key).
pub(crate) fn decode_meta<'b>(name: &str, bytes: &'b [u8]) -> Result<&'b [u8], DecodeError> {
    unframed(META_TAG, name.as_bytes(), bytes)
}

/// The payload of `bytes`, a value framed by [`framed`] for the table
/// `tag` names under `key`; the version byte and checksum are checked
/// first. The payload's length and fields are the caller's to check.
pub(crate) fn unframed<'b>(
    tag: &[u8],
    key: &[u8],
    bytes: &'b [u8],
) -> Result<&'b [u8], DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&FORMAT_VERSION) => {
            let (framed, stored) = split_checksum(bytes)?;
            if checksum(tag, key, framed) != stored {
                return Err(DecodeError::ChecksumMismatch);
            }
            Ok(&framed[1..])
        }
        Some(&v) => Err(DecodeError::UnknownVersion(v)),
    }
}

/// `payload` framed as a format-2 value of the table `tag` names under
/// `key`: `[2][payload][checksum]`. For the meta table and for fixed-width
/// values kept outside postcard (format 3's `partitions` rows,
/// `redb/partition/row.rs`, with the tag `b"idempotency.partition\0"`).
pub(crate) fn framed(tag: &[u8], key: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(1 + payload.len() + CHECKSUM_BYTES);
    value.push(FORMAT_VERSION);
    value.extend_from_slice(payload);
    let sum = checksum(tag, key, &value);
    value.extend_from_slice(&sum);
    value
}

/// A format-2 value split into `[version][body]` and its stored checksum.
fn split_checksum(bytes: &[u8]) -> Result<(&[u8], &[u8]), DecodeError> {
    let framed_len = bytes
        .len()
        .checked_sub(CHECKSUM_BYTES)
        .filter(|&n| n > 0)
        .ok_or(DecodeError::Truncated(bytes.len()))?;
    Ok(bytes.split_at(framed_len))
}

/// The checksum of the framed bytes `[version][postcard]` stored under
/// `key` in the table `tag` names.
fn checksum(tag: &[u8], key: &[u8], framed: &[u8]) -> [u8; CHECKSUM_BYTES] {
    // The short prefix through the streaming hasher, the value itself in
    // one bulk call (no copy into the stream's buffer).
    let mut h = rapidhash::v3::RapidStreamHasherV3::new(&CHECKSUM_SECRETS);
    h.write(tag);
    h.write(&u64::try_from(key.len()).unwrap_or(u64::MAX).to_le_bytes());
    h.write(key);
    let secrets = rapidhash::v3::RapidSecrets {
        seed: h.finish(),
        secrets: CHECKSUM_SECRETS.secrets,
    };
    rapidhash::v3::rapidhash_v3_seeded(framed, &secrets).to_le_bytes()
}

fn encode_checked<T: Serialize>(tag: &[u8], key: &[u8], value: &T) -> Vec<u8> {
    // postcard serializes these plain structs infallibly into a Vec; the
    // fallback (a bare version byte, which fails to decode) keeps the
    // function total without an unwrap.
    let Ok(mut out) = postcard::to_extend(value, vec![FORMAT_VERSION]) else {
        return vec![FORMAT_VERSION];
    };
    let sum = checksum(tag, key, &out);
    out.extend_from_slice(&sum);
    out
}

fn decode_checked<T: for<'de> Deserialize<'de>>(
    tag: &[u8],
    key: &[u8],
    bytes: &[u8],
) -> Result<T, DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&FORMAT_VERSION) => {
            let (framed, stored) = split_checksum(bytes)?;
            if checksum(tag, key, framed) != stored {
                return Err(DecodeError::ChecksumMismatch);
            }
            decode_postcard(&framed[1..])
        }
        Some(&FORMAT_VERSION_1) => decode_postcard(&bytes[1..]),
        Some(&v) => Err(DecodeError::UnknownVersion(v)),
    }
}

fn decode_postcard<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DecodeError> {
    let (value, tail): (T, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !tail.is_empty() {
        return Err(DecodeError::TrailingBytes(tail.len()));
    }
    Ok(value)
}

/// A value in format 1 (`[1][postcard T]`, no checksum), as a format-1
/// build wrote it: for tests of the legacy decode and the migration.
#[cfg(test)]
pub(crate) fn encode_v1<T: super::wire::ToWire>(value: &T) -> Vec<u8> {
    postcard::to_extend(&value.to_wire(), vec![FORMAT_VERSION_1]).unwrap_or_default()
}

/// The record key, outbox sequence number and entity id `decode_all`
/// checks values against.
#[cfg(any(test, fuzzing))]
pub(crate) const FUZZ_KEY: (&[u8], u64, &str) = (b"\x04fuzzkey", 0, "fuzz");

/// Feeds `bytes` to every decoder (record, outbox, entity, under
/// [`FUZZ_KEY`]); returns whether they decoded as a record. For the
/// `record_decode` fuzz target: no input may panic.
#[cfg(any(test, fuzzing))]
pub(crate) fn decode_all(bytes: &[u8]) -> bool {
    let (rkey, seq, id) = FUZZ_KEY;
    let _ = decode_outbox(seq, bytes);
    let _ = decode_entity(id, bytes);
    let _ = decode_meta("next_token", bytes);
    decode(rkey, bytes).is_ok()
}

/// Feeds the postcard `payload`, framed with a correct checksum for each
/// decoder (record, outbox, entity, meta under [`FUZZ_KEY`]), to every
/// decoder; returns whether it decoded as a record. Random bytes almost
/// never carry a matching checksum, so this is how mutations reach the
/// field decoders behind it.
#[cfg(any(test, fuzzing))]
pub(crate) fn decode_all_framed(payload: &[u8]) -> bool {
    let (rkey, seq, id) = FUZZ_KEY;
    let _ = decode_outbox(seq, &framed(OUTBOX_TAG, &seq.to_le_bytes(), payload));
    let _ = decode_entity(id, &framed(ENTITY_TAG, id.as_bytes(), payload));
    let _ = decode_meta("next_token", &encode_meta("next_token", payload));
    decode(rkey, &framed(RECORD_TAG, rkey, payload)).is_ok()
}

/// The `record_decode` fuzz target's input: byte 0 picks the mode, the
/// rest is the value. An even byte: the rest is a stored value as is
/// ([`decode_all`]: the framing, version byte and checksum are checked). An
/// odd byte: the rest is a postcard payload, framed with a correct
/// checksum first ([`decode_all_framed`]: the field decoders). Returns
/// whether it decoded as a record; an empty input decodes as nothing.
#[cfg(any(test, fuzzing))]
pub(crate) fn fuzz_decode(input: &[u8]) -> bool {
    match input.split_first() {
        None => false,
        Some((mode, value)) if mode.is_multiple_of(2) => decode_all(value),
        Some((_, payload)) => decode_all_framed(payload),
    }
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

    const RKEY: &[u8] = b"\x04shoppay-1";

    #[test]
    fn round_trips() {
        let r = sample();
        let bytes = encode(RKEY, &r);
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode(RKEY, &bytes), Ok(r));
        let entry = OutboxEntry {
            seq: 7,
            id: "shop/pay-1/0".into(),
            topic: "email".into(),
            payload: b"receipt".to_vec(),
            created_at_ms: 5,
        };
        assert_eq!(
            decode_outbox(7, &encode_outbox(7, &entry)),
            Ok(entry.clone())
        );
        let entity = EntityState {
            state: "paid".into(),
            version: 2,
            updated_at_ms: 9,
        };
        assert_eq!(
            decode_entity("order-1", &encode_entity("order-1", &entity)),
            Ok(entity)
        );
    }

    #[test]
    fn format_1_values_still_decode() {
        let r = sample();
        let v1 = encode_v1(&r);
        assert_eq!(v1[0], FORMAT_VERSION_1);
        // Format 2 is format 1 with a new version byte and a checksum.
        let v2 = encode(RKEY, &r);
        assert_eq!(&v2[1..v2.len() - CHECKSUM_BYTES], &v1[1..]);
        assert_eq!(decode(RKEY, &v1), Ok(r.clone()));
        // A format-1 value carries no checksum: any key reads it.
        assert_eq!(decode(b"\x01ab", &v1), Ok(r));
        // A format-2 value whose version byte says 1 is not one.
        let mut downgraded = v2.clone();
        downgraded[0] = FORMAT_VERSION_1;
        assert_eq!(
            decode(RKEY, &downgraded),
            Err(DecodeError::TrailingBytes(CHECKSUM_BYTES))
        );
    }

    #[test]
    fn a_value_under_other_key_bytes_or_in_another_table_fails_its_checksum() {
        let bytes = encode(RKEY, &sample());
        assert_eq!(
            decode(b"\x04shoppay-2", &bytes),
            Err(DecodeError::ChecksumMismatch)
        );
        // The length prefix separates scope from key in the hash too.
        assert_eq!(decode(b"", &bytes), Err(DecodeError::ChecksumMismatch));
        let entity = EntityState {
            state: "paid".into(),
            version: 2,
            updated_at_ms: 9,
        };
        let stored = encode_entity("order-1", &entity);
        assert_eq!(
            decode_entity("order-2", &stored),
            Err(DecodeError::ChecksumMismatch)
        );
        // The same bytes and key in another table.
        let as_record = encode_checked(RECORD_TAG, b"order-1", &EntityWire::from(&entity));
        assert_eq!(
            decode_entity("order-1", &as_record),
            Err(DecodeError::ChecksumMismatch)
        );
        let entry = OutboxEntry {
            seq: 1,
            id: "x".into(),
            topic: "t".into(),
            payload: vec![],
            created_at_ms: 0,
        };
        assert_eq!(
            decode_outbox(2, &encode_outbox(1, &entry)),
            Err(DecodeError::ChecksumMismatch)
        );
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let good = encode(RKEY, &sample());
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode(RKEY, &bad).is_err(),
                    "flip of bit {bit} of byte {i} decoded"
                );
            }
        }
        for i in 0..RKEY.len() {
            let mut key = RKEY.to_vec();
            key[i] ^= 0x20;
            assert_eq!(decode(&key, &good), Err(DecodeError::ChecksumMismatch));
        }
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        let good = encode(RKEY, &sample());
        assert_eq!(decode(RKEY, &[]), Err(DecodeError::Empty));
        assert_eq!(decode(RKEY, &[9, 0]), Err(DecodeError::UnknownVersion(9)));
        assert_eq!(decode(RKEY, &[2; 8]), Err(DecodeError::Truncated(8)));
        assert_eq!(
            decode(RKEY, &[FORMAT_VERSION]),
            Err(DecodeError::Truncated(1))
        );
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(decode(RKEY, &trailing), Err(DecodeError::ChecksumMismatch));
        for cut in 1..good.len() {
            assert!(decode(RKEY, &good[..cut]).is_err(), "prefix {cut} decoded");
        }
        // Format 1 has no checksum: its own checks still hold.
        let mut trailing = encode_v1(&sample());
        trailing.push(0);
        assert_eq!(decode(RKEY, &trailing), Err(DecodeError::TrailingBytes(1)));
        // The state discriminant is the first field: 9 is no state.
        assert!(matches!(
            decode(RKEY, &[1, 9]),
            Err(DecodeError::Malformed(_))
        ));
        // A well-framed format-2 value whose fields are garbage.
        let framed = [FORMAT_VERSION, 9];
        let mut bad = framed.to_vec();
        bad.extend_from_slice(&checksum(RECORD_TAG, RKEY, &framed));
        assert!(matches!(decode(RKEY, &bad), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn meta_values_round_trip_and_are_bound_to_their_key_and_table() {
        let v = encode_meta("next_token", &7_u64.to_le_bytes());
        assert_eq!(v.len(), 1 + 8 + CHECKSUM_BYTES);
        assert_eq!(v[0], FORMAT_VERSION);
        assert_eq!(decode_meta("next_token", &v), Ok(&7_u64.to_le_bytes()[..]));
        assert_eq!(
            decode_meta("next_outbox_seq", &v),
            Err(DecodeError::ChecksumMismatch)
        );
        for i in 0..v.len() {
            for bit in 0..8 {
                let mut bad = v.clone();
                bad[i] ^= 1 << bit;
                assert!(decode_meta("next_token", &bad).is_err(), "{i}/{bit}");
            }
        }
        // The same framing and key in another table does not verify.
        let as_entity = encode_checked(ENTITY_TAG, b"format_version", &());
        assert_eq!(as_entity.len(), 1 + CHECKSUM_BYTES);
        assert_eq!(
            decode_meta("format_version", &as_entity),
            Err(DecodeError::ChecksumMismatch)
        );
        assert_eq!(
            decode_meta("format_version", &encode_meta("format_version", &[])),
            Ok(&[][..])
        );
        assert_eq!(decode_meta("k", &[]), Err(DecodeError::Empty));
        assert_eq!(decode_meta("k", &[2]), Err(DecodeError::Truncated(1)));
        assert_eq!(
            decode_meta("k", &[1, 0]),
            Err(DecodeError::UnknownVersion(1))
        );
    }

    #[test]
    fn checksum_mismatch_says_what_it_means() {
        let text = DecodeError::ChecksumMismatch.to_string();
        assert!(text.contains("checksum does not match"), "{text}");
        assert!(text.contains("damaged"), "{text}");
    }
}
