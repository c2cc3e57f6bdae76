//! Snapshot reads: each sees the last commit and never waits for the
//! writer. They work on a writable database and on a read-only one alike,
//! and on both layouts (`layout.rs`): a read that needs a record's key in
//! its table finds it through the `layout::Lookup` of its own transaction.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use redb::{
    ReadOnlyTable, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};

use crate::dead_letter::DeadLetter;
use crate::error::{Corrupted, Error, OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::codec;
use crate::store::record::{EntityState, Record};
use crate::store::Scanned;

use super::layout::Layout;
use super::overlay::{Overlay, Seen};
use super::partition::catalog;
use super::partition::merge;
use super::partition::row::{PartitionRow, PartitionState, FILTERS, PARTITIONS};
use super::partition::slot;
use super::snapshot::{Snapshot, Snapshots};
use super::tables::{
    Context, DEAD_LETTERS, ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY,
    STEPS,
};
use crate::store::step::{HistoryRecord, StepRecord};

/// One engine table in a fresh read transaction.
fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
    db: &impl ReadableDatabase,
    table: TableDefinition<K, V>,
    what: &'static str,
) -> Result<ReadOnlyTable<K, V>> {
    let txn = db.begin_read().context(what)?;
    txn.open_table(table).context(what)
}

/// Opens each engine table once, alone, in a read transaction: a damaged
/// table definition makes redb panic in `open_table`, and here that panic
/// is contained by the open (`OpenError::Corrupt`). In a write transaction
/// the same panic poisons the transaction's table lock, and a table still
/// open from that transaction then panics again in its `Drop` while
/// unwinding, which aborts the process. Tables that do not exist yet are
/// fine (a new file).
pub(super) fn probe_tables(db: &impl ReadableDatabase) -> std::result::Result<(), OpenError> {
    fn probe<K: redb::Key + 'static, V: redb::Value + 'static>(
        txn: &redb::ReadTransaction,
        def: TableDefinition<K, V>,
    ) -> std::result::Result<(), OpenError> {
        match txn.open_table(def) {
            Ok(_) | Err(redb::TableError::TableDoesNotExist(_)) => Ok(()),
            Err(e) => Err(OpenError::Storage {
                context: "checking the engine's tables",
                source: Box::new(redb::Error::from(e)),
            }),
        }
    }
    let txn = db.begin_read().map_err(|e| OpenError::Storage {
        context: "checking the engine's tables",
        source: Box::new(redb::Error::from(e)),
    })?;
    probe(&txn, META)?;
    probe(&txn, RECORDS)?;
    probe(&txn, LEASES)?;
    probe(&txn, RECOVERY)?;
    probe(&txn, EXPIRY)?;
    probe(&txn, OUTBOX)?;
    probe(&txn, ENTITIES)?;
    probe(&txn, STEPS)?;
    probe(&txn, HISTORY)?;
    probe(&txn, DEAD_LETTERS)?;
    // Format 3's.
    probe(&txn, catalog::RECORDS)?;
    probe(&txn, catalog::STEPS)?;
    probe(&txn, catalog::HISTORY)?;
    probe(&txn, PARTITIONS)?;
    probe(&txn, FILTERS)
}

/// `key`'s record as of the last commit, unless an acknowledged write not
/// yet committed is in `overlay`. The overlay is read first, then the
/// snapshot (see `snapshot.rs`): a value the writer drops from the overlay
/// is in a commit it announced before.
pub(super) fn record_seen(
    reads: &Snapshots,
    db: &impl ReadableDatabase,
    overlay: &Overlay,
    key: &IdempotencyKey,
) -> Result<Option<Record>> {
    let rkey = key.record_key();
    match overlay.record(rkey) {
        Seen::Absent => record_at(&*reads.current(db, READING_A_RECORD)?, key, rkey),
        Seen::Deleted => Ok(None),
        Seen::Value(v) => decode_record(key, rkey, &v).map(Some),
    }
}

/// `entity`'s state as of the last commit, unless an acknowledged write
/// not yet committed is in `overlay` (read first, as in [`record_seen`]).
pub(super) fn entity_seen(
    reads: &Snapshots,
    db: &impl ReadableDatabase,
    overlay: &Overlay,
    entity_id: &str,
) -> Result<Option<EntityState>> {
    match overlay.entity(entity_id) {
        Seen::Absent => entity(&*reads.current(db, READING_AN_ENTITY)?, entity_id),
        Seen::Deleted => Ok(None),
        Seen::Value(v) => decode_entity(entity_id, &v).map(Some),
    }
}

