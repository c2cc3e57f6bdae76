//! One bounded sweep step: stale PROCESSING records move to UNKNOWN,
//! expired records are deleted or tombstoned. UNKNOWN records are never
//! touched. Each step walks the index tables from the oldest entry, so it
//! costs O(due work), never a scan.

use redb::{ReadableTable, Table};

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::ops::{Ops, Swept};
use crate::store::record::RecordState;

use super::journal::IndexTable;
use super::partition::merge::MERGE_STEP_RECORDS;
use super::tables::{OpError, Tables};

impl Tables<'_> {
    /// Handles at most `limit` due entries of each index.
    pub(super) fn sweep(&mut self, limit: usize) -> Result<SweepCounts, OpError> {
        let now = self.now;
        let mut counts = SweepCounts::default();
        // Format 3: the oldest due partition in key order first
        // (`drain.rs`); the index below catches the rest.
        self.drain(limit, &mut counts)?;
        // Format 3: a step of the merge of closed partitions
        // (`merge_step.rs`).
        self.merge_step(MERGE_STEP_RECORDS, &mut counts)?;
        let upper = (now.saturating_add(1), &[][..]);
        // Stale PROCESSING → UNKNOWN. Lease ends are exclusive: a lease
        // ending at `now` has run out.
        let stale = first_keys(&self.leases, upper, limit)?;
        counts.more |= stale.len() == limit;
        for (at, rkey) in stale {
            let due = match (IdempotencyKey::from_record_key(&rkey), self.raw(&rkey)?) {
                (Some(key), Some(Ok(rec)))
                    if rec.state == RecordState::Processing && rec.lease_until_ms == at =>
                {
                    Some((key, rec))
                }
                _ => None,
            };
            match due {
                Some((key, rec)) => {
                    if self.sweep_record(&key, &rec)? == Some(Swept::MovedToUnknown) {
                        counts.moved_to_unknown += 1;
                    }
                }
                // An index entry that does not match its record: drop it so
                // the sweep cannot spin on it.
                None => {
                    self.del_index(IndexTable::Leases, at, &rkey)?;
                }
            }
        }
        let expired = first_keys(&self.expiry, upper, limit)?;
        counts.more |= expired.len() == limit;
        for (at, rkey) in expired {
            let due = match (IdempotencyKey::from_record_key(&rkey), self.raw(&rkey)?) {
                (Some(key), Some(Ok(rec)))
                    if rec.expires_at_ms == at
                        && !matches!(rec.state, RecordState::Processing | RecordState::Unknown) =>
                {
                    Some((key, rec))
                }
                _ => None,
            };
            let swept = match due {
                Some((key, rec)) => self.sweep_record(&key, &rec)?,
                None => None,
            };
            match swept {
                Some(Swept::Tombstoned) => counts.tombstoned += 1,
                Some(Swept::Deleted) => counts.deleted += 1,
                Some(Swept::MovedToUnknown) | None => {
                    self.del_index(IndexTable::Expiry, at, &rkey)?;
                }
            }
        }
        Ok(counts)
    }
}

/// Up to `limit` index entries below `upper`, oldest first.
fn first_keys(
    table: &Table<'_, (u64, &'static [u8]), ()>,
    upper: (u64, &[u8]),
    limit: usize,
) -> Result<Vec<(u64, Vec<u8>)>, redb::StorageError> {
    let mut out = Vec::new();
    for entry in table.range(..upper)?.take(limit) {
        let (k, _) = entry?;
        let (at, rkey) = k.value();
        out.push((at, rkey.to_vec()));
    }
    Ok(out)
}
