//! The redb tables the engine owns, and the engine's view of them inside
//! one write transaction.
//!
//! Every engine table name starts with `idempotency.`; an app that keeps its
//! own tables in the same database file must use names without that prefix.
//!
//! Index tables let background passes cost O(work) instead of a scan:
//! each record is in exactly one index, chosen by its state:
//!
//! | state | index | entry |
//! |---|---|---|
//! | PROCESSING | `idempotency.leases` | `(lease_until_ms, record key)` |
//! | UNKNOWN | `idempotency.recovery` | `(unknown_since_ms, record key)` |
//! | COMPLETED, `FINAL_FAILURE`, TOMBSTONE | `idempotency.expiry` | `(expires_at_ms, record key)` |
//!
//! Effect steps and the evidence log live in two tables created on first
//! use (a format-2 file without them opens as it is): `idempotency.steps`
//! `(record key, step name)` → encoded step, `idempotency.history`
//! `(record key, seq)` → encoded log entry (`store/codec.rs`). Dead
//! letters too: `idempotency.dead_letters`, sequence number → encoded dead
//! letter, opened by the first write that gives a message up.

use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};

use crate::dead_letter::DeadLetter;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::message::{OutboxEntry, OutgoingMessage};
use crate::store::codec::{self, DecodeError};
use crate::store::config::StoreConfig;
use crate::store::ops::{Loaded, LoadedStep, Txn};
use crate::store::record::{EntityState, Record};
use crate::store::step::{HistoryRecord, StepRecord};

use super::journal::{base_sum, Change, IndexTable, RecordDelta, Unlogged};
use super::partition::catalog::{self, Catalog, CatalogChange, CatalogTables};
use super::partition::merge::MergeTables;
use super::partition::row::{FILTERS, PARTITIONS};
use super::partition::slot;

/// Format version, counters, the journal's position and the last app's
/// expiry settings: keys and values are `meta.rs`'s.
pub(super) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.meta");
/// Record key → encoded record (see `store/codec.rs`).
pub(super) const RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.records");
/// PROCESSING records by lease end.
pub(super) const LEASES: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.leases");
/// UNKNOWN records by the instant they became unknown: the recovery queue.
pub(super) const RECOVERY: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.recovery");
/// Records that expire, by expiry instant.
pub(super) const EXPIRY: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.expiry");
/// Unpublished outbox messages by sequence number (commit order).
pub(super) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
/// Business entity id → encoded state and version.
pub(super) const ENTITIES: TableDefinition<&str, &[u8]> =
    TableDefinition::new("idempotency.entities");
/// (Record key, step name) → encoded effect step; created on first use.
pub(super) const STEPS: TableDefinition<(&[u8], &str), &[u8]> =
    TableDefinition::new("idempotency.steps");
/// (Record key, seq) → encoded evidence log entry; created on first use.
pub(super) const HISTORY: TableDefinition<(&[u8], u32), &[u8]> =
    TableDefinition::new("idempotency.history");

/// Sequence number → encoded dead letter; created on first use (added
/// after format 2 shipped, as a new table: no old value changes).
pub(super) const DEAD_LETTERS: TableDefinition<u64, &[u8]> =
    TableDefinition::new("idempotency.dead_letters");

/// Adds what the engine was doing to a redb error.
pub(super) trait Context<T> {
    fn context(self, what: &'static str) -> Result<T>;
}

impl<T, E: Into<redb::Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &'static str) -> Result<T> {
        self.map_err(|e| Error::Storage {
            context: what,
            source: Box::new(e.into()),
        })
    }
}

/// An op failed: refused alone, or a redb error that sinks the batch.
pub(super) type OpError = crate::store::ops::OpError<redb::Error>;

impl<E: Into<redb::Error>> From<E> for OpError {
    fn from(e: E) -> OpError {
        OpError::Fatal(e.into())
    }
}

/// Counters the writer hands out, persisted in the meta table at each
/// commit that changes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sequences {
    /// Next fencing token (global, so tokens grow per key even across
    /// expiry and release).
    pub(super) token: u64,
    /// Next outbox sequence number.
    pub(super) outbox: u64,
}