/// `key`'s effect steps in name order, as seen at `now_ms` (a step
/// Reserved under a claim that no longer runs reads as Unknown), from one
/// snapshot with its record. A file without the steps table (format 2
/// before any step) has none. In format 3 steps are under the slot key of
/// their record's partition: a key without a record has none.
pub(super) fn steps(
    snapshot: &Snapshot,
    key: &IdempotencyKey,
    now_ms: u64,
) -> Result<Vec<StepRecord>> {
    let what = "reading effect steps";
    let rkey = key.record_key();
    let Some(table) = snapshot.steps(what)? else {
        return Ok(Vec::new());
    };
    let (slot, record) = match snapshot.find(rkey, what)? {
        Some(found) => (
            found.slot,
            Some(decode_record(key, rkey, found.value.value())?),
        ),
        None => match snapshot.slot_without_record(rkey) {
            Some(slot) => (slot, None),
            None => return Ok(Vec::new()),
        },
    };
    let claim = record.map(|r| {
        let live =
            r.state == crate::store::record::RecordState::Processing && r.lease_until_ms > now_ms;
        (r.token, live)
    });
    let mut out = Vec::new();
    for entry in table.range((&*slot, "")..).context(what)? {
        let (k, v) = entry.context(what)?;
        let (at, name) = k.value();
        if at != &*slot {
            break;
        }
        let step = codec::decode_step(rkey, name, v.value()).map_err(|e| Error::Corrupt {
            what: Corrupted::Step {
                key: key.clone(),
                step: name.to_owned(),
            },
            reason: e.to_string(),
        })?;
        out.push(step.as_seen(claim));
    }
    Ok(out)
}

/// `key`'s evidence log, oldest first (empty in a file without the
/// history table). In format 3 the log is under the slot key of its
/// record's partition: a key without a record has none.
pub(super) fn history(
    db: &impl ReadableDatabase,
    layout: &Layout,
    key: &IdempotencyKey,
) -> Result<Vec<HistoryRecord>> {
    let what = "reading the evidence log";
    let rkey = key.record_key();
    let txn = db.begin_read().context(what)?;
    let table = match txn.open_table(layout.history()) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e).context(what),
    };
    let Some(slot) = slot_in(&txn, layout, rkey, what)? else {
        return Ok(Vec::new());
    };
    let slot = &*slot;
    let mut out = Vec::new();
    for entry in table.range((slot, 0)..=(slot, u32::MAX)).context(what)? {
        let (k, v) = entry.context(what)?;
        let seq = k.value().1;
        let e = codec::decode_history(rkey, seq, v.value()).map_err(|e| Error::Corrupt {
            what: Corrupted::History {
                key: key.clone(),
                seq,
            },
            reason: e.to_string(),
        })?;
        out.push(e);
    }
    Ok(out)
}

/// The key `rkey`'s record, steps and log are stored under in `txn`: the
/// record key itself in format 2 (record or not); in format 3 the slot key
/// of the partition holding its record, `None` without one.
fn slot_in<'k>(
    txn: &redb::ReadTransaction,
    layout: &Layout,
    rkey: &'k [u8],
    what: &'static str,
) -> Result<Option<Cow<'k, [u8]>>> {
    let lookup = layout.lookup(txn).context(what)?;
    if let Some(slot) = lookup.slot_without_record(rkey) {
        return Ok(Some(slot));
    }
    let records = match txn.open_table(layout.records()) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e).context(what),
    };
    Ok(lookup
        .find(&records, rkey)
        .context(what)?
        .map(|found| found.slot))
}

/// `key`'s record in `snapshot` (no overlay: a read-only database has
/// none).
pub(super) fn record(snapshot: &Snapshot, key: &IdempotencyKey) -> Result<Option<Record>> {
    record_at(snapshot, key, key.record_key())
}

/// Context of a record's point read.
pub(super) const READING_A_RECORD: &str = "reading a record";
/// Context of an entity's point read.
pub(super) const READING_AN_ENTITY: &str = "reading an entity";

/// `key`'s record, stored under `rkey` (its record key).
fn record_at(snapshot: &Snapshot, key: &IdempotencyKey, rkey: &[u8]) -> Result<Option<Record>> {
    snapshot
        .find(rkey, READING_A_RECORD)?
        .map(|found| decode_record(key, rkey, found.value.value()))
        .transpose()
}

