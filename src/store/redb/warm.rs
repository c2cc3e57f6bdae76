//! Reading the hot partition into redb's cache when a format-3 file opens.
//!
//! Every fresh key's `begin` looks the key up in the hot partition (the
//! sealed ones answer from their filters, in memory) and its claim
//! inserts it there. Right after an open the hot partition's pages are in
//! no cache: each of the first requests then reads one of its leaves from
//! the disk, about one 4 KiB page a request until every leaf was met once
//! (BENCHMARKS.md, "Every target row at one commit", run E: 5.1 KB read per
//! fresh key after a reopen at 1M and 10M records). Reading the partition
//! once, in key order, at open costs one sequential pass over at most
//! [`WARM_BYTES`] instead, whatever the number of records stored: the hot
//! partition holds at most a seal's worth of keys (`SealRule`).
//!
//! The newest pages of the three index tables (the lease, recovery and
//! expiry indexes, where every claim and completion adds an entry at a
//! time near now) are read the same way.
//!
//! Store layer (layer 2).

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::partition::catalog::RECORDS;
use super::partition::slot;
use super::tables::{EXPIRY, LEASES, RECOVERY};

/// The most bytes of records the warm-up reads: a hot partition sealed
/// by its key count holds about 15–20 MiB; this bounds the open's extra
/// work where a file holds a larger one (a partition sealed by a build
/// with a larger seal rule).
pub(super) const WARM_BYTES: u64 = 64 << 20;

/// What [`warm_hot_partition`] read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Warmed {
    /// Records of the hot partition read.
    pub(super) records: u64,
    /// Their bytes (key and value).
    pub(super) bytes: u64,
}

/// Reads the records of partition `hot` (the hot partition of the
/// format-3 file `db`), at most [`WARM_BYTES`] of them, and the last entry
/// of each index table, so that redb's cache holds their pages.
///
/// Best effort: a read that fails stops the warm-up and is not reported
/// here. The request that meets the same page reports it for its key, as
/// it would without a warm-up; an open is not refused for a page it does
/// not need yet.
pub(super) fn warm_hot_partition(db: &Database, hot: u64) -> Warmed {
    warm(db, hot, WARM_BYTES)
}

/// [`warm_hot_partition`], reading at most `max_bytes` of records (the
/// record that reaches it included).
fn warm(db: &Database, hot: u64, max_bytes: u64) -> Warmed {
    let mut warmed = Warmed::default();
    let Ok(txn) = db.begin_read() else {
        return warmed;
    };
    if let Ok(records) = txn.open_table(RECORDS) {
        let (lo, hi) = slot::range_of(hot);
        let range = match &hi {
            Some(hi) => records.range::<&[u8]>(lo.as_slice()..hi.as_slice()),
            None => records.range::<&[u8]>(lo.as_slice()..),
        };
        if let Ok(range) = range {
            for entry in range {
                let Ok((key, value)) = entry else { break };
                warmed.records += 1;
                warmed.bytes += (key.value().len() + value.value().len()) as u64;
                if warmed.bytes >= max_bytes {
                    break;
                }
            }
        }
    }
    for index in [LEASES, RECOVERY, EXPIRY] {
        last_entry(&txn, index);
    }
    warmed
}

/// Reads the last entry of `index`, if the table exists: the path to its
/// newest leaf.
fn last_entry(txn: &redb::ReadTransaction, index: TableDefinition<(u64, &[u8]), ()>) {
    if let Ok(table) = txn.open_table(index) {
        let _ = table.last();
    }
}

#[cfg(test)]
#[path = "warm_tests.rs"]
mod tests;
