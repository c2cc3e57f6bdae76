//! The wire structs of format 2: the only types the codec (`codec.rs`)
//! hands to postcard. Their field order, field types and variant order ARE
//! the on-disk format (postcard writes fields in declaration order, enum
//! variants by their position, integers as varints, strings and byte
//! strings length-prefixed), so they live here, private to the store, and
//! nowhere else carries `Serialize` for the disk: the store's own types
//! (`record.rs`) and the public [`OutboxEntry`] convert from and to them.
//! A public type can then change its fields, their order or its derives
//! without touching a byte on disk.
//!
//! Format 2 is released: never reorder, retype, add or remove a field
//! here. The golden tests (`codec_golden.rs`) fail if the bytes change; a
//! new layout is a new format version, with a fixture of the old one.
//!
//! Encoding borrows (the `Cow`s are borrowed from the value being
//! stored, so a large body is not copied to be written); decoding owns
//! (postcard hands every string and byte string over as a copy, moved
//! into the store's types without another).

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::dead_letter::DeadLetter;
use crate::message::OutboxEntry;

use super::record::{EntityState, Record, RecordState, StoredResponse};
use super::step::{Actor, HistoryRecord, StepRecord, StepStatus};

/// A record's state; variant order is the format (0 = PROCESSING …
/// 4 = TOMBSTONE).
#[derive(Clone, Copy, Serialize, Deserialize)]
pub(super) enum StateWire {
    Processing,
    Completed,
    FinalFailure,
    Unknown,
    Tombstone,
}

/// A record (`idempotency.records`, PostgreSQL's `record` column).
#[derive(Serialize, Deserialize)]
pub(super) struct RecordWire<'a> {
    state: StateWire,
    fingerprint: [u8; 32],
    fingerprint_version: u8,
    token: u64,
    reference: Cow<'a, str>,
    claimed_at_ms: u64,
    updated_at_ms: u64,
    lease_until_ms: u64,
    expires_at_ms: u64,
    expired_at_ms: u64,
    unknown_since_ms: u64,
    attempts: u32,
    reason: Cow<'a, str>,
    response: Option<ResponseWire<'a>>,
}

/// A stored response: the envelope and the resource, inside a record.
#[derive(Serialize, Deserialize)]
pub(super) struct ResponseWire<'a> {
    schema_version: u32,
    status: u16,
    /// Header values as sequences of bytes (the same bytes as a byte
    /// string in postcard).
    headers: Cow<'a, [(String, Vec<u8>)]>,
    #[serde(with = "cow_bytes")]
    body: Cow<'a, [u8]>,
    resource: Option<Cow<'a, str>>,
}

/// An outbox message (`idempotency.outbox`).
#[derive(Serialize, Deserialize)]
pub(super) struct OutboxWire<'a> {
    seq: u64,
    id: Cow<'a, str>,
    topic: Cow<'a, str>,
    #[serde(with = "cow_bytes")]
    payload: Cow<'a, [u8]>,
    created_at_ms: u64,
}

/// A dead letter (`idempotency.dead_letters`, redb only; created on first
/// use, after format 2 shipped: a new table, so no old value changes).
#[derive(Serialize, Deserialize)]
pub(super) struct DeadLetterWire<'a> {
    seq: u64,
    consumer: Cow<'a, str>,
    message_id: Cow<'a, str>,
    topic: Cow<'a, str>,
    #[serde(with = "cow_bytes")]
    payload: Cow<'a, [u8]>,
    attempts: u32,
    reason: Cow<'a, str>,
    dead_at_ms: u64,
}

impl<'a> From<&'a DeadLetter> for DeadLetterWire<'a> {
    fn from(d: &'a DeadLetter) -> DeadLetterWire<'a> {
        DeadLetterWire {
            seq: d.seq,
            consumer: Cow::Borrowed(&d.consumer),
            message_id: Cow::Borrowed(&d.message_id),
            topic: Cow::Borrowed(&d.topic),
            payload: Cow::Borrowed(&d.payload),
            attempts: d.attempts,
            reason: Cow::Borrowed(&d.reason),
            dead_at_ms: d.dead_at_ms,
        }
    }
}