/// The engine's tables inside one write transaction, plus the batch's
/// counters and clock reading.
pub(crate) struct Tables<'t> {
    pub(super) txn: &'t WriteTransaction,
    pub(super) records: Table<'t, &'static [u8], &'static [u8]>,
    pub(super) leases: Table<'t, (u64, &'static [u8]), ()>,
    pub(super) recovery: Table<'t, (u64, &'static [u8]), ()>,
    pub(super) expiry: Table<'t, (u64, &'static [u8]), ()>,
    pub(super) outbox: Table<'t, u64, &'static [u8]>,
    pub(super) entities: Table<'t, &'static str, &'static [u8]>,
    pub(super) steps: Table<'t, (&'static [u8], &'static str), &'static [u8]>,
    pub(super) history: Table<'t, (&'static [u8], u32), &'static [u8]>,
    pub(super) seq: Sequences,
    /// The batch's one reading of the clock, in ms.
    pub(super) now: u64,
    pub(super) cfg: StoreConfig,
    /// Every change made, in order, for the journal (`None`: not kept).
    pub(super) changes: Option<Vec<Change>>,
    /// Bytes of keys and values in `changes`.
    pub(super) changes_bytes: usize,
    /// Bytes a merge's copy steps wrote that their changes do not carry
    /// (`Journal::charge`).
    pub(super) merge_bytes: u64,
    /// Whether a client waits on the writer (a later job of the group, or
    /// one queued behind it): a merge step past its time
    /// (`merge::MERGE_STEP_TIME`) stops then, and goes on to its record
    /// bound while nobody waits (`None`: always stop in time).
    pub(super) clients_waiting: Option<&'t dyn Fn() -> bool>,
    /// Format 3: the partitions, and where the last key looked up lives
    /// (`None`: format 2, records keyed by their record key).
    partitioned: Option<Partitioned<'t>>,
}

/// Format 3's view inside [`Tables`]: the writer's catalog and the last
/// lookup's answer (a write of a key follows its read, so one entry saves
/// the second lookup).
struct Partitioned<'t> {
    catalog: &'t mut Catalog,
    /// Record key → the partition holding it (`None`: none does).
    last: Option<(Vec<u8>, Option<u64>)>,
    /// The last record deleted, and the partition it was in: its steps
    /// and log entries are still there, for the deletes that follow.
    gone: Option<(Vec<u8>, u64)>,
    /// Sealed partitions whose last record this transaction deleted, and
    /// whose row and filter it deleted too: the writer forgets them once
    /// the transaction is sure to stand ([`Tables::take_dropped`]).
    dropped: Vec<u64>,
}

