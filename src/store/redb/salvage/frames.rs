//! The journal's frames applied on top of what the walks read, values
//! checked, and the counters for the new file.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use crate::salvage::Lost;
use crate::store::codec;
use crate::store::record::hex;

use super::super::journal::{expand, salvage_frames, Change, Frame, IndexTable, JournalStorage};
use super::super::meta;
use super::gathered::{Entries, Gathered, IndexEntry, Reasons, StoredCounter};
use super::walk::{Gap, IndexGaps};

/// Added to a counter past every value found when its stored value is
/// unreadable: tokens or sequence numbers handed out for records that
/// were lost must not be handed out again.
pub(super) const COUNTER_MARGIN: u64 = 1 << 32;

/// What was read, while frames are applied and values checked.
pub(super) struct Work {
    pub(super) records: Entries,
    pub(super) index: BTreeSet<IndexEntry>,
    pub(super) outbox: BTreeMap<u64, Vec<u8>>,
    pub(super) entities: BTreeMap<String, Vec<u8>>,
    pub(super) unreadable: Reasons,
    pub(super) next_token: u64,
    pub(super) next_outbox: u64,
    /// Entities not copied: last written before an unreadable frame (LSN).
    pub(super) stale_entities: Vec<(String, u64)>,
    /// (Record key, step name) → encoded step.
    pub(super) steps: BTreeMap<(Vec<u8>, String), Vec<u8>>,
    /// (Record key, seq) → encoded log entry.
    pub(super) history: BTreeMap<(Vec<u8>, u32), Vec<u8>>,
}

/// Why a value last written before an unreadable frame is not copied.
pub(super) fn stale(lsn: u64) -> String {
    format!(
        "last written in journal frame {lsn}, before frames that could not be read: \
         its latest state may be in them"
    )
}

impl Work {
    /// Applies the frames' changes in order; then drops what was last
    /// written before `stale_before` (an unreadable frame).
    pub(super) fn apply(&mut self, frames: &[(u64, Frame)], stale_before: u64) {
        // Record keys and entities by the LSN of their last write found.
        let mut last_write: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
        let mut last_entity_write: BTreeMap<String, u64> = BTreeMap::new();
        for (lsn, frame) in frames {
            for logged in &frame.changes {
                // A derived change (format 3) stands for the plain changes
                // the live path made, which the record found under its key
                // tells; one that does not fit it leaves the key unknown.
                let plain = match logged.derived_key() {
                    Some(key) => match expand(logged, self.records.get(key).map(Vec::as_slice)) {
                        Ok(plain) => plain,
                        Err(e) => {
                            last_write.insert(key.clone(), *lsn);
                            self.records.remove(key);
                            self.unreadable.insert(key.clone(), e.to_string());
                            continue;
                        }
                    },
                    None => vec![logged.clone()],
                };
                for change in &plain {
                    self.apply_plain(change, *lsn, &mut last_write, &mut last_entity_write);
                }
            }
            self.next_token = self.next_token.max(frame.next_token);
            self.next_outbox = self.next_outbox.max(frame.next_outbox);
        }
        for (key, lsn) in last_write.into_iter().filter(|(_, l)| *l < stale_before) {
            self.records.remove(&key);
            self.unreadable.insert(key, stale(lsn));
        }
        for (id, lsn) in last_entity_write
            .into_iter()
            .filter(|(_, l)| *l < stale_before)
        {
            self.entities.remove(&id);
            self.stale_entities.push((id, lsn));
        }
    }

    /// Applies one plain change of frame `lsn`, noting the last write of
    /// each record key and entity.
    fn apply_plain(
        &mut self,
        change: &Change,
        lsn: u64,
        last_write: &mut BTreeMap<Vec<u8>, u64>,
        last_entity_write: &mut BTreeMap<String, u64>,
    ) {
        match change {
            Change::PutRecord { key, value } => {
                last_write.insert(key.clone(), lsn);
                self.unreadable.remove(key);
                self.records.insert(key.clone(), value.clone());
            }
            Change::DelRecord { key } => {
                last_write.insert(key.clone(), lsn);
                self.unreadable.remove(key);
                self.records.remove(key);
            }
            Change::PutIndex {
                index: which,
                at,
                key,
            } => {
                self.index.insert((index_name(*which), *at, key.clone()));
            }
            Change::DelIndex {
                index: which,
                at,
                key,
            } => {
                self.index.remove(&(index_name(*which), *at, key.clone()));
            }
            Change::PutOutbox { seq, value } => {
                self.outbox.insert(*seq, value.clone());
            }
            Change::DelOutbox { seq } => {
                self.outbox.remove(seq);
            }
            Change::PutEntity { id, value } => {
                last_entity_write.insert(id.clone(), lsn);
                self.entities.insert(id.clone(), value.clone());
            }
            Change::PutStep { key, name, value } => {
                self.steps
                    .insert((key.clone(), name.clone()), value.clone());
            }
            Change::DelStep { key, name } => {
                self.steps.remove(&(key.clone(), name.clone()));
            }
            Change::PutHistory { key, seq, value } => {
                self.history.insert((key.clone(), *seq), value.clone());
            }
            Change::DelHistory { key, seq } => {
                self.history.remove(&(key.clone(), *seq));
            }
            // Salvage keeps what requests and relays need; dead
            // letters (an operator's list) are not carried over.
            // Format 3: rows and filters are built anew for the new
            // file, never copied (`partitioned::known_partitions`
            // reads the partitions they name).
            Change::PutDeadLetter { .. }
            | Change::DelDeadLetter { .. }
            | Change::PutPartition { .. }
            | Change::DelPartition { .. }
            | Change::PutFilter { .. }
            | Change::DelFilter { .. }
            // A merge's copies are twins of their sources, and its
            // drops delete stale copies: the sources' records
            // (found by the walks or written by the frames) stand
            // for both (`partitioned::unslot` weighs a key found in
            // a source and in the merged partition).
            | Change::MergeCopy { .. }
            | Change::MergeDrop { .. }
            // Expanded before (`expand` gives plain changes only).
            | Change::PutNewRecord { .. }
            | Change::PutRecordDelta { .. }
            | Change::DelIndexedRecord { .. } => {}
        }
    }