impl From<DeadLetterWire<'_>> for DeadLetter {
    fn from(w: DeadLetterWire<'_>) -> DeadLetter {
        DeadLetter {
            seq: w.seq,
            consumer: w.consumer.into_owned(),
            message_id: w.message_id.into_owned(),
            topic: w.topic.into_owned(),
            payload: w.payload.into_owned(),
            attempts: w.attempts,
            reason: w.reason.into_owned(),
            dead_at_ms: w.dead_at_ms,
        }
    }
}

/// An entity's state (`idempotency.entities`).
#[derive(Serialize, Deserialize)]
pub(super) struct EntityWire<'a> {
    state: Cow<'a, str>,
    version: u64,
    updated_at_ms: u64,
}

/// An effect step's state; variant order is the format (0 = reserved …
/// 4 = not executed).
#[derive(Clone, Copy, Serialize, Deserialize)]
pub(super) enum StepStatusWire {
    Reserved,
    Confirmed,
    Failed,
    Unknown,
    NotExecuted,
}

/// An effect step (`idempotency.steps`, PostgreSQL's steps table), added
/// beside format 2 in tables created on first use.
#[derive(Serialize, Deserialize)]
pub(super) struct StepWire<'a> {
    name: Cow<'a, str>,
    reference: Cow<'a, str>,
    status: StepStatusWire,
    token: u64,
    #[serde(with = "cow_bytes")]
    evidence: Cow<'a, [u8]>,
    reserved_at_ms: u64,
    settled_at_ms: Option<u64>,
    attempts: u32,
    last_asked_ms: Option<u64>,
}

/// Who made a logged transition; variant order is the format.
#[derive(Serialize, Deserialize)]
pub(super) enum ActorWire<'a> {
    Claim { token: u64 },
    Resolver,
    Operator { reason: Cow<'a, str> },
    Sweeper,
}

/// An entry of a key's evidence log (`idempotency.history`, PostgreSQL's
/// history table).
#[derive(Serialize, Deserialize)]
pub(super) struct HistoryWire<'a> {
    seq: u32,
    at_ms: u64,
    actor: ActorWire<'a>,
    step: Option<Cow<'a, str>>,
    from: Cow<'a, str>,
    to: Cow<'a, str>,
    #[serde(with = "cow_bytes")]
    evidence: Cow<'a, [u8]>,
}

/// `Vec<u8>` as a serde byte string. postcard writes exactly the bytes a
/// sequence of `u8` gets (varint length, then the raw bytes), so the format
/// is unchanged; but a byte string is copied in one go, where a sequence is
/// decoded one element at a time (that loop was the largest cost of a
/// replay, see BENCHMARKS.md).
pub(crate) mod byte_buf {
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

/// `Cow<[u8]>` as a serde byte string (see [`byte_buf`]: the same
/// bytes as a sequence of `u8`, decoded in one copy).
mod cow_bytes {
    use std::borrow::Cow;

    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(super) fn deserialize<'de, 'a, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Cow<'a, [u8]>, D::Error> {
        super::byte_buf::deserialize(d).map(Cow::Owned)
    }
}

impl From<RecordState> for StateWire {
    fn from(s: RecordState) -> StateWire {
        match s {
            RecordState::Processing => StateWire::Processing,
            RecordState::Completed => StateWire::Completed,
            RecordState::FinalFailure => StateWire::FinalFailure,
            RecordState::Unknown => StateWire::Unknown,
            RecordState::Tombstone => StateWire::Tombstone,
        }
    }
}

impl From<StateWire> for RecordState {
    fn from(s: StateWire) -> RecordState {
        match s {
            StateWire::Processing => RecordState::Processing,
            StateWire::Completed => RecordState::Completed,
            StateWire::FinalFailure => RecordState::FinalFailure,
            StateWire::Unknown => RecordState::Unknown,
            StateWire::Tombstone => RecordState::Tombstone,
        }
    }
}