impl<'t> Tables<'t> {
    /// The tables of a format-2 file.
    pub(super) fn open(
        txn: &'t WriteTransaction,
        seq: Sequences,
        now: u64,
        cfg: StoreConfig,
    ) -> std::result::Result<Tables<'t>, redb::Error> {
        Tables::open_as(txn, seq, now, cfg, None)
    }

    /// The tables of a format-3 file, whose partitions `catalog` knows.
    pub(super) fn open_partitioned(
        txn: &'t WriteTransaction,
        seq: Sequences,
        now: u64,
        cfg: StoreConfig,
        catalog: &'t mut Catalog,
    ) -> std::result::Result<Tables<'t>, redb::Error> {
        Tables::open_as(txn, seq, now, cfg, Some(catalog))
    }

    fn open_as(
        txn: &'t WriteTransaction,
        seq: Sequences,
        now: u64,
        cfg: StoreConfig,
        catalog: Option<&'t mut Catalog>,
    ) -> std::result::Result<Tables<'t>, redb::Error> {
        let partitioned = catalog.is_some();
        Ok(Tables {
            txn,
            records: txn.open_table(if partitioned {
                catalog::RECORDS
            } else {
                RECORDS
            })?,
            leases: txn.open_table(LEASES)?,
            recovery: txn.open_table(RECOVERY)?,
            expiry: txn.open_table(EXPIRY)?,
            outbox: txn.open_table(OUTBOX)?,
            entities: txn.open_table(ENTITIES)?,
            steps: txn.open_table(if partitioned { catalog::STEPS } else { STEPS })?,
            history: txn.open_table(if partitioned {
                catalog::HISTORY
            } else {
                HISTORY
            })?,
            seq,
            now,
            cfg,
            changes: None,
            changes_bytes: 0,
            merge_bytes: 0,
            clients_waiting: None,
            partitioned: catalog.map(|catalog| Partitioned {
                catalog,
                last: None,
                gone: None,
                dropped: Vec::new(),
            }),
        })
    }

    /// Format 3: seals the hot partition if it is due (its interval ran
    /// out or it holds its most keys) and opens the next; the writer calls
    /// it before a group's jobs. Format 2: nothing.
    pub(super) fn seal_if_due(&mut self) -> std::result::Result<(), redb::Error> {
        let now = self.now;
        let Some(part) = self.partitioned.as_mut() else {
            return Ok(());
        };
        if !part.catalog.due_to_seal(now) {
            return Ok(());
        }
        let mut rows = self.txn.open_table(PARTITIONS)?;
        let mut filters = self.txn.open_table(FILTERS)?;
        let mut changes = Vec::new();
        part.catalog
            .seal(
                &mut CatalogTables {
                    records: &self.records,
                    rows: &mut rows,
                    filters: &mut filters,
                },
                now,
                &mut changes,
            )
            .map_err(catalog_error)?;
        // A key looked up before the seal may now be in a sealed partition.
        part.last = None;
        for change in changes {
            self.log(|| Change::from(change));
        }
        Ok(())
    }

    /// The partition holding `rkey` (format 3), through the catalog's
    /// probes over this transaction's records table.
    pub(super) fn locate(
        &mut self,
        rkey: &[u8],
    ) -> std::result::Result<Option<u64>, redb::StorageError> {
        let Some(part) = self.partitioned.as_mut() else {
            return Ok(None);
        };
        if let Some((key, at)) = &part.last {
            if key.as_slice() == rkey {
                return Ok(*at);
            }
        }
        let records = &self.records;
        let found = part
            .catalog
            .probes()
            .locate(part.catalog.filters().hasher(), rkey, |p| {
                let slot = slot::slot_key(p, rkey);
                records.get(slot.as_slice()).map(|v| v.map(|_| ()))
            })?
            .map(|(p, ())| p);
        part.last = Some((rkey.to_vec(), found));
        Ok(found)
    }

    /// The key `rkey`'s record (and its steps and log) is stored under:
    /// `rkey` itself in format 2; in format 3 its slot key in the
    /// partition holding it, or in the hot partition for a key no
    /// partition holds (`new`: whether it was new, for the caller that
    /// inserts it).
    pub(super) fn slot_of<'k>(
        &mut self,
        rkey: &'k [u8],
    ) -> std::result::Result<(std::borrow::Cow<'k, [u8]>, bool), redb::StorageError> {
        if self.partitioned.is_none() {
            return Ok((std::borrow::Cow::Borrowed(rkey), false));
        }
        let found = self.locate(rkey)?;
        let Some(part) = self.partitioned.as_ref() else {
            return Ok((std::borrow::Cow::Borrowed(rkey), false));
        };
        let p = found.unwrap_or(part.catalog.hot().partition);
        Ok((
            std::borrow::Cow::Owned(slot::slot_key(p, rkey)),
            found.is_none(),
        ))
    }

    /// Keeps every change from now on, for the journal.
    pub(super) fn keep_changes(&mut self) {
        self.changes = Some(Vec::new());
    }

    fn log(&mut self, change: impl FnOnce() -> Change) {
        if let Some(changes) = &mut self.changes {
            let change = change();
            self.changes_bytes = self.changes_bytes.saturating_add(change.size_bytes());
            changes.push(change);
        }
    }

    fn index_table(&mut self, which: IndexTable) -> &mut Table<'t, (u64, &'static [u8]), ()> {
        match which {
            IndexTable::Leases => &mut self.leases,
            IndexTable::Recovery => &mut self.recovery,
            IndexTable::Expiry => &mut self.expiry,
        }
    }

    /// Adds an index entry; `logged`: as its own change (else the record
    /// change that follows stands for it, `journal/derived.rs`).
    fn put_index_as(
        &mut self,
        which: IndexTable,
        at: u64,
        rkey: &[u8],
        logged: bool,
    ) -> std::result::Result<(), redb::StorageError> {
        self.index_table(which).insert((at, rkey), ())?;
        if logged {
            self.log(|| Change::PutIndex {
                index: which,
                at,
                key: rkey.to_vec(),
            });
        }
        Ok(())
    }

    /// Removes an index entry, logged.
    pub(super) fn del_index(
        &mut self,
        which: IndexTable,
        at: u64,
        rkey: &[u8],
    ) -> std::result::Result<(), redb::StorageError> {
        self.del_index_as(which, at, rkey, true)
    }

    /// Removes an index entry; `logged` as in [`Self::put_index_as`].
    fn del_index_as(
        &mut self,
        which: IndexTable,
        at: u64,
        rkey: &[u8],
        logged: bool,
    ) -> std::result::Result<(), redb::StorageError> {
        self.index_table(which).remove((at, rkey))?;
        if logged {
            self.log(|| Change::DelIndex {
                index: which,
                at,
                key: rkey.to_vec(),
            });
        }
        Ok(())
    }

    /// Whether a write of record `rkey` over `old` may be logged as one
    /// change whose index entries replay derives (`journal/derived.rs`):
    /// in format 3, with changes kept, when the value stored under its
    /// slot is `old`'s encoding (none for `None`). Replay then finds that
    /// same value (a frame is applied to the state it was written from).
    /// Otherwise (format 2, whose journal keeps the changes a released
    /// build reads, or a caller's `old` that is not what is stored) the
    /// index changes are logged as they are made.
    fn derivable(
        &mut self,
        rkey: &[u8],
        old: Option<&Record>,
    ) -> std::result::Result<Derivable, redb::StorageError> {
        if self.changes.is_none() || self.partitioned.is_none() {
            return Ok(Derivable::No);
        }
        let (slot, _) = self.slot_of(rkey)?;
        let stored = self.records.get(&*slot)?;
        Ok(match (stored, old) {
            (None, None) => Derivable::New,
            (Some(v), Some(old)) if v.value() == codec::encode(rkey, old).as_slice() => {
                Derivable::Over(base_sum(v.value()))
            }
            _ => Derivable::No,
        })
    }

    /// Stores `value` under record key `rkey`, logged as it is.
    pub(super) fn put_record(
        &mut self,
        rkey: &[u8],
        value: Vec<u8>,
    ) -> std::result::Result<(), redb::StorageError> {
        self.put_record_as(rkey, value, Logged::Plain)
    }

    /// Stores `value` under record key `rkey` (and its merge copy and
    /// twins), logged as `logged` says.
    fn put_record_as(
        &mut self,
        rkey: &[u8],
        value: Vec<u8>,
        logged: Logged,
    ) -> std::result::Result<(), redb::StorageError> {
        let (slot, new) = self.slot_of(rkey)?;
        self.records.insert(&*slot, value.as_slice())?;
        if let Some(copy) = self.mirror_of(&slot) {
            self.records.insert(copy.as_slice(), value.as_slice())?;
            let value = value.clone();
            self.log(|| Change::PutRecord { key: copy, value });
        }
        if !new {
            self.put_record_twins(&slot, &value)?;
        }
        if let Some(part) = self.partitioned.as_mut() {
            if new {
                part.catalog.inserted_new_key(self.now);
                let p = part.catalog.hot().partition;
                part.last = Some((rkey.to_vec(), Some(p)));
            }
        }
        let key = slot.into_owned();
        self.log(|| match logged {
            Logged::Plain => Change::PutRecord { key, value },
            Logged::New => Change::PutNewRecord { key, value },
            Logged::Delta(base, delta) => Change::PutRecordDelta {
                key,
                base,
                delta,
                live: Unlogged(value),
            },
        });
        Ok(())
    }

    /// Deletes record `rkey` (and its merge copy and twins), logged as it
    /// is.
    fn del_record(&mut self, rkey: &[u8]) -> std::result::Result<(), redb::StorageError> {
        self.del_record_as(rkey, false)
    }

    /// Deletes record `rkey`; `derived`: logged as a delete whose index
    /// change replay derives (`Change::DelIndexedRecord`).
    fn del_record_as(
        &mut self,
        rkey: &[u8],
        derived: bool,
    ) -> std::result::Result<(), redb::StorageError> {
        let (slot, _) = self.slot_of(rkey)?;
        self.records.remove(&*slot)?;
        if let Some(copy) = self.mirror_of(&slot) {
            self.records.remove(copy.as_slice())?;
            self.log(|| Change::DelRecord { key: copy });
        }
        self.del_record_twins(&slot)?;
        if let Some(part) = self.partitioned.as_mut() {
            part.last = Some((rkey.to_vec(), None));
            if let Some((p, _)) = slot::split(&slot) {
                part.gone = Some((rkey.to_vec(), p));
            }
        }
        let key = slot.to_vec();
        self.log(|| {
            if derived {
                Change::DelIndexedRecord { key }
            } else {
                Change::DelRecord { key }
            }
        });
        self.drop_if_emptied(&slot)
    }

    /// Format 3: drops the sealed partition `slot` was in if that was its
    /// last record (its row and filter deleted, logged; the catalog told
    /// by the writer after the transaction, see [`Self::take_dropped`]).
    /// Records expire in about the order they were claimed, so partitions
    /// empty oldest first, one delete at a time: no scan is needed.
    fn drop_if_emptied(&mut self, slot: &[u8]) -> std::result::Result<(), redb::StorageError> {
        let Some(part) = self.partitioned.as_mut() else {
            return Ok(());
        };
        let Some((p, _)) = slot::split(slot) else {
            return Ok(());
        };
        if p == part.catalog.hot().partition
            || part.dropped.contains(&p)
            || part.catalog.held_by_merge(p)
        {
            return Ok(());
        }
        if catalog::range(&self.records, p)?.next().is_some() {
            return Ok(());
        }
        self.txn
            .open_table(PARTITIONS)
            .map_err(table_error)?
            .remove(p)?;
        self.txn
            .open_table(FILTERS)
            .map_err(table_error)?
            .remove(p)?;
        if let Some(part) = self.partitioned.as_mut() {
            part.dropped.push(p);
        }
        self.log(|| Change::DelPartition { partition: p });
        self.log(|| Change::DelFilter { partition: p });
        Ok(())
    }

    /// Where a write to slot key `slot` must be made again while a merge
    /// runs (`Catalog::mirror_of`); `None` in format 2 and otherwise.
    fn mirror_of(&self, slot: &[u8]) -> Option<Vec<u8>> {
        self.partitioned.as_ref()?.catalog.mirror_of(slot)
    }

    /// A step of the merge of closed partitions needs a lookup answered
    /// again: forgets the last key located.
    pub(super) fn forget_located(&mut self) {
        if let Some(part) = self.partitioned.as_mut() {
            part.last = None;
            part.gone = None;
        }
    }

    /// Format 3: the writer's catalog and the tables a merge step writes,
    /// borrowed together; `None` in format 2.
    pub(super) fn merge_parts(&mut self) -> Option<(&mut Catalog, MergeTables<'_, 't>)> {
        let part = self.partitioned.as_mut()?;
        Some((
            &mut *part.catalog,
            MergeTables {
                records: &mut self.records,
                steps: &mut self.steps,
                history: &mut self.history,
            },
        ))
    }

    /// Appends `change` to the journal's changes (a merge step's).
    pub(super) fn log_change(&mut self, change: Change) {
        self.log(|| change);
    }

    /// The writer's catalog (format 3).
    pub(super) fn partitioned_catalog(&self) -> Option<&Catalog> {
        self.partitioned.as_ref().map(|part| &*part.catalog)
    }

    /// The writer's catalog, to note a drain step (format 3).
    pub(super) fn partitioned_catalog_mut(&mut self) -> Option<&mut Catalog> {
        self.partitioned.as_mut().map(|part| &mut *part.catalog)
    }

    /// The partitions this transaction dropped (format 3): the writer
    /// forgets them in its catalog once the transaction will stand (a
    /// group's: at once, since a failed commit poisons the store and a
    /// reopen loads the catalog again; an isolated job's: after its
    /// commit, never after a rollback).
    pub(super) fn take_dropped(&mut self) -> Vec<u64> {
        self.partitioned
            .as_mut()
            .map(|part| std::mem::take(&mut part.dropped))
            .unwrap_or_default()
    }

    /// The key `rkey`'s steps and log entries are stored under: beside its
    /// record ([`Self::slot_of`]), or, for a key whose record this
    /// transaction just deleted, where that record was (the deletes of its
    /// steps and log follow the record's).
    fn steps_slot_of<'k>(
        &mut self,
        rkey: &'k [u8],
    ) -> std::result::Result<std::borrow::Cow<'k, [u8]>, redb::StorageError> {
        let (slot, new) = self.slot_of(rkey)?;
        if new {
            if let Some(Partitioned {
                gone: Some((key, p)),
                ..
            }) = &self.partitioned
            {
                if key.as_slice() == rkey {
                    return Ok(std::borrow::Cow::Owned(slot::slot_key(*p, rkey)));
                }
            }
        }
        Ok(slot)
    }

    pub(super) fn raw(
        &mut self,
        rkey: &[u8],
    ) -> std::result::Result<Option<std::result::Result<Record, DecodeError>>, redb::StorageError>
    {
        if self.partitioned.is_some() && self.locate(rkey)?.is_none() {
            return Ok(None);
        }
        let (slot, _) = self.slot_of(rkey)?;
        Ok(self
            .records
            .get(&*slot)?
            .map(|v| codec::decode(rkey, v.value())))
    }

    /// Writes `new` over `old`, moving the record between index tables.
    pub(super) fn put_raw(
        &mut self,
        rkey: &[u8],
        old: Option<&Record>,
        new: &Record,
    ) -> std::result::Result<(), redb::StorageError> {
        let derived = self.derivable(rkey, old)?;
        let plain = derived == Derivable::No;
        if let Some(old) = old {
            self.unindex(rkey, old, plain)?;
        }
        self.index(rkey, new, plain)?;
        let logged = match (derived, old) {
            (Derivable::New, None) => Logged::New,
            (Derivable::Over(base), Some(old)) => {
                Logged::Delta(base, RecordDelta::between(old, new))
            }
            _ => Logged::Plain,
        };
        self.put_record_as(rkey, codec::encode(rkey, new), logged)
    }

    /// Removes every index entry naming `rkey`, in any index.
    fn unindex_everywhere(&mut self, rkey: &[u8]) -> std::result::Result<(), redb::StorageError> {
        for which in [IndexTable::Leases, IndexTable::Recovery, IndexTable::Expiry] {
            let mut found = Vec::new();
            for entry in self.index_table(which).iter()? {
                let (k, _) = entry?;
                let (at, key) = k.value();
                if key == rkey {
                    found.push(at);
                }
            }
            for at in found {
                self.del_index(which, at, rkey)?;
            }
        }
        Ok(())
    }

    pub(super) fn delete_raw(
        &mut self,
        rkey: &[u8],
        old: &Record,
    ) -> std::result::Result<(), redb::StorageError> {
        let derived = self.derivable(rkey, Some(old))? != Derivable::No;
        self.unindex(rkey, old, !derived)?;
        self.del_record_as(rkey, derived)
    }

    /// Adds `rec`'s index entry; `logged` as in [`Self::put_index_as`].
    fn index(
        &mut self,
        rkey: &[u8],
        rec: &Record,
        logged: bool,
    ) -> std::result::Result<(), redb::StorageError> {
        let (which, at) = IndexTable::of(rec);
        self.put_index_as(which, at, rkey, logged)
    }

    /// Removes `rec`'s index entry; `logged` as in [`Self::put_index_as`].
    fn unindex(
        &mut self,
        rkey: &[u8],
        rec: &Record,
        logged: bool,
    ) -> std::result::Result<(), redb::StorageError> {
        let (which, at) = IndexTable::of(rec);
        self.del_index_as(which, at, rkey, logged)
    }
}

