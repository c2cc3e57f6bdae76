//! What a scrub of the database found (see [`crate::Engine::verify`]).

use std::fmt;

/// The result of [`crate::Engine::verify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// How many records were checked.
    pub records: u64,
    /// Everything found wrong; empty when the file is sound as far as the
    /// engine can check.
    pub damage: Vec<Damage>,
}

impl VerifyReport {
    /// Whether nothing was found wrong.
    pub fn is_sound(&self) -> bool {
        self.damage.is_empty()
    }
}

/// One piece of damage a scrub found ([`crate::Engine::verify`]). Keys are kept as the stored record key
/// bytes in lower-case hex (`[scope length][scope][key]`), since a damaged
/// key may not be a valid key any more; `Display` shows `scope/key` where
/// the bytes still are one.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Damage {
    /// A record's stored key bytes are not a valid scope and key.
    BadKey {
        /// The stored key bytes, in hex.
        key_hex: String,
    },
    /// A record's value does not decode, or fails its checksum: its bytes
    /// or its key bytes were damaged (the reason says which check failed).
    /// A request for its key gets an error naming the key
    /// ([`crate::Error::Corrupt`]), never a replay.
    Undecodable {
        /// The stored key bytes, in hex.
        key_hex: String,
        /// What the decoder found.
        reason: String,
    },
    /// An index entry (lease, recovery or expiry) names a record that does
    /// not exist, or that its state and instants put elsewhere. A record
    /// whose key bytes were damaged shows up this way: its index entry
    /// still names the old key.
    StrayIndexEntry {
        /// `"leases"`, `"recovery"` or `"expiry"`.
        index: &'static str,
        /// The entry's instant (ms since the Unix epoch).
        at_ms: u64,
        /// The record key it names, in hex.
        key_hex: String,
    },
    /// A record is missing from the index its state names: sweeps and the
    /// recovery queue would never find it.
    MissingIndexEntry {
        /// `"leases"`, `"recovery"` or `"expiry"`.
        index: &'static str,
        /// The instant the record expects (ms since the Unix epoch).
        at_ms: u64,
        /// The record's key, in hex.
        key_hex: String,
    },
    /// A record a walk of the records table meets is not found by a lookup
    /// of its key: a page of the table's tree is damaged, so a request for
    /// this key (and maybe for others near it) would find no record and
    /// run the work again. Restore the file from a backup.
    UnreachableRecord {
        /// The stored key bytes, in hex.
        key_hex: String,
    },
    /// An outbox message does not decode or fails its checksum.
    UndecodableOutboxMessage {
        /// Its sequence number.
        seq: u64,
        /// What the decoder found.
        reason: String,
    },
    /// An entity's state does not decode or fails its checksum.
    UndecodableEntity {
        /// The entity id.
        entity: String,
        /// What the decoder found.
        reason: String,
    },
    /// An entity a walk of the entities table meets is not found by a
    /// lookup of its id (a damaged page of the table's tree).
    UnreachableEntity {
        /// The entity id.
        entity: String,
    },
    /// A value of the meta table (redb: the format version, the next
    /// fencing token or outbox sequence number, the journal's id and
    /// position, the stored expiry settings) fails its checksum, has the
    /// wrong length for its key, or is missing where it must be; or the
    /// table holds a key the engine does not know (a damaged key). A
    /// writable open refuses such a file ([`crate::OpenError::Corrupt`]):
    /// restore it from a backup.
    BadMetaValue {
        /// The meta key, as stored.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// A record key for people: `scope/key` when its bytes still are a valid
/// key, else the hex as stored.
pub(crate) fn shown(key_hex: &str) -> String {
    let bytes: Option<Vec<u8>> = (0..key_hex.len())
        .step_by(2)
        .map(|i| {
            key_hex
                .get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
        })
        .collect();
    bytes
        .as_deref()
        .and_then(crate::key::IdempotencyKey::from_record_key)
        .map_or_else(|| key_hex.to_string(), |key| key.to_string())
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::BadKey { key_hex } => {
                write!(f, "record key {key_hex} is not a valid scope and key")
            }
            Damage::Undecodable { key_hex, reason } => {
                write!(f, "record {} does not decode: {reason}", shown(key_hex))
            }
            Damage::StrayIndexEntry {
                index,
                at_ms,
                key_hex,
            } => write!(
                f,
                "{index} index entry at {at_ms} ms names record {}, which is missing or belongs elsewhere",
                shown(key_hex)
            ),
            Damage::MissingIndexEntry {
                index,
                at_ms,
                key_hex,
            } => write!(
                f,
                "record {} is missing from the {index} index (expected at {at_ms} ms)",
                shown(key_hex)
            ),
            Damage::UnreachableRecord { key_hex } => write!(
                f,
                "record {} is stored but a lookup of its key does not find it (a damaged page of the records table)",
                shown(key_hex)
            ),
            Damage::UnreachableEntity { entity } => write!(
                f,
                "entity {entity:?} is stored but a lookup of its id does not find it (a damaged page of the entities table)"
            ),
            Damage::UndecodableOutboxMessage { seq, reason } => {
                write!(f, "outbox message #{seq} does not decode: {reason}")
            }
            Damage::UndecodableEntity { entity, reason } => {
                write!(f, "entity {entity:?} does not decode: {reason}")
            }
            Damage::BadMetaValue { key, reason } => {
                write!(f, "meta value {key:?} is damaged: {reason}")
            }
        }
    }
}
