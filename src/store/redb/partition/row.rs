//! Format 3's `idempotency.partitions` rows (docs/format3-plan.md,
//! "Tables"), one per partition of the slot-keyed tables (`slot.rs`).
//!
//! # The row (`idempotency.partitions`, key: the partition number, u64)
//!
//! Framed as every other value of the file (`store/codec.rs`:
//! `[version 2][payload][rapidhash checksum, 8 bytes]`), with the domain
//! tag `b"idempotency.partition\0"` and the partition number as u64 LE as
//! the checksum's key bytes, so a row copied under another partition or
//! into another table does not verify. The payload, fixed-width
//! ([`ROW_PAYLOAD_BYTES`]):
//!
//! ```text
//! byte 0        state: 0 hot, 1 sealed, 2 dropping, 3 merging,
//!               4 merge source
//! bytes 1..9    keys, u64 LE: record keys that entered the partition
//! bytes 9..17   first_claim_ms, u64 LE: the earliest claim among them
//! bytes 17..25  last_claim_ms, u64 LE: the latest (>= first_claim_ms)
//! bytes 25..33  max_expires_at_ms, u64 LE: the latest claim's instant
//!               (the engine drops a partition when its last record is
//!               deleted, not by this; kept for a bulk expiry)
//! bytes 33..65  the checksum of the partition's stored filter
//!               (`filter.rs`); 32 zero bytes: no stored filter
//! ```
//!
//! A hot partition has no stored filter (lookups always read its small
//! key range); a sealed one has one. The merge of closed partitions
//! (`partition/merge.rs`) adds three states: the partition it fills is
//! *merging* (no filter; lookups skip it: its records are copies), the
//! partitions it copies from are *merge sources* (sealed partitions still
//! read, with their filters), and once the merged partition is sealed its
//! sources are *dropping* (no filter; lookups skip them: their records are
//! stale copies, deleted in bounded steps, then the row). A row that
//! breaks those rules is damage. The hot row's `keys` and
//! `last_claim_ms` are as of its opening: the seal writes them.

use redb::TableDefinition;
use thiserror::Error;

use crate::store::codec::{self, DecodeError};

use super::filter::FilterChecksum;

/// The rows' table: partition number → row.
pub(crate) const PARTITIONS_TABLE: &str = "idempotency.partitions";
/// The filters' table: partition number → stored filter, written when
/// the partition is sealed.
pub(crate) const FILTERS_TABLE: &str = "idempotency.filters";
/// The checksum's domain tag of a row.
const ROW_TAG: &[u8] = b"idempotency.partition\0";
/// Bytes of a row's payload.
pub(crate) const ROW_PAYLOAD_BYTES: usize = 65;

/// Partition number → encoded row.
pub(crate) const PARTITIONS: TableDefinition<u64, &[u8]> = TableDefinition::new(PARTITIONS_TABLE);
/// Partition number → stored filter.
pub(crate) const FILTERS: TableDefinition<u64, &[u8]> = TableDefinition::new(FILTERS_TABLE);

/// Where a partition is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartitionState {
    /// The newest partition: claims insert new keys into it.
    Hot,
    /// No new key enters it; its filter is stored.
    Sealed,
    /// Its records were merged into another partition: being emptied and
    /// dropped; lookups skip it (its records are stale copies).
    Dropping,
    /// Being filled by the merge of the merge sources; lookups skip it
    /// (its records are copies of the sources').
    Merging,
    /// Sealed, and being copied into the merging partition; still read.
    MergeSource,
}

impl PartitionState {
    fn byte(self) -> u8 {
        match self {
            PartitionState::Hot => 0,
            PartitionState::Sealed => 1,
            PartitionState::Dropping => 2,
            PartitionState::Merging => 3,
            PartitionState::MergeSource => 4,
        }
    }

    fn from_byte(b: u8) -> Option<PartitionState> {
        match b {
            0 => Some(PartitionState::Hot),
            1 => Some(PartitionState::Sealed),
            2 => Some(PartitionState::Dropping),
            3 => Some(PartitionState::Merging),
            4 => Some(PartitionState::MergeSource),
            _ => None,
        }
    }
}