    /// Moves into `g` each record that decodes and sits where its index
    /// entry says, with that entry; lists the others.
    pub(super) fn check_records(&mut self, index_gaps: &IndexGaps, g: &mut Gathered) {
        // Where the index tables put each key; and the tables holding an
        // entry whose key bytes are not a key at all (a damaged page read
        // as entries): their other entries may be missing unnoticed.
        let mut placed: BTreeMap<Vec<u8>, Vec<(&'static str, u64)>> = BTreeMap::new();
        let mut garbled = BTreeSet::new();
        for (name, at, key) in &self.index {
            placed.entry(key.clone()).or_default().push((name, *at));
            if crate::key::IdempotencyKey::from_record_key(key).is_none() {
                garbled.insert(*name);
            }
        }
        for (key, value) in std::mem::take(&mut self.records) {
            let rec = match codec::decode(&key, &value) {
                Ok(rec) => rec,
                Err(e) => {
                    self.unreadable.insert(key, format!("does not decode: {e}"));
                    continue;
                }
            };
            let (name, at) = rec.index();
            let entry = (name, at, key.clone());
            let unchecked = index_gaps.iter().any(|(which, gap)| {
                *which == name
                    && gap
                        .as_ref()
                        .is_some_and(|gap| gap.holds(&(at, key.clone())))
            });
            // An entry that puts the key elsewhere says the record may be
            // an older copy; no entry at all is trusted only where the
            // index could not be walked.
            let unchecked = unchecked || garbled.contains(name);
            let elsewhere = placed.contains_key(&key);
            if !self.index.contains(&entry) && (elsewhere || !unchecked) {
                let reason = if elsewhere {
                    format!(
                        "its state is not matched by the {name} index entry at {at} ms it needs \
                         (it may be an older copy of the record)"
                    )
                } else {
                    format!("no index entry names it (its state needs one in {name} at {at} ms)")
                };
                self.unreadable.insert(key, reason);
                continue;
            }
            self.next_token = self.next_token.max(rec.token.saturating_add(1));
            g.records.insert(key, value);
            // Only the entry each copied record needs (a stray one is not
            // copied).
            g.index.insert(entry);
        }
        for (name, at, key) in &self.index {
            if !g.records.contains_key(key) && !self.unreadable.contains_key(key) {
                self.unreadable.insert(
                    key.clone(),
                    format!("named by the {name} index entry at {at} ms, but no record was found"),
                );
            }
        }
        for (key, reason) in std::mem::take(&mut self.unreadable) {
            g.report.lost.push(Lost::Record {
                key_hex: hex(&key),
                reason,
            });
        }
    }

    /// Moves into `g` each outbox message and entity that decodes; lists
    /// the others and the stretches no walk passed.
    pub(super) fn check_rest(
        &mut self,
        outbox_gap: Option<Gap<u64>>,
        entities_gap: Option<Gap<String>>,
        g: &mut Gathered,
    ) {
        let lost = &mut g.report.lost;
        for (seq, value) in std::mem::take(&mut self.outbox) {
            match codec::decode_outbox(seq, &value) {
                Ok(_) => {
                    self.next_outbox = self.next_outbox.max(seq.saturating_add(1));
                    g.outbox.insert(seq, value);
                }
                Err(e) => lost.push(Lost::OutboxMessage {
                    seq: Some(seq),
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        if let Some(gap) = outbox_gap {
            let end = |s: Option<u64>| s.map_or_else(|| "the end".to_string(), |s| format!("#{s}"));
            lost.push(Lost::OutboxMessage {
                seq: None,
                reason: format!(
                    "messages between {} and {} ({})",
                    end(gap.after),
                    end(gap.before),
                    gap.reason
                ),
            });
        }
        for (id, value) in std::mem::take(&mut self.entities) {
            match codec::decode_entity(&id, &value) {
                Ok(_) => {
                    g.entities.insert(id, value);
                }
                Err(e) => lost.push(Lost::Entity {
                    entity: id,
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        for (id, lsn) in std::mem::take(&mut self.stale_entities) {
            lost.push(Lost::Entity {
                entity: id,
                reason: stale(lsn),
            });
        }
        if let Some(gap) = entities_gap {
            lost.push(Lost::Range {
                table: "entities",
                after_hex: gap.after.map(|k| hex(k.as_bytes())),
                before_hex: gap.before.map(|k| hex(k.as_bytes())),
                reason: gap.reason,
            });
        }
    }
}

impl Work {
    /// Moves into `g` each effect step and log entry that decodes under
    /// its key; lists the others and the stretches no walk passed.
    pub(super) fn check_steps(
        &mut self,
        steps_gap: Option<Gap<(Vec<u8>, String)>>,
        history_gap: Option<Gap<(Vec<u8>, u32)>>,
        g: &mut Gathered,
    ) {
        let lost = &mut g.report.lost;
        // A key's steps and log are copied only with its record: without
        // it nothing could settle them, and the key would look resumable.
        let orphan = "its record was not copied (listed above); it goes with it";
        for ((rkey, name), value) in std::mem::take(&mut self.steps) {
            match codec::decode_step(&rkey, &name, &value) {
                Ok(_) if !g.records.contains_key(&rkey) => lost.push(Lost::Step {
                    key_hex: hex(&rkey),
                    step: name,
                    reason: orphan.to_owned(),
                }),
                Ok(_) => {
                    g.steps.insert((rkey, name), value);
                }
                Err(e) => lost.push(Lost::Step {
                    key_hex: hex(&rkey),
                    step: name,
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        for ((rkey, seq), value) in std::mem::take(&mut self.history) {
            match codec::decode_history(&rkey, seq, &value) {
                Ok(_) if !g.records.contains_key(&rkey) => lost.push(Lost::HistoryEntry {
                    key_hex: hex(&rkey),
                    seq,
                    reason: orphan.to_owned(),
                }),
                Ok(_) => {
                    g.history.insert((rkey, seq), value);
                }
                Err(e) => lost.push(Lost::HistoryEntry {
                    key_hex: hex(&rkey),
                    seq,
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        if let Some(gap) = steps_gap {
            lost.push(Lost::Range {
                table: "steps",
                after_hex: gap.after.map(|(k, _)| hex(&k)),
                before_hex: gap.before.map(|(k, _)| hex(&k)),
                reason: gap.reason,
            });
        }
        if let Some(gap) = history_gap {
            lost.push(Lost::Range {
                table: "history",
                after_hex: gap.after.map(|(k, _)| hex(&k)),
                before_hex: gap.before.map(|(k, _)| hex(&k)),
                reason: gap.reason,
            });
        }
    }
}

/// The frames beyond the checkpoint in the journal beside `path` that
/// still check, read one by one (after the ordinary read refused the
/// journal), and what was missing.
pub(super) fn frames_one_by_one(
    path: &Path,
    stored: &meta::StoredJournal,
) -> (Vec<(u64, Frame)>, u64, String) {
    let journal = JournalStorage::path_of(path);
    let bytes = match std::fs::read(&journal) {
        Ok(bytes) => bytes,
        Err(e) => return (Vec::new(), 0, format!("it cannot be read: {e}")),
    };
    let name = journal.display().to_string();
    match salvage_frames(&name, &bytes, stored.id, stored.lsn) {
        Ok(found) => {
            let mut detail = format!(
                "read frame by frame instead: {} frames beyond the checkpoint (LSN {}) taken in",
                found.frames.len(),
                stored.lsn
            );
            if !found.anchored {
                detail.push_str("; the checkpoint's own frame is missing");
            }
            for (first, last) in &found.missing {
                // Writing to a String cannot fail.
                let _ = write!(
                    detail,
                    "; frames {first} to {last} are unreadable, and the keys they changed unknown"
                );
            }
            let last_missing = found.missing.last().map_or(0, |(_, last)| *last);
            (found.frames, last_missing, detail)
        }
        Err(e) => (
            Vec::new(),
            0,
            format!("it cannot be read frame by frame either: {e}"),
        ),
    }
}

/// The counter for the new file: at least the stored one and past every
/// value found; if the stored one is unreadable, well past them.
pub(super) fn settle_counter(
    lost: &mut Vec<Lost>,
    key: &str,
    stored: StoredCounter,
    found: u64,
) -> u64 {
    match stored {
        Ok(Some(stored)) => stored.max(found).max(1),
        Ok(_) => found.max(1),
        Err(e) => {
            let value = found.saturating_add(COUNTER_MARGIN);
            lost.push(Lost::MetaValue {
                key: key.to_string(),
                reason: format!("unreadable ({e}); set to {value}, past every value found"),
            });
            value
        }
    }
}

pub(super) fn index_name(which: IndexTable) -> &'static str {
    match which {
        IndexTable::Leases => "leases",
        IndexTable::Recovery => "recovery",
        IndexTable::Expiry => "expiry",
    }
}
