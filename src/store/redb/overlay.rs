//! What readers see of acknowledged writes that redb has not committed yet.
//!
//! With a journal, the writer keeps one redb write transaction open across
//! several group commits (see `writer.rs`): a group is durable once its
//! journal frame is synced, well before redb commits it. The syncer thread
//! puts each synced group's record and entity values here *before* it
//! answers the group's callers, and the writer empties the overlay right
//! after the redb commit that holds them. A point read looks here first,
//! then in redb's last commit, so it sees every write acknowledged before
//! it started and nothing that is not yet durable. Reads over whole tables
//! (lists, scans, counts) ask the writer to commit first instead (see
//! `RedbStore::commit_open`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::journal::Change;
use super::partition::slot;

/// One key's newest acknowledged value: `None` means deleted.
type Value = Option<Arc<[u8]>>;

/// The synced, not yet committed record and entity values.
#[derive(Default)]
pub(super) struct Overlay {
    inner: Mutex<Maps>,
    /// Whether acknowledged changes (of any table) wait for redb's commit;
    /// read without the lock on the hot path.
    held: AtomicBool,
    /// Format 3: record changes carry slot keys (`partition/slot.rs`),
    /// kept here under their record keys, which reads ask by.
    partitioned: bool,
}

#[derive(Default)]
struct Maps {
    /// Record key bytes → encoded record.
    records: HashMap<Vec<u8>, Value>,
    /// Entity id → encoded state.
    entities: HashMap<String, Value>,
}

/// What a point read found in the overlay.
pub(super) enum Seen {
    /// Not held here: read redb.
    Absent,
    /// Deleted by an acknowledged write.
    Deleted,
    /// The newest acknowledged value (still in its stored framing).
    Value(Arc<[u8]>),
}

impl From<Option<&Value>> for Seen {
    fn from(found: Option<&Value>) -> Seen {
        match found {
            None => Seen::Absent,
            Some(None) => Seen::Deleted,
            Some(Some(v)) => Seen::Value(v.clone()),
        }
    }
}

impl Overlay {
    /// The overlay of a format-3 file (module docs of `partition/slot.rs`).
    pub(super) fn partitioned() -> Overlay {
        Overlay {
            partitioned: true,
            ..Overlay::default()
        }
    }

    /// The record key of a record change's key.
    fn record_key(&self, key: Vec<u8>) -> Vec<u8> {
        if !self.partitioned {
            return key;
        }
        match slot::split(&key) {
            Some((_, rkey)) => rkey.to_vec(),
            None => key,
        }
    }

    /// Takes in one synced group's changes, in order (later ones win).
    /// Index and outbox changes are not kept, only noted: whole-table
    /// reads commit first.
    pub(super) fn apply(&self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let mut maps = self.inner.lock();
        for change in changes {
            match change {
                Change::PutRecord { key, value } | Change::PutNewRecord { key, value } => {
                    maps.records
                        .insert(self.record_key(key), Some(value.into()));
                }
                // The value the live write stored, kept beside its delta.
                Change::PutRecordDelta { key, live, .. } => {
                    maps.records
                        .insert(self.record_key(key), Some(live.0.into()));
                }
                Change::DelRecord { key } | Change::DelIndexedRecord { key } => {
                    maps.records.insert(self.record_key(key), None);
                }
                Change::PutEntity { id, value } => {
                    maps.entities.insert(id, Some(value.into()));
                }
                // Steps and log entries are read per key over a range:
                // such reads commit first, as whole-table reads do.
                Change::PutIndex { .. }
                | Change::DelIndex { .. }
                | Change::PutOutbox { .. }
                | Change::DelOutbox { .. }
                | Change::PutStep { .. }
                | Change::DelStep { .. }
                | Change::PutHistory { .. }
                | Change::DelHistory { .. }
                | Change::PutDeadLetter { .. }
                | Change::DelDeadLetter { .. }
                | Change::PutPartition { .. }
                | Change::DelPartition { .. }
                | Change::PutFilter { .. }
                | Change::DelFilter { .. }
                // A merge's copies and drops leave every record key's
                // value as it was.
                | Change::MergeCopy { .. }
                | Change::MergeDrop { .. } => {}
            }
        }
        // Index and outbox changes count too: whole-table reads must then
        // ask for a commit (see `held`).
        self.held.store(true, Ordering::Release);
    }