/// UNKNOWN records and PROCESSING records whose lease ended at or
/// before `now_ms` (in doubt at read time, though no sweep has moved
/// them yet), oldest first by the instant they came into doubt.
pub(super) fn in_doubt(
    db: &impl ReadableDatabase,
    layout: &Layout,
    limit: usize,
    now_ms: u64,
) -> Result<Vec<(IdempotencyKey, Record)>> {
    let what = "reading the recovery queue";
    // One snapshot for all tables, so every queue entry has its record
    // (index entries hold record keys: found through this snapshot's
    // partitions in format 3).
    let txn = db.begin_read().context(what)?;
    let queue = txn.open_table(RECOVERY).context(what)?;
    let leases = txn.open_table(LEASES).context(what)?;
    let records = txn.open_table(layout.records()).context(what)?;
    let lookup = layout.lookup(&txn).context(what)?;
    let mut found: Vec<(u64, IdempotencyKey, Record)> = Vec::new();
    let stale = leases
        .range(..(now_ms.saturating_add(1), &[][..]))
        .context(what)?;
    for (index, in_doubt) in [(queue.iter().context(what)?, true), (stale, false)] {
        let mut taken = 0;
        for entry in index {
            if taken >= limit {
                break;
            }
            let (k, _) = entry.context(what)?;
            let (since, rkey) = k.value();
            let Some(key) = IdempotencyKey::from_record_key(rkey) else {
                continue;
            };
            let Some(stored) = lookup.find(&records, rkey).context(what)? else {
                continue;
            };
            // One corrupt record must not hide the rest of the queue;
            // listings show it with its error.
            match decode_record(&key, rkey, stored.value.value()) {
                Ok(rec) if in_doubt || rec.lease_until_ms <= now_ms => {
                    taken += 1;
                    found.push((since, key, rec));
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "skipping a corrupt in-doubt record"),
            }
        }
    }
    found.sort_by_key(|(since, _, _)| *since);
    found.truncate(limit);
    Ok(found.into_iter().map(|(_, key, rec)| (key, rec)).collect())
}

/// Every record in the table's order ((scope length, scope, key) in
/// format 2; by partition, then that, in format 3), until `visit` returns
/// false. A key of the table that is not a record key (format 3: shorter
/// than its partition prefix) is damage: it is passed on as raw bytes.
pub(super) fn scan(
    db: &impl ReadableDatabase,
    layout: &Layout,
    visit: &mut dyn FnMut(Scanned) -> bool,
) -> Result<()> {
    let what = "listing records";
    let txn = db.begin_read().context(what)?;
    let table = txn.open_table(layout.records()).context(what)?;
    let unread = unread_partitions(&txn, layout)?;
    let prefix = layout.prefix_bytes();
    for entry in table.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        if is_unread(&unread, k.value()) {
            continue;
        }
        if !visit(scanned(prefix, k.value(), v.value())) {
            break;
        }
    }
    Ok(())
}

/// A key and value of a records table whose keys carry `prefix` bytes
/// before the record key, as a scan hands them on.
fn scanned(prefix: usize, k: &[u8], v: &[u8]) -> Scanned {
    match k.get(prefix..) {
        Some(rkey) => (
            IdempotencyKey::from_record_key(rkey).ok_or_else(|| rkey.to_vec()),
            codec::decode(rkey, v),
        ),
        None => (Err(k.to_vec()), codec::decode(k, v)),
    }
}

/// Every record in (scope, key) byte order, the order PostgreSQL's
/// primary key lists them in, so a listing is the same on every backend
/// and in both layouts. A record key starts with its scope's length
/// (`key::record_key`), so the table holds one run per scope length (per
/// partition and scope length in format 3), each in (scope, key) order:
/// the runs that hold keys are found with one seek each, and merged.
/// Stops when `visit` returns false.
pub(super) fn scan_in_key_order(
    db: &impl ReadableDatabase,
    layout: &Layout,
    visit: &mut dyn FnMut(Scanned) -> bool,
) -> Result<()> {
    let what = "listing records";
    let txn = db.begin_read().context(what)?;
    let table = txn.open_table(layout.records()).context(what)?;
    let unread = unread_partitions(&txn, layout)?;
    let prefix = layout.prefix_bytes();
    let mut runs = runs(&table, prefix + 1, &unread)?;
    let mut heads = BinaryHeap::new();
    for run in 0..runs.len() {
        push_head(&mut runs, run, prefix, &mut heads)?;
    }
    while let Some((_, run, k, value)) = heads.pop() {
        if !visit(scanned(prefix, &k, &value)) {
            break;
        }
        push_head(&mut runs, run, prefix, &mut heads)?;
    }
    Ok(())
}

