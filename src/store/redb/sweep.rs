//! One bounded sweep step: stale PROCESSING records move to UNKNOWN,
//! expired records are deleted or tombstoned. UNKNOWN records are never
//! touched. Each step walks the index tables from the oldest entry, so it
//! costs O(due work), never a scan.

use redb::{ReadableTable, Table};

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::record::{hex, RecordState};

use super::tables::{OpError, Tables};

impl Tables<'_> {
    /// Handles at most `limit` due entries of each index.
    pub(super) fn sweep(&mut self, limit: usize) -> Result<SweepCounts, OpError> {
        let now = self.now;
        let mut counts = SweepCounts::default();
        let upper = (now.saturating_add(1), &[][..]);
        // Stale PROCESSING → UNKNOWN. Lease ends are exclusive: a lease
        // ending at `now` has run out.
        let stale = first_keys(&self.leases, upper, limit)?;
        counts.more |= stale.len() == limit;
        for (at, rkey) in stale {
            match self.get_raw(&rkey)? {
                Some(Ok(rec))
                    if rec.state == RecordState::Processing && rec.lease_until_ms <= now =>
                {
                    let key = IdempotencyKey::from_record_key(&rkey);
                    let shown = key.as_ref().map_or_else(|| hex(&rkey), ToString::to_string);
                    tracing::warn!(key = %shown, token = rec.token, "stale claim moved to UNKNOWN");
                    let new = rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, now);
                    self.put(&rkey, Some(&rec), &new)?;
                    counts.moved_to_unknown += 1;
                }
                // An index entry that does not match its record: drop it so
                // the sweep cannot spin on it.
                _ => {
                    self.leases.remove((at, rkey.as_slice()))?;
                }
            }
        }
        let expired = first_keys(&self.expiry, upper, limit)?;
        counts.more |= expired.len() == limit;
        for (at, rkey) in expired {
            match self.get_raw(&rkey)? {
                Some(Ok(rec)) if rec.expires_at_ms == at && rec.expires_at_ms <= now => {
                    let keep = match rec.state {
                        RecordState::Completed | RecordState::FinalFailure => self
                            .cfg
                            .expiry
                            .keep_ms()
                            .map(|keep_ms| rec.expires_at_ms.saturating_add(keep_ms))
                            .filter(|&until| until > now),
                        _ => None,
                    };
                    if let Some(until) = keep {
                        let new = rec.tombstone(until, now);
                        self.put(&rkey, Some(&rec), &new)?;
                        counts.tombstoned += 1;
                    } else {
                        self.delete(&rkey, &rec)?;
                        counts.deleted += 1;
                    }
                }
                _ => {
                    self.expiry.remove((at, rkey.as_slice()))?;
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
