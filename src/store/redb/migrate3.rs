//! Migrating a format-2 redb file to format 3 (partitioned records,
//! docs/format3-plan.md), on a writable open that asks for it
//! (`EngineBuilder::migrate_to_format_3`), after
//! the journal's frames were applied and checkpointed.
//!
//! # Bounded steps
//!
//! The copy runs in steps, each one durable write transaction that copies
//! at most [`MigrationSteps::records`] records ([`STEP_RECORDS`] unless a
//! test asks for fewer), so a crash loses one step's work at most and
//! what a transaction tracks does not grow with the file (the last
//! step's filter, about 3 bytes a key, and redb's list of the pages a
//! deleted table frees, 8 bytes a page, do). (redb 4.6 writes a
//! transaction's dirty pages beyond half its cache to the file before the
//! commit, so one transaction's memory stayed near the cache size too:
//! at 2M records the peak RSS was within 60 MiB of a plain open's either
//! way, with redb's default 1 GiB cache.) Until the last
//! step commits the file stays format 2: `format_version` is still 2 and
//! format 2's tables are untouched and answer every read.
//!
//! 1. Each step copies the next records after the resume point, in
//!    record-key order, under their slot keys in one partition numbered
//!    [`BUILT_PARTITIONS`] (above every partition that takes claims, so
//!    the copy appends past the table's last key and redb packs its
//!    leaves); a value is copied as it is (its checksum is keyed by its
//!    record key, which does not change), one that does not decode too
//!    (it stays an error naming its key, and `verify` lists it). The
//!    effect steps and evidence-log entries whose record key falls in the
//!    step's key range go beside their records in the same transaction.
//! 2. The step that finds fewer records left than it may copy is the last:
//!    it copies them and every step and log entry past them, seals the
//!    partition (its filter built by reading its key range, then stored,
//!    and its row written), deletes format 2's records, steps and history
//!    tables, and writes the filters' seed and then `format_version` = 3,
//!    last. One transaction: the switch is atomic.
//!
//! The index tables (leases, recovery, expiry), the outbox, the entities
//! and the dead letters are keyed by record key or their own ids: they
//! are not touched.
//!
//! # Resuming
//!
//! The resume point is the last slot key in the built partition: the copy
//! goes in key order, and each step commits its records together with
//! their steps and log, so every record key up to it is copied and none
//! after it. A crash (or a failed step) loses at most the step that was
//! running; the next open that asks for format 3 goes on from the last
//! step that committed. No cursor is kept in the meta table.
//!
//! # A partial copy under a format-2 open
//!
//! A half-migrated file is a format-2 file: an open that does not ask for
//! format 3 reads and writes format 2's tables. Its writes would leave the
//! partial copy stale (a record completed, a key expired or claimed
//! again), and the copy is resumed, not checked (a stamp cannot prove it
//! current: the journal's LSN does not move for a local transaction,
//! which commits without a frame). So a writable open that
//! does not ask for format 3 deletes a partial copy before its writer
//! starts ([`drop_partial_copy`]: one durable transaction, redb's table
//! deletion, which holds a list of the freed pages, not the pages), and
//! the next migrating open starts over. A read-only open writes nothing
//! and ignores the copy. `verify` of a half-migrated file checks format
//! 2's tables and reports nothing for the copy: it is not damage, and it
//! is gone or finished by the next writable open. The page map walks the
//! copy's tables like every other, so a damaged page in it is placed.
//!
//! Builds from before the bounded migration do not know this rule: a
//! writable open by one of them leaves a partial copy in place, and a
//! migrating open of this build would then resume it although it may be
//! stale. Do not open a half-migrated file writable with such a build.

use std::ops::Bound;
use std::path::Path;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableError, WriteTransaction};

use crate::error::OpenError;
use crate::store::record::hex;