/// The runs of `table` that hold keys: one per distinct first `run_bytes`
/// bytes of its keys (the partition prefix, if any, and the scope length),
/// in key order; a key shorter than that (damage, or format 2's empty key)
/// is a run of its own.
fn runs(
    table: &ReadOnlyTable<&'static [u8], &'static [u8]>,
    run_bytes: usize,
    unread: &std::collections::BTreeSet<u64>,
) -> Result<Vec<redb::Range<'static, &'static [u8], &'static [u8]>>> {
    let what = "listing records";
    let mut runs = Vec::new();
    let mut from: Vec<u8> = Vec::new();
    loop {
        let next = table
            .range::<&[u8]>(from.as_slice()..)
            .context(what)?
            .next()
            .transpose()
            .context(what)?;
        let Some((k, _)) = next else {
            return Ok(runs);
        };
        let k = k.value();
        if let Some(lo) = k.get(..run_bytes) {
            let skip = is_unread(unread, lo);
            let Some(hi) = successor(lo) else {
                if !skip {
                    runs.push(table.range::<&[u8]>(lo..).context(what)?);
                }
                return Ok(runs);
            };
            if !skip {
                runs.push(table.range::<&[u8]>(lo..hi.as_slice()).context(what)?);
            }
            from = hi;
        } else {
            runs.push(table.range::<&[u8]>(k..=k).context(what)?);
            from = k.to_vec();
            from.push(0);
        }
    }
}

/// Format 3: the partitions of `txn` lookups never read (a merge's copies
/// and the stale records a merge left, `partition/merge.rs`), which
/// listings skip too. Format 2: none.
fn unread_partitions(
    txn: &redb::ReadTransaction,
    layout: &Layout,
) -> Result<std::collections::BTreeSet<u64>> {
    let what = "listing records";
    let mut out = std::collections::BTreeSet::new();
    if matches!(layout, Layout::Single) {
        return Ok(out);
    }
    let rows = match txn.open_table(PARTITIONS) {
        Ok(rows) => rows,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(out),
        Err(e) => return Err(e).context(what),
    };
    for entry in rows.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        if PartitionRow::decode(k.value(), v.value()).is_ok_and(|row| !row.is_read()) {
            out.insert(k.value());
        }
    }
    Ok(out)
}

/// Whether records-table key `k` (a slot key) is in one of `unread`.
fn is_unread(unread: &std::collections::BTreeSet<u64>, k: &[u8]) -> bool {
    !unread.is_empty() && slot::split(k).is_some_and(|(p, _)| unread.contains(&p))
}

/// The smallest byte string above every string that starts with
/// `prefix`; `None` when there is none (`prefix` is all 0xff).
fn successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut out = prefix.to_vec();
    while let Some(last) = out.pop() {
        if let Some(next) = last.checked_add(1) {
            out.push(next);
            return Some(out);
        }
    }
    None
}

/// The head of a run of [`scan_in_key_order`]: ((scope, key), run, the
/// table's key, value).
type Head = (Reverse<(Vec<u8>, Vec<u8>)>, usize, Vec<u8>, Vec<u8>);