/// One partition's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartitionRow {
    /// Where the partition is in its life.
    pub(crate) state: PartitionState,
    /// Record keys that entered the partition.
    pub(crate) keys: u64,
    /// The earliest claim among them, ms since the Unix epoch.
    pub(crate) first_claim_ms: u64,
    /// The latest claim among them, ms since the Unix epoch.
    pub(crate) last_claim_ms: u64,
    /// When every record not pinned has expired, ms since the Unix epoch:
    /// the partition can be dropped from then on.
    pub(crate) max_expires_at_ms: u64,
    /// The checksum of the stored filter; `None` while hot.
    pub(crate) filter_checksum: Option<FilterChecksum>,
}

/// What is wrong with a row.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum RowProblem {
    /// The framing (version byte, checksum) failed.
    #[error("{0}")]
    Frame(DecodeError),
    /// The payload is not [`ROW_PAYLOAD_BYTES`] long.
    #[error("a payload of {0} bytes where a row has {ROW_PAYLOAD_BYTES}")]
    Length(usize),
    /// The state byte is none of 0, 1, 2.
    #[error("unknown state {0} (0 hot, 1 sealed, 2 dropping, 3 merging, 4 merge source)")]
    State(u8),
    /// The first claim is after the last.
    #[error("its first claim ({first_ms} ms) is after its last ({last_ms} ms)")]
    ClaimOrder {
        /// `first_claim_ms`.
        first_ms: u64,
        /// `last_claim_ms`.
        last_ms: u64,
    },
    /// A hot partition with a filter checksum.
    #[error("a hot partition with a filter checksum (its filter is only stored when sealed)")]
    HotWithFilter,
    /// A sealed partition (or a merge source) without one.
    #[error("a sealed partition without a filter checksum")]
    SealedWithoutFilter,
    /// A merging or dropping partition with one (lookups never read it).
    #[error("a merging or dropping partition with a filter checksum")]
    UnreadWithFilter,
    /// A transition its state does not allow.
    #[error("cannot {action} a {from:?} partition")]
    Transition {
        /// What was asked.
        action: &'static str,
        /// The state it was in.
        from: PartitionState,
    },
}

/// A row that does not decode, or a transition it does not allow: its
/// partition and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the row of partition {partition} in {PARTITIONS_TABLE}: {problem}")]
pub(crate) struct RowError {
    /// The partition number.
    pub(crate) partition: u64,
    /// What is wrong.
    pub(crate) problem: RowProblem,
}

impl PartitionRow {
    /// Whether lookups read the partition: hot, sealed or a merge source;
    /// never a merging (its records are copies) or dropping one (its
    /// records are stale copies).
    pub(crate) fn is_read(&self) -> bool {
        matches!(
            self.state,
            PartitionState::Hot | PartitionState::Sealed | PartitionState::MergeSource
        )
    }

    /// The row of a partition its first claim (at `claimed_at_ms`, its
    /// record expiring at `expires_at_ms`) creates: hot, one key.
    pub(crate) fn hot(claimed_at_ms: u64, expires_at_ms: u64) -> PartitionRow {
        PartitionRow {
            state: PartitionState::Hot,
            keys: 1,
            first_claim_ms: claimed_at_ms,
            last_claim_ms: claimed_at_ms,
            max_expires_at_ms: expires_at_ms,
            filter_checksum: None,
        }
    }

    /// Counts a new key claimed at `claimed_at_ms`, its record expiring at
    /// `expires_at_ms`. Claim times widen the range whatever their order
    /// (a clock may step back).
    pub(crate) fn claimed(&mut self, claimed_at_ms: u64, expires_at_ms: u64) {
        self.keys = self.keys.saturating_add(1);
        self.first_claim_ms = self.first_claim_ms.min(claimed_at_ms);
        self.last_claim_ms = self.last_claim_ms.max(claimed_at_ms);
        self.expires_by(expires_at_ms);
    }

    /// Notes a record of the partition now expiring at `expires_at_ms` (a
    /// completion or a tombstone moves it later).
    fn expires_by(&mut self, expires_at_ms: u64) {
        self.max_expires_at_ms = self.max_expires_at_ms.max(expires_at_ms);
    }