use super::MigrationSteps;
use crate::store::redb::meta::{self, MetaError};
use crate::store::redb::partition::catalog::{self, build_filter};
use crate::store::redb::partition::filter::FilterHasher;
use crate::store::redb::partition::row::{PartitionRow, FILTERS, PARTITIONS};
use crate::store::redb::partition::slot::{self, BUILT_PARTITIONS};
use crate::store::redb::tables::{HISTORY, META, RECORDS, STEPS};

/// Records one migration step copies by default: about 50 MB of dirty
/// pages with 1 KiB records, and one fsync per 50,000 records.
pub(crate) const STEP_RECORDS: u64 = 50_000;

const WHAT: &str = "migrating the database from format 2 to format 3";

/// What one open's migration did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Migrated {
    /// Records copied by this open (a resumed migration copied the rest
    /// before).
    pub(super) records: u64,
    /// Effect steps copied by this open.
    pub(super) steps: u64,
    /// Evidence-log entries copied by this open.
    pub(super) history: u64,
    /// Transactions committed, the last (the switch) included.
    pub(super) transactions: u64,
    /// Whether it went on from an earlier open's partial copy.
    pub(super) resumed: bool,
}

/// Migrates the format-2 database `db` to format 3 in steps of
/// `steps.records` records, going on from a partial copy if there is one
/// (see the module docs), with the filters' seed `seed`; `path` names it
/// in errors; `now_ms` is the sealed partition's row time.
///
/// # Errors
///
/// [`OpenError::Storage`] (or `Corrupt` for a damaged meta value) when a
/// read or write fails: the step that was running writes nothing, the
/// ones before it stay (the next migrating open goes on from them). With
/// `steps.stop_after` (a test hook), `Storage` once that many steps
/// committed, before the last.
pub(super) fn to_format_3(
    db: &Database,
    path: &Path,
    seed: &[u8; 16],
    now_ms: u64,
    steps: MigrationSteps,
) -> Result<Migrated, OpenError> {
    let fail = |e: MetaError| e.open_error(path, WHAT);
    let mut after = resume_point(db).map_err(fail)?;
    let mut m = Migrated {
        resumed: after.is_some(),
        ..Migrated::default()
    };
    if let Some(last) = &after {
        tracing::info!(after = %hex(last),
            "resuming the migration to format 3 after the last record key its last step copied");
    }
    let limit = steps.records.max(1);
    loop {
        if steps.stop_after.is_some_and(|n| m.transactions >= n) {
            return Err(OpenError::Storage {
                context: WHAT,
                source: format!(
                    "stopped after {} steps by the test hook (unstable_format_3_migration)",
                    m.transactions
                )
                .into(),
            });
        }
        let mut txn = db.begin_write().map_err(|e| fail(e.into()))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| fail(e.into()))?;
        // On an error the transaction is dropped: the step writes nothing.
        let last = copy_step(&txn, after.as_deref(), limit, &mut m).map_err(fail)?;
        if last.is_none() {
            finish(&txn, seed, now_ms).map_err(fail)?;
        }
        txn.commit().map_err(|e| fail(e.into()))?;
        m.transactions += 1;
        match last {
            Some(last) => after = Some(last),
            None => break,
        }
    }
    tracing::info!(
        records = m.records,
        steps = m.steps,
        history = m.history,
        transactions = m.transactions,
        resumed = m.resumed,
        "database migrated from format 2 to format 3"
    );
    Ok(m)
}