/// Takes the next record of `runs[run]`, if any, into `heads`; the
/// table's keys carry `prefix` bytes before the record key.
fn push_head(
    runs: &mut [redb::Range<'static, &'static [u8], &'static [u8]>],
    run: usize,
    prefix: usize,
    heads: &mut BinaryHeap<Head>,
) -> Result<()> {
    let what = "listing records";
    if let Some(entry) = runs.get_mut(run).and_then(Iterator::next) {
        let (k, v) = entry.context(what)?;
        let k = k.value();
        let order = scope_and_key(k.get(prefix..).unwrap_or(k));
        heads.push((Reverse(order), run, k.to_vec(), v.value().to_vec()));
    }
    Ok(())
}

/// The (scope, key) bytes of a record key, for ordering; a damaged key
/// whose length byte runs past its end is all scope.
fn scope_and_key(rkey: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let Some((&len, rest)) = rkey.split_first() else {
        return (Vec::new(), Vec::new());
    };
    let (scope, key) = rest.split_at(usize::from(len).min(rest.len()));
    (scope.to_vec(), key.to_vec())
}

pub(super) fn oldest_in_doubt(db: &impl ReadableDatabase, now_ms: u64) -> Result<Option<u64>> {
    let what = "reading the recovery queue";
    let txn = db.begin_read().context(what)?;
    let mut oldest = None;
    // A lease index entry is in doubt only once its lease has ended.
    for (table, due_by) in [(RECOVERY, u64::MAX), (LEASES, now_ms)] {
        let index = txn.open_table(table).context(what)?;
        let first = index.first().context(what)?;
        let since = first.map(|(k, _)| k.value().0).filter(|&at| at <= due_by);
        oldest = match (oldest, since) {
            (Some(a), Some(b)) => Some(std::cmp::min(a, b)),
            (a, b) => a.or(b),
        };
    }
    Ok(oldest)
}

pub(super) fn sweep_due(
    db: &impl ReadableDatabase,
    now_ms: u64,
    merge_ttl_ms: Option<u64>,
) -> Result<bool> {
    let what = "checking for sweep work";
    for index in [LEASES, EXPIRY] {
        let index = table(db, index, what)?;
        let first = index.first().context(what)?;
        if first.is_some_and(|(k, _)| k.value().0 <= now_ms) {
            return Ok(true);
        }
    }
    match merge_ttl_ms {
        Some(ttl_ms) => merge_due(db, now_ms, ttl_ms),
        None => Ok(false),
    }
}

/// Format 3: whether the merge of closed partitions has work
/// (`partition/merge.rs`): a merge or a drop under way, or partitions due
/// to merge at `now_ms` with records kept `ttl_ms`. Format 2: never.
fn merge_due(db: &impl ReadableDatabase, now_ms: u64, ttl_ms: u64) -> Result<bool> {
    let what = "checking for merge work";
    let txn = db.begin_read().context(what)?;
    let rows = match txn.open_table(PARTITIONS) {
        Ok(rows) => rows,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(false),
        Err(e) => return Err(e).context(what),
    };
    let mut decoded = Vec::new();
    for entry in rows.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        if let Ok(row) = PartitionRow::decode(k.value(), v.value()) {
            if matches!(
                row.state,
                PartitionState::Merging | PartitionState::Dropping
            ) {
                return Ok(true);
            }
            decoded.push((k.value(), row));
        }
    }
    Ok(!merge::due_sources(decoded, now_ms, ttl_ms).is_empty())
}

pub(super) fn outbox(db: &impl ReadableDatabase, limit: usize) -> Result<Vec<OutboxEntry>> {
    let what = "reading the outbox";
    let table = table(db, OUTBOX, what)?;
    let mut out = Vec::new();
    for entry in table.iter().context(what)?.take(limit) {
        let (seq, bytes) = entry.context(what)?;
        let entry =
            codec::decode_outbox(seq.value(), bytes.value()).map_err(|e| Error::Corrupt {
                what: Corrupted::OutboxMessage(seq.value()),
                reason: e.to_string(),
            })?;
        out.push(entry);
    }
    Ok(out)
}

/// Up to `limit` dead letters, oldest first; a file without the table
/// (no message given up yet) has none.
pub(super) fn dead_letters(db: &impl ReadableDatabase, limit: usize) -> Result<Vec<DeadLetter>> {
    let what = "reading the dead letters";
    let txn = db.begin_read().context(what)?;
    let table = match txn.open_table(DEAD_LETTERS) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e).context(what),
    };
    let mut out = Vec::new();
    for entry in table.iter().context(what)?.take(limit) {
        let (seq, bytes) = entry.context(what)?;
        let letter =
            codec::decode_dead_letter(seq.value(), bytes.value()).map_err(|e| Error::Corrupt {
                what: Corrupted::DeadLetter(seq.value()),
                reason: e.to_string(),
            })?;
        out.push(letter);
    }
    Ok(out)
}

pub(super) fn outbox_len(db: &impl ReadableDatabase) -> Result<u64> {
    let what = "counting the outbox";
    table(db, OUTBOX, what)?.len().context(what)
}

/// `entity`'s state in `snapshot`.
pub(super) fn entity(snapshot: &Snapshot, entity: &str) -> Result<Option<EntityState>> {
    let what = READING_AN_ENTITY;
    let Some(v) = snapshot.entities(what)?.get(entity).context(what)? else {
        return Ok(None);
    };
    decode_entity(entity, v.value()).map(Some)
}

/// A stored entity state; one that does not decode or fails its checksum
/// is `Error::Corrupt` naming the entity.
fn decode_entity(entity: &str, bytes: &[u8]) -> Result<EntityState> {
    codec::decode_entity(entity, bytes).map_err(|e| Error::Corrupt {
        what: Corrupted::Entity(entity.to_owned()),
        reason: e.to_string(),
    })
}

/// The record stored under `rkey` (`key`'s record key); a value that does
/// not decode or fails its checksum is `Error::Corrupt` naming `key`.
fn decode_record(key: &IdempotencyKey, rkey: &[u8], bytes: &[u8]) -> Result<Record> {
    codec::decode(rkey, bytes).map_err(|e| Error::Corrupt {
        what: Corrupted::Record(key.clone()),
        reason: e.to_string(),
    })
}
