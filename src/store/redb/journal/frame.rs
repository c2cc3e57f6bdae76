//! The frame: what one group commit changed, and how it sits on disk
//! (header, checksum, padding; see the layout in `mod.rs`).

use serde::{Deserialize, Serialize};

use super::delta::{RecordDelta, Unlogged};

/// Bytes of a frame before its payload.
pub(super) const FRAME_HEADER: usize = 32;
/// Fewest payload bytes of a frame the writer writes: a [`Frame`] in
/// postcard is its three fields, at least one byte each (two varints and
/// the varint length of `changes`).
pub(super) const MIN_PAYLOAD: u64 = 3;
/// Fewest bytes a frame the writer writes takes on disk (header, payload,
/// padding: 40), the anchor's size.
pub(super) const MIN_FRAME_BYTES: u64 = (FRAME_HEADER as u64 + MIN_PAYLOAD).div_ceil(8) * 8;
/// Largest payload a frame may claim (its length field is a u32); the
/// writer refuses a larger frame, so the reader never meets a valid one.
pub(super) const MAX_PAYLOAD: u64 = u32::MAX as u64;

/// One change to an engine table, as a frame records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::store::redb) enum Change {
    /// `idempotency.records`: record key → encoded record.
    PutRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    /// An index table (see [`IndexTable`]): `(instant ms, record key)`.
    PutIndex {
        index: IndexTable,
        at: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    DelIndex {
        index: IndexTable,
        at: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    /// `idempotency.outbox`: sequence number → encoded message.
    PutOutbox {
        seq: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelOutbox {
        seq: u64,
    },
    /// `idempotency.entities`: entity id → encoded state.
    PutEntity {
        id: String,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    // Added with effect steps: appended, so the variant indexes above (the
    // journal's format 2) never move.
    /// `idempotency.steps`: (record key, step name) → encoded step.
    PutStep {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        name: String,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelStep {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        name: String,
    },
    /// `idempotency.history`: (record key, seq) → encoded log entry.
    PutHistory {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        seq: u32,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelHistory {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        seq: u32,
    },
    // Added with dead letters: appended, as above.
    /// `idempotency.dead_letters`: sequence number → encoded dead letter.
    PutDeadLetter {
        seq: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelDeadLetter {
        seq: u64,
    },
    // Added with format 3's partitions: appended, as above. A format-3
    // file's record, step and log changes carry slot keys
    // (`partition/slot.rs`); a format-2 file never holds these four.
    /// `idempotency.partitions`: partition number → encoded row.
    PutPartition {
        partition: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelPartition {
        partition: u64,
    },
    /// `idempotency.filters`: partition number → stored filter.
    PutFilter {
        partition: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelFilter {
        partition: u64,
    },
    // Added with the merge of closed partitions: appended, as above.
    /// Format 3's merge (`partition/merge.rs`): `copied` records, each
    /// with its steps and log entries, copied from the merge sources (the
    /// partitions whose rows are merge sources) into partition `target`,
    /// the first `copied` in record-key order after record key `after`
    /// (`None`: from the first). Replayed by running the same copy, which
    /// finds the same records: the state a frame is applied to is the
    /// state it was written from.
    MergeCopy {
        target: u64,
        after: Option<Vec<u8>>,
        copied: u64,
    },
    /// Format 3's merge: a drop step of dropping partition `partition`
    /// (`partition/merge.rs`, `drop_step` with `limit`), which deleted
    /// `records` records, with their steps and log entries. Replayed by
    /// running the same step. Not written as record deletes: the record
    /// keys live on in the merged partition, and readers' overlay
    /// (`overlay.rs`) knows records by record key.
    MergeDrop {
        partition: u64,
        limit: u64,
        records: u64,
    },
    // Added with index entries derived at replay: appended, as above.
    // Written only to a format-3 file's journal (a format-2 file's keeps
    // the plain changes above, which a released build reads). Each stands
    // for a record write and the index changes it made, which replay
    // derives from the record stored under `key` before it
    // (`derived.rs`).
    /// A record stored under slot key `key`, where none was; its index
    /// entry added.
    PutNewRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    /// The record under slot key `key` rewritten: the fields that differ
    /// from the stored one (`delta.rs`); its index entry moved. `base`:
    /// the last 8 bytes of the stored value it changes (a format-2 value's
    /// checksum), so a delta is never applied to another value.
    PutRecordDelta {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        base: [u8; 8],
        delta: RecordDelta,
        /// The value the live write stored, for the overlay; not in the
        /// frame.
        #[serde(skip)]
        live: Unlogged,
    },
    /// The record under slot key `key` deleted, with its index entry.
    DelIndexedRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
}

impl Change {
    /// Bytes of the keys and values it carries (what makes a frame large).
    pub(in crate::store::redb) fn size_bytes(&self) -> usize {
        match self {
            Change::PutRecord { key, value }
            | Change::PutNewRecord { key, value }
            | Change::PutHistory { key, value, .. } => key.len().saturating_add(value.len()),
            Change::DelRecord { key }
            | Change::DelIndexedRecord { key }
            | Change::PutIndex { key, .. }
            | Change::DelIndex { key, .. }
            | Change::DelHistory { key, .. } => key.len(),
            Change::PutOutbox { value, .. }
            | Change::PutDeadLetter { value, .. }
            | Change::PutPartition { value, .. }
            | Change::PutFilter { value, .. } => value.len(),
            Change::DelOutbox { .. }
            | Change::DelDeadLetter { .. }
            | Change::DelPartition { .. }
            | Change::DelFilter { .. }
            | Change::MergeDrop { .. } => 0,
            Change::PutEntity { id, value } => id.len().saturating_add(value.len()),
            Change::PutStep { key, name, value } => key
                .len()
                .saturating_add(name.len())
                .saturating_add(value.len()),
            Change::DelStep { key, name } => key.len().saturating_add(name.len()),
            Change::MergeCopy { after, .. } => after.as_ref().map_or(0, Vec::len),
            Change::PutRecordDelta { key, delta, .. } => {
                key.len().saturating_add(delta.size_bytes())
            }
        }
    }
}

/// The three index tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::store::redb) enum IndexTable {
    Leases,
    Recovery,
    Expiry,
}

/// What one group commit changed: its changes in order, and the counters
/// after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::store::redb) struct Frame {
    pub(in crate::store::redb) next_token: u64,
    pub(in crate::store::redb) next_outbox: u64,
    pub(in crate::store::redb) changes: Vec<Change>,
}

/// Fills a frame's 32-byte header: payload length, `unsynced`, LSN and
/// checksum (module docs).
pub(super) fn write_header(head: &mut [u8], len: u32, unsynced: u32, lsn: u64, sum: &[u8; 16]) {
    head[0..4].copy_from_slice(&len.to_le_bytes());
    head[4..8].copy_from_slice(&unsynced.to_le_bytes());
    head[8..16].copy_from_slice(&lsn.to_le_bytes());
    head[16..32].copy_from_slice(sum);
}

/// A frame's size on disk: header, payload, padding to 8 bytes.
pub(super) fn frame_len(payload: u64) -> u64 {
    (FRAME_HEADER as u64 + payload).div_ceil(8) * 8
}

pub(super) fn checksum(id: &[u8; 16], lsn: u64, unsynced: u32, payload: &[u8]) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(id);
    h.update(&lsn.to_le_bytes());
    // Hashed only when set, so version 1 frames (always 0) check the same.
    if unsynced != 0 {
        h.update(&unsynced.to_le_bytes());
    }
    h.update(&(payload.len() as u64).to_le_bytes());
    h.update(payload);
    let mut out = [0_u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}