/// The record key of the last record a committed step copied (`None`: no
/// partial copy).
fn resume_point(db: &Database) -> Result<Option<Vec<u8>>, MetaError> {
    let txn = db.begin_read()?;
    let records = match txn.open_table(catalog::RECORDS) {
        Ok(table) => table,
        Err(TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let last = catalog::range(&records, BUILT_PARTITIONS)?.next_back();
    Ok(match last {
        Some(entry) => slot::split(entry?.0.value()).map(|(_, rkey)| rkey.to_vec()),
        None => None,
    })
}

/// Copies up to `limit` records after record key `after` (from the
/// first without one), with the steps and log entries of their key range,
/// counting them in `m`. Returns the last record key copied while records
/// may be left; `None` when fewer than `limit` were left: this was the
/// last step, which has also copied every step and log entry past them.
fn copy_step(
    txn: &WriteTransaction,
    after: Option<&[u8]>,
    limit: u64,
    m: &mut Migrated,
) -> Result<Option<Vec<u8>>, MetaError> {
    let p = BUILT_PARTITIONS;
    let mut copied = 0u64;
    let mut last: Option<Vec<u8>> = None;
    {
        let from = txn.open_table(RECORDS)?;
        let mut to = txn.open_table(catalog::RECORDS)?;
        let lower = after.map_or(Bound::Unbounded, Bound::Excluded);
        for entry in from.range::<&[u8]>((lower, Bound::Unbounded))? {
            if copied == limit {
                break;
            }
            let (k, v) = entry?;
            to.insert(slot::slot_key(p, k.value()).as_slice(), v.value())?;
            copied += 1;
            if copied == limit {
                last = Some(k.value().to_vec());
            }
        }
    }
    m.records += copied;
    // The step's key range: (after, last], or past `after` to the end.
    let in_range = |rkey: &[u8]| -> Option<bool> {
        if after == Some(rkey) {
            return Some(false);
        }
        match &last {
            Some(last) if rkey > last.as_slice() => None,
            _ => Some(true),
        }
    };
    // In a write transaction a missing table opens empty (format 2
    // creates steps and history on first use); deleted at the end.
    {
        let from = txn.open_table(STEPS)?;
        let mut to = txn.open_table(catalog::STEPS)?;
        let entries = match after {
            Some(a) => from.range::<(&[u8], &str)>((a, "")..)?,
            None => from.range::<(&[u8], &str)>(..)?,
        };
        for entry in entries {
            let (k, v) = entry?;
            let (rkey, name) = k.value();
            match in_range(rkey) {
                None => break,
                Some(false) => continue,
                Some(true) => {}
            }
            to.insert((slot::slot_key(p, rkey).as_slice(), name), v.value())?;
            m.steps += 1;
        }
    }
    {
        let from = txn.open_table(HISTORY)?;
        let mut to = txn.open_table(catalog::HISTORY)?;
        let entries = match after {
            Some(a) => from.range::<(&[u8], u32)>((a, 0)..)?,
            None => from.range::<(&[u8], u32)>(..)?,
        };
        for entry in entries {
            let (k, v) = entry?;
            let (rkey, seq) = k.value();
            match in_range(rkey) {
                None => break,
                Some(false) => continue,
                Some(true) => {}
            }
            to.insert((slot::slot_key(p, rkey).as_slice(), seq), v.value())?;
            m.history += 1;
        }
    }
    Ok(last)
}

/// The last step's switch, after its copy: the built partition sealed
/// (if it holds records), format 2's tables deleted, the seed and then
/// `format_version` = 3 written.
fn finish(txn: &WriteTransaction, seed: &[u8; 16], now_ms: u64) -> Result<(), MetaError> {
    seal_built_partition(txn, seed, now_ms)?;
    txn.delete_table(RECORDS)?;
    txn.delete_table(STEPS)?;
    txn.delete_table(HISTORY)?;
    meta::migrate_to_format_3(&mut txn.open_table(META)?, seed)?;
    Ok(())
}

/// Deletes the partial copy of a migration to format 3 that did not
/// finish, if the format-2 file `db` holds one (module docs): run by a
/// writable open that does not ask for format 3, before its writer
/// starts. Format 3's tables in a format-2 file are only ever such a
/// copy. Writes nothing when there is none.
///
/// # Errors
///
/// [`OpenError::Storage`] naming what it was doing when redb fails.
pub(super) fn drop_partial_copy(db: &Database, path: &Path) -> Result<(), OpenError> {
    let what = "deleting the partial copy of an unfinished migration to format 3";
    let storage = |e: redb::Error| OpenError::Storage {
        context: what,
        source: Box::new(e),
    };
    let Some(records) = partial_copy(db).map_err(storage)? else {
        return Ok(());
    };
    let mut txn = db.begin_write().map_err(|e| storage(e.into()))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| storage(e.into()))?;
    delete_copy(&txn).map_err(storage)?;
    txn.commit().map_err(|e| storage(e.into()))?;
    tracing::warn!(
        path = %path.display(),
        records,
        "opened without format 3, this format-2 file held the partial copy of a migration to \
         format 3 that did not finish: deleted it (writes in format 2 would leave it stale); \
         the next open that asks for format 3 starts the migration over"
    );
    Ok(())
}

/// Deletes format 3's tables.
fn delete_copy(txn: &WriteTransaction) -> Result<(), redb::Error> {
    txn.delete_table(catalog::RECORDS)?;
    txn.delete_table(catalog::STEPS)?;
    txn.delete_table(catalog::HISTORY)?;
    txn.delete_table(PARTITIONS)?;
    txn.delete_table(FILTERS)?;
    Ok(())
}

/// The records in format 3's tables of a format-2 file (`None`: none of
/// them exists).
pub(super) fn partial_copy(db: &impl ReadableDatabase) -> Result<Option<u64>, redb::Error> {
    use redb::ReadableTableMetadata;
    let txn = db.begin_read()?;
    let mut found = None;
    match txn.open_table(catalog::RECORDS) {
        Ok(t) => found = Some(t.len()?),
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let others = [
        exists(&txn, catalog::STEPS)?,
        exists(&txn, catalog::HISTORY)?,
        exists(&txn, PARTITIONS)?,
        exists(&txn, FILTERS)?,
    ];
    if found.is_none() && others.contains(&true) {
        found = Some(0);
    }
    Ok(found)
}

fn exists<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    def: redb::TableDefinition<K, V>,
) -> Result<bool, redb::Error> {
    match txn.open_table(def) {
        Ok(_) => Ok(true),
        Err(TableError::TableDoesNotExist(_)) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Seals partition [`BUILT_PARTITIONS`] of format 3's records in `txn`,
/// once its records were inserted in key order: its filter built from its
/// range (hashed with the file's filter seed `seed`) and stored, and its
/// row written, sealed, with `now_ms` as its first and last claim time.
/// Nothing is written for an empty partition. Shared by the migration
/// from format 2 and by salvage of a format-3 file (`salvage/write.rs`).
///
/// # Errors
///
/// [`MetaError::Storage`] when redb fails; [`MetaError::Damaged`] (under
/// `format_version`) when the filter cannot be built.
pub(in crate::store::redb) fn seal_built_partition(
    txn: &WriteTransaction,
    seed: &[u8; 16],
    now_ms: u64,
) -> Result<(), MetaError> {
    let p = BUILT_PARTITIONS;
    let hasher = FilterHasher::new(seed);
    let records = txn.open_table(catalog::RECORDS)?;
    if catalog::range(&records, p)?.next().is_none() {
        return Ok(());
    }
    let mut rows = txn.open_table(PARTITIONS)?;
    let mut filters = txn.open_table(FILTERS)?;
    let filter =
        build_filter(&records, &hasher, p, |keys| keys).map_err(|e| MetaError::Damaged {
            key: meta::Key::FormatVersion,
            reason: format!("building the built partition's filter: {e}"),
        })?;
    let (bytes, sum) = filter.encode();
    let mut row = PartitionRow::hot(now_ms, now_ms);
    row.keys = filter.len();
    row.seal(p, sum).map_err(|e| MetaError::Damaged {
        key: meta::Key::FormatVersion,
        reason: e.to_string(),
    })?;
    filters.insert(p, bytes.as_slice())?;
    rows.insert(p, row.encode(p).as_slice())?;
    Ok(())
}

#[cfg(test)]
#[path = "migrate3_tests.rs"]
mod tests;