impl Txn for Tables<'_> {
    type Fatal = redb::Error;

    fn now(&self) -> u64 {
        self.now
    }

    fn cfg(&self) -> StoreConfig {
        self.cfg
    }

    fn load(&mut self, key: &IdempotencyKey) -> std::result::Result<Loaded<Record>, redb::Error> {
        Ok(self.raw(key.record_key())?)
    }

    fn store(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> std::result::Result<(), redb::Error> {
        Ok(self.put_raw(key.record_key(), old, new)?)
    }

    fn remove(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
    ) -> std::result::Result<(), redb::Error> {
        let rkey = key.record_key();
        if let Some(old) = old {
            self.delete_raw(rkey, old)?;
        } else {
            // A record that does not decode (a force purge) cannot say
            // where its index entry is: look for it. A full scan of the
            // three indexes, for an operator's rare repair; leaving the
            // entry would have `verify` report it until a sweep met it.
            self.unindex_everywhere(rkey)?;
            self.del_record(rkey)?;
        }
        Ok(())
    }

    fn next_token(&mut self) -> std::result::Result<u64, redb::Error> {
        let token = self.seq.token;
        self.seq.token += 1;
        Ok(token)
    }

    fn push_outbox(
        &mut self,
        id: String,
        message: OutgoingMessage,
    ) -> std::result::Result<(), redb::Error> {
        let entry = OutboxEntry {
            seq: self.seq.outbox,
            id,
            topic: message.topic,
            payload: message.payload,
            created_at_ms: self.now,
        };
        let value = codec::encode_outbox(entry.seq, &entry);
        self.outbox.insert(entry.seq, value.as_slice())?;
        self.log(|| Change::PutOutbox {
            seq: entry.seq,
            value,
        });
        self.seq.outbox += 1;
        Ok(())
    }

    fn remove_outbox(&mut self, seq: u64) -> std::result::Result<bool, redb::Error> {
        let removed = self.outbox.remove(seq)?.is_some();
        if removed {
            self.log(|| Change::DelOutbox { seq });
        }
        Ok(removed)
    }

    fn push_dead_letter(
        &mut self,
        mut letter: DeadLetter,
    ) -> std::result::Result<u64, redb::Error> {
        let mut table = self.txn.open_table(DEAD_LETTERS)?;
        let seq = table
            .last()?
            .map_or(1, |(k, _)| k.value().saturating_add(1));
        letter.seq = seq;
        letter.dead_at_ms = self.now;
        let value = codec::encode_dead_letter(seq, &letter);
        table.insert(seq, value.as_slice())?;
        drop(table);
        self.log(|| Change::PutDeadLetter { seq, value });
        Ok(seq)
    }

    fn load_dead_letter(
        &mut self,
        seq: u64,
    ) -> std::result::Result<Loaded<DeadLetter>, redb::Error> {
        let table = self.txn.open_table(DEAD_LETTERS)?;
        let loaded = table
            .get(seq)?
            .map(|v| codec::decode_dead_letter(seq, v.value()));
        Ok(loaded)
    }

    fn remove_dead_letter(&mut self, seq: u64) -> std::result::Result<(), redb::Error> {
        let removed = self.txn.open_table(DEAD_LETTERS)?.remove(seq)?.is_some();
        if removed {
            self.log(|| Change::DelDeadLetter { seq });
        }
        Ok(())
    }

    fn load_steps(
        &mut self,
        key: &IdempotencyKey,
    ) -> std::result::Result<Vec<LoadedStep>, redb::Error> {
        let rkey = key.record_key();
        let slot = self.steps_slot_of(rkey)?;
        let mut out = Vec::new();
        for entry in self.steps.range((&*slot, "")..)? {
            let (k, v) = entry?;
            let (at, name) = k.value();
            if at != &*slot {
                break;
            }
            out.push((name.to_owned(), codec::decode_step(rkey, name, v.value())));
        }
        Ok(out)
    }

    fn store_step(
        &mut self,
        key: &IdempotencyKey,
        step: &StepRecord,
    ) -> std::result::Result<(), redb::Error> {
        let rkey = key.record_key();
        let slot = self.steps_slot_of(rkey)?;
        let value = codec::encode_step(rkey, step);
        self.steps
            .insert((&*slot, step.name.as_str()), value.as_slice())?;
        if let Some(copy) = self.mirror_of(&slot) {
            self.steps
                .insert((copy.as_slice(), step.name.as_str()), value.as_slice())?;
            let (name, value) = (step.name.clone(), value.clone());
            self.log(|| Change::PutStep {
                key: copy,
                name,
                value,
            });
        }
        self.put_step_twins(&slot, &step.name, &value)?;
        self.log(|| Change::PutStep {
            key: slot.into_owned(),
            name: step.name.clone(),
            value,
        });
        Ok(())
    }

    fn remove_steps(&mut self, key: &IdempotencyKey) -> std::result::Result<(), redb::Error> {
        let rkey = key.record_key();
        let slot = self.steps_slot_of(rkey)?;
        let mut names = Vec::new();
        for entry in self.steps.range((&*slot, "")..)? {
            let (k, _) = entry?;
            let (at, name) = k.value();
            if at != &*slot {
                break;
            }
            names.push(name.to_owned());
        }
        let copy = self.mirror_of(&slot);
        for name in names {
            self.steps.remove((&*slot, name.as_str()))?;
            if let Some(copy) = &copy {
                self.steps.remove((copy.as_slice(), name.as_str()))?;
                let (key, name) = (copy.clone(), name.clone());
                self.log(|| Change::DelStep { key, name });
            }
            self.del_step_twins(&slot, &name)?;
            self.log(|| Change::DelStep {
                key: slot.to_vec(),
                name,
            });
        }
        Ok(())
    }

    fn history_span(
        &mut self,
        key: &IdempotencyKey,
    ) -> std::result::Result<Option<(u32, u32)>, redb::Error> {
        let slot = self.steps_slot_of(key.record_key())?;
        let mut range = self.history.range((&*slot, 0)..=(&*slot, u32::MAX))?;
        let first = match range.next() {
            Some(entry) => entry?.0.value().1,
            None => return Ok(None),
        };
        let last = match range.next_back() {
            Some(entry) => entry?.0.value().1,
            None => first,
        };
        Ok(Some((first, last)))
    }

    fn append_history(
        &mut self,
        key: &IdempotencyKey,
        entry: &HistoryRecord,
    ) -> std::result::Result<(), redb::Error> {
        let rkey = key.record_key();
        let slot = self.steps_slot_of(rkey)?;
        let value = codec::encode_history(rkey, entry);
        self.history.insert((&*slot, entry.seq), value.as_slice())?;
        if let Some(copy) = self.mirror_of(&slot) {
            self.history
                .insert((copy.as_slice(), entry.seq), value.as_slice())?;
            let value = value.clone();
            self.log(|| Change::PutHistory {
                key: copy,
                seq: entry.seq,
                value,
            });
        }
        self.put_history_twins(&slot, entry.seq, &value)?;
        self.log(|| Change::PutHistory {
            key: slot.into_owned(),
            seq: entry.seq,
            value,
        });
        Ok(())
    }

    fn remove_history(&mut self, key: &IdempotencyKey) -> std::result::Result<(), redb::Error> {
        let slot = self.steps_slot_of(key.record_key())?;
        let mut seqs = Vec::new();
        for entry in self.history.range((&*slot, 0)..=(&*slot, u32::MAX))? {
            seqs.push(entry?.0.value().1);
        }
        let copy = self.mirror_of(&slot);
        for seq in seqs {
            if let Some(copy) = &copy {
                self.history.remove((copy.as_slice(), seq))?;
                let key = copy.clone();
                self.log(|| Change::DelHistory { key, seq });
            }
            self.del_history_twins(&slot, seq)?;
            self.history.remove((&*slot, seq))?;
            self.log(|| Change::DelHistory {
                key: slot.to_vec(),
                seq,
            });
        }
        Ok(())
    }

    fn load_entity(
        &mut self,
        entity: &str,
    ) -> std::result::Result<Loaded<EntityState>, redb::Error> {
        Ok(self
            .entities
            .get(entity)?
            .map(|v| codec::decode_entity(entity, v.value())))
    }

    fn store_entity(
        &mut self,
        entity: &str,
        state: &EntityState,
    ) -> std::result::Result<(), redb::Error> {
        let value = codec::encode_entity(entity, state);
        self.entities.insert(entity, value.as_slice())?;
        self.log(|| Change::PutEntity {
            id: entity.to_string(),
            value,
        });
        Ok(())
    }
}