    /// Seals a hot partition whose stored filter has checksum `filter`.
    ///
    /// # Errors
    ///
    /// [`RowProblem::Transition`] (naming `partition`) unless it is hot.
    pub(crate) fn seal(&mut self, partition: u64, filter: FilterChecksum) -> Result<(), RowError> {
        if self.state != PartitionState::Hot {
            return Err(self.transition(partition, "seal"));
        }
        self.state = PartitionState::Sealed;
        self.filter_checksum = Some(filter);
        Ok(())
    }

    fn transition(&self, partition: u64, action: &'static str) -> RowError {
        RowError {
            partition,
            problem: RowProblem::Transition {
                action,
                from: self.state,
            },
        }
    }

    /// The stored row of partition `partition` (module docs).
    pub(crate) fn encode(&self, partition: u64) -> Vec<u8> {
        let mut payload = [0u8; ROW_PAYLOAD_BYTES];
        payload[0] = self.state.byte();
        payload[1..9].copy_from_slice(&self.keys.to_le_bytes());
        payload[9..17].copy_from_slice(&self.first_claim_ms.to_le_bytes());
        payload[17..25].copy_from_slice(&self.last_claim_ms.to_le_bytes());
        payload[25..33].copy_from_slice(&self.max_expires_at_ms.to_le_bytes());
        if let Some(FilterChecksum(sum)) = self.filter_checksum {
            payload[33..65].copy_from_slice(&sum);
        }
        codec::framed(ROW_TAG, &partition.to_le_bytes(), &payload)
    }

    /// The row stored as `bytes` under partition `partition`: framing and
    /// checksum first, then the payload's length and rules.
    ///
    /// # Errors
    ///
    /// A [`RowError`] naming `partition` and what is wrong. Never a
    /// panic, whatever `bytes` hold.
    pub(crate) fn decode(partition: u64, bytes: &[u8]) -> Result<PartitionRow, RowError> {
        let fail = |problem| RowError { partition, problem };
        let payload = codec::unframed(ROW_TAG, &partition.to_le_bytes(), bytes)
            .map_err(|e| fail(RowProblem::Frame(e)))?;
        let Ok(payload) = <&[u8; ROW_PAYLOAD_BYTES]>::try_from(payload) else {
            return Err(fail(RowProblem::Length(payload.len())));
        };
        let state = PartitionState::from_byte(payload[0])
            .ok_or_else(|| fail(RowProblem::State(payload[0])))?;
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&payload[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut sum = [0u8; 32];
        sum.copy_from_slice(&payload[33..65]);
        let row = PartitionRow {
            state,
            keys: u64_at(1),
            first_claim_ms: u64_at(9),
            last_claim_ms: u64_at(17),
            max_expires_at_ms: u64_at(25),
            filter_checksum: (sum != [0; 32]).then_some(FilterChecksum(sum)),
        };
        if row.first_claim_ms > row.last_claim_ms {
            return Err(fail(RowProblem::ClaimOrder {
                first_ms: row.first_claim_ms,
                last_ms: row.last_claim_ms,
            }));
        }
        match (row.state, row.filter_checksum) {
            (PartitionState::Hot, Some(_)) => Err(fail(RowProblem::HotWithFilter)),
            (PartitionState::Sealed | PartitionState::MergeSource, None) => {
                Err(fail(RowProblem::SealedWithoutFilter))
            }
            (PartitionState::Merging | PartitionState::Dropping, Some(_)) => {
                Err(fail(RowProblem::UnreadWithFilter))
            }
            _ => Ok(row),
        }
    }
}

#[cfg(test)]
#[path = "row_tests.rs"]
mod tests;

/// The `stored_structures` fuzz target's partition rows: `bytes` decoded as
/// the row of partition `partition`, as stored (`framed` false: framing and
/// checksum checked) or as a payload framed with a correct checksum first
/// (`framed` true: the payload's rules). A row that decodes encodes back
/// to the same bytes. Returns whether it decoded.
#[cfg(any(test, fuzzing))]
pub(crate) fn fuzz_decode(partition: u64, framed: bool, bytes: &[u8]) -> bool {
    let stored = if framed {
        codec::framed(ROW_TAG, &partition.to_le_bytes(), bytes)
    } else {
        bytes.to_vec()
    };
    match PartitionRow::decode(partition, &stored) {
        Ok(row) => {
            assert_eq!(
                row.encode(partition),
                stored,
                "a row that does not re-encode"
            );
            true
        }
        Err(_) => false,
    }
}