impl<'a> From<&'a Record> for RecordWire<'a> {
    fn from(r: &'a Record) -> RecordWire<'a> {
        RecordWire {
            state: r.state.into(),
            fingerprint: r.fingerprint,
            fingerprint_version: r.fingerprint_version,
            token: r.token,
            reference: Cow::Borrowed(&r.reference),
            claimed_at_ms: r.claimed_at_ms,
            updated_at_ms: r.updated_at_ms,
            lease_until_ms: r.lease_until_ms,
            expires_at_ms: r.expires_at_ms,
            expired_at_ms: r.expired_at_ms,
            unknown_since_ms: r.unknown_since_ms,
            attempts: r.attempts,
            reason: Cow::Borrowed(&r.reason),
            response: r.response.as_ref().map(ResponseWire::from),
        }
    }
}

impl From<RecordWire<'_>> for Record {
    fn from(w: RecordWire<'_>) -> Record {
        Record {
            state: w.state.into(),
            fingerprint: w.fingerprint,
            fingerprint_version: w.fingerprint_version,
            token: w.token,
            reference: w.reference.into_owned(),
            claimed_at_ms: w.claimed_at_ms,
            updated_at_ms: w.updated_at_ms,
            lease_until_ms: w.lease_until_ms,
            expires_at_ms: w.expires_at_ms,
            expired_at_ms: w.expired_at_ms,
            unknown_since_ms: w.unknown_since_ms,
            attempts: w.attempts,
            reason: w.reason.into_owned(),
            response: w.response.map(StoredResponse::from),
        }
    }
}

impl<'a> From<&'a StoredResponse> for ResponseWire<'a> {
    fn from(r: &'a StoredResponse) -> ResponseWire<'a> {
        ResponseWire {
            schema_version: r.schema_version,
            status: r.status,
            headers: Cow::Borrowed(&r.headers),
            body: Cow::Borrowed(&r.body),
            resource: r.resource.as_deref().map(Cow::Borrowed),
        }
    }
}

impl From<ResponseWire<'_>> for StoredResponse {
    fn from(w: ResponseWire<'_>) -> StoredResponse {
        StoredResponse {
            schema_version: w.schema_version,
            status: w.status,
            headers: w.headers.into_owned(),
            body: w.body.into_owned(),
            resource: w.resource.map(Cow::into_owned),
        }
    }
}

impl<'a> From<&'a OutboxEntry> for OutboxWire<'a> {
    fn from(e: &'a OutboxEntry) -> OutboxWire<'a> {
        OutboxWire {
            seq: e.seq,
            id: Cow::Borrowed(&e.id),
            topic: Cow::Borrowed(&e.topic),
            payload: Cow::Borrowed(&e.payload),
            created_at_ms: e.created_at_ms,
        }
    }
}

impl From<OutboxWire<'_>> for OutboxEntry {
    fn from(w: OutboxWire<'_>) -> OutboxEntry {
        OutboxEntry {
            seq: w.seq,
            id: w.id.into_owned(),
            topic: w.topic.into_owned(),
            payload: w.payload.into_owned(),
            created_at_ms: w.created_at_ms,
        }
    }
}

impl<'a> From<&'a EntityState> for EntityWire<'a> {
    fn from(e: &'a EntityState) -> EntityWire<'a> {
        EntityWire {
            state: Cow::Borrowed(&e.state),
            version: e.version,
            updated_at_ms: e.updated_at_ms,
        }
    }
}

impl From<EntityWire<'_>> for EntityState {
    fn from(w: EntityWire<'_>) -> EntityState {
        EntityState {
            state: w.state.into_owned(),
            version: w.version,
            updated_at_ms: w.updated_at_ms,
        }
    }
}

impl From<StepStatus> for StepStatusWire {
    fn from(s: StepStatus) -> StepStatusWire {
        match s {
            StepStatus::Reserved => StepStatusWire::Reserved,
            StepStatus::Confirmed => StepStatusWire::Confirmed,
            StepStatus::Failed => StepStatusWire::Failed,
            StepStatus::Unknown => StepStatusWire::Unknown,
            StepStatus::NotExecuted => StepStatusWire::NotExecuted,
        }
    }
}

