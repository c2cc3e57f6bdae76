//! Format 3: a merged record's twin in its dropping source, from the
//! merge's switch to the source's drop step (`merge_step.rs`).
//!
//! Until the switch the writer mirrors every write of a copied key to its
//! copy (`Catalog::mirror_of`). After it, the merged partition holds the
//! live copy and the sources wait to be dropped; the writer goes on
//! writing each change of a merged record to its twin in a dropping source
//! wherever the twin is still there (`Catalog::dropped_twins`), so that a
//! source record is, until its drop step, the byte-equal twin of the live
//! copy. A drop step can then tell damage from change: before it deletes
//! a source record, [`Tables::rescue_twins`] compares it with the live
//! copy and repairs a live record, step or log entry that is missing or
//! fails its checksum from its intact twin, instead of deleting the last
//! good copy.
//!
//! Store layer (layer 2).

use redb::ReadableTable;

use crate::store::codec;
use crate::store::record::hex;

use super::journal::Change;
use super::partition::slot;
use super::partition::{catalog, merge};
use super::tables::{OpError, Tables};

/// Records [`Tables::rescue_twins`] reads between looks at its time.
const READ_CHUNK: usize = 16;

impl Tables<'_> {
    /// The twins of slot key `slot` in dropping sources (none in format 2,
    /// outside a merged partition, or when nothing is dropping).
    fn twins_of(&self, slot: &[u8]) -> Vec<Vec<u8>> {
        self.partitioned_catalog()
            .map(|c| c.dropped_twins(slot))
            .unwrap_or_default()
    }

    /// Writes record `value` over each twin of `slot` that is present.
    pub(super) fn put_record_twins(
        &mut self,
        slot: &[u8],
        value: &[u8],
    ) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.records.get(twin.as_slice())?.is_none() {
                continue;
            }
            self.records.insert(twin.as_slice(), value)?;
            self.log_change(Change::PutRecord {
                key: twin,
                value: value.to_vec(),
            });
        }
        Ok(())
    }

    /// Deletes every twin of `slot`'s record.
    pub(super) fn del_record_twins(&mut self, slot: &[u8]) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.records.remove(twin.as_slice())?.is_some() {
                self.log_change(Change::DelRecord { key: twin });
            }
        }
        Ok(())
    }

    /// Writes step `name` of `slot` to each twin whose record is present.
    pub(super) fn put_step_twins(
        &mut self,
        slot: &[u8],
        name: &str,
        value: &[u8],
    ) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.records.get(twin.as_slice())?.is_none() {
                continue;
            }
            self.steps.insert((twin.as_slice(), name), value)?;
            self.log_change(Change::PutStep {
                key: twin,
                name: name.to_owned(),
                value: value.to_vec(),
            });
        }
        Ok(())
    }

    /// Deletes step `name` of every twin of `slot`.
    pub(super) fn del_step_twins(
        &mut self,
        slot: &[u8],
        name: &str,
    ) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.steps.remove((twin.as_slice(), name))?.is_some() {
                self.log_change(Change::DelStep {
                    key: twin,
                    name: name.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Writes log entry `seq` of `slot` to each twin whose record is
    /// present.
    pub(super) fn put_history_twins(
        &mut self,
        slot: &[u8],
        seq: u32,
        value: &[u8],
    ) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.records.get(twin.as_slice())?.is_none() {
                continue;
            }
            self.history.insert((twin.as_slice(), seq), value)?;
            self.log_change(Change::PutHistory {
                key: twin,
                seq,
                value: value.to_vec(),
            });
        }
        Ok(())
    }

    /// Deletes log entry `seq` of every twin of `slot`.
    pub(super) fn del_history_twins(
        &mut self,
        slot: &[u8],
        seq: u32,
    ) -> Result<(), redb::StorageError> {
        for twin in self.twins_of(slot) {
            if self.history.remove((twin.as_slice(), seq))?.is_some() {
                self.log_change(Change::DelHistory { key: twin, seq });
            }
        }
        Ok(())
    }

    /// Before a drop step deletes the first `limit` records of dropping
    /// partition `partition` (a merge's source): repairs each one's live
    /// copy from it where the live record, a step or a log entry is
    /// missing or fails its checksum while the twin's passes. A live
    /// record no partition holds any more is written back into the
    /// partition it was merged into (or, when that partition's filter does
    /// not answer for it, the hot partition). Each repair is logged with a
    /// warning: it is damage the merge would have made permanent. It stops
    /// early once `spent()` says its time is up (asked after each record).
    /// Returns how many of the first records it looked at: the drop step
    /// deletes no more than these. A dropping partition the engine built
    /// (a merge given up at open, `catalog::resume_merge`) is a copy, not
    /// a twin: nothing to look at, `limit` returned.
    ///
    /// # Errors
    ///
    /// The storage error of reading or writing the tables.
    pub(super) fn rescue_twins(
        &mut self,
        partition: u64,
        limit: usize,
        spent: &dyn Fn() -> bool,
    ) -> Result<usize, OpError> {
        if partition >= slot::BUILT_PARTITIONS {
            return Ok(limit);
        }
        let batch: Vec<(Vec<u8>, Vec<u8>)> = {
            let mut out = Vec::new();
            for entry in catalog::range(&self.records, partition)?.take(limit) {
                // Read no further than the time allows (asked every
                // `READ_CHUNK` records): a step cut short would otherwise
                // read `limit` records to look at a few, and its drop
                // delete no more than those.
                if out.len() >= merge::MIN_STEP_RECORDS && out.len() % READ_CHUNK == 0 && spent() {
                    break;
                }
                let (k, v) = entry?;
                out.push((k.value().to_vec(), v.value().to_vec()));
            }
            out
        };
        // A key a newer source holds too (damage) was copied from the
        // newest (`merge::copy_step`): only that one is the live copy's twin.
        let newer: Vec<u64> = self
            .partitioned_catalog()
            .map(catalog::Catalog::dropping_sources)
            .unwrap_or_default()
            .into_iter()
            .filter(|d| *d > partition)
            .collect();
        for (looked, (source, value)) in batch.into_iter().enumerate() {
            if looked >= merge::MIN_STEP_RECORDS && spent() {
                return Ok(looked);
            }
            let Some((_, rkey)) = slot::split(&source) else {
                continue;
            };
            let rkey = rkey.to_vec();
            let mut shadowed = false;
            for &d in &newer {
                shadowed |= self
                    .records
                    .get(slot::slot_key(d, &rkey).as_slice())?
                    .is_some();
            }
            if shadowed {
                continue;
            }
            let twin_ok = codec::decode(&rkey, &value).is_ok();
            let Some(p) = self.locate(&rkey)? else {
                if !twin_ok {
                    continue;
                }
                let live = self.write_back(&rkey, value)?;
                self.rescue_steps(&source, &live, &rkey)?;
                tracing::warn!(
                    key = %hex(&rkey),
                    partition,
                    "a merged record was missing from its merged partition: written back from its dropping source"
                );
                continue;
            };
            let live = slot::slot_key(p, &rkey);
            let mut fixed = false;
            let bad_live = match self.records.get(live.as_slice())? {
                Some(v) => {
                    v.value() != value.as_slice() && codec::decode(&rkey, v.value()).is_err()
                }
                None => false,
            };
            if bad_live && twin_ok {
                self.records.insert(live.as_slice(), value.as_slice())?;
                self.log_change(Change::PutRecord {
                    key: live.clone(),
                    value,
                });
                fixed = true;
            }
            fixed |= self.rescue_steps(&source, &live, &rkey)?;
            if fixed {
                tracing::warn!(
                    key = %hex(&rkey),
                    partition,
                    "a merged record's live copy was damaged: repaired from its dropping source"
                );
            }
        }
        Ok(limit)
    }

    /// Writes lost record `rkey` (`value`, from its twin) back where a
    /// lookup finds it, and returns its slot key: into the partition it
    /// was merged into, where its steps and log entries are, when that
    /// partition's filter answers for it there; else into the hot
    /// partition as a new key.
    fn write_back(&mut self, rkey: &[u8], value: Vec<u8>) -> Result<Vec<u8>, OpError> {
        if let Some(merged) = self
            .partitioned_catalog()
            .and_then(catalog::Catalog::newest_built)
        {
            let slot = slot::slot_key(merged, rkey);
            self.records.insert(slot.as_slice(), value.as_slice())?;
            self.forget_located();
            if self.locate(rkey)? == Some(merged) {
                self.log_change(Change::PutRecord {
                    key: slot.clone(),
                    value,
                });
                return Ok(slot);
            }
            self.records.remove(slot.as_slice())?;
            self.forget_located();
        }
        self.put_record(rkey, value)?;
        let (live, _) = self.slot_of(rkey)?;
        Ok(live.into_owned())
    }

    /// Repairs the steps and log entries of live slot `live` from those of
    /// its twin `source` (record key `rkey`): each one missing or failing
    /// its checksum while the twin's passes. Returns whether it wrote any.
    fn rescue_steps(&mut self, source: &[u8], live: &[u8], rkey: &[u8]) -> Result<bool, OpError> {
        let mut steps = Vec::new();
        for entry in self.steps.range((source, "")..)? {
            let (k, v) = entry?;
            let (at, name) = k.value();
            if at != source {
                break;
            }
            steps.push((name.to_owned(), v.value().to_vec()));
        }
        let mut fixed = false;
        for (name, value) in steps {
            if codec::decode_step(rkey, &name, &value).is_err() {
                continue;
            }
            let bad = match self.steps.get((live, name.as_str()))? {
                Some(v) => {
                    v.value() != value.as_slice()
                        && codec::decode_step(rkey, &name, v.value()).is_err()
                }
                None => true,
            };
            if bad {
                self.steps.insert((live, name.as_str()), value.as_slice())?;
                self.log_change(Change::PutStep {
                    key: live.to_vec(),
                    name,
                    value,
                });
                fixed = true;
            }
        }
        let mut log = Vec::new();
        for entry in self.history.range((source, 0)..=(source, u32::MAX))? {
            let (k, v) = entry?;
            log.push((k.value().1, v.value().to_vec()));
        }
        for (seq, value) in log {
            if codec::decode_history(rkey, seq, &value).is_err() {
                continue;
            }
            let bad = match self.history.get((live, seq))? {
                Some(v) => {
                    v.value() != value.as_slice()
                        && codec::decode_history(rkey, seq, v.value()).is_err()
                }
                None => true,
            };
            if bad {
                self.history.insert((live, seq), value.as_slice())?;
                self.log_change(Change::PutHistory {
                    key: live.to_vec(),
                    seq,
                    value,
                });
                fixed = true;
            }
        }
        Ok(fixed)
    }
}