    /// Forgets everything: redb has committed it.
    pub(super) fn clear(&self) {
        let mut maps = self.inner.lock();
        maps.records.clear();
        maps.entities.clear();
        self.held.store(false, Ordering::Release);
    }

    /// Whether acknowledged changes of any table wait for redb's commit.
    pub(super) fn held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The record stored under `rkey`, if an uncommitted write set it.
    pub(super) fn record(&self, rkey: &[u8]) -> Seen {
        if !self.held.load(Ordering::Acquire) {
            return Seen::Absent;
        }
        Seen::from(self.inner.lock().records.get(rkey))
    }

    /// The state of `entity`, if an uncommitted write set it.
    pub(super) fn entity(&self, entity: &str) -> Seen {
        if !self.held.load(Ordering::Acquire) {
            return Seen::Absent;
        }
        Seen::from(self.inner.lock().entities.get(entity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(seen: Seen) -> Option<Option<Vec<u8>>> {
        match seen {
            Seen::Absent => None,
            Seen::Deleted => Some(None),
            Seen::Value(v) => Some(Some(v.to_vec())),
        }
    }

    #[test]
    fn the_last_change_of_a_key_wins_until_cleared() {
        let o = Overlay::default();
        assert!(value(o.record(b"k")).is_none());
        o.apply(vec![
            Change::PutRecord {
                key: b"k".to_vec(),
                value: vec![1],
            },
            Change::PutRecord {
                key: b"k".to_vec(),
                value: vec![2],
            },
        ]);
        assert_eq!(value(o.record(b"k")), Some(Some(vec![2])));
        o.apply(vec![Change::DelRecord { key: b"k".to_vec() }]);
        assert_eq!(value(o.record(b"k")), Some(None));
        o.apply(vec![Change::PutEntity {
            id: "e".into(),
            value: vec![3],
        }]);
        assert_eq!(value(o.entity("e")), Some(Some(vec![3])));
        o.clear();
        assert!(value(o.record(b"k")).is_none());
        assert!(value(o.entity("e")).is_none());
        assert!(!o.held());
    }

    /// Format 3's derived changes: a new record and a delta are seen as
    /// the values the live writes stored (a delta's kept beside it), a
    /// derived delete as deleted.
    #[test]
    fn derived_record_changes_are_seen_as_stored() {
        use super::super::journal::{RecordDelta, Unlogged};
        let o = Overlay::partitioned();
        let slot = slot::slot_key(1, b"k");
        o.apply(vec![Change::PutNewRecord {
            key: slot.clone(),
            value: vec![1],
        }]);
        assert_eq!(value(o.record(b"k")), Some(Some(vec![1])));
        o.apply(vec![Change::PutRecordDelta {
            key: slot.clone(),
            base: [0; 8],
            delta: RecordDelta::default(),
            live: Unlogged(vec![2]),
        }]);
        assert_eq!(value(o.record(b"k")), Some(Some(vec![2])));
        o.apply(vec![Change::DelIndexedRecord { key: slot }]);
        assert_eq!(value(o.record(b"k")), Some(None));
    }

    #[test]
    fn outbox_and_index_changes_count_as_held() {
        let o = Overlay::default();
        o.apply(Vec::new());
        assert!(!o.held(), "an empty group changes nothing");
        o.apply(vec![Change::DelOutbox { seq: 1 }]);
        assert!(o.held(), "a whole-table read must ask for a commit");
        assert!(value(o.record(b"k")).is_none());
        o.clear();
        assert!(!o.held());
    }
}