impl From<StepStatusWire> for StepStatus {
    fn from(s: StepStatusWire) -> StepStatus {
        match s {
            StepStatusWire::Reserved => StepStatus::Reserved,
            StepStatusWire::Confirmed => StepStatus::Confirmed,
            StepStatusWire::Failed => StepStatus::Failed,
            StepStatusWire::Unknown => StepStatus::Unknown,
            StepStatusWire::NotExecuted => StepStatus::NotExecuted,
        }
    }
}

impl<'a> From<&'a StepRecord> for StepWire<'a> {
    fn from(s: &'a StepRecord) -> StepWire<'a> {
        StepWire {
            name: Cow::Borrowed(&s.name),
            reference: Cow::Borrowed(&s.reference),
            status: s.status.into(),
            token: s.token,
            evidence: Cow::Borrowed(&s.evidence),
            reserved_at_ms: s.reserved_at_ms,
            settled_at_ms: s.settled_at_ms,
            attempts: s.attempts,
            last_asked_ms: s.last_asked_ms,
        }
    }
}

impl From<StepWire<'_>> for StepRecord {
    fn from(w: StepWire<'_>) -> StepRecord {
        StepRecord {
            name: w.name.into_owned(),
            reference: w.reference.into_owned(),
            status: w.status.into(),
            token: w.token,
            evidence: w.evidence.into_owned(),
            reserved_at_ms: w.reserved_at_ms,
            settled_at_ms: w.settled_at_ms,
            attempts: w.attempts,
            last_asked_ms: w.last_asked_ms,
        }
    }
}

impl<'a> From<&'a Actor> for ActorWire<'a> {
    fn from(a: &'a Actor) -> ActorWire<'a> {
        match a {
            Actor::Claim { token } => ActorWire::Claim { token: *token },
            Actor::Resolver => ActorWire::Resolver,
            Actor::Operator { reason } => ActorWire::Operator {
                reason: Cow::Borrowed(reason),
            },
            Actor::Sweeper => ActorWire::Sweeper,
        }
    }
}

impl From<ActorWire<'_>> for Actor {
    fn from(w: ActorWire<'_>) -> Actor {
        match w {
            ActorWire::Claim { token } => Actor::Claim { token },
            ActorWire::Resolver => Actor::Resolver,
            ActorWire::Operator { reason } => Actor::Operator {
                reason: reason.into_owned(),
            },
            ActorWire::Sweeper => Actor::Sweeper,
        }
    }
}

impl<'a> From<&'a HistoryRecord> for HistoryWire<'a> {
    fn from(h: &'a HistoryRecord) -> HistoryWire<'a> {
        HistoryWire {
            seq: h.seq,
            at_ms: h.at_ms,
            actor: ActorWire::from(&h.actor),
            step: h.step.as_deref().map(Cow::Borrowed),
            from: Cow::Borrowed(&h.from),
            to: Cow::Borrowed(&h.to),
            evidence: Cow::Borrowed(&h.evidence),
        }
    }
}

impl From<HistoryWire<'_>> for HistoryRecord {
    fn from(w: HistoryWire<'_>) -> HistoryRecord {
        HistoryRecord {
            seq: w.seq,
            at_ms: w.at_ms,
            actor: w.actor.into(),
            step: w.step.map(Cow::into_owned),
            from: w.from.into_owned(),
            to: w.to.into_owned(),
            evidence: w.evidence.into_owned(),
        }
    }
}

/// A stored type and its wire struct: what `codec::encode_v1` (tests of
/// format 1) writes.
#[cfg(test)]
pub(crate) trait ToWire {
    fn to_wire(&self) -> impl Serialize + '_;
}

#[cfg(test)]
impl ToWire for Record {
    fn to_wire(&self) -> impl Serialize + '_ {
        RecordWire::from(self)
    }
}

#[cfg(test)]
impl ToWire for EntityState {
    fn to_wire(&self) -> impl Serialize + '_ {
        EntityWire::from(self)
    }
}

#[cfg(test)]
impl ToWire for OutboxEntry {
    fn to_wire(&self) -> impl Serialize + '_ {
        OutboxWire::from(self)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::byte_buf;

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
}
