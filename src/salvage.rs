//! What a salvage of a damaged database file copied and what it could not
//! (see [`crate::Engine::salvage`]).

use std::fmt;

/// The result of [`crate::Engine::salvage`]: how much was copied into the
/// new file, and every key (or range of keys) that was not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SalvageReport {
    /// Records copied (idempotency records and inbox marks alike), their
    /// stored bytes unchanged.
    pub records: u64,
    /// Outbox messages copied.
    pub outbox_messages: u64,
    /// Entities copied.
    pub entities: u64,
    /// Journal frames beyond the last checkpoint whose changes were taken
    /// in (0 after a clean close).
    pub journal_frames: u64,
    /// Everything that could not be copied; empty when the new file holds
    /// everything the damaged one did.
    pub lost: Vec<Lost>,
}

impl SalvageReport {
    /// Whether everything was copied (nothing is in doubt).
    pub fn is_complete(&self) -> bool {
        self.lost.is_empty()
    }
}

/// One thing a salvage could not copy. Keys are the stored record key bytes
/// in lower-case hex (`[scope length][scope][key]`), as in
/// [`crate::Damage`]; `Display` shows `scope/key` where the bytes still are
/// one. Every listed key is in doubt: the new file has no record for it,
/// so resolve it with the provider before its work is retried.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lost {
    /// A record was found but not copied: its value fails its checksum or
    /// does not decode, it could not be read, or its state disagrees with
    /// the index entry that names it (it may be an older copy of the
    /// record, so it is not trusted). An index entry or journal frame that
    /// names a key whose record cannot be read is listed this way too.
    Record {
        /// The stored key bytes, in hex.
        key_hex: String,
        /// Why it was not copied.
        reason: String,
    },
    /// Part of a table's tree could not be walked: records (or entities)
    /// with keys strictly between `after_hex` and `before_hex` (`None`: the
    /// table's start or end) may exist and were not copied, except those
    /// found another way and not listed elsewhere. Their keys cannot be
    /// known.
    Range {
        /// `"records"`, `"entities"`, `"steps"` or `"history"`.
        table: &'static str,
        /// The last key read before the damage, in hex (`None`: from the
        /// start of the table).
        after_hex: Option<String>,
        /// The first key read after it, in hex (`None`: to the end).
        before_hex: Option<String>,
        /// What stopped the walk.
        reason: String,
    },
    /// An outbox message was not copied (it fails its checksum, or could
    /// not be read). `seq: None`: a stretch of the outbox could not be
    /// walked, and which messages it held cannot be known.
    OutboxMessage {
        /// Its sequence number, when known.
        seq: Option<u64>,
        /// Why it was not copied.
        reason: String,
    },
    /// An entity's state was not copied.
    Entity {
        /// The entity id.
        entity: String,
        /// Why it was not copied.
        reason: String,
    },
    /// The journal's frames beyond the last checkpoint could not be read:
    /// writes acknowledged after that checkpoint may be missing from the
    /// new file, and which keys they changed cannot be known.
    Journal {
        /// What is wrong with the journal (or with the meta values that
        /// name it).
        detail: String,
    },
    /// An effect step was not copied (it fails its checksum or does not
    /// decode). Resolve the key's step with its provider by hand.
    Step {
        /// The stored key bytes of its record, in hex.
        key_hex: String,
        /// The step name as stored.
        step: String,
        /// Why it was not copied.
        reason: String,
    },
    /// An entry of a key's evidence log was not copied.
    HistoryEntry {
        /// The stored key bytes of its record, in hex.
        key_hex: String,
        /// The entry's sequence number.
        seq: u32,
        /// Why it was not copied.
        reason: String,
    },
    /// A meta value could not be read; the new file uses the value the
    /// copied data allows (a fencing-token or outbox counter is set well
    /// past every value found, so none is handed out twice).
    MetaValue {
        /// The meta key.
        key: String,
        /// What is wrong, and what the new file holds instead.
        reason: String,
    },
}

impl fmt::Display for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = |hex: &Option<String>| {
            hex.as_deref()
                .map_or_else(|| "-".to_string(), crate::verify::shown)
        };
        match self {
            Lost::Record { key_hex, reason } => {
                write!(
                    f,
                    "record {} not copied: {reason}",
                    crate::verify::shown(key_hex)
                )
            }
            Lost::Range {
                table,
                after_hex,
                before_hex,
                reason,
            } => write!(
                f,
                "{table} between {} and {} could not be walked ({reason}); keys there are unknown",
                shown(after_hex),
                shown(before_hex)
            ),
            Lost::OutboxMessage {
                seq: Some(seq),
                reason,
            } => write!(f, "outbox message #{seq} not copied: {reason}"),
            Lost::OutboxMessage { seq: None, reason } => {
                write!(f, "part of the outbox could not be walked: {reason}")
            }
            Lost::Entity { entity, reason } => {
                write!(f, "entity {entity:?} not copied: {reason}")
            }
            Lost::Step {
                key_hex,
                step,
                reason,
            } => write!(
                f,
                "effect step {step:?} of {} not copied: {reason}",
                crate::verify::shown(key_hex)
            ),
            Lost::HistoryEntry {
                key_hex,
                seq,
                reason,
            } => write!(
                f,
                "evidence log entry #{seq} of {} not copied: {reason}",
                crate::verify::shown(key_hex)
            ),
            Lost::Journal { detail } => write!(
                f,
                "the journal could not be read ({detail}); writes after the last checkpoint may be missing"
            ),
            Lost::MetaValue { key, reason } => write!(f, "meta value {key:?}: {reason}"),
        }
    }
}