/// A table that cannot be opened, as a storage error.
pub(super) fn table_error(e: redb::TableError) -> redb::StorageError {
    match e {
        redb::TableError::Storage(e) => e,
        other => redb::StorageError::Corrupted(other.to_string()),
    }
}

/// A catalog error as the redb error that fails the batch (and poisons
/// the backend: a reopen loads the catalog again).
pub(super) fn catalog_error(e: catalog::CatalogError) -> redb::Error {
    match e {
        catalog::CatalogError::Storage(e) => e,
        other => redb::Error::Corrupted(other.to_string()),
    }
}

impl From<CatalogChange> for Change {
    fn from(change: CatalogChange) -> Change {
        match change {
            CatalogChange::Row(partition, Some(value)) => Change::PutPartition { partition, value },
            CatalogChange::Row(partition, None) => Change::DelPartition { partition },
            CatalogChange::Filter(partition, Some(value)) => Change::PutFilter { partition, value },
            CatalogChange::Filter(partition, None) => Change::DelFilter { partition },
        }
    }
}

/// How a record write is logged.
enum Logged {
    /// As it is (`Change::PutRecord`), its index changes beside it.
    Plain,
    /// Format 3, where no record was stored: `Change::PutNewRecord`.
    New,
    /// Format 3, as the fields changed from the stored record (whose
    /// last 8 bytes come first): `Change::PutRecordDelta`.
    Delta([u8; 8], RecordDelta),
}

/// Whether a record write may be logged as a derived change
/// ([`Tables::derivable`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Derivable {
    /// No: log its index changes as they are made.
    No,
    /// Yes, and no record is stored under its slot.
    New,
    /// Yes, over the stored value whose last 8 bytes these are.
    Over([u8; 8]),
}
