//! Format 3's expiry in key order: a sealed partition whose records have
//! had their TTL since its last claim is walked in slot-key order, a
//! bounded step at a time, and each expired record in it deleted or
//! tombstoned as the sweep does (`Ops::sweep_record`). Its leaves are then
//! read and rewritten in order, once, instead of in the random order the
//! expiry index lists them (BENCHMARKS.md, "One table, partition-prefixed
//! keys": a stepped range delete 2.4–3.4 µs a record against 44–85 µs
//! through the index). The partition is dropped with its last record
//! (`tables.rs`); what stays (UNKNOWN and PROCESSING records, tombstones,
//! a longer TTL) is left to the per-record sweep, which reaches it through
//! its index entry when due. Each partition is drained once per open.

use std::ops::Bound;

use redb::ReadableTable;

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::codec;
use crate::store::ops::{Ops, Swept};
use crate::store::record::RecordState;

use super::partition::slot;
use super::tables::{OpError, Tables};

impl Tables<'_> {
    /// Format 3: one drain step of at most `limit` records of the oldest
    /// due partition, into `counts` (`more` set when it has more to go).
    /// Format 2: nothing.
    pub(super) fn drain(&mut self, limit: usize, counts: &mut SweepCounts) -> Result<(), OpError> {
        let now = self.now;
        let Some((p, after)) = self
            .partitioned_catalog()
            .and_then(|c| c.drain_next(now, self.cfg.ttl_ms))
        else {
            return Ok(());
        };
        let mut batch: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        {
            let (lo, hi) = slot::range_of(p);
            let start = match &after {
                Some(a) => Bound::Excluded(a.as_slice()),
                None => Bound::Included(&lo[..]),
            };
            let end = match &hi {
                Some(h) => Bound::Excluded(&h[..]),
                None => Bound::Unbounded,
            };
            for entry in self.records.range::<&[u8]>((start, end))? {
                let (k, v) = entry?;
                batch.push((k.value().to_vec(), v.value().to_vec()));
                if batch.len() >= limit {
                    break;
                }
            }
        }
        let done = batch.len() < limit;
        let last = batch.last().map(|(k, _)| k.clone());
        for (stored, value) in batch {
            let Some((_, rkey)) = slot::split(&stored) else {
                continue;
            };
            let (Some(key), Ok(rec)) = (
                IdempotencyKey::from_record_key(rkey),
                codec::decode(rkey, &value),
            ) else {
                // Damage is `verify`'s to report, not the drain's to touch.
                continue;
            };
            let expired = matches!(
                rec.state,
                RecordState::Completed | RecordState::FinalFailure | RecordState::Tombstone
            ) && rec.expires_at_ms <= now;
            if !expired {
                continue;
            }
            match self.sweep_record(&key, &rec)? {
                Some(Swept::Deleted) => counts.deleted += 1,
                Some(Swept::Tombstoned) => counts.tombstoned += 1,
                Some(Swept::MovedToUnknown) | None => {}
            }
        }
        counts.more |= !done;
        if let Some(c) = self.partitioned_catalog_mut() {
            c.drain_step(p, if done { None } else { last });
        }
        Ok(())
    }
}
